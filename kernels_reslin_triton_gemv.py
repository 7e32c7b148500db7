"""The projections of a generation step as matrix-vector products, each fused with what the
unfused step runs around it: the RMS norm before it, SwiGLU or the residual add after it.

At a generation step each row is one token (M = the batch, mostly 1 to 16), so every nn.Linear
is a matrix-vector product bound by reading its weight, and each norm, SwiGLU or residual add
beside it is a launch of its own, a few microseconds each inside a CUDA graph where a 400M
model's weights take ~7 us a layer to read. Each entry point here is one launch:

    rms_norm_linear(x, norm_weight, eps, weight)            rms_norm(x) @ weight.T
    rms_norm_swiglu(x, norm_weight, eps, gate_weight, up_weight)
                                                            silu(xn @ gate_weight.T) * (xn @ up_weight.T)
    gated_rms_norm_linear(o, gate, norm_weight, eps, head_dim, weight, residual)
                                                            residual + gated_head_norm(o, gate) @ weight.T
    linear_residual(x, weight, residual)                    residual + x @ weight.T

They round as often as the unfused path (modeling_reslin with kernels_reslin_triton_layers), so
that a fused step stays within the unfused one's own rounding: the product's input once in x's
dtype (the gated head norm as `rms_norm` with a gate stores it; the row norm as `rms_norm` casts the
normed row, but where the product is not a tl.dot (one row, a row tile) the norm's weight times
x, its 1/rms applied to the fp32 product, since it factors out of it),
the product accumulated in fp32 and cast to x's dtype (as F.linear returns it), SwiGLU as
`kernels_reslin_triton_layers.swiglu` forms it from those two cast products (silu(gate) * up in
fp32, cast once), the residual added to the cast product in fp32 and cast once (a tensor add of
two tensors of x's dtype). Forward only: the model calls them where autograd is off.

Each takes `split_counters`: int32 zeros, one or more for each tile of outputs, that every launch
leaves at zero (a generation step's cache keeps them: `ResLinCache.split_counters`). With them a
product of a few rows and few outputs may split K among programs (`gemv_launch`); two launches
given the same counters must then not run at once (one stream, or graphs replayed in turn).
"""

import torch

try:
    from .kernels_reslin_triton_launch import (_cdiv, _Launcher, _next_power_of_2, _on_inputs_device,
                                               _wait_for_previous_kernel, programmatic_launch, tl, triton)
    from .kernels_reslin_triton_layers import token_rows
except ImportError:
    from kernels_reslin_triton_launch import (_cdiv, _Launcher, _next_power_of_2, _on_inputs_device,
                                              _wait_for_previous_kernel, programmatic_launch, tl, triton)
    from kernels_reslin_triton_layers import token_rows

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A product this small is a round or two of loads a program: the GPU's bandwidth comes only from
# many loads in flight at once, so the launch has at least this many programs, about two for
# each of an H200's 132 SMs.
PROGRAMS_TO_FILL = 256
# Elements of each weight a one-row program loads at once: 64 bytes a thread, on 4 warps in 2-byte
# elements, on 8 in fp32 (on 4, ptxas spilled the fp32 gated norm's program); SwiGLU's two weights
# twice that (faster at one row than half a tile each: benchmarks/README.md).
ONE_ROW_TILE = 4096
MAX_BLOCK_K = 4096
DOT_BLOCK_M = 16  # the smallest tl.dot tile: 2 to 16 rows are one padded tile
DOT_BLOCK_N = 32
DOT_BLOCK_K = 256  # of one weight in 2-byte elements: half of it in fp32, a quarter for SwiGLU's two weights
DOT_STAGES = 4
DOT_SWAP_AB = False  # weight @ x.T from two rows on: bench_gemv.py --sweep times it against x @ weight.T
GATED_DOT_STAGES = 3  # the gated head norm's, at 16 rows: 8-11% faster than 2 (bench_gemv.py --sweep)
# Up to this many rows the gated head norm runs a program a row, each over GATED_ONE_ROW_BLOCK_N
# outputs and the whole K on 8 warps: its 16-row tiles leave N / DOT_BLOCK_N programs (32 at 400M);
# at 4 rows this took 0.46x (400M) and 0.61x (1.3B) their time (bench_gemv.py --sweep, H100). On 4
# warps it took up to 244 registers under PDL, which loads its weights before the wait (126 on 8).
GATED_ONE_ROW_MAX_ROWS = 4
GATED_ONE_ROW_BLOCK_N = 8
# From two rows up to this many, a tl.dot product of few tiles splits K among programs where the
# caller gives split counters (`gemv_launch`): at 16 rows of the 400M model, the step took 1,109 ->
# 1,061 us of GPU time for gdn and 1,327 -> 1,234 for rdn (bench_generate.py's "split" loop, H100).
SPLIT_K_MAX_ROWS = 16
# ... and only a product of at most this many tiles: at 16 rows of the 400M shapes (bench_gemv.py
# --split, H100) o_proj's and down's 32 tiles took 9.1 -> 5.5 and 7.4 -> 6.7 us a call split,
# the in-projection's 129 and SwiGLU's 88 took 7.7 -> 8.7 and 9.0 -> 9.6.
SPLIT_K_MAX_TILES = 64


@_Launcher
@triton.jit
def _gemv_kernel(x_ptr, gate_ptr, norm_weight_ptr, weight_ptr, up_weight_ptr, residual_ptr, y_ptr,
                 q_state_ptr, k_state_ptr, v_state_ptr, q_taps_ptr, k_taps_ptr, v_taps_ptr, KEY_WIDTH, VALUE_WIDTH,
                 partials_ptr, counters_ptr, SPLITS, SPLIT_SPAN,
                 M, N, K, K_SPAN, x_stride, gate_stride, residual_stride, eps,
                 NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr,
                 CONV_SIZE: tl.constexpr, CONV_SLOTS: tl.constexpr,
                 GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                 SWAP_AB: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr):
    """y [M, N] = epilogue(normed(x) @ weight.T) for the rows of a BLOCK_M tile and the outputs of
    a BLOCK_N tile, the weight's rows streamed over K in BLOCK_K chunks.

    NORM: "none"; "row", the RMS norm over the whole row (without DOT its 1/rms applied to the
    product, below);
    "gated_heads", the RMS norm of each group of GROUP channels (a head) times silu(gate), formed in
    each chunk, which holds whole heads. K is walked as K_SPAN padded positions, GROUP_BLOCK (a
    power of two) a group, of which the first GROUP are channels: a head of 48 channels takes 64
    lanes. Without groups GROUP == GROUP_BLOCK and a position is a channel. SWIGLU: silu(x @
    weight.T) * (x @ up_weight.T). RESIDUAL: residual + the product. CONV_SIZE (0: none): the
    outputs that are q, k and v (`_convolve_outputs`) through their short convolutions.

    BLOCK_M == 1 (one token) multiplies the weight tile by the broadcast x row and sums along K:
    every lane loads weight straight into registers, and nothing is padded. Without DOT, a few
    rows (a row tile) the same way, each weight element times every row's x: the weight read once
    for the tile's rows, whose BLOCK_M fp32 products of the weight tile are held in registers at
    once (small tiles only). DOT (BLOCK_M == 16): a tl.dot of a 16-row tile, where the tensor
    cores take 16 rows at the cost of one, and Triton's software pipeline keeps the next chunks'
    weight loads in flight through shared memory (cp.async; the broadcast paths' single round of
    loads needs none). SWAP_AB forms the transpose, weight @ x.T, so that the weight tile is the
    tensor cores' wide operand (on Hopper, a wgmma of BLOCK_N >= 64 outputs against the 16 rows).

    SPLIT (tl.dot tiles only): K is split among SPLITS programs along the grid's third axis, each
    over SPLIT_SPAN padded positions (a multiple of BLOCK_K), so that a product of few outputs
    still has enough programs to keep the memory busy; the tile's last program to finish adds the
    partial sums in split order and runs the epilogue (`_split_sums`).

    PDL: launched with programmatic dependent launch, the broadcast paths with PRELOAD load their
    first chunk of weights before they wait for the previous kernel (`_wait_for_previous_kernel`),
    so the weights must not be what that kernel wrote. The tl.dot path waits first: its loads are
    the pipeline's."""
    tl.static_assert(DOT or not (SWAP_AB or SPLIT), "only tl.dot tiles swap their product or split K")
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = outs < N
    positions = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    weight_rows = weight_ptr + outs.to(tl.int64)[:, None] * K
    up_weight_rows = up_weight_ptr + outs.to(tl.int64)[:, None] * K if SWIGLU else weight_rows

    if PRELOAD and not DOT:
        cols, col_ok, _ = _chunk_columns(0, positions, K_SPAN, GROUP, GROUP_BLOCK)
        first_weight, first_up_weight = _weight_chunk(weight_rows, up_weight_rows, cols,
                                                      out_ok[:, None] & col_ok[None, :], SWIGLU)
    _wait_for_previous_kernel(PDL)

    # What the epilogue reads besides the product is loaded before the K loop, so that its
    # latency passes under the weights' stream rather than after it.
    y_ok = row_ok[:, None] & out_ok[None, :]
    if RESIDUAL:
        residual = tl.load(residual_ptr + rows.to(tl.int64)[:, None] * residual_stride + outs[None, :], mask=y_ok,
                           other=0.0).to(tl.float32)
    if CONV_SIZE:
        last_taps, window_sums, shifted = _convolution_loads(rows, outs, y_ok, q_state_ptr, k_state_ptr, v_state_ptr,
                                                             q_taps_ptr, k_taps_ptr, v_taps_ptr, KEY_WIDTH,
                                                             VALUE_WIDTH, CONV_SIZE, CONV_SLOTS)
    # The row norm's 1/rms is one number a row: it factors out of the product, and its squares are
    # summed from the chunks the product loads anyway, so that no pass over x comes before the
    # weights' loads. A tl.dot tile keeps the pass before its pipelined loop (faster there), and a
    # split one sees only its span of K: they sum the whole row's squares first.
    row_squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM == "row" and DOT:
        for start in range(0, K, BLOCK_K):
            cols = start + positions
            x = tl.load(x_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
            x = x.to(tl.float32)
            row_squares += tl.sum(x * x, axis=1)
        row_rstd = 1.0 / tl.sqrt(row_squares / K + eps)

    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        up_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    elif SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        up_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SPLIT:
        span_start = tl.program_id(2) * SPLIT_SPAN
        span_end = tl.minimum(span_start + SPLIT_SPAN, K_SPAN)
    else:
        span_start = 0
        span_end = K_SPAN
    for start in range(span_start, span_end, BLOCK_K):
        cols, col_ok, lanes = _chunk_columns(start, positions, K_SPAN, GROUP, GROUP_BLOCK)
        x_ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_rows + cols[None, :], mask=x_ok, other=0.0)
        if NORM == "row":
            norm_weight = tl.load(norm_weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            x = x.to(tl.float32)
            if DOT:
                x = x * row_rstd[:, None]
            else:
                row_squares += tl.sum(x * x, axis=1)
            x = (x * norm_weight[None, :]).to(x_ptr.dtype.element_ty)
        elif NORM == "gated_heads":
            x = x.to(tl.float32)
            squares = tl.reshape(x * x, [BLOCK_M, BLOCK_K // GROUP_BLOCK, GROUP_BLOCK])
            head_rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=2) / GROUP + eps)
            rstd = tl.reshape(tl.broadcast_to(head_rstd[:, :, None], [BLOCK_M, BLOCK_K // GROUP_BLOCK, GROUP_BLOCK]),
                              [BLOCK_M, BLOCK_K])
            norm_weight = tl.load(norm_weight_ptr + lanes, mask=lanes < GROUP, other=0.0).to(tl.float32)
            gate = tl.load(gate_ptr + rows.to(tl.int64)[:, None] * gate_stride + cols[None, :], mask=x_ok,
                           other=0.0).to(tl.float32)
            x = (x * rstd * norm_weight[None, :] * gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty)
        weight_ok = out_ok[:, None] & col_ok[None, :]
        if PRELOAD and not DOT:
            if start == 0:
                weight, up_weight = first_weight, first_up_weight
            else:
                weight, up_weight = _weight_chunk(weight_rows, up_weight_rows, cols, weight_ok, SWIGLU)
        else:
            weight, up_weight = _weight_chunk(weight_rows, up_weight_rows, cols, weight_ok, SWIGLU)
        if BLOCK_M == 1:
            x = x.to(tl.float32)
            acc += tl.sum(weight.to(tl.float32) * x, axis=1)
            if SWIGLU:
                up_acc += tl.sum(up_weight.to(tl.float32) * x, axis=1)
        elif not DOT:  # with one row this form compiles to other code (more registers, a spill at PDL)
            x = x.to(tl.float32)[:, None, :]
            acc += tl.sum(weight.to(tl.float32)[None, :, :] * x, axis=2)
            if SWIGLU:
                up_acc += tl.sum(up_weight.to(tl.float32)[None, :, :] * x, axis=2)
        elif SWAP_AB:
            acc = tl.dot(weight, tl.trans(x), acc, input_precision="ieee")
            if SWIGLU:
                up_acc = tl.dot(up_weight, tl.trans(x), up_acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(weight), acc, input_precision="ieee")
            if SWIGLU:
                up_acc = tl.dot(x, tl.trans(up_weight), up_acc, input_precision="ieee")

    if BLOCK_M == 1:
        acc = acc[None, :]
        up_acc = up_acc[None, :]
    elif SWAP_AB:
        acc = tl.trans(acc)
        up_acc = tl.trans(up_acc)
    if NORM == "row" and not DOT:
        row_rstd = 1.0 / tl.sqrt(row_squares / K + eps)
        acc *= row_rstd[:, None]
        up_acc *= row_rstd[:, None]
    if SPLIT:
        acc, up_acc, last = _split_sums(acc, up_acc, rows, outs, y_ok, M, N, partials_ptr, counters_ptr, SPLITS, SWIGLU)
        y_ok &= last  # the others wrote their partial sums only
    # The products as F.linear returns them, in x's dtype.
    y = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    if SWIGLU:
        up = up_acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = y * tl.sigmoid(y) * up
    if CONV_SIZE:
        y = _convolve_outputs(y, last_taps, window_sums, shifted, rows, outs, y_ok, q_state_ptr, k_state_ptr,
                              v_state_ptr, KEY_WIDTH, VALUE_WIDTH, CONV_SIZE, CONV_SLOTS)
    if RESIDUAL:
        y += residual
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * N + outs[None, :], y.to(y_ptr.dtype.element_ty), mask=y_ok)


@triton.jit
def _split_sums(acc, up_acc, rows, outs, y_ok, M, N, partials_ptr, counters_ptr, SPLITS, SWIGLU: tl.constexpr):
    """(the products' sums over every split, of up_acc too, whether this program is the tile's
    last): each program stores its partial sums [rows, outs] in fp32 at its split's place in
    partials [SPLITS, 1 or 2 (SWIGLU), M, N], then takes a ticket from its tile's counter; the one
    holding the last ticket loads every split's sums, adds them in split order (the same sum
    whichever program ends last) and leaves the counter at zero for the next launch. The others
    get zeros and must store nothing."""
    offsets = rows.to(tl.int64)[:, None] * N + outs[None, :]
    plane = M * N
    weights = 2 if SWIGLU else 1
    split = tl.program_id(2)
    tl.store(partials_ptr + split * weights * plane + offsets, acc, mask=y_ok)
    if SWIGLU:
        tl.store(partials_ptr + (split * weights + 1) * plane + offsets, up_acc, mask=y_ok)
    # Every thread's partial sums stored before the ticket that releases them (acq_rel, GPU scope).
    tl.debug_barrier()
    counter = counters_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    last = tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1
    sums = tl.zeros(acc.shape, dtype=tl.float32)
    up_sums = tl.zeros(acc.shape, dtype=tl.float32)
    for other in range(SPLITS):
        # .cg: from L2, where the other programs' stores are, not from this SM's L1.
        sums += tl.load(partials_ptr + other * weights * plane + offsets, mask=y_ok & last, other=0.0,
                        cache_modifier=".cg")
        if SWIGLU:
            up_sums += tl.load(partials_ptr + (other * weights + 1) * plane + offsets, mask=y_ok & last, other=0.0,
                               cache_modifier=".cg")
    tl.store(counter, 0, mask=last)
    return sums, up_sums, last


@triton.jit
def _convolution_windows(rows, outs, y_ok, q_state_ptr, k_state_ptr, v_state_ptr, KEY_WIDTH, VALUE_WIDTH,
                         K: tl.constexpr, SLOTS: tl.constexpr):
    """For the outputs [rows, outs] of the in-projection (q | k | v: KEY_WIDTH, KEY_WIDTH and
    VALUE_WIDTH channels from column 0, the other columns not convolved): (which columns are q's,
    k's, any of the three; each channel's tap offset; pointers to each row's window of K - 1
    inputs [rows, outs, SLOTS], SLOTS a power of two; which of them this program owns)."""
    segment = tl.where(outs < KEY_WIDTH, 0, tl.where(outs < 2 * KEY_WIDTH, 1, 2))  # q, k, v (or past them)
    channel = outs - segment * KEY_WIDTH
    width = tl.where(segment == 2, VALUE_WIDTH, KEY_WIDTH)
    column_ok = channel < width
    in_q, in_k = column_ok & (segment == 0), column_ok & (segment == 1)
    slots = tl.arange(0, SLOTS)
    state_offsets = ((rows.to(tl.int64)[:, None] * width[None, :] + channel[None, :]) * (K - 1))[:, :, None] + \
        slots[None, None, :]
    windows = _segment(q_state_ptr, k_state_ptr, state_offsets, in_q[None, :, None], in_k[None, :, None], v_state_ptr)
    owned = y_ok[:, :, None] & (slots < K - 1)[None, None, :] & column_ok[None, :, None]
    return in_q, in_k, column_ok, channel * K, windows, owned


@triton.jit
def _convolution_loads(rows, outs, y_ok, q_state_ptr, k_state_ptr, v_state_ptr, q_taps_ptr, k_taps_ptr, v_taps_ptr,
                       KEY_WIDTH, VALUE_WIDTH, K: tl.constexpr, SLOTS: tl.constexpr):
    """What `_convolve_outputs` reads besides the product, which a program loads before its K loop:
    (each channel's last tap [outs], the taps times the window of K - 1 earlier inputs summed in
    fp32 [rows, outs], the windows moved along by one, their last slot still to fill)."""
    in_q, in_k, convolved, taps_offsets, windows, owned = _convolution_windows(
        rows, outs, y_ok, q_state_ptr, k_state_ptr, v_state_ptr, KEY_WIDTH, VALUE_WIDTH, K, SLOTS)
    slots = tl.arange(0, SLOTS)
    slot_ok = slots < K - 1
    last_taps = tl.load(_segment(q_taps_ptr, k_taps_ptr, taps_offsets + K - 1, in_q, in_k, v_taps_ptr),
                        mask=convolved, other=0.0).to(tl.float32)
    taps = tl.load(_segment(q_taps_ptr, k_taps_ptr, taps_offsets[:, None] + slots[None, :], in_q[:, None],
                            in_k[:, None], v_taps_ptr), mask=convolved[:, None] & slot_ok[None, :], other=0.0)
    window = tl.load(windows, mask=owned, other=0.0)
    window_sums = tl.sum(window.to(tl.float32) * taps.to(tl.float32)[None, :, :], axis=2)
    shifted = tl.load(windows + 1, mask=owned & (slots + 1 < K - 1)[None, None, :], other=0.0)
    return last_taps, window_sums, shifted


@triton.jit
def _convolve_outputs(y, last_taps, window_sums, shifted, rows, outs, y_ok, q_state_ptr, k_state_ptr, v_state_ptr,
                      KEY_WIDTH, VALUE_WIDTH, K: tl.constexpr, SLOTS: tl.constexpr):
    """y [rows, outs] (fp32, rounded to the output's dtype) with its q, k and v columns through
    their short convolutions, as ResLinShortConvolution runs them: silu(the taps [channels, K]
    times the window [state, y]) summed in fp32, from `_convolution_loads`. Each channel's state
    [rows, channels, K - 1] then moves along by y, in place. A program owns its outputs' channels:
    no other program reads the states it writes."""
    # The windows' pointers again, not held in registers across the K loop.
    _, _, convolved, _, windows, owned = _convolution_windows(
        rows, outs, y_ok, q_state_ptr, k_state_ptr, v_state_ptr, KEY_WIDTH, VALUE_WIDTH, K, SLOTS)
    pre = y * last_taps[None, :] + window_sums
    # The new state: slot j holds the window's input j + 1, the last slot this token's y.
    moved = (tl.arange(0, SLOTS) + 1 < K - 1)[None, None, :]
    shifted = tl.where(moved, shifted, y[:, :, None].to(shifted.dtype))
    # Every read of the old states before the first write: a small tile is held by several threads.
    tl.debug_barrier()
    tl.store(windows, shifted, mask=owned)
    return tl.where(convolved[None, :], pre * tl.sigmoid(pre), y)


@triton.jit
def _segment(q_ptr, k_ptr, offsets, in_q, in_k, v_ptr):
    """Pointers to the element at `offsets` of q, k or v, as the (disjoint) masks name it (v where
    neither does): one load or store for the three tensors."""
    return tl.where(in_q, q_ptr, tl.where(in_k, k_ptr, v_ptr)) + offsets


@triton.jit
def _chunk_columns(start, positions, K_SPAN, GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr):
    """(the channels, which of them are real, the lanes within a group) of the chunk of padded
    positions start + positions (see `_gemv_kernel`)."""
    padded = start + positions
    lanes = padded % GROUP_BLOCK
    if GROUP == GROUP_BLOCK:
        cols = padded
        col_ok = padded < K_SPAN
    else:
        cols = (padded // GROUP_BLOCK) * GROUP + lanes
        col_ok = (lanes < GROUP) & (padded < K_SPAN)
    return cols, col_ok, lanes


@triton.jit
def _weight_chunk(weight_rows, up_weight_rows, cols, weight_ok, SWIGLU: tl.constexpr):
    """The tiles of the weight and, with SWIGLU, of the up weight at the columns cols (else the
    weight's again, unused)."""
    weight = tl.load(weight_rows + cols[None, :], mask=weight_ok, other=0.0)
    up_weight = weight
    if SWIGLU:
        up_weight = tl.load(up_weight_rows + cols[None, :], mask=weight_ok, other=0.0)
    return weight, up_weight


def gemv_launch(M, N, K_span, group_block, weights, element_bytes, can_split=False):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP_AB, splits) of `_gemv_kernel` for M rows,
    N outputs, K_span positions in groups of group_block (1 without groups: with groups, the gated
    head norm), `weights` weight matrices (2 for SwiGLU) of element_bytes each; `can_split`: the
    caller gave split counters. Chosen by bench_gemv.py --sweep at the 400m and 1.3b shapes
    (benchmarks/README.md).

    One row: a program's chunk spans the whole K where it can (up to MAX_BLOCK_K: the 400M down
    projection's 2816 in a chunk of 4096, its lanes past 2816 masked, which costs issue slots, not
    bandwidth), so that the product is one round of loads: ONE_ROW_TILE elements of each weight a
    program, many programs to a SM (4 warps in 2-byte elements, 8 in fp32 and for the gated norm,
    whose x side, the gate's sigmoid and the heads' sums, is more work a lane), every weight
    element in flight at once (K = 1024: tiles of 4 rows; the 400M in-projection's 4120 rows in
    1030 programs). x, read by every program, stays in each SM's L1. Fewer rows a program where
    that leaves fewer than PROGRAMS_TO_FILL programs.

    The gated norm up to GATED_ONE_ROW_MAX_ROWS rows: a program a row, as at one row.

    More rows: tl.dot tiles of 16 rows and DOT_BLOCK_N outputs, chunks along K that Triton's
    software pipeline keeps DOT_STAGES deep in flight through shared memory (GATED_DOT_STAGES for
    the gated norm); SwiGLU's short chunks, two weights of 64 positions, ranked first at 4 and
    16 rows (1.3-1.5x faster than chunks of 128). Up to SPLIT_K_MAX_ROWS rows, in a product of
    at most SPLIT_K_MAX_TILES tiles, K is split in two, four, ... while the tiles are fewer than
    PROGRAMS_TO_FILL: N / DOT_BLOCK_N tiles leave most SMs idle where N is the hidden width (32
    tiles at 400M)."""
    K_block = max(16, _next_power_of_2(K_span))
    gated = group_block > 1
    one_row_K = max(group_block, min(K_block, MAX_BLOCK_K))
    if M == 1:
        BLOCK_N = max(1, ONE_ROW_TILE // one_row_K)
        while BLOCK_N > 1 and _cdiv(N, BLOCK_N) < PROGRAMS_TO_FILL:
            BLOCK_N //= 2
        return 1, BLOCK_N, one_row_K, 8 if gated else 2 * element_bytes, 1, False, 1
    if gated and M <= GATED_ONE_ROW_MAX_ROWS:
        return 1, GATED_ONE_ROW_BLOCK_N, one_row_K, 8, 1, False, 1
    chunk = DOT_BLOCK_K * 2 // element_bytes // (1 if weights == 1 else 4)
    BLOCK_K = max(group_block, min(K_block, max(16, chunk)))
    splits = 1
    tiles = _cdiv(N, DOT_BLOCK_N) * _cdiv(M, DOT_BLOCK_M)
    if can_split and M <= SPLIT_K_MAX_ROWS and tiles <= SPLIT_K_MAX_TILES:
        while tiles * splits < PROGRAMS_TO_FILL and 2 * splits <= _cdiv(K_span, BLOCK_K):
            splits *= 2
    return DOT_BLOCK_M, DOT_BLOCK_N, BLOCK_K, 4, GATED_DOT_STAGES if gated else DOT_STAGES, DOT_SWAP_AB, splits


def _check_no_grad(*tensors):
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise ValueError("the fused generation-step products have no backward: call them under torch.no_grad() "
                         "or with tensors that do not require grad")


def _describe(t):
    return f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_weight(name, weight):
    """weight [N, K] (nn.Linear's layout), contiguous: returns (N, K)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{name} must be a tensor [N, K] (nn.Linear's layout), got {_describe(weight)}")
    if not weight.is_contiguous():
        raise ValueError(f"{name} must be contiguous (a copy of it at each call would cost more than the product)")
    return weight.shape


def _check_input(name, x, K):
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"{name} must be a tensor [..., {K}] (K = the weight's input width), got {_describe(x)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def _check_like(name, t, x, x_name, shape=None):
    """t of x's dtype and device (and of `shape` where given)."""
    if (not isinstance(t, torch.Tensor) or t.dtype != x.dtype or t.device != x.device
            or (shape is not None and t.shape != shape)):
        wanted = f"{tuple(shape)} " if shape is not None else ""
        raise ValueError(f"{name} must be {wanted}of {x_name}'s dtype {x.dtype} on {x.device}, got {_describe(t)}")


def _check_norm_weight(norm_weight, size, x, what):
    if (not isinstance(norm_weight, torch.Tensor) or norm_weight.shape != (size,)
            or not norm_weight.is_floating_point() or norm_weight.device != x.device):
        raise ValueError(f"norm_weight must be a floating-point [{size}] ({what}) on {x.device}, got "
                         f"{_describe(norm_weight)}")
    return norm_weight.contiguous()


def gemv_config(M, N, K, element_bytes, norm, head_dim=None, swiglu=False, residual=False, conv_size=0,
                can_split=False):
    """(K_SPAN, constexprs, num_warps, num_stages, SPLITS, SPLIT_SPAN) of `_gemv_kernel` for M rows
    of K channels and N outputs of element_bytes each: the host's launch, and
    tools/compile_for_gpu.py's variants. `head_dim`: the group of the "gated_heads" norm;
    `conv_size`: the short convolutions' taps; `can_split`: the caller gave split counters.
    SPLITS: the programs K is split among (1: not split); SPLIT_SPAN: the padded positions of each."""
    group_block = _next_power_of_2(head_dim) if norm == "gated_heads" else None
    K_span = K // head_dim * group_block if group_block else K
    BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, swap_ab, splits = gemv_launch(
        M, N, K_span, group_block or 1, 2 if swiglu else 1, element_bytes, can_split)
    split_span = _cdiv(_cdiv(K_span, BLOCK_K), splits) * BLOCK_K
    splits = _cdiv(K_span, split_span)  # fewer where the chunks do not share out evenly
    group, group_block = (head_dim, group_block) if group_block else (BLOCK_K, BLOCK_K)  # else a position is a channel
    constexprs = dict(NORM=norm, SWIGLU=swiglu, RESIDUAL=residual, CONV_SIZE=conv_size,
                      CONV_SLOTS=_next_power_of_2(max(conv_size - 1, 1)), GROUP=group, GROUP_BLOCK=group_block,
                      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT=BLOCK_M == DOT_BLOCK_M,
                      SWAP_AB=swap_ab, SPLIT=splits > 1)
    return K_span, constexprs, warps, stages, splits, split_span


@_on_inputs_device
def _launch(x, gate, norm_weight, eps, weight, up_weight, residual, norm, head_dim=None, weight_just_written=False,
            convolutions=None, split_counters=None):
    """y [..., N] in x's dtype; gate and residual as row views (`token_rows`)."""
    rows = token_rows(x)
    M, K = rows.shape
    N = weight.shape[0]
    taps, states = convolutions or ((None,) * 3, (None,) * 3)
    conv_size = 0 if convolutions is None else taps[0].shape[-1]
    swiglu = up_weight is not None
    K_span, constexprs, warps, stages, splits, split_span = gemv_config(
        M, N, K, x.element_size(), norm, head_dim, swiglu, residual is not None, conv_size, split_counters is not None)
    widths = (0, 0) if convolutions is None else (taps[0].shape[0], taps[2].shape[0])
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    pdl = programmatic_launch(rows)
    if M:
        grid = (_cdiv(N, constexprs["BLOCK_N"]), _cdiv(M, constexprs["BLOCK_M"]), splits)
        partials, counters = None, None  # unused unsplit: one compiled variant with counters given or not
        if constexprs["SPLIT"]:
            if split_counters.numel() < grid[0] * grid[1]:
                raise ValueError(f"split_counters holds {split_counters.numel()} counters, this product's "
                                 f"{grid[0] * grid[1]} tiles need one each")
            partials = torch.empty(splits * (2 if swiglu else 1) * M * N, device=x.device, dtype=torch.float32)
            counters = split_counters
        _gemv_kernel[grid](rows, gate, norm_weight, weight, up_weight, residual, y, *states, *taps, *widths,
                           partials, counters, splits, split_span, M, N, K, K_span, rows.stride(0),
                           0 if gate is None else gate.stride(0), 0 if residual is None else residual.stride(0), eps,
                           **constexprs, **pdl, PRELOAD=pdl["PDL"] and not weight_just_written, num_warps=warps,
                           num_stages=stages)
    return y.view(*x.shape[:-1], N)


def _check_split_counters(split_counters, x):
    if split_counters is not None and (
            not isinstance(split_counters, torch.Tensor) or split_counters.dtype != torch.int32
            or split_counters.dim() != 1 or not split_counters.is_contiguous() or split_counters.device != x.device):
        raise ValueError(f"split_counters must be a contiguous 1-d int32 tensor on {x.device} (zeros, left zero by "
                         f"every launch), got {_describe(split_counters)}")


def rms_norm_linear(x, norm_weight, eps, weight, *, weight_just_written=False, convolutions=None, split_counters=None):
    """F.linear(rms_norm(x) * norm_weight, weight) for x [..., K], norm_weight [K], weight [N, K]:
    [..., N] in x's dtype. Rounds as rms_norm then F.linear do: the normed x to x's dtype, the fp32
    product to x's dtype. `weight_just_written`: the kernel launched just before wrote `weight` (a
    cache's new side-by-side copy), which under programmatic dependent launch is then not loaded
    before that kernel's end (`_gemv_kernel`).

    `convolutions`: ((q, k, v) taps [D, 1, C], (q, k, v) states [B, D, C - 1]) of a linear attention
    layer's short convolutions, for x [B, 1, K] one token a row whose first outputs are q | k | v:
    those come out as silu(convolution) of the product (summed in fp32 from its rounded value), and
    the states, contiguous in x's dtype (oldest input first), move along by it in place."""
    N, K = _check_weight("weight", weight)
    _check_input("x", x, K)
    _check_like("weight", weight, x, "x")
    norm_weight = _check_norm_weight(norm_weight, K, x, "x's width")
    _check_no_grad(x, norm_weight, weight)
    _check_split_counters(split_counters, x)
    if convolutions is not None:
        _check_convolutions(convolutions, x, N)
    return _launch(x, None, norm_weight, float(eps), weight, None, None, "row", weight_just_written=weight_just_written,
                   convolutions=convolutions, split_counters=split_counters)


def _check_convolutions(convolutions, x, N):
    """ValueErrors naming the convolutions' tensor at fault (shapes, dtypes, devices alone)."""
    if len(convolutions) != 2 or any(len(part) != 3 for part in convolutions):
        raise ValueError("convolutions must be ((q, k, v) taps, (q, k, v) states)")
    taps, states = convolutions
    C = taps[0].shape[-1] if taps[0].dim() == 3 else 0
    if C < 2:
        raise ValueError(f"the convolutions' taps must be [D, 1, C] with C >= 2, got q's {tuple(taps[0].shape)}")
    if x.dim() != 3 or x.shape[1] != 1:
        raise ValueError(f"with convolutions, x must be [B, 1, K] (one token a row), got {tuple(x.shape)}")
    B = x.shape[0]
    widths = [taps[0].shape[0], taps[0].shape[0], taps[2].shape[0]]
    if sum(widths) > N:
        raise ValueError(f"the convolutions' {sum(widths)} channels (q | k | v) exceed the product's {N} outputs")
    for name, tap, state, D in zip("qkv", taps, states, widths):
        if tap.shape != (D, 1, C) or not tap.is_contiguous() or tap.device != x.device:
            raise ValueError(f"the convolutions' {name} taps must be contiguous [{D}, 1, {C}] on {x.device}, got "
                             f"{_describe(tap)}")
        if state.shape != (B, D, C - 1) or state.dtype != x.dtype or not state.is_contiguous() or state.device != x.device:
            raise ValueError(f"the convolutions' {name} state must be contiguous [{B}, {D}, {C - 1}] {x.dtype} on "
                             f"{x.device}, got {_describe(state)}{'' if state.is_contiguous() else ', not contiguous'}")


def rms_norm_swiglu(x, norm_weight, eps, gate_weight, up_weight, *, split_counters=None):
    """silu(xn @ gate_weight.T) * (xn @ up_weight.T) with xn = rms_norm(x) * norm_weight, x [..., K],
    the weights [N, K] each: [..., N] in x's dtype (the MLP's input to its down projection). Rounds
    as rms_norm, F.linear and `swiglu` do: xn and each product to x's dtype, then silu(gate) * up
    in fp32 to x's dtype."""
    N, K = _check_weight("gate_weight", gate_weight)
    _check_input("x", x, K)
    _check_like("gate_weight", gate_weight, x, "x")
    _check_weight("up_weight", up_weight)
    _check_like("up_weight", up_weight, x, "x", gate_weight.shape)
    norm_weight = _check_norm_weight(norm_weight, K, x, "x's width")
    _check_no_grad(x, norm_weight, gate_weight, up_weight)
    _check_split_counters(split_counters, x)
    return _launch(x, None, norm_weight, float(eps), gate_weight, up_weight, None, "row",
                   split_counters=split_counters)


def gated_rms_norm_linear(o, gate, norm_weight, eps, head_dim, weight, residual, *, split_counters=None):
    """residual + F.linear(y, weight), y = rms_norm of each head of head_dim channels of o, times
    norm_weight [head_dim], times silu(gate): the output of a linear-attention layer (its o_norm
    and o_proj) added to the block's input. o and gate [..., K] (heads side by side, K a multiple
    of head_dim), weight [N, K], residual [..., N]: [..., N] in o's dtype. Rounds as the unfused
    path does: y to o's dtype (norm, weight and gate applied in fp32), the fp32 product to o's
    dtype, then residual + product in fp32 to o's dtype."""
    N, K = _check_weight("weight", weight)
    _check_input("o", o, K)
    _check_like("weight", weight, o, "o")
    _check_like("gate", gate, o, "o", o.shape)
    if not isinstance(head_dim, int) or head_dim <= 0 or K % head_dim:
        raise ValueError(f"head_dim must be a positive int dividing o's width {K}, got {head_dim!r}")
    if _next_power_of_2(head_dim) > MAX_BLOCK_K:
        raise ValueError(f"head_dim must be at most {MAX_BLOCK_K} (a chunk holds whole heads), got {head_dim}")
    norm_weight = _check_norm_weight(norm_weight, head_dim, o, "per head")
    _check_like("residual", residual, o, "o", (*o.shape[:-1], N))
    _check_no_grad(o, gate, norm_weight, weight, residual)
    _check_split_counters(split_counters, o)
    return _launch(o, token_rows(gate), norm_weight, float(eps), weight, None, token_rows(residual), "gated_heads",
                   head_dim, split_counters=split_counters)


def linear_residual(x, weight, residual, *, split_counters=None):
    """residual + F.linear(x, weight) for x [..., K], weight [N, K], residual [..., N]: [..., N] in
    x's dtype. Rounds as the unfused path does: the fp32 product to x's dtype, then the sum in fp32
    to x's dtype."""
    N, K = _check_weight("weight", weight)
    _check_input("x", x, K)
    _check_like("weight", weight, x, "x")
    _check_like("residual", residual, x, "x", (*x.shape[:-1], N))
    _check_no_grad(x, weight, residual)
    _check_split_counters(split_counters, x)
    return _launch(x, None, None, 0.0, weight, None, token_rows(residual), "none", split_counters=split_counters)
