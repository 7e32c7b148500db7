"""Triton kernels of ResLin.

``decode_step``: one token of every rule (DESIGN.md section 1), advancing the fp32 states S and
R in place. A program owns one (sequence, value head) pair and a tile of BV value columns with
all Dk key rows: every quantity of the step (the reads S^T k and S^T q, the clip, both writes)
is column-separable, so the tiles never talk to each other and each state element is read and
written exactly once.
"""

import functools
import hashlib
from typing import List, Optional, Tuple

try:
    import triton
    import triton.language as tl
except ImportError:  # kernels_reslin falls back to the "torch" backend without Triton
    raise

import torch

# Relative import for the remote-code loader; a plain one for `import kernels_reslin_triton`.
try:
    from .kernels_reslin_torch import sequence_bounds
except ImportError:
    from kernels_reslin_torch import sequence_bounds


# Host-side sizes in plain Python: triton.cdiv and triton.next_power_of_2 are constexpr functions
# in triton 3.6, whose calls cost microseconds each, on every launch.
def _cdiv(a, b):
    return -(-a // b)


def _next_power_of_2(n):
    return 1 << (n - 1).bit_length()


class _Launcher:
    """A @triton.jit kernel launched as Triton launches it, `kernel[grid](*args, **kwargs)`, but on
    CUDA a specialisation's later launches go straight to the C launcher of the binary its first
    launch returned (`_binary_launch`).

    Triton derives every argument's specialisation again at each launch (type, pointers' 16-byte
    alignment, integers equal to 1 or multiples of 16), reads its settings and looks the binary
    up: on the H200 machine's host (session 25) a 35-argument kernel took 28-50 us a launch that
    way and 13-23 us through its binary, and a training call makes 7-20 launches. Calls bound by
    the host gained (H16 D128, medians of three interleaved rounds): gdn's training call at
    B8xT2048 2,288 -> 2,067 us and its forward 577 -> 427, sGLA's training call at B2xT8192 1,708
    -> 1,455; RDN's calls, bound by the GPU, did not move.

    The key here is finer than Triton's: every integer, bool and constexpr by value, pointers by
    dtype and alignment, floats by type (Triton never specialises on their value), the launch
    options and the device. A key's first launch is Triton's own (compiling if needed). Triton's
    CPU interpreter (the tests) is never bypassed, nor is Triton other than 3.6: how a binary
    takes its arguments is Triton's internal (3.6 passes every parameter, constexprs included,
    where earlier versions passed the others alone)."""

    MAX_KEYS = 1024  # forgotten all at once past this (shapes are keys): no growth without bound

    def __init__(self, kernel):
        self.kernel = kernel
        compiled = isinstance(kernel, triton.runtime.JITFunction) and triton.__version__.startswith("3.6.")
        self.params = kernel.arg_names if compiled else ()
        self.by_value = tuple(param.is_constexpr for param in kernel.params) if compiled else ()
        self.launches = {} if compiled else None

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        if self.launches is None or not args[0].is_cuda:
            return self.kernel[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        key = (device, tuple(kwargs.items()),
               *(arg if by_value else _specialisation(arg) for arg, by_value in zip(args, self.by_value)))
        launch = self.launches.get(key)
        if launch is None:
            binary = self.kernel[grid](*args, **kwargs)
            if isinstance(binary, triton.compiler.CompiledKernel):
                if len(self.launches) >= self.MAX_KEYS:
                    self.launches.clear()
                self.launches[key] = _binary_launch(binary)
            return
        launch(tuple(grid) + (1,) * (3 - len(grid)), device,
               (*args, *(kwargs[name] for name in self.params[len(args):])))


def _binary_launch(binary):
    """`launch(grid, device, every parameter's value)` of a compiled kernel: its C launcher called
    as Triton 3.6's runner calls it (`CompiledKernel.__getitem__`, `CudaLauncher.__call__`), less
    what costs host time there on every launch and serves nothing here: a closure, the launch
    metadata built for the launch hooks (a `LazyDict` a launch, and the two empty hook chains
    called from C), the scratch allocations of kernels that need none. A kernel that needs
    scratch memory, and any launch while a profiler has hooked Triton's launches, take Triton's
    runner."""
    runner = binary.run  # loads the binary's module at its first use
    if runner.global_scratch_size or runner.profile_scratch_size:
        return lambda grid, device, args: binary[grid](*args)
    c_launch, function, metadata = runner.launch, binary.function, binary.packed_metadata
    cooperative, pdl = runner.launch_cooperative_grid, runner.launch_pdl
    current_stream = triton.runtime.driver.active.get_current_stream
    hooks = triton.knobs.runtime

    def launch(grid, device, args):
        if hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls:
            return binary[grid](*args)
        c_launch(*grid, current_stream(device), function, cooperative, pdl, None, None, metadata, None, None, None,
                 *args)
    return launch


def _specialisation(arg):
    """What of a non-constexpr argument a compiled kernel depends on (see `_Launcher`)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    return float if isinstance(arg, float) else arg


def _on_inputs_device(launcher):
    """Run `launcher` with the CUDA device of its first argument current. Triton launches on the
    current device, not on the tensors': the layers of a model split across GPUs (device_map)
    would have their kernels refused, or run on the wrong GPU's stream. Triton's CPU interpreter
    takes CPU tensors, which need no device."""
    @functools.wraps(launcher)
    def launch(q, *args, **kwargs):
        if not q.is_cuda:
            return launcher(q, *args, **kwargs)
        with torch.cuda.device(q.device):
            return launcher(q, *args, **kwargs)
    return launch


@_Launcher
@triton.jit
def _decode_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, gamma_ptr, gamma_write_ptr,
                        S_ptr, R_ptr, o_ptr, scale, clip, HV, GROUP, DK, DV,
                        BK: tl.constexpr, BV: tl.constexpr,
                        DELTA: tl.constexpr, RESIDUAL: tl.constexpr):
    seq_head = tl.program_id(0)                    # n * HV + value head
    key_row = seq_head // GROUP                    # n * H + key head (q and k have H = HV / GROUP)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BK)
    row_ok, col_ok = rows < DK, cols < DV
    state_ok = row_ok[:, None] & col_ok[None, :]
    state_offsets = seq_head.to(tl.int64) * DK * DV + rows[:, None] * DV + cols[None, :]

    q = tl.load(q_ptr + key_row * DK + rows, mask=row_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + key_row * DK + rows, mask=row_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + seq_head * DV + cols, mask=col_ok, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + seq_head).to(tl.float32))
    beta = tl.load(beta_ptr + seq_head).to(tl.float32)
    S = tl.load(S_ptr + state_offsets, mask=state_ok, other=0.0)

    if RESIDUAL:
        gamma = tl.load(gamma_ptr + seq_head).to(tl.float32)
        gamma_write = tl.load(gamma_write_ptr + seq_head).to(tl.float32)
        R = tl.load(R_ptr + state_offsets, mask=state_ok, other=0.0)
        # The residual reads the OLD base state S_{t-1}: not decayed, not yet written.
        residual = v - tl.sum(S * k[:, None], axis=0)
        residual = tl.minimum(tl.maximum(residual, -clip), clip)
        base_read = decay * tl.sum(S * q[:, None], axis=0)
        R = decay * R
        if DELTA:
            residual = residual - tl.sum(R * k[:, None], axis=0)
        R = R + gamma_write * k[:, None] * residual[None, :]
        tl.store(R_ptr + state_offsets, R, mask=state_ok)
        o = base_read + gamma * tl.sum(R * q[:, None], axis=0)

    S = decay * S
    write = v
    if DELTA:
        write = v - tl.sum(S * k[:, None], axis=0)
    S = S + beta * k[:, None] * write[None, :]
    tl.store(S_ptr + state_offsets, S, mask=state_ok)
    if not RESIDUAL:
        o = tl.sum(S * q[:, None], axis=0)
    tl.store(o_ptr + seq_head * DV + cols, (scale * o).to(o_ptr.dtype.element_ty), mask=col_ok)


@_on_inputs_device
def decode_step(q, k, v, g, beta, gamma, gamma_write, S, R, update, clip, scale):
    """One token: q, k [N, 1, H, Dk]; v [N, 1, HV, Dv]; g, beta, gamma, gamma_write [N, 1, HV];
    S, R [N, HV, Dk, Dv] fp32 contiguous, advanced in place (R None without gamma).
    Returns o [N, 1, HV, Dv] in v's dtype. The token axis stays: with T = 1 a contiguous
    [N, 1, ...] tensor is laid out as [N, ...], and every view made here costs launch time."""
    N, _, H, Dk = q.shape
    HV, Dv = v.shape[2:]
    q, k, v, g, beta = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v, g, beta))
    residual = gamma is not None
    if residual:
        gamma, gamma_write = (x if x.is_contiguous() else x.contiguous() for x in (gamma, gamma_write))
    o = torch.empty_like(v)
    BK = _next_power_of_2(Dk)
    # Enough programs to fill the GPU at small batches, and state tiles of <= 4K fp32 a program.
    BV = min(_next_power_of_2(Dv), max(16, 4096 // BK))
    grid = (N * HV, _cdiv(Dv, BV))
    _decode_step_kernel[grid](
        q, k, v, g, beta, gamma if residual else g, gamma_write if residual else g,
        S, R if residual else S, o, scale, clip, HV, HV // H, Dk, Dv,
        BK=BK, BV=BV, DELTA=update == "delta", RESIDUAL=residual,
    )
    return o


# ---------------------------------------------------------------------------------------------
# Chunked forward (DESIGN.md section 1, "Chunked form"). The tokens of every sequence lie one
# after another ([L tokens, heads, dim]); chunks of BC tokens never straddle two sequences, and
# the rows of a short tail chunk load as zeros (g = 0, strength b = 0, k = 0), which neither
# decay nor write any state. Five kernels (two for sGLA; see below for few long sequences), each
# serving every rule:
#   _chunk_gram_kernel (delta rule; RLA's fused pass), every chunk at once, from K K^T by blocks of
#       a quarter chunk (few warps suit them): T^-1, T = I + diag(b) strictly_lower(e^(G_i - G_j) K K^T),
#       for S and, with the residual state, for R; and the residual rules' prediction operator
#       P = strictly_lower(e^(G_prev_i - G_j) K K^T), so that no sequential loop forms K K^T;
#   _chunk_wy_kernel (delta rule), every chunk at once: the WY terms
#       W = T^-1 diag(b e^G) K and U0 = T^-1 diag(b) V, as full-chunk tensor-core dots;
#   _chunk_state_kernel, chunk after chunk for one (sequence, value head, value tile): stores the
#       chunk-start states h and the chunk's writes U = U0 - W h (the additive rule writes
#       U = diag(b) V) and moves on to S = e^(G_last) h + (e^(G_last - G) K)^T U. The residual
#       rules run it twice, S's pass then R's, one state each;
#   _chunk_residual_writes_kernel (residual rules), every chunk at once, between the two passes:
#       pred = e^(G_prev) K h + P U from S's chunk-start states, and R's writes from the clipped
#       residual clip(v - pred) (for the delta rule, R's U0 = T_R^-1 diag(b_R) r; RLA forms P
#       here). For RLA from 32 to 63 (sequence, head) pairs, the state kernel does all three in one
#       pass (BOTH_STATES);
#   _chunk_output_kernel, every chunk at once: o = e^G (Q h) + (mask(Q K^T) e^(G_i - G_j)) U,
#       for the residual rules the exclusive base read plus gamma times R's read.
# Few long sequences of the additive rule (sGLA, RLA) leave most SMs idle along the state loop.
# Below 32 (sequence, head) pairs (_ChunkRun.scans_states) its passes run as
# _chunk_local_state_kernel, every chunk's own addition to the state at once, then
# _chunk_state_scan_kernel, which turns them into the chunk-start states a few chunks a step with
# no product with the state; RLA's writes kernel then stores what R's writes add to R, for R's
# scan. Otherwise, where few programs would still run the loop, it runs on segments of each
# sequence side by side from zero states, _chunk_segment_starts_kernel carries the segments' end
# states into their true start states, and _chunk_state_join_kernel adds them, decayed, to every
# chunk-start state at once (S is linear in its start state); RLA then runs R's pass the same
# way, its writes read from the joined h (_ChunkRun.state_segments says when, and why not for
# the delta rule).
# Precision: states, decays and the inverse's blocks in fp32 (merged with tf32 dots for bf16/fp16
# inputs); the large dots take their operands in the input dtype (bf16/fp16 tensor cores, fp32
# accumulation); everything is exact fp32 ("ieee") for fp32 inputs. T^-1, P, W, U0, U and h are
# stored in the input dtype (a joined segment's h twice: before and after its start state is
# added; final states stay fp32 throughout).
# ---------------------------------------------------------------------------------------------

CHUNK_SIZE = 64
# A forward whose backward will not run may take longer chunks (`forward_chunk_size`): sGLA's
# below 64 sequence-heads, RLA's below 32, where their state passes run on few programs or store
# every chunk's state twice. The output kernel still reads OUTPUT_ROWS rows a program.
LONG_CHUNK_SIZE = 128
OUTPUT_ROWS = 64
# One warp per chunk for T^-1 and P: its 16 x 16 blocks leave more warps idle (on the H200 at
# B4xT4096 H8 D128, gdn's gram kernel took 41 us on 1 warp, 87 on 2, 164 on 4; session 18, with
# the series inverse, H16 B1xT32768: 96 on 1, 157 on 2, 285 on 4).
GRAM_WARPS = 1

# The additive rule's state recurrence over few long sequences is split into segments (see
# _ChunkRun.state_segments) until about PARALLEL_PROGRAMS programs run it (~8 per SM of an H200),
# in segments of at least MIN_SEGMENT_CHUNKS chunks, when that makes at least MIN_SEGMENTS.
PARALLEL_PROGRAMS = 1024
MIN_SEGMENT_CHUNKS = 16
MIN_SEGMENTS = 16
# The delta rule's state passes over fewer than KEPT_BELOW_SEQUENCE_HEADS (row, head) pairs: a
# training forward keeps the state at the start of every segment of each row, as many segments
# as bring the (segment, head) pairs to KEPT_SEQUENCE_HEADS, each at least MIN_KEPT_SEGMENT_CHUNKS
# long, so that the backward's recompute runs every segment at once (`kept_segments`).
KEPT_BELOW_SEQUENCE_HEADS = 64
KEPT_SEQUENCE_HEADS = 128
MIN_KEPT_SEGMENT_CHUNKS = 16
# `_chunk_state_scan_kernel`: state elements a program, and chunks folded at a time (at least 16:
# a dot's rows; 8 does not compile for the H200). Timed there (H16 D128, sGLA forward at
# B1xT32768, session 15: 587 us) against blocks of 256 (594) and 64 (624), 32 chunks (649).
# On 2 warps the scan kernel took 153 us against 162 on 4 and 200 on 8 (session 16, same shape).
SCAN_BLOCK = 128
SCAN_CHUNKS = 16
SCAN_WARPS = 2
TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}



@triton.jit
def _mm(a, b, DT: tl.constexpr, acc=None):
    """a @ b, fp32 accumulation, operands cast to DT (exact fp32 dots when DT is fp32); added into
    the fp32 `acc` where given (one accumulator for a sum of products: fewer registers held)."""
    if DT == tl.float32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a.to(DT), b.to(DT), acc)
    return out


@triton.jit
def _load_rows(ptr, rows, row_ok, head, heads, cols, width):
    """x[rows, head, cols] of a [tokens, heads, width] tensor, zero outside it."""
    offsets = (rows * heads + head)[:, None] * width + cols[None, :]
    return tl.load(ptr + offsets, mask=row_ok[:, None] & (cols < width)[None, :], other=0.0)


@triton.jit
def _load_columns(ptr, rows, row_ok, head, heads, cols, width):
    """x[rows, head, cols] transposed, [cols, rows]: loaded so, it is a dot's left operand as it
    lies in shared memory; transposing a loaded tile in registers costs the sequential loops
    (the forward state kernel at B4xT4096 H8 D128: gdn 145 -> 92 us, sGLA 116 -> 68 on an H200)."""
    offsets = (rows * heads + head)[None, :] * width + cols[:, None]
    return tl.load(ptr + offsets, mask=row_ok[None, :] & (cols < width)[:, None], other=0.0)


@triton.jit
def _store_rows(ptr, rows, row_ok, head, heads, cols, width, x):
    offsets = (rows * heads + head)[:, None] * width + cols[None, :]
    tl.store(ptr + offsets, x.to(ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < width)[None, :])


@triton.jit
def _sequence_bounds(seq, cu_seqlens_ptr, chunk_offsets_ptr, T, NT, VARLEN: tl.constexpr):
    """First token, end and first chunk of a sequence."""
    if VARLEN:
        bos, eos = tl.load(cu_seqlens_ptr + seq), tl.load(cu_seqlens_ptr + seq + 1)
        first_chunk = tl.load(chunk_offsets_ptr + seq)
    else:
        bos = seq.to(tl.int64) * T
        eos = bos + T
        first_chunk = (seq * NT).to(tl.int64)
    return bos, eos, first_chunk


@triton.jit
def _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT,
                  BC: tl.constexpr, VARLEN: tl.constexpr):
    """A chunk's first token and the end of its sequence (int64 token indices)."""
    seq = tl.load(chunk_seq_ptr + chunk) if VARLEN else chunk // NT  # else B rows of T tokens, NT chunks each
    bos, eos, first_chunk = _sequence_bounds(seq, cu_seqlens_ptr, chunk_offsets_ptr, T, NT, VARLEN)
    return bos + (chunk - first_chunk).to(tl.int64) * BC, eos


@triton.jit
def _token_scalars(ptr, rows, row_ok, head, HV):
    return tl.load(ptr + rows * HV + head, mask=row_ok, other=0.0).to(tl.float32)


@triton.jit
def _mm_fp32(a, b, DT: tl.constexpr):
    """a @ b of fp32 operands: exact for fp32 inputs, tf32 tensor cores when the inputs are
    bf16/fp16 (whose own rounding is 8x coarser)."""
    if DT == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision="tf32")
    return out


@triton.jit
def _key_block(k_ptr, g_ptr, first_row, end, head, HV, GROUP, DK, G_before, BLOCK: tl.constexpr, BK: tl.constexpr):
    """One BLOCK-row block of a chunk: its rows, keys, cumulative log decay G (continuing
    G_before) and G_prev = G - g (before each row's own decay), and G at its last row."""
    rows = first_row + tl.arange(0, BLOCK)
    row_ok = rows < end
    g = _token_scalars(g_ptr, rows, row_ok, head, HV)
    k = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, tl.arange(0, BK), DK)
    G = G_before + tl.cumsum(g, axis=0)
    return rows, row_ok, k, G, G - g, G_before + tl.sum(g, axis=0)


@triton.jit
def _decayed(gram, G_i, G_j, DIAGONAL: tl.constexpr, BLOCK: tl.constexpr):
    """e^(G_i - G_j) times block (i, j) of K K^T, strictly lower on the diagonal."""
    log_decay = G_i[:, None] - G_j[None, :]
    if DIAGONAL:
        r = tl.arange(0, BLOCK)
        log_decay = tl.where(r[:, None] > r[None, :], log_decay, float("-inf"))
    return tl.exp(log_decay) * gram


@triton.jit
def _lower_decay(G, BC: tl.constexpr):
    """e^(G_i - G_j) for j <= i, 0 above the diagonal (masked before the exponential, which
    would overflow there)."""
    r = tl.arange(0, BC)
    return tl.exp(tl.where(r[:, None] >= r[None, :], G[:, None] - G[None, :], float("-inf")))


@triton.jit
def _decayed_blocks(K00, K10, K11, K20, K21, K22, K30, K31, K32, K33, Gr0, Gr1, Gr2, Gr3, G0, G1, G2, G3,
                    BLOCK: tl.constexpr):
    """The ten blocks on and below the diagonal of strictly_lower(e^(Gr_i - G_j) K K^T), from
    those of K K^T: Gr is G for T's matrix A, G_prev for the prediction operator P."""
    return (_decayed(K00, Gr0, G0, True, BLOCK),
            _decayed(K10, Gr1, G0, False, BLOCK), _decayed(K11, Gr1, G1, True, BLOCK),
            _decayed(K20, Gr2, G0, False, BLOCK), _decayed(K21, Gr2, G1, False, BLOCK),
            _decayed(K22, Gr2, G2, True, BLOCK),
            _decayed(K30, Gr3, G0, False, BLOCK), _decayed(K31, Gr3, G1, False, BLOCK),
            _decayed(K32, Gr3, G2, False, BLOCK), _decayed(K33, Gr3, G3, True, BLOCK))


@triton.jit
def _store_lower(B00, B10, B11, B20, B21, B22, B30, B31, B32, B33, ptr, rows0, ok0, rows1, ok1, rows2, ok2,
                 rows3, ok3, head, HV, BC: tl.constexpr, BLOCK: tl.constexpr):
    """A chunk's lower block-triangular [BC, BC] matrix as rows [token, head, position in the
    chunk]; blocks above the diagonal are left unwritten (`_load_lower` masks them)."""
    c = tl.arange(0, BLOCK)
    _store_rows(ptr, rows0, ok0, head, HV, c, BC, B00)
    _store_rows(ptr, rows1, ok1, head, HV, c, BC, B10)
    _store_rows(ptr, rows1, ok1, head, HV, c + BLOCK, BC, B11)
    _store_rows(ptr, rows2, ok2, head, HV, c, BC, B20)
    _store_rows(ptr, rows2, ok2, head, HV, c + BLOCK, BC, B21)
    _store_rows(ptr, rows2, ok2, head, HV, c + 2 * BLOCK, BC, B22)
    _store_rows(ptr, rows3, ok3, head, HV, c, BC, B30)
    _store_rows(ptr, rows3, ok3, head, HV, c + BLOCK, BC, B31)
    _store_rows(ptr, rows3, ok3, head, HV, c + 2 * BLOCK, BC, B32)
    _store_rows(ptr, rows3, ok3, head, HV, c + 3 * BLOCK, BC, B33)


@triton.jit
def _invert_unit_lower(A, BLOCK: tl.constexpr, DT: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular A by doubling: where X inverts I + A's diagonal
    blocks of `size` rows, X - X A' X inverts its blocks of 2 size rows, A' being A's blocks just
    below X's (A' X A' = 0). From X = I - A' at size 1, three doublings for blocks of 16, two
    products each on tensor cores (tf32 for bf16/fp16 inputs), whose factors are blocks of the
    inverse itself: within 9.1e-4 of the inverse in tf32 on repeated keys (simulated, session 18;
    on the GPU, test_gpu.py's repeated keys, its outputs and states are as far from the fp32
    reference as forward substitution's, 1.1e-2 for gdn, as are FLA's). The power series
    (I - A)(I + A^2)(I + A^4)(I + A^8), as many products, cancels binomially large terms there
    (outputs off by 1e9 on that test). Forward substitution, a row at a time, was slow: H200,
    H16 D128, session 19, the gram kernel at B1xT32768 gdn 161 -> 99 us, rdn 308 -> 158 (the
    series: 97 and 175), at B8xT2048 gdn 81 -> 50, rdn 153 -> 82."""
    tl.static_assert(BLOCK <= 64)
    r = tl.arange(0, BLOCK)
    X = tl.where(r[:, None] == r[None, :], 1.0, 0.0) - tl.where(_below_blocks(r, 1), A, 0.0)
    for step in tl.static_range(1, 6):
        if (1 << step) < BLOCK:
            X -= _mm_fp32(X, _mm_fp32(tl.where(_below_blocks(r, 1 << step), A, 0.0), X, DT), DT)
    return X


@triton.jit
def _below_blocks(r, size: tl.constexpr):
    """Where the rows of each odd block of `size` rows meet the block before it."""
    return ((r[:, None] // size) % 2 == 1) & (r[None, :] // size == r[:, None] // size - 1)


@triton.jit
def _store_inverse(M00, M10, M11, M20, M21, M22, M30, M31, M32, M33, strength_ptr, X_ptr,
                   rows0, ok0, rows1, ok1, rows2, ok2, rows3, ok3, head, HV, BC: tl.constexpr,
                   BLOCK: tl.constexpr, DT: tl.constexpr):
    """X = T^-1, T = I + diag(b) M (M: the blocks of the decayed Gram matrix), by blocks:
    X_ii = (I + A_ii)^-1 and X_ij = -X_ii sum_{j <= m < i} A_im X_mj; stored by `_store_lower`."""
    b0 = _token_scalars(strength_ptr, rows0, ok0, head, HV)[:, None]
    b1 = _token_scalars(strength_ptr, rows1, ok1, head, HV)[:, None]
    b2 = _token_scalars(strength_ptr, rows2, ok2, head, HV)[:, None]
    b3 = _token_scalars(strength_ptr, rows3, ok3, head, HV)[:, None]
    X00 = _invert_unit_lower(b0 * M00, BLOCK, DT)
    X11 = _invert_unit_lower(b1 * M11, BLOCK, DT)
    X22 = _invert_unit_lower(b2 * M22, BLOCK, DT)
    X33 = _invert_unit_lower(b3 * M33, BLOCK, DT)
    X10 = -_mm_fp32(X11, _mm_fp32(b1 * M10, X00, DT), DT)
    X21 = -_mm_fp32(X22, _mm_fp32(b2 * M21, X11, DT), DT)
    X20 = -_mm_fp32(X22, _mm_fp32(b2 * M20, X00, DT) + _mm_fp32(b2 * M21, X10, DT), DT)
    X32 = -_mm_fp32(X33, _mm_fp32(b3 * M32, X22, DT), DT)
    X31 = -_mm_fp32(X33, _mm_fp32(b3 * M31, X11, DT) + _mm_fp32(b3 * M32, X21, DT), DT)
    X30 = -_mm_fp32(X33, _mm_fp32(b3 * M30, X00, DT) + _mm_fp32(b3 * M31, X10, DT) + _mm_fp32(b3 * M32, X20, DT),
                    DT)
    _store_lower(X00, X10, X11, X20, X21, X22, X30, X31, X32, X33, X_ptr, rows0, ok0, rows1, ok1, rows2, ok2,
                 rows3, ok3, head, HV, BC, BLOCK)


@_Launcher
@triton.jit
def _chunk_gram_kernel(k_ptr, g_ptr, strength_ptr, residual_strength_ptr, cu_seqlens_ptr, chunk_seq_ptr,
                       chunk_offsets_ptr, X_ptr, X_residual_ptr, P_ptr, T, NT, HV, GROUP, DK, BC: tl.constexpr,
                       BLOCK: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr,
                       RESIDUAL: tl.constexpr, STORE_P: tl.constexpr, VARLEN: tl.constexpr):
    """What a chunk's K K^T gives, by 16 x 16 blocks: for the delta rule T^-1 for S (write
    strength beta) and, with the residual state, for R (its write strength); with STORE_P (RLA's
    fused pass) the prediction operator P = strictly_lower(e^(G_prev_i - G_j) K K^T), which
    `_pred` reads so that the sequential kernel needs no K K^T in its loop."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    start, end = _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
    fixed = (end, head, HV, GROUP, DK)
    rows0, ok0, k0, G0, Gp0, G_end = _key_block(k_ptr, g_ptr, start, *fixed, 0.0, BLOCK, BK)
    rows1, ok1, k1, G1, Gp1, G_end = _key_block(k_ptr, g_ptr, start + BLOCK, *fixed, G_end, BLOCK, BK)
    rows2, ok2, k2, G2, Gp2, G_end = _key_block(k_ptr, g_ptr, start + 2 * BLOCK, *fixed, G_end, BLOCK, BK)
    rows3, ok3, k3, G3, Gp3, G_end = _key_block(k_ptr, g_ptr, start + 3 * BLOCK, *fixed, G_end, BLOCK, BK)
    gram = (_mm(k0, tl.trans(k0), DT),
            _mm(k1, tl.trans(k0), DT), _mm(k1, tl.trans(k1), DT),
            _mm(k2, tl.trans(k0), DT), _mm(k2, tl.trans(k1), DT), _mm(k2, tl.trans(k2), DT),
            _mm(k3, tl.trans(k0), DT), _mm(k3, tl.trans(k1), DT), _mm(k3, tl.trans(k2), DT),
            _mm(k3, tl.trans(k3), DT))
    blocks = (rows0, ok0, rows1, ok1, rows2, ok2, rows3, ok3, head, HV)
    if STORE_P:
        _store_lower(*_decayed_blocks(*gram, Gp0, Gp1, Gp2, Gp3, G0, G1, G2, G3, BLOCK), P_ptr, *blocks, BC, BLOCK)
    if DELTA:
        A = _decayed_blocks(*gram, G0, G1, G2, G3, G0, G1, G2, G3, BLOCK)
        _store_inverse(*A, strength_ptr, X_ptr, *blocks, BC, BLOCK, DT)
        if RESIDUAL:
            _store_inverse(*A, residual_strength_ptr, X_residual_ptr, *blocks, BC, BLOCK, DT)


@triton.jit
def _load_lower(ptr, rows, row_ok, head, HV, BC: tl.constexpr):
    """A chunk's [BC, BC] matrix written by `_store_lower`, zeros above the diagonal."""
    r = tl.arange(0, BC)
    return tl.where(r[:, None] >= r[None, :], _load_rows(ptr, rows, row_ok, head, HV, r, BC), 0.0)


@_Launcher
@triton.jit
def _chunk_decay_kernel(g_ptr, G_ptr, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, HV,
                        BC: tl.constexpr, BH: tl.constexpr, VARLEN: tl.constexpr):
    """A chunk's cumulative log decay G (fp32) for every head, which the additive rule's
    sequential passes load (`_chunk_decay`; the delta rule's WY kernel stores its own)."""
    start, end = _chunk_bounds(tl.program_id(0), cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
    rows, heads = start + tl.arange(0, BC), tl.arange(0, BH)
    offsets = rows[:, None] * HV + heads[None, :]
    ok = (rows < end)[:, None] & (heads < HV)[None, :]
    tl.store(G_ptr + offsets, tl.cumsum(tl.load(g_ptr + offsets, mask=ok, other=0.0).to(tl.float32), axis=0), mask=ok)


@triton.jit
def _factor_columns(a, b, c, d):
    """Four per-row factors of equal shapes side by side, on a last axis of four: (a, b, c, d)."""
    joined = tl.join(tl.join(a, c), tl.join(b, d))  # [..., s, t] holds column 2 s + t
    return tl.reshape(joined, joined.shape[:-2] + [4])


@_Launcher
@triton.jit
def _chunk_pass_factors_kernel(g_ptr, strength_ptr, residual_strength_ptr, row_factors_ptr, chunk_factors_ptr,
                               cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, HV, BC: tl.constexpr,
                               BH: tl.constexpr, VARLEN: tl.constexpr):
    """A chunk's factors for RLA's fused pass (`_load_pass_factors`), every head at once: by row
    e^(G_prev), b, gamma and e^(G_last - G), and e^(G_last)."""
    chunk = tl.program_id(0)
    start, end = _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
    rows, heads = start + tl.arange(0, BC), tl.arange(0, BH)
    offsets = rows[:, None] * HV + heads[None, :]
    ok = (rows < end)[:, None] & (heads < HV)[None, :]
    g = tl.load(g_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    G = tl.cumsum(g, axis=0)
    G_last = tl.sum(g, axis=0)  # padded rows add 0
    factors = _factor_columns(tl.exp(G - g), tl.load(strength_ptr + offsets, mask=ok, other=0.0).to(tl.float32),
                              tl.load(residual_strength_ptr + offsets, mask=ok, other=0.0).to(tl.float32),
                              tl.exp(G_last[None, :] - G))
    tl.store(row_factors_ptr + offsets[:, :, None] * 4 + tl.arange(0, 4)[None, None, :], factors,
             mask=ok[:, :, None])
    tl.store(chunk_factors_ptr + chunk * HV + heads, tl.exp(G_last), mask=heads < HV)


@triton.jit
def _load_pass_factors(row_factors_ptr, chunk_factors_ptr, chunk, rows, row_ok, head, HV, BC: tl.constexpr):
    """What RLA's fused pass needs of a chunk's gates: e^(G_last), and by row e^(G_prev) (pred),
    b, gamma and e^(G_last - G), the latter four one [BC, 4] load (rows past the sequence 0,
    where nothing is written). Scanning g and loading b and gamma apart in the loop cost more
    (H200, H16 D128, B2xT8192, session 32: the pass 343 -> 289 us, the factors' kernel 7; 341 ->
    239 with no gate loaded at all, wrong, to time). The same factors in the reverse passes (e^G
    for e^(G_prev) and R's gamma for b) lost there (RDN's two 570 -> 598 us, sGLA's 112 -> 155)."""
    factors = tl.load(row_factors_ptr + (rows * HV + head)[:, None] * 4 + tl.arange(0, 4)[None, :],
                      mask=row_ok[:, None], other=0.0)
    first, second = tl.split(tl.reshape(factors, (BC, 2, 2)))  # columns 0 and 2, 1 and 3
    pred_decay, residual_strength = tl.split(first)
    strength, to_end = tl.split(second)
    return tl.load(chunk_factors_ptr + chunk * HV + head), pred_decay, strength, residual_strength, to_end


@_Launcher
@triton.jit
def _chunk_wy_kernel(k_ptr, v_ptr, g_ptr, strength_ptr, residual_strength_ptr, X_ptr, X_residual_ptr,
                     cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, W_ptr, U0_ptr, W_residual_ptr, G_ptr,
                     T, NT, HV, GROUP, DK, DV, NUM_CHUNKS, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     DT: tl.constexpr, RESIDUAL: tl.constexpr, VARLEN: tl.constexpr):
    """The WY terms of a chunk: U0 = X diag(b) V for S and W = X diag(b e^G) K for S and R (R's U0
    needs the residual, which the writes kernel forms), for the state passes that read them: the
    passes that form their writes from X need neither (`_ChunkRun.writes_from_inverse`). A
    program takes every num_programs-th (chunk, head) of the NUM_CHUNKS * HV (`wy_programs`). The
    cumulative log decay G is stored too (fp32), for the state passes: no scan on their loops'
    chain."""
    for item in range(tl.program_id(0), NUM_CHUNKS * HV, tl.num_programs(0)):
        chunk, head = item % NUM_CHUNKS, item // NUM_CHUNKS
        start, end = _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
        rows = start + tl.arange(0, BC)
        row_ok = rows < end
        G = tl.cumsum(_token_scalars(g_ptr, rows, row_ok, head, HV), axis=0)
        tl.store(G_ptr + rows * HV + head, G, mask=row_ok)
        decay = tl.exp(G)
        strength = _token_scalars(strength_ptr, rows, row_ok, head, HV)
        kcols, vcols = tl.arange(0, BK), tl.arange(0, BV)
        k = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
        v = _load_rows(v_ptr, rows, row_ok, head, HV, vcols, DV)
        X = _load_lower(X_ptr, rows, row_ok, head, HV, BC)
        _store_rows(U0_ptr, rows, row_ok, head, HV, vcols, DV, _mm(X, strength[:, None] * v, DT))
        _store_rows(W_ptr, rows, row_ok, head, HV, kcols, DK, _mm(X, (strength * decay)[:, None] * k, DT))
        if RESIDUAL:
            residual_strength = _token_scalars(residual_strength_ptr, rows, row_ok, head, HV)
            X = _load_lower(X_residual_ptr, rows, row_ok, head, HV, BC)
            _store_rows(W_residual_ptr, rows, row_ok, head, HV, kcols, DK,
                        _mm(X, (residual_strength * decay)[:, None] * k, DT))


@triton.jit
def _pred(k, h, U, P, pred_decay, DT: tl.constexpr):
    """pred_t = S_{t-1}^T k_t for a chunk's rows: decay e^(G_{t-1} - G_j), never divided by a_t,
    so the chunk-start state h reaches row t as pred_decay = e^(G_prev_t) and earlier rows'
    writes U through P."""
    return pred_decay[:, None] * _mm(k, h, DT) + _mm(P, U, DT)


@triton.jit
def _clipped_residual(k, v, h, U, P, pred_decay, clip, z_ptr, rows, row_ok, head, HV, vcols, DV, DT: tl.constexpr,
                      STORE_Z: tl.constexpr):
    """The residual clip(v - pred, -c, c) of a chunk's rows that R writes, from S's chunk-start
    state h and its writes U. z = v - pred is stored for the backward when STORE_Z, in the
    inputs' dtype, as +-inf where it was clipped: the backward's clip decisions are then the
    forward's own, however z rounds near the clip."""
    z = v - _pred(k, h, U, P, pred_decay, DT)
    residual = tl.minimum(tl.maximum(z, -clip), clip)
    if STORE_Z:
        clipped = tl.where(z > 0, float("inf"), float("-inf"))
        _store_rows(z_ptr, rows, row_ok, head, HV, vcols, DV, tl.where(residual == z, z, clipped))
    return residual


@triton.jit
def _added(k_t, to_end, U, DT: tl.constexpr):
    """What a chunk's writes U add to the state by its end: (diag(to_end) K)^T U, to_end =
    e^(G_last - G)."""
    return _mm(k_t, to_end[:, None] * U, DT)


@triton.jit
def _chunk_writes(v_ptr, strength_ptr, U_ptr, rows, row_ok, head, HV, vcols, DV, DELTA: tl.constexpr):
    """The writes U of a block of rows: the delta rule's as the state kernel stored them, the
    additive rule's diag(b) V."""
    if DELTA:
        U = _load_rows(U_ptr, rows, row_ok, head, HV, vcols, DV)
    else:
        U = _token_scalars(strength_ptr, rows, row_ok, head, HV)[:, None] * \
            _load_rows(v_ptr, rows, row_ok, head, HV, vcols, DV).to(tl.float32)
    return U


@triton.jit
def _advanced(S, k_t, decay, to_end, U, DT: tl.constexpr):
    """A state at the chunk's end from its start: e^(G_last) S + (e^(G_last - G) K)^T U, given
    decay = e^(G_last) and to_end = e^(G_last - G)."""
    return decay * S + _added(k_t, to_end, U, DT)


@triton.jit
def _state_tile(seq_head, kcols, vcols, DK, DV):
    """Offsets and mask of a [BK, BV] tile of state number seq_head."""
    offsets = seq_head.to(tl.int64) * DK * DV + kcols[:, None] * DV + vcols[None, :]
    ok = (kcols < DK)[:, None] & (vcols < DV)[None, :]
    return offsets, ok


@triton.jit
def _chunk_decay(G_ptr, start, rows, row_ok, end, head, HV, BC: tl.constexpr):
    """A sequential pass's chunk decays, G and G at the chunk's last real row: loads of the G that
    the WY kernel (delta rule) or the decay kernel (additive rule) stored, so that no scan sits
    on the loop's chain (rows past the sequence load 0, where every write is 0). RLA's fused
    pass loads its decays with its gates as one tile instead (`_load_pass_factors`); the additive
    rule's pass over many programs scans g (`_ChunkRun.pass_scans_decays`)."""
    return _token_scalars(G_ptr, rows, row_ok, head, HV), tl.load(G_ptr + (tl.minimum(start + BC, end) - 1) * HV + head)


@triton.jit
def _scanned_chunk_decay(g_ptr, rows, row_ok, head, HV):
    """G, G_last and G_prev = G - g scanned from g: the residual rules' S reverse pass reads
    G_prev (pred) and loads g anyway; loading G there as well was slower (H200, H16 D128,
    session 27: RDN's S reverse pass +50 us at B8xT2048)."""
    g = _token_scalars(g_ptr, rows, row_ok, head, HV)
    G = tl.cumsum(g, axis=0)
    return G, tl.sum(g, axis=0), G - g  # padded rows add 0: G_last is the last real token's G


@_Launcher
@triton.jit
def _chunk_state_kernel(k_ptr, v_ptr, G_ptr, strength_ptr, W_ptr, U0_ptr, U_ptr, h_ptr, S0_ptr, S_ptr,
                        P_ptr, row_factors_ptr, chunk_factors_ptr, z_ptr, U_residual_ptr, h_residual_ptr, R0_ptr, R_ptr,
                        kept_ptr, cu_seqlens_ptr, chunk_offsets_ptr, clip, T, NT, HV, GROUP, DK, DV, KEPT_SEGMENTS,
                        BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr,
                        WRITES_FROM_INVERSE: tl.constexpr, BOTH_STATES: tl.constexpr, STORE_Z: tl.constexpr,
                        SCAN_G: tl.constexpr, LAUNCHES_DEPENDENTS: tl.constexpr, KEPT_SEGMENT_CHUNKS: tl.constexpr,
                        VARLEN: tl.constexpr):
    """Chunk after chunk of one (sequence, value head, value tile) of one state: stores the
    chunk-start states h and the writes U = U0 - W h (the additive rule: diag(b) V, recomputed
    where read), then S = e^(G_last) h + (e^(G_last - G) K)^T U, from the initial state at S0_ptr
    to the final one at S_ptr (the same tensor for both advances it in place). The residual rules
    run it twice: for S, then for R with its own writes (`_chunk_residual_writes_kernel`) in place
    of V, or of U0 and W. Or, for RLA (BOTH_STATES, additive rule only), S and R together: R's
    writes made from S's chunk-start state as that kernel makes them, kept in registers; R0_ptr
    and R_ptr as S0_ptr and S_ptr; the gates and decays as factors (`_chunk_pass_factors_kernel`).
    Every step is separable by value column, so a program owns the same value tile of S and R.
    With WRITES_FROM_INVERSE (delta rule) W_ptr holds T^-1, and the writes are formed from it, the
    values (R's: the clipped residuals) and the chunk's keys, U = T^-1 diag(b) (V - diag(e^G) K h):
    no U0 or W is read, and the WY kernel forms none. With SCAN_G G_ptr holds g, scanned every
    chunk, in place of the stored G (`_ChunkRun.pass_scans_decays`). LAUNCHES_DEPENDENTS
    (compiled, not interpreted): a kernel launched as its programmatic dependent may start once
    every program's loop is done. With KEPT_SEGMENT_CHUNKS (a training forward over B rows of T
    tokens) the fp32 state at the start of every KEPT_SEGMENT_CHUNKS chunks is kept too, at
    kept_ptr [B * KEPT_SEGMENTS, HV, DK, DV]: the backward's recompute runs from them, every
    segment at once (`kept_segments`)."""
    value_tile, seq_head = tl.program_id(0), tl.program_id(1)
    seq, head = seq_head // HV, seq_head % HV
    bos, eos, chunk = _sequence_bounds(seq, cu_seqlens_ptr, chunk_offsets_ptr, T, NT, VARLEN)
    first_chunk = chunk
    kcols, vcols = tl.arange(0, BK), value_tile * BV + tl.arange(0, BV)
    state_offsets, tile_ok = _state_tile(seq_head, kcols, vcols, DK, DV)
    tile = kcols[:, None] * DV + vcols[None, :]
    S = tl.load(S0_ptr + state_offsets, mask=tile_ok, other=0.0)
    if BOTH_STATES:
        R = tl.load(R0_ptr + state_offsets, mask=tile_ok, other=0.0)
    r = tl.arange(0, BC)
    for start in range(bos, eos, BC):
        chunk_tile = (chunk * HV + head) * DK * DV + tile
        tl.store(h_ptr + chunk_tile, S.to(DT), mask=tile_ok)
        if KEPT_SEGMENT_CHUNKS:
            step = chunk - first_chunk
            if step % KEPT_SEGMENT_CHUNKS == 0:
                kept_tile = ((seq * KEPT_SEGMENTS + step // KEPT_SEGMENT_CHUNKS) * HV + head).to(tl.int64) * DK * DV + tile
                tl.store(kept_ptr + kept_tile, S, mask=tile_ok)
        if BOTH_STATES:
            tl.store(h_residual_ptr + chunk_tile, R.to(DT), mask=tile_ok)
        rows = start + r
        row_ok = rows < eos
        if BOTH_STATES:  # K for pred; its transpose for the advance without a second load
            decay, pred_decay, strength, residual_strength, to_end = _load_pass_factors(
                row_factors_ptr, chunk_factors_ptr, chunk, rows, row_ok, head, HV, BC)
            k = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
            k_t = tl.trans(k)
        else:
            if SCAN_G:
                G, G_last, _ = _scanned_chunk_decay(G_ptr, rows, row_ok, head, HV)
            else:
                G, G_last = _chunk_decay(G_ptr, start, rows, row_ok, eos, head, HV, BC)
            decay, to_end = tl.exp(G_last), tl.exp(G_last - G)
            k_t = _load_columns(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
        if DELTA:
            if WRITES_FROM_INVERSE:  # U = T^-1 diag(b) (V - diag(e^G) K h)
                v = _load_rows(v_ptr, rows, row_ok, head, HV, vcols, DV).to(tl.float32)
                innovation = v - tl.exp(G)[:, None] * _mm(tl.trans(k_t), S, DT)
                strength = _token_scalars(strength_ptr, rows, row_ok, head, HV)
                U = _mm(_load_lower(W_ptr, rows, row_ok, head, HV, BC), strength[:, None] * innovation, DT)
            else:  # U = U0 - W h
                U = _load_rows(U0_ptr, rows, row_ok, head, HV, vcols, DV).to(tl.float32)
                U -= _mm(_load_rows(W_ptr, rows, row_ok, head, HV, kcols, DK), S, DT)
            _store_rows(U_ptr, rows, row_ok, head, HV, vcols, DV, U)
        else:
            v = _load_rows(v_ptr, rows, row_ok, head, HV, vcols, DV).to(tl.float32)
            if not BOTH_STATES:
                strength = _token_scalars(strength_ptr, rows, row_ok, head, HV)
            U = strength[:, None] * v
        if BOTH_STATES:
            residual = _clipped_residual(k, v, S, U, _load_lower(P_ptr, rows, row_ok, head, HV, BC), pred_decay, clip,
                                         z_ptr, rows, row_ok, head, HV, vcols, DV, DT, STORE_Z)
            U_residual = residual_strength[:, None] * residual
            _store_rows(U_residual_ptr, rows, row_ok, head, HV, vcols, DV, U_residual)
        S = _advanced(S, k_t, decay, to_end, U, DT)
        if BOTH_STATES:
            R = _advanced(R, k_t, decay, to_end, U_residual, DT)
        chunk += 1
    if LAUNCHES_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(S_ptr + state_offsets, S, mask=tile_ok)
    if BOTH_STATES:
        tl.store(R_ptr + state_offsets, R, mask=tile_ok)


@_Launcher
@triton.jit
def _chunk_local_state_kernel(k_ptr, v_ptr, g_ptr, strength_ptr, h_ptr, chunk_decay_ptr, cu_seqlens_ptr,
                              chunk_seq_ptr, chunk_offsets_ptr, T, NT, HV, GROUP, DK, DV, BC: tl.constexpr,
                              BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, VARLEN: tl.constexpr):
    """Every chunk at once (the additive rule, whose writes do not read the state): what the chunk
    adds to the state by its end, (e^(G_last - G) K)^T diag(b) V, stored in h, and its log decay
    G_last, for `_chunk_state_scan_kernel`."""
    value_tile, chunk, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
    rows = start + tl.arange(0, BC)
    row_ok = rows < end
    kcols, vcols = tl.arange(0, BK), value_tile * BV + tl.arange(0, BV)
    k_t = _load_columns(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
    g = _token_scalars(g_ptr, rows, row_ok, head, HV)
    U = _chunk_writes(v_ptr, strength_ptr, v_ptr, rows, row_ok, head, HV, vcols, DV, DELTA=False)
    h_offsets, tile_ok = _state_tile(chunk * HV + head, kcols, vcols, DK, DV)
    G_last = tl.sum(g, axis=0)
    tl.store(h_ptr + h_offsets, _added(k_t, tl.exp(G_last - tl.cumsum(g, axis=0)), U, DT).to(DT), mask=tile_ok)
    if value_tile == 0:
        tl.store(chunk_decay_ptr + chunk.to(tl.int64) * HV + head, G_last)


@_Launcher
@triton.jit
def _chunk_state_scan_kernel(chunk_decay_ptr, h_ptr, S0_ptr, S_ptr, cu_seqlens_ptr, chunk_offsets_ptr, T, NT, HV,
                             DK, DV, BC: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr,
                             VARLEN: tl.constexpr):
    """The chunk-start states of one (sequence, value head), BLOCK of the state's elements a
    program: h holds what each chunk adds on entry (`_chunk_local_state_kernel`, each chunk's log
    decay in chunk_decay), its start state on exit. CHUNKS chunks at a time from the state S
    before them, the chunked read one level up: with L_i the log decay from S to chunk i's end,
    chunk i ends at e^(L_i) S + sum_{j <= i} e^(L_i - L_j) added_j (never e^(-L_j): no overflow,
    no division by a decay). No product with the whole state in the loop, and CHUNKS chunks'
    loads in flight at once. From the initial state at S0_ptr to the final one at S_ptr."""
    block, seq_head = tl.program_id(0), tl.program_id(1)
    seq, head = seq_head // HV, seq_head % HV
    bos, eos, first_chunk = _sequence_bounds(seq, cu_seqlens_ptr, chunk_offsets_ptr, T, NT, VARLEN)
    elements = block * BLOCK + tl.arange(0, BLOCK)
    element_ok = elements < DK * DV
    state_offsets = seq_head.to(tl.int64) * DK * DV + elements
    S = tl.load(S0_ptr + state_offsets, mask=element_ok, other=0.0)
    steps = tl.arange(0, CHUNKS)
    num_chunks = tl.cdiv(eos - bos, BC)
    for first in range(0, num_chunks, CHUNKS):
        chunks = first + steps
        chunk_ok = chunks < num_chunks  # past the sequence: no decay, nothing added
        offsets = ((first_chunk + chunks) * HV + head)[:, None] * DK * DV + elements[None, :]
        ok = chunk_ok[:, None] & element_ok[None, :]
        added = tl.load(h_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        decay = tl.load(chunk_decay_ptr + (first_chunk + chunks) * HV + head, mask=chunk_ok, other=0.0)
        L = tl.cumsum(decay, axis=0)
        ends = tl.exp(L)[:, None] * S[None, :] + _mm_fp32(_lower_decay(L, CHUNKS), added, DT)
        # Chunk i starts from chunk i - 1's end, the first from S; the last end carries on.
        tl.store(h_ptr + offsets, tl.broadcast_to(S[None, :], (CHUNKS, BLOCK)).to(DT),
                 mask=ok & (steps == 0)[:, None])
        tl.store(h_ptr + offsets + HV * DK * DV, ends.to(DT),
                 mask=ok & ((chunks + 1 < num_chunks) & (steps < CHUNKS - 1))[:, None])
        S = tl.sum(tl.where((steps == CHUNKS - 1)[:, None], ends, 0.0), axis=0)
    tl.store(S_ptr + state_offsets, S, mask=element_ok)


@_Launcher
@triton.jit
def _chunk_residual_writes_kernel(k_ptr, v_ptr, g_ptr, strength_ptr, residual_strength_ptr, U_ptr, h_ptr, P_ptr,
                                  X_residual_ptr, z_ptr, writes_ptr, U_residual_ptr, h_residual_ptr, cu_seqlens_ptr,
                                  chunk_seq_ptr, chunk_offsets_ptr, clip, T, NT, HV, GROUP, DK, DV, BC: tl.constexpr,
                                  BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr,
                                  WRITES_FROM_INVERSE: tl.constexpr, ADDS_TO_STATE: tl.constexpr,
                                  STORE_Z: tl.constexpr, VARLEN: tl.constexpr):
    """Every chunk at once, after S's pass: pred_t = S_{t-1}^T k_t from the chunk-start state h
    and the chunk's own writes U, z = v - pred (stored for the backward when STORE_Z), the
    clipped residual r, and what R's pass writes with: U0_R = X_R diag(b_R) r for the delta
    rule, r itself for the delta rule's pass that forms its writes from X_R (WRITES_FROM_INVERSE)
    and for the additive one (its pass scales by b_R; R's writes U_R = diag(b_R) r are stored
    too, for the output and the backward, as the delta rule's pass stores its own).
    None of it needs R, so R's recurrence is S's again, over other writes. With ADDS_TO_STATE
    (the additive rule, whose R then advances by scan) no pass reads R's writes again: what they
    add to R by the chunk's end, (e^(G_last - G) K)^T U_R, goes to h_residual in their place, as
    `_chunk_local_state_kernel` stores S's. P is formed here (stored for the backward when
    STORE_Z), not read from the gram kernel. H200, H16 D128: RLA's forward, for which the gram
    kernel ran for P alone, 532 -> 502 us at B8xT2048, 577 -> 549 at B4xT4096, its backward call
    2,701 -> 2,642 and 2,787 -> 2,731 (session 17; in chunks of 128 the gram kernel's blocks took
    298 us for P at B1xT32768); RDN's forward 2,404 -> 2,347 us at B1xT32768, 880 -> 853 at
    B8xT2048 (session 18, both with an inverse since reverted). Making R's W here too (the WY
    kernel's for S alone) lost: RDN's writes kernel 295 -> 421 us, its WY kernel 292 -> 176."""
    value_tile, chunk, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
    rows = start + tl.arange(0, BC)
    row_ok = rows < end
    kcols, vcols = tl.arange(0, BK), value_tile * BV + tl.arange(0, BV)
    h_offsets, tile_ok = _state_tile(chunk * HV + head, kcols, vcols, DK, DV)
    h = tl.load(h_ptr + h_offsets, mask=tile_ok, other=0.0)
    k = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
    g = _token_scalars(g_ptr, rows, row_ok, head, HV)
    # v, U and P held in the inputs' dtype (the dots take them so) for the additive rule in chunks
    # of 64: 137 -> 105 registers (ptxas, bf16 D128), four programs a SM in place of three, RLA's
    # kernel 145 -> 121 us at B8xT2048 (H200, H16, session 38). For the delta rule (146 -> 138
    # registers, no program more) and in chunks of 128 (255 either way) they cost 6-12 us: fp32.
    held = DT if (not DELTA and BC == 64) else tl.float32
    v = _load_rows(v_ptr, rows, row_ok, head, HV, vcols, DV).to(held)
    G = tl.cumsum(g, axis=0)
    P = _decayed(_mm(k, tl.trans(k), DT), G - g, G, True, BC).to(held)
    if STORE_Z and value_tile == 0:
        _store_rows(P_ptr, rows, row_ok, head, HV, tl.arange(0, BC), BC, P)
    if DELTA:
        U = _load_rows(U_ptr, rows, row_ok, head, HV, vcols, DV)
    else:
        U = (_token_scalars(strength_ptr, rows, row_ok, head, HV)[:, None] * v).to(held)
    residual = _clipped_residual(k, v, h, U, P, tl.exp(G - g), clip, z_ptr, rows, row_ok, head, HV, vcols, DV, DT,
                                 STORE_Z)
    scaled = _token_scalars(residual_strength_ptr, rows, row_ok, head, HV)[:, None] * residual
    if DELTA and WRITES_FROM_INVERSE:  # R's pass forms U_R from X_R and r
        _store_rows(writes_ptr, rows, row_ok, head, HV, vcols, DV, residual)
    elif DELTA:
        _store_rows(writes_ptr, rows, row_ok, head, HV, vcols, DV,
                    _mm(_load_lower(X_residual_ptr, rows, row_ok, head, HV, BC), scaled, DT))
    else:
        _store_rows(U_residual_ptr, rows, row_ok, head, HV, vcols, DV, scaled)
        if ADDS_TO_STATE:
            added = _added(tl.trans(k), tl.exp(tl.sum(g, axis=0) - G), scaled, DT)
            tl.store(h_residual_ptr + h_offsets, added.to(DT), mask=tile_ok)
        else:
            _store_rows(writes_ptr, rows, row_ok, head, HV, vcols, DV, residual)


@_Launcher
@triton.jit
def _chunk_segment_starts_kernel(S0_ptr, ends_ptr, segment_decay_ptr, starts_ptr, S_ptr, SEGMENTS, HV, DK, DV,
                                 BK: tl.constexpr, BV: tl.constexpr):
    """The start states of the segments that `_chunk_state_kernel` ran from zero states (additive
    rule: S, or R once S is joined), and the final states. The state is linear in its start state,
    so a segment starts from e^(G over the segment before) S_start(before) + that segment's end
    state, from the row's initial state on; the last segment's successor is the final state."""
    value_tile, row, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kcols, vcols = tl.arange(0, BK), value_tile * BV + tl.arange(0, BV)
    state_offsets, tile_ok = _state_tile(row * HV + head, kcols, vcols, DK, DV)
    S = tl.load(S0_ptr + state_offsets, mask=tile_ok, other=0.0)
    for segment in range(row * SEGMENTS, (row + 1) * SEGMENTS):
        segment_offsets, _ = _state_tile(segment * HV + head, kcols, vcols, DK, DV)
        tl.store(starts_ptr + segment_offsets, S, mask=tile_ok)
        S = tl.exp(tl.load(segment_decay_ptr + segment * HV + head)) * S + \
            tl.load(ends_ptr + segment_offsets, mask=tile_ok, other=0.0)
    tl.store(S_ptr + state_offsets, S, mask=tile_ok)


@_Launcher
@triton.jit
def _chunk_state_join_kernel(h_ptr, starts_ptr, chunk_decay_ptr, NT, SEGMENT_CHUNKS, SEGMENTS, HV, DK, DV,
                             BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr):
    """Every chunk at once: a chunk-start state of a segment run from zero gains the segment's
    start state decayed to the chunk, h_c + e^(G from the segment's start to c) S_start."""
    value_tile, chunk, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row, in_row = chunk // NT, chunk % NT
    segment = row * SEGMENTS + in_row // SEGMENT_CHUNKS
    kcols, vcols = tl.arange(0, BK), value_tile * BV + tl.arange(0, BV)
    h_offsets, tile_ok = _state_tile(chunk.to(tl.int64) * HV + head, kcols, vcols, DK, DV)
    start_offsets, _ = _state_tile(segment * HV + head, kcols, vcols, DK, DV)
    decay = tl.exp(tl.load(chunk_decay_ptr + chunk.to(tl.int64) * HV + head))
    h = tl.load(h_ptr + h_offsets, mask=tile_ok, other=0.0).to(tl.float32)
    S = tl.load(starts_ptr + start_offsets, mask=tile_ok, other=0.0)
    tl.store(h_ptr + h_offsets, (h + decay * S).to(DT), mask=tile_ok)


@triton.jit
def _chunk_queries_keys(q_ptr, k_ptr, g_ptr, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, value_tile, chunk, head,
                        T, NT, HV, GROUP, DK, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        VARLEN: tl.constexpr):
    """What the every-chunk-at-once kernels over a value tile start from: the chunk's rows (and
    which are real), the tile's columns, the queries, keys and cumulative log decay G."""
    start, end = _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
    rows = start + tl.arange(0, BC)
    row_ok = rows < end
    kcols, vcols = tl.arange(0, BK), value_tile * BV + tl.arange(0, BV)
    q = _load_rows(q_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
    k = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
    G = tl.cumsum(_token_scalars(g_ptr, rows, row_ok, head, HV), axis=0)
    return rows, row_ok, kcols, vcols, q, k, G


@triton.jit
def _causal_attend(q, k, G, BC: tl.constexpr, DT: tl.constexpr):
    """mask(Q K^T) e^(G_i - G_j), the diagonal included: how a chunk's rows read its own writes."""
    return _lower_decay(G, BC) * _mm(q, tl.trans(k), DT)


@triton.jit
def _chunk_start_states(h_ptr, h_residual_ptr, offsets, ok, RESIDUAL: tl.constexpr):
    """The output kernel's chunk-start states h and h_R (h twice without the residual state)."""
    h = tl.load(h_ptr + offsets, mask=ok, other=0.0)
    h_residual = h
    if RESIDUAL:
        h_residual = tl.load(h_residual_ptr + offsets, mask=ok, other=0.0)
    return h, h_residual


@_Launcher
@triton.jit
def _chunk_output_kernel(q_ptr, k_ptr, v_ptr, g_ptr, strength_ptr, U_ptr, h_ptr, gamma_ptr, U_residual_ptr,
                         h_residual_ptr, o_ptr, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, scale,
                         T, NT, HV, GROUP, DK, DV, BC: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, RESIDUAL: tl.constexpr,
                         DEPENDENT: tl.constexpr, VARLEN: tl.constexpr):
    """o = e^G (Q h) + (mask(Q K^T) e^(G_i - G_j)) U for every chunk at once, BR of its BC rows a
    program: a block of rows reads its own block of writes through the causal mask and the
    chunk's earlier blocks whole. With the residual state the base read is exclusive (a_t
    S_{t-1}^T q_t) and R's inclusive read, scaled by gamma, is added; both share Q K^T.
    DEPENDENT: launched as a programmatic dependent of the state pass before it (PDL, Hopper), so
    Q K^T is formed while that pass ends; what the pass wrote is read after `gdc_wait`
    (`_ChunkRun.output_launched_dependent`)."""
    value_tile, row_block, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    chunk, block = row_block // (BC // BR), row_block % (BC // BR)
    start, end = _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
    kcols, vcols = tl.arange(0, BK), value_tile * BV + tl.arange(0, BV)
    h_offsets, tile_ok = _state_tile(chunk * HV + head, kcols, vcols, DK, DV)
    if not DEPENDENT:  # the chunk-start states first, so that their latency hides behind Q K^T
        h, h_residual = _chunk_start_states(h_ptr, h_residual_ptr, h_offsets, tile_ok, RESIDUAL)
    rows = start + block * BR + tl.arange(0, BR)
    row_ok = rows < end
    q = _load_rows(q_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
    k = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
    # G continues from the chunk's earlier rows: summed first, as their reads below need G.
    G_before = 0.0
    for earlier in tl.static_range(BC // BR - 1):
        if earlier < block:
            earlier_rows = start + earlier * BR + tl.arange(0, BR)
            G_before += tl.sum(_token_scalars(g_ptr, earlier_rows, earlier_rows < end, head, HV), axis=0)
    G = G_before + tl.cumsum(_token_scalars(g_ptr, rows, row_ok, head, HV), axis=0)
    if DEPENDENT:
        attend = _causal_attend(q, k, G, BR, DT)
        tl.extra.cuda.gdc_wait()
        h, h_residual = _chunk_start_states(h_ptr, h_residual_ptr, h_offsets, tile_ok, RESIDUAL)
        U = _chunk_writes(v_ptr, strength_ptr, U_ptr, rows, row_ok, head, HV, vcols, DV, DELTA)
    else:
        U = _chunk_writes(v_ptr, strength_ptr, U_ptr, rows, row_ok, head, HV, vcols, DV, DELTA)
        attend = _causal_attend(q, k, G, BR, DT)
    if RESIDUAL:
        # One accumulator: gamma scales R's chunk-start read before S's joins it (e^G is both's),
        # and R's intra-chunk reads through gamma * attend.
        gamma = _token_scalars(gamma_ptr, rows, row_ok, head, HV)
        o = _mm(q, h, DT, gamma[:, None] * _mm(q, h_residual, DT))
        o = tl.exp(G)[:, None] * o
        r = tl.arange(0, BR)
        o = _mm(tl.where(r[:, None] > r[None, :], attend, 0.0), U, DT, o)
        o = _mm(gamma[:, None] * attend, _load_rows(U_residual_ptr, rows, row_ok, head, HV, vcols, DV), DT, o)
    else:
        o = _mm(attend, U, DT, tl.exp(G)[:, None] * _mm(q, h, DT))
    G_key = 0.0  # the earlier blocks' reads: every row before this block, unmasked
    for earlier in tl.static_range(BC // BR - 1):
        if earlier < block:
            key_rows = start + earlier * BR + tl.arange(0, BR)
            key_ok = key_rows < end
            g_key = _token_scalars(g_ptr, key_rows, key_ok, head, HV)
            G_keys = G_key + tl.cumsum(g_key, axis=0)
            G_key += tl.sum(g_key, axis=0)
            keys = _load_rows(k_ptr, key_rows, key_ok, head // GROUP, HV // GROUP, kcols, DK)
            earlier_attend = tl.exp(G[:, None] - G_keys[None, :]) * _mm(q, tl.trans(keys), DT)
            o = _mm(earlier_attend, _chunk_writes(v_ptr, strength_ptr, U_ptr, key_rows, key_ok, head, HV, vcols, DV,
                                                  DELTA), DT, o)
            if RESIDUAL:
                o = _mm(gamma[:, None] * earlier_attend, _load_rows(U_residual_ptr, key_rows, key_ok, head, HV, vcols,
                                                                    DV), DT, o)
    _store_rows(o_ptr, rows, row_ok, head, HV, vcols, DV, scale * o)


class _ChunkLayout:
    """Where the chunks of B rows of T tokens, or of packed sequences (cu_seqlens), lie."""

    def __init__(self, B, T, cu_seqlens, device, chunk_size):
        self.T, self.NT, self.varlen = T, _cdiv(T, chunk_size), cu_seqlens is not None
        if self.varlen:
            self.cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int64)
            chunks = (self.cu_seqlens.diff() + chunk_size - 1) // chunk_size
            self.chunk_offsets = torch.nn.functional.pad(torch.cumsum(chunks, 0), (1, 0))
            self.num_sequences = len(chunks)
            # The grid needs it on the host: from the bounds the checks already read.
            bounds = sequence_bounds(cu_seqlens)
            self.num_chunks = sum(_cdiv(end - start, chunk_size) for start, end in zip(bounds[:-1], bounds[1:]))
            self.chunk_seq = torch.repeat_interleave(torch.arange(self.num_sequences, device=device), chunks,
                                                     output_size=self.num_chunks)
        else:  # computed inside the kernels; the table arguments are never read
            self.num_sequences, self.num_chunks = B, B * self.NT
            self.cu_seqlens = self.chunk_offsets = self.chunk_seq = torch.empty(1, device=device, dtype=torch.int64)


def pipeline_stages(fp32, BK):
    """Software-pipelining depth (num_stages) of the sequential state kernel and the output
    kernel, and of the reverse state kernel, within an H200's 227 KB of shared memory (measured
    with tools/compile_for_gpu.py, bf16, tiles as launched: the reverse kernel needs 119 KB at
    D = 128 with 2 stages, 185 KB with 3 for S's pass of the residual delta rule, 230 KB at D = 256
    with 2, too close). Timed on the H200 (kernel_variants, H8 D128): the forward with 2 stages
    instead of 3 was slower at B4xT4096 (gdn's state kernel 92 -> 125 us); the reverse kernel with
    3 stages gained for gdn (186 -> 152 us). Session 14, after the additive rule's reverse passes
    dropped dU: 3 reverse stages for sGLA (B2xT8192 H16 212 -> 161 us, B1xT32768 766 -> 639;
    B8xT2048 116 -> 121) and RLA (its passes 164 KB at 3 stages). Session 28, RDN's two reverse
    passes on 3 stages (H16): 684 -> 600 us at B8xT2048, 686 -> 574 at B2xT8192. Pipelined fp32
    tiles take twice the memory of bf16 ones."""
    if fp32:
        return 1, 1
    if BK > 128:  # the state kernel's K^T, W and S tiles need 263 KB at 3 stages
        return 2, 1
    return 3, 3


def state_pass_stages(stages, value_tile):
    """num_stages of `_chunk_state_kernel`: one more than the other kernels' (`pipeline_stages`)
    over value tiles of 16 and 32, whose shared memory leaves room for it (sm_90, bf16, D128: 144
    KB at 4 stages, 179 KB at 5, tiles of 16). H200, H16 D128, B1xT32768 (session 20), tiles of
    16: gdn's state kernel 617 -> 590 us, rdn's two passes 1,233 -> 1,181; at 5 stages 601 and
    1,201; tiles of 32 on 8 warps there lost (892). Tiles of 32 (B2xT8192, session 35): rdn's two
    passes 334 -> 319 us, gdn's 171 -> 168, RLA's fused pass equal (291 -> 290); tiles of 64 lost
    (B8xT2048: rdn 230 -> 312, gdn 116 -> 155), and so did 2 stages everywhere (rdn 334 -> 476)."""
    return stages + (value_tile <= 32 and stages == 3)  # 3: 16-bit inputs, D <= 128


def reverse_warps(value_tile, warps):
    """num_warps of `_chunk_state_backward_kernel`: 8 over value tiles of 64 (every rule from 128
    sequence-heads, `_ChunkRun.state_tile`). H200, H16 D128, B8xT2048 (session 35): RLA's
    two reverse passes 287 -> 231 us; the delta rule's, over tiles of 32 on 4 warps until then,
    gdn 247 -> 188 and rdn 598 -> 485 at 64 on 8; over tiles of 32 8 warps lost (rdn 593 -> 599,
    gdn 246 -> 263; at B2xT8192 RLA's 324 -> 327). RDN's S pass over tiles of 64 needs 229,888 B of
    shared memory at 3 stages, bf16 D128 (of the H200's 232,448: `tools/compile_for_gpu.py`)."""
    return 8 if value_tile >= 64 else warps


def grad_keys_launches(delta, residual, BV_full, fp32):
    """(key tile, launches) of `_chunk_grad_keys_kernel`: the columns of K a program takes, and
    (side, num_warps, num_stages, value tile) of each launch, timed on the H200 (H8 D128, against
    8 warps, 2 stages, tiles of 64). Session 9: sGLA, with the fewest accumulators, ran 301 -> 211
    us on 4 warps (gdn lost: 378 -> 388); gdn gained from 3 stages (378 -> 358). Session 10, over
    value tiles of 32 with 3 stages: sGLA 210 -> 182; gdn lost from tiles of 32 (360 -> 381).
    The residual rules run two sides of about half the accumulators each, on 4 warps: two
    programs a SM (sm_90, bf16 D128: the queries' side 253 registers, no spills, 76 KB of shared
    memory; the keys' side RLA's 255 and none, 70 KB, RDN's 255 and 544 B spilled, 102 KB), where
    the whole kernel on 8 warps (255 registers) runs one. Session 23, H16, B8xT2048 / B2xT8192:
    RLA 1,085 -> 843 / 1,086 -> 840 us, RDN 1,353 -> 1,134 / 1,353 -> 1,135; the keys' side on 8
    warps lost (RDN 1,430). Key tiles of 128 (session 34, H16, B2xT8192 / B8xT2048): the delta
    rule without R 676 -> 462 / 680 -> 462 us (at 64 its 8 warps had little work each, and each
    key tile formed the chunk's dO U^T again); sGLA lost (331 -> 367 on 8 warps), and so did the
    residual rules, whole (RDN 1,136 -> 1,678, spilling 1.3 KB) or on the queries' side alone
    (1,136 -> 1,175). In fp32 the delta rule's tiles of 128 need 320 KB of shared memory: 64.
    RDN's keys' side split by state (SIDE 3 then 4; session 34): 1,135 -> 1,106 us at both
    shapes (S's side spills 148 B where the whole keys' side spilled 544), and R's, the lighter,
    over value tiles of 64: 1,106 -> 1,081 (S's on 2 stages lost: 1,138); RLA's split lost
    (839 -> 864) and keeps two launches."""
    if not residual:
        return (64 if fp32 else 128, [(0, 8, 3, min(BV_full, 64))]) if delta else (64, [(0, 4, 3, min(BV_full, 32))])
    if delta:
        return 64, [(1, 4, 3, min(BV_full, 32)), (3, 4, 3, min(BV_full, 32)), (4, 4, 3, min(BV_full, 64))]
    return 64, [(1, 4, 3, min(BV_full, 32)), (2, 4, 3, min(BV_full, 32))]


def output_tile(BK, BV_full):
    """Value columns a program of `_chunk_output_kernel` owns. Q K^T is formed once a value tile:
    whole value rows form it once (H200, H16 D128, session 14: rla 216 -> 190 us at B2xT8192, rdn
    406 -> 370 at B1xT32768; session 15: sGLA 278 -> 263 at B1xT32768; session 16: gdn 145 -> 127
    at B8xT2048, 284 -> 246 at B1xT32768). Untimed, so not yet: D256 (whose tiles of 128 need 213
    KB of shared memory with the residual state)."""
    return min(BV_full, 128 if BK <= 128 else 64)


def local_grad_tile(delta, residual, BV_full):
    """Value columns a program of `_chunk_local_grad_kernel` takes; each forms its chunk's Q K^T.
    Whole rows of 128 (once a chunk) against tiles of 64 (H200, H16 D128, B2xT8192 / B8xT2048,
    session 34): rla's kernel 209 -> 166 / 212 -> 171 us, the backward call of rdn -15 / -23 us
    and of gdn -20 / -19 us; sGLA's kernel lost (118 -> 129), and 8 warps lost for every rule."""
    return min(BV_full, 128 if delta or residual else 64)


# num_warps of `_chunk_grad_values_kernel`: on 4 instead of 8 (H200, H8 D128, session 10) gdn's
# ran 263 -> 153 us and rdn's 540 -> 384; sGLA's and RLA's did not move.
GRAD_VALUES_WARPS = 4


def grad_values_sides(delta, residual):
    """The SIDEs of `_chunk_grad_values_kernel`'s launches: RDN's two inverses in one program held
    255 registers and spilled 444 B (sm_90, bf16 D128, 4 warps); R's side then S's each hold one
    (spills 4 B and 60 B). On the H200, RDN H16 D128 (session 24): the kernel 564 -> 494 us at
    B8xT2048 and 567 -> 495 at B2xT8192, bf16 error against fp32 unchanged (6.3e-3 at most).
    R's dk share rounds to bf16 in dk_keys between the launches; an fp32 dk_keys, tried, made
    the keys' kernel 1,137 -> 1,272 us for no gain in error."""
    return (1, 2) if delta and residual else (0,)


def wy_programs(items, residual, device):
    """Programs of `_chunk_wy_kernel`, each looping over (chunk, head) items. The residual delta
    rule's (two inverses, W and W_R, U0) two a SM, so that an item's loads are in flight while the
    one before computes: RDN's WY kernel on the H200, H16 D128 (session 25), 286 -> 245 us at
    B1xT32768, 138 -> 125 at B2xT8192. gdn's lost that way at B2xT8192 (87 -> 94 us; the same at
    B1xT32768): one program an item for it, as before. At D256 (124 KB of shared memory at sm_90)
    one program fits a SM: untimed there."""
    return min(items, 2 * _multiprocessors(device)) if residual else items


@functools.lru_cache
def _multiprocessors(device):
    """SMs of a CUDA device. In Triton's interpreter any count serves; a small one makes the
    persistent kernels' programs loop over several items there too, as they do on a GPU."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def writes_launch(chunk_size, BV_full, warps):
    """Value tile and warps of `_chunk_residual_writes_kernel`: tiles of 64, but whole value rows
    up to 128 on 8 warps in chunks of LONG_CHUNK_SIZE (RLA's forward over few sequence-heads),
    whose P and K K^T are then formed once a chunk. H200, H16 D128, B1xT32768, session 17: 462
    -> 428 us (4 warps: 534); in chunks of 64 with the backward's z stored it lost (510 -> 701)."""
    if chunk_size > CHUNK_SIZE and BV_full <= 128:
        return BV_full, 8
    return min(BV_full, 64), warps


def register_cap(kernel, delta, residual, BK, fp32):
    """The register cap (ptxas's `maxnreg`) that `kernel` launches with, None for none: where a cap
    lets one more 4-warp program onto a SM (<= 128 registers: four, <= 168: three) and was timed
    to pay, spills and all. H200, H16 D128 bf16, B2xT8192 / B8xT2048, us (session 39):
    - the delta rule's writes kernel at 128 (146 -> 128 registers, 48 B spilled; 136 -> 128 with
      z stored, 8 B): RDN's 153 -> 142 / 154 -> 144, its backward's recompute 184 -> 166;
    - the values-gradient kernel at 168 (the delta rule's 255 -> 168, 164-200 B spilled; RLA's
      198 -> 168, 20 B): rdn 497 -> 453, rla 244 -> 217, gdn 226 -> 197 (sGLA's, at 96, untimed);
    - RDN's local-grad kernel at 168 (179 -> 168, 8 B): 124 -> 112;
    - RDN's residual-grad kernel at 128 (130 -> 108, none spilled): 138 -> 123.
    Caps that lost: RLA's residual-grad kernel at 128 (80 -> 83 registers, 104 -> 112 us: a cap
    moves ptxas's allocation even below it, so none goes where it was not timed), RLA's writes
    kernel in chunks of 128 (255 -> 128, 608-748 B spilled, session 37). Only at key tiles of 128
    in bf16 / fp16, the sizes timed: fp32 and wider heads hold more, smaller ones less."""
    if BK != 128 or fp32:
        return None
    caps = {_chunk_residual_writes_kernel: 128 if delta else None,
            _chunk_grad_values_kernel: 168 if delta or residual else None,
            _chunk_local_grad_kernel: 168 if delta and residual else None,
            _chunk_residual_grad_kernel: 128 if delta else None}
    return caps.get(kernel)


def _fresh_state(like):
    """An unwritten fp32 state shaped as `like`, for a pass that reads its initial state from
    `like` and writes its final one here: no copy of the initial state first (H200, H16 D128,
    B8xT2048: ~5 us of copy a state and call)."""
    return torch.empty_like(like, memory_format=torch.contiguous_format)


class _ChunkRun:
    """The inputs of one chunked call laid out as packed tokens, and everything the forward
    computes before its outputs: T^-1, the WY terms, the chunk-start states h and the writes U
    (of S, and of R with the residual state). The backward builds it again (recomputing is
    cheaper than keeping h) and reads it, but for the delta rule's inverses, T^-1 (and T_R^-1
    with the residual state): a training forward keeps them, as FLA keeps its A, one [1 or 2,
    tokens, heads, chunk] tensor in the input dtype, and the backward, given it (`inverse`), skips
    the gram kernel (RDN: -63 us of a training call at B8xT2048 H16 D128, -65 at B2xT8192, replayed
    on the H200 in session 49; RLA's P is formed again, by the writes kernel). A training forward
    of the delta rule over few long rows also keeps the fp32 states at its segments' starts
    (`kept_segments`), from which the backward's passes run every segment at once
    (`kept_states`)."""

    def __init__(self, q, k, v, g, beta, gamma, gamma_write, update, clip, S0, R0, cu_seqlens, chunk_size,
                 for_backward=False, training=False, inverse=None, kept_states=None):
        B, T, H, Dk = q.shape
        HV, Dv = v.shape[2:]
        L = B * T
        layout = self.layout = _ChunkLayout(B, T, cu_seqlens, q.device, chunk_size)
        flat = lambda x: None if x is None else x.reshape(L, *x.shape[2:]).contiguous()  # noqa: E731
        self.q, self.k, self.v, self.g, self.beta, self.gamma, self.gamma_write = map(
            flat, (q, k, v, g, beta, gamma, gamma_write))
        self.residual, self.delta, self.clip, self.chunk_size = gamma is not None, update == "delta", clip, chunk_size
        self.for_backward = for_backward
        self.segment_chunks, self.segments = kept_segments(update, layout.varlen, layout.num_sequences, HV, layout.NT)
        q, k, v, g, beta = self.q, self.k, self.v, self.g, self.beta
        residual, delta = self.residual, self.delta
        empty = lambda *shape: torch.empty(*shape, device=q.device, dtype=q.dtype)  # noqa: E731
        self.h = empty(layout.num_chunks, HV, Dk, Dv)
        self.h_residual, self.U_residual = ((empty(layout.num_chunks, HV, Dk, Dv), empty(L, HV, Dv))
                                            if residual else (self.h, v))
        store_z = for_backward and residual  # z = v - pred, for the backward (`_clipped_residual`)
        self.z = empty(L, HV, Dv) if store_z else v
        # Unused pointers point at a real tensor; the kernels never read them.
        self.X = self.X_residual = self.P = self.W = self.W_residual = U0 = self.U = v
        self.row_factors = self.chunk_factors = v
        if not residual:
            self.gamma_write = beta
        if training and self.segment_chunks:
            kept_states = torch.empty(1 + residual, layout.num_sequences * self.segments, HV, Dk, Dv, device=q.device,
                                      dtype=torch.float32)
        self.kept_states = kept_states  # the forward's to keep, or the backward's to run from
        self.tables = (layout.cu_seqlens, layout.chunk_seq, layout.chunk_offsets)
        self.G = None  # the cumulative log decays: `cumulative_decays`
        self.shape = dict(T=layout.T, NT=layout.NT, HV=HV, GROUP=HV // H, DK=Dk, DV=Dv)
        self.BK, self.BV_full = max(16, _next_power_of_2(Dk)), max(16, _next_power_of_2(Dv))
        self.DT = TRITON_DTYPES[q.dtype]
        self.warps = 4 if self.BK <= 128 else 8
        self.stages, self.backward_stages = pipeline_stages(q.dtype == torch.float32, self.BK)
        common = dict(BC=chunk_size, BK=self.BK, DT=self.DT, VARLEN=layout.varlen)
        if inverse is not None and not delta:
            raise ValueError("kept inverses serve the delta rule only")
        self.inverses = None
        if delta:
            # Kept inverses leave the forward as an op's output: zeros where the kernels never write
            # them (the blocks above the diagonal), not whatever the memory held.
            fresh_inverse = torch.zeros if training else torch.empty
            self.inverses = inverse if inverse is not None else fresh_inverse(
                1 + residual, L, HV, chunk_size, device=q.device, dtype=q.dtype)
            self.X = self.inverses[0]
            if residual:
                self.X_residual = self.inverses[1]
            self.U = empty(L, HV, Dv)
            if not self.writes_from_inverse():  # the WY kernel's
                U0, self.W = empty(L, HV, Dv), empty(L, HV, Dk)
                self.G = torch.empty(L, HV, device=q.device, dtype=torch.float32)
                if residual:
                    self.W_residual = empty(L, HV, Dk)
        fused = residual and self.fuse_residual_passes()
        # The writes kernel forms P itself, stored only for the backward; RLA's fused pass reads P
        # from the gram kernel.
        if residual and (fused or store_z):
            self.P = empty(L, HV, chunk_size)
        if (delta or fused) and inverse is None:
            _chunk_gram_kernel[(layout.num_chunks, HV)](
                k, g, beta, self.gamma_write, *self.tables, self.X, self.X_residual, self.P, layout.T, layout.NT,
                HV, HV // H, Dk, BLOCK=chunk_size // 4, DELTA=delta, RESIDUAL=residual, STORE_P=fused, **common,
                num_warps=GRAM_WARPS)
        if delta and not self.writes_from_inverse():
            _chunk_wy_kernel[(wy_programs(layout.num_chunks * HV, residual, q.device),)](
                k, v, g, beta, self.gamma_write, self.X, self.X_residual, *self.tables, self.W, U0, self.W_residual,
                self.G, **self.shape, NUM_CHUNKS=layout.num_chunks, BV=self.BV_full, RESIDUAL=residual, **common,
                num_warps=self.warps, num_stages=min(self.stages, 2))  # the next chunk's loads in flight
        if fused:
            self.S, self.R = self.advance_both(S0, R0, store_z)
            return
        if residual and self.scans_states():
            # RLA with every pass over all chunks at once: R's additions come with its writes.
            chunk_decay = self.chunk_additions(v, beta, self.h)
            self.S = self.scan(S0, self.h, chunk_decay)
            self.residual_writes(store_z, adds_to_state=True)
            self.R = self.scan(R0, self.h_residual, chunk_decay)
            return
        from_inverse = self.writes_from_inverse()
        kept = (None, None) if self.kept_states is None else self.kept_states
        self.S = self.advance(S0, v, beta, self.X if from_inverse else self.W, U0, self.U, self.h, kept[0])
        if not residual:
            self.R = self.S
            return
        writes = self.residual_writes(store_z, adds_to_state=False)
        W_residual = self.X_residual if from_inverse else self.W_residual
        self.R = self.advance(R0, writes, self.gamma_write, W_residual, writes, self.U_residual, self.h_residual,
                              kept[1])

    def cumulative_decays(self, scan):
        """The pointer a sequential pass reads G from (`_chunk_decay`): the delta rule's WY kernel
        stores G; for the additive rule `_chunk_decay_kernel` forms it at the first pass that loads
        it (its scans and RLA's fused pass never do). A pass that scans g itself (the residual
        rules' S reverse pass) gets g."""
        if scan:
            return self.g
        if self.G is None:
            layout, HV = self.layout, self.shape["HV"]
            self.G = torch.empty_like(self.g, dtype=torch.float32)
            _chunk_decay_kernel[(layout.num_chunks,)](self.g, self.G, *self.tables, layout.T, layout.NT, HV,
                                                      BC=self.chunk_size, BH=_next_power_of_2(HV), VARLEN=layout.varlen)
        return self.G

    def residual_writes(self, store_z, adds_to_state):
        """`_chunk_residual_writes_kernel`: R's writes (and z) from S's chunk-start states h, every
        chunk at once. Returns what R's pass writes with (None with `adds_to_state`, which stores
        what each chunk adds to R in h_residual instead). In the input dtype, as S's U0 is (H200,
        H16 D128, session 15: rdn's forward 1,090 -> 1,049 us at B2xT8192, its writes kernel 379 ->
        336 at B1xT32768; rla 598 -> 538 at B8xT2048)."""
        writes = None if adds_to_state else torch.empty_like(self.v)
        BV, warps = writes_launch(self.chunk_size, self.BV_full, self.warps)
        _chunk_residual_writes_kernel[(_cdiv(self.shape["DV"], BV), self.layout.num_chunks, self.shape["HV"])](
            self.k, self.v, self.g, self.beta, self.gamma_write, self.U, self.h, self.P, self.X_residual, self.z,
            self.v if adds_to_state else writes, self.U_residual, self.h_residual, *self.tables, self.clip,
            **self.shape, BC=self.chunk_size, BK=self.BK, BV=BV, DT=self.DT, DELTA=self.delta,
            WRITES_FROM_INVERSE=self.writes_from_inverse(), ADDS_TO_STATE=adds_to_state, STORE_Z=store_z,
            VARLEN=self.layout.varlen, num_warps=warps,
            num_stages=self.stages, maxnreg=self.register_cap(_chunk_residual_writes_kernel))
        return writes

    def fuse_residual_passes(self):
        """Whether RLA's passes run as one (`_chunk_state_kernel` with BOTH_STATES). It pays where the
        state tiles are narrow, below 64 (sequence, head) pairs: each pass then runs few programs and
        the writes kernel between them is a third launch over every chunk. On an H200 (D128, session
        12, forward us): H16 B1xT32768 1,764 -> 1,605, B2xT8192 714 -> 609; H8 B2xT8192 451 -> 409,
        B4xT4096 369 -> 311. From 64 pairs on it lost (H16 B4xT4096 657 -> 688, B8xT2048 620 -> 695),
        as it did for RDN even at H16 B1xT32768 (2,641 -> 2,947). Below 32 pairs RLA's passes are
        scans instead (`scans_states`). Where RLA runs in segments those stay: the two were not
        timed against each other."""
        return not self.delta and 32 <= self.sequence_heads < 64 and self.state_segments() == 1

    def advance_both(self, S0, R0, store_z):
        """RLA's S and R passes in one from S0 and R0. Returns the final S and R."""
        layout, HV = self.layout, self.shape["HV"]
        factors = functools.partial(torch.empty, device=S0.device, dtype=torch.float32)
        self.row_factors, self.chunk_factors = factors(self.g.shape[0], HV, 4), factors(layout.num_chunks, HV)
        _chunk_pass_factors_kernel[(layout.num_chunks,)](
            self.g, self.beta, self.gamma_write, self.row_factors, self.chunk_factors, *self.tables, layout.T,
            layout.NT, HV, BC=self.chunk_size, BH=_next_power_of_2(HV), VARLEN=layout.varlen)
        S, R = (_fresh_state(x) for x in (S0, R0))
        self.state_pass(S0.contiguous(), S, layout.cu_seqlens, layout.chunk_offsets, layout.num_sequences,
                        layout.varlen, self.v, self.beta, self.W, self.v, self.U, self.h,
                        residual_states=(R0.contiguous(), R), store_z=store_z)
        return S, R

    def advance(self, initial, v, strength, W, U0, U, h, kept=None):
        """One state's pass (`_chunk_state_kernel`) from `initial` over the writes (v and the write
        strength for the additive rule, U0 and W for the delta rule), storing h and, for the delta
        rule, U. `kept`: the state at its segments' starts (`kept_segments`), which a training
        forward's pass stores and the backward's recompute runs from. Returns the final state
        (None from kept starts: the backward never reads it)."""
        layout = self.layout
        if self.scans_states():
            return self.scan(initial, h, self.chunk_additions(v, strength, h))
        if kept is not None and self.for_backward:
            cu_seqlens, chunk_offsets, varlen, shape = self.kept_segment_rows()
            sequences = layout.num_sequences * self.segments
            self.state_pass(kept, torch.empty_like(kept), cu_seqlens, chunk_offsets, sequences, varlen, v, strength,
                            W, U0, U, h, sequence_heads=sequences * self.shape["HV"], shape=shape)
            return None
        segments = self.state_segments()
        if segments > 1:
            return self.advance_in_segments(initial, segments, v, strength, W, U0, U, h)
        final = _fresh_state(initial)
        self.state_pass(initial.contiguous(), final, layout.cu_seqlens, layout.chunk_offsets, layout.num_sequences,
                        layout.varlen, v, strength, W, U0, U, h, kept=kept)
        return final

    def state_pass(self, initial, final, cu_seqlens, chunk_offsets, sequences, varlen, v, strength, W, U0, U, h,
                   residual_states=None, store_z=False, kept=None, sequence_heads=None, shape=None):
        """`_chunk_state_kernel` over `sequences` rows of cu_seqlens, from the states `initial` into
        `final` (one tensor for both advances it in place); with `residual_states` (R's initial and
        final states), RLA's R advanced with S in the same pass (h_R, R's writes and, with store_z,
        z stored); with `kept`, the states at the kept segments' starts stored there. Its tiles are
        those of `sequence_heads` pairs (the call's, unless given); `shape`: the rows' T and NT in
        place of the call's (`kept_segment_rows`)."""
        both = residual_states is not None
        scan = not both and self.pass_scans_decays()
        G = self.g if both else self.cumulative_decays(scan=scan)  # RLA's fused pass reads its factors
        tile = self.state_tile(sequence_heads=sequence_heads)
        _chunk_state_kernel[(_cdiv(self.shape["DV"], tile), sequences * self.shape["HV"])](
            self.k, v, G, strength, W, U0, U, h, initial, final,
            self.P, self.row_factors, self.chunk_factors, self.z, self.U_residual, self.h_residual,
            *(residual_states if both else (initial, final)), initial if kept is None else kept, cu_seqlens,
            chunk_offsets, self.clip, **(shape or self.shape), KEPT_SEGMENTS=1 if kept is None else self.segments,
            BC=self.chunk_size, BK=self.BK, BV=tile, DT=self.DT, DELTA=self.delta,
            WRITES_FROM_INVERSE=self.writes_from_inverse(), BOTH_STATES=both, STORE_Z=store_z, SCAN_G=scan,
            LAUNCHES_DEPENDENTS=self.output_launched_dependent(),
            KEPT_SEGMENT_CHUNKS=0 if kept is None else self.segment_chunks, VARLEN=varlen, num_warps=self.warps,
            num_stages=state_pass_stages(self.stages, tile))

    def pass_scans_decays(self):
        """Whether the additive rule's state pass scans g itself every chunk instead of loading the G
        that `_chunk_decay_kernel` stores: from 128 sequence-heads, where the pass runs programs
        enough to hide the scan, and only while no G is stored. The forward's decay kernel is then
        not launched (H200, H16 D128, session 41, us of kernels: sGLA's forward at B8xT2048 208 ->
        205, the pass equal at 79; RLA's 477 -> 473). At 32 sequence-heads the scan sits on the
        loop's chain: the pass 85 -> 101 at B2xT8192. The delta rule's passes that form their writes
        from T^-1 scan g too: no WY kernel runs to store G for them (`writes_from_inverse`)."""
        return self.writes_from_inverse() or (not self.delta and self.G is None and self.sequence_heads >= 128)

    @property
    def sequence_heads(self):
        """(sequence, value head) pairs: what sets how many programs a sequential pass runs, and so
        the tiles, paths and launches the methods below choose."""
        return self.layout.num_sequences * self.shape["HV"]

    def register_cap(self, kernel):
        """`register_cap` for this call's rule, head size and dtype."""
        return register_cap(kernel, self.delta, self.residual, self.BK, self.DT == tl.float32)

    def scans_states(self):
        """Whether the additive rule's state passes run as every chunk's own writes at once, then a
        scan over the chunks (`chunk_additions`, `scan`) instead of `_chunk_state_kernel`, whose
        sequential loop forms a product every chunk: below 32 sequence-heads, where that loop runs
        on few programs for many chunks (H200, H16 D128, session 15: sGLA's forward at B1xT32768
        758 -> 605 us, its state passes 478 -> 322). RLA's too, R's additions made with its writes
        and P formed there, no gram kernel: its forward at B1xT32768 1,458 -> 1,248 us against the
        fused pass, its backward (whose recomputed forward takes the same path) 6,293 -> 6,153
        (session 17). With R's additions in a kernel of their own and P from the gram kernel it
        had lost (1,447 -> 1,485 us, session 15)."""
        return not self.delta and self.sequence_heads < 32

    def chunk_additions(self, v, strength, h):
        """What every chunk of an additive state adds by its end from the writes diag(strength) v
        (`_chunk_local_state_kernel`, into h), all at once. Returns the chunks' log decays."""
        layout, HV, Dv = self.layout, self.shape["HV"], self.shape["DV"]
        BV = min(self.BV_full, 64)
        chunk_decay = torch.empty(layout.num_chunks, HV, device=h.device, dtype=torch.float32)
        _chunk_local_state_kernel[(_cdiv(Dv, BV), layout.num_chunks, HV)](
            self.k, v, self.g, strength, h, chunk_decay, *self.tables, **self.shape, BC=self.chunk_size, BK=self.BK,
            BV=BV, DT=self.DT, VARLEN=layout.varlen, num_warps=self.warps)
        return chunk_decay

    def scan(self, initial, h, chunk_decay):
        """An additive state's pass from `initial` by scan (`_chunk_state_scan_kernel`): h holds
        what every chunk adds on entry, the chunk-start states on exit. Returns the final state."""
        layout, HV, Dk, Dv = self.layout, self.shape["HV"], self.shape["DK"], self.shape["DV"]
        final = _fresh_state(initial)
        _chunk_state_scan_kernel[(_cdiv(Dk * Dv, SCAN_BLOCK), layout.num_sequences * HV)](
            chunk_decay, h, initial.contiguous(), final, layout.cu_seqlens, layout.chunk_offsets, layout.T,
            layout.NT, HV, Dk, Dv, BC=self.chunk_size, CHUNKS=SCAN_CHUNKS, BLOCK=SCAN_BLOCK, DT=self.DT,
            VARLEN=layout.varlen, num_warps=SCAN_WARPS)
        return final

    def state_segments(self):
        """Segments each sequence's state recurrence is split into (1: not split). Few long
        sequences leave most SMs idle along the sequential loop. The additive rule's states can
        run in segments side by side: S's writes K^T diag(b) V do not depend on S, nor R's on R.
        The delta rule's writes U = U0 - W h do."""
        layout = self.layout
        if self.delta or layout.varlen:
            return 1
        programs = _cdiv(self.shape["DV"], self.state_tile()) * self.sequence_heads
        segments = min(PARALLEL_PROGRAMS // programs, layout.NT // MIN_SEGMENT_CHUNKS)
        # The join passes over h once more. On an H200 (H16 D128, session 10) 16 segments paid at
        # B1xT32768 (against 8: sGLA 768 -> 750 us, RLA 1,861 -> 1,819), 8 did not at B2xT8192
        # (sGLA 276 -> 402 us, RLA 717 -> 967).
        return segments if segments >= MIN_SEGMENTS else 1

    def advance_in_segments(self, initial, segments, v, strength, W, U0, U, h):
        """The state pass over every segment at once from zero states, then the join kernel: a
        segment's chunk-start states gain its start state (its row's initial state carried
        through the segments before it), decayed to each chunk; the final states come last."""
        layout, HV, BC = self.layout, self.shape["HV"], self.chunk_size
        B, T, NT = layout.num_sequences, layout.T, layout.NT
        segment_chunks = _cdiv(NT, segments)
        segments = _cdiv(NT, segment_chunks)  # none left empty
        cu_seqlens, chunk_offsets = self.segment_tables(segment_chunks, segments)
        padded = torch.nn.functional.pad(self.g.view(B, T, HV), (0, 0, 0, segments * segment_chunks * BC - T))
        # Log decays in fp32 whatever g's dtype (the kernels exponentiate them): each chunk's, each
        # segment's, and from a segment's start to each of its chunks' starts.
        chunk_decay = padded.view(B, segments, segment_chunks, BC, HV).sum(3, dtype=torch.float32)
        segment_decay = chunk_decay.sum(2)
        to_chunk = (chunk_decay.cumsum(2) - chunk_decay).view(B, segments * segment_chunks, HV)[:, :NT].contiguous()
        ends = torch.zeros(B * segments, *initial.shape[1:], device=initial.device, dtype=torch.float32)
        self.state_pass(ends, ends, cu_seqlens, chunk_offsets, B * segments, True, v, strength, W, U0, U, h)
        starts, final = torch.empty_like(ends), _fresh_state(initial)
        Dk, Dv = self.shape["DK"], self.shape["DV"]
        _chunk_segment_starts_kernel[(_cdiv(Dv, self.state_tile()), B, HV)](
            initial.contiguous(), ends, segment_decay, starts, final, segments, HV, Dk, Dv, BK=self.BK,
            BV=self.state_tile(), num_warps=self.warps)
        join_tile = min(self.BV_full, 64)
        _chunk_state_join_kernel[(_cdiv(Dv, join_tile), layout.num_chunks, HV)](
            h, starts, to_chunk, NT, segment_chunks, segments, HV, Dk, Dv, BK=self.BK, BV=join_tile, DT=self.DT,
            num_warps=self.warps)
        return final

    def kept_segment_rows(self):
        """(cu_seqlens, chunk_offsets, varlen, shape) of the backward's recompute over rows x
        segments from the kept starts: where the segments tile the rows exactly, rows of their
        own of segment_chunks chunks each, else packed sequences (`segment_tables`: a few small
        torch kernels for each pass, gaps in the backward's stream). H200, H16 D128 bf16, B2xT8192,
        forward + backward replayed, kept starts against recomputing from S0 in the same run:
        with the tables rdn -29 us, gdn -4; as rows of their own rdn -71, gdn -27 (session 47)."""
        layout = self.layout
        length = self.segment_chunks * self.chunk_size
        if layout.T == self.segments * length:
            return layout.cu_seqlens, layout.chunk_offsets, False, dict(self.shape, T=length, NT=self.segment_chunks)
        return (*self.segment_tables(self.segment_chunks, self.segments), True, self.shape)

    def segment_tables(self, segment_chunks, segments):
        """cu_seqlens and chunk_offsets of the B rows of T tokens cut into `segments` of
        `segment_chunks` chunks each (the last may be shorter), for a pass over them as sequences
        of their own."""
        layout = self.layout
        B, T, NT = layout.num_sequences, layout.T, layout.NT
        arange = functools.partial(torch.arange, device=self.g.device, dtype=torch.int64)
        rows, parts = arange(B)[:, None], arange(segments)[None, :]
        starts = (rows * T + parts * segment_chunks * self.chunk_size).flatten()  # a multiple of BC: the chunks stay
        return torch.cat([starts, starts.new_full((1,), B * T)]), (rows * NT + parts * segment_chunks).flatten()

    def state_tile(self, reverse=False, sequence_heads=None):
        """Value columns a program of the sequential kernels owns: few sequence-heads leave SMs
        idle, so narrower tiles then. Timed on the H200 (D128) at 64 sequence-heads (B8xT2048 H8),
        tiles of 64 made the forward state kernel faster (gdn 95 -> 68 us, rdn's two passes 193 ->
        134) and the reverse one slower (gdn 184 -> 200, rdn 422 -> 541); at 32 both lost. Below
        32 sequence-heads (B1xT32768 H16, session 10) the forward's tiles of 16 beat 32: gdn's
        state kernel 816 -> 608 us, rdn's two passes 1,636 -> 1,215, sGLA 747 -> 726 us for the
        call (no segments then, against 16 and the join); from 32 on they lost (B2xT8192, gdn
        183 -> 224). The reverse kernel's too, below 32 (session 14, B1xT32768 H16): sGLA 766 -> 696
        us, RLA's two passes 3,093 -> 2,834. At 128 sequence-heads
        (B8xT2048 H16, session 13) the delta rule's reverse kernel was faster at 32 than at 64
        (gdn 419 -> 305 us, rdn 1,058 -> 845) and the additive rule's slower (sGLA 256 -> 284,
        RLA 702 -> 778), on 4 warps; on 8 (`reverse_warps`, session 35, B8xT2048) the delta rule's
        reverse kernel is faster at 64 than at 32 (gdn 247 -> 188, rdn's two passes 598 -> 485)."""
        sequence_heads = self.sequence_heads if sequence_heads is None else sequence_heads
        if sequence_heads < 32:
            return min(self.BV_full, 16)
        wide = sequence_heads >= (128 if reverse else 64)
        return min(self.BV_full, 64 if wide else 32)

    def writes_from_inverse(self):
        """Whether the forward's delta-rule state passes form their writes U = T^-1 diag(b) (V -
        diag(e^G) K h) from T^-1, the values and the keys they load anyway, in place of reading
        U0 = T^-1 diag(b) V and W = T^-1 diag(b e^G) K: no WY kernel runs then (the passes scan
        g for G), and RDN's writes kernel stores R's clipped residuals r for R's pass, not X_R
        diag(b_R) r. It costs one more dot on the loop's chain than W h, which pays from 64
        sequence-heads (from 32 with one state). H200, H16 D128 bf16, forward replayed from CUDA
        graphs, ms, reading U0 and W / forming the writes (session 45): B8xT2048 gdn 0.351 /
        0.307, rdn 0.714 / 0.652; B4xT4096 gdn 0.396 / 0.346, rdn 0.774 / 0.730; B2xT8192 gdn
        0.447 / 0.434, rdn 0.866 / 0.906 (its passes 329 -> 515 us against WY's 126 and 27 of the
        writes kernel's); B1xT32768 gdn 1.068 / 1.142, rdn 2.045 / 2.351. Forward + backward at
        B8xT2048 (the backward's recompute reads W): gdn 1.643 / 1.599, rdn 3.694 / 3.635. Not at
        D256, where the loop spills (192 B, sm_90)."""
        return self.delta and not self.for_backward and self.BK <= 128 and \
            self.sequence_heads >= (64 if self.residual else 32)

    def output(self, scale):
        o = torch.empty_like(self.v)
        HV, Dv = self.v.shape[1:]
        BV = output_tile(self.BK, self.BV_full)
        rows = min(self.chunk_size, OUTPUT_ROWS)
        dependent = self.output_launched_dependent()
        _chunk_output_kernel[(_cdiv(Dv, BV), self.layout.num_chunks * (self.chunk_size // rows), HV)](
            self.q, self.k, self.v, self.g, self.beta, self.U, self.h, self.gamma if self.residual else self.g,
            self.U_residual, self.h_residual, o, *self.tables, scale, **self.shape, BC=self.chunk_size, BR=rows,
            BK=self.BK, BV=BV, DT=self.DT, DELTA=self.delta, RESIDUAL=self.residual, DEPENDENT=dependent,
            VARLEN=self.layout.varlen, num_warps=self.warps, num_stages=self.stages, launch_pdl=dependent)
        return o

    def output_launched_dependent(self):
        """Whether the output kernel is launched as a programmatic dependent of the state pass before
        it (PDL), forming Q K^T while that pass ends: the residual rules' on CUDA, but for RLA's
        states scanned below 32 sequence-heads (`scans_states`: no pass for it to overlap). H200, H16
        D128, forward replayed from CUDA graphs, ms, main / this: B8xT2048 rdn 0.730 / 0.713, rla
        0.483 / 0.477 (session 42); B2xT8192 rdn 0.880 / 0.870, rla 0.533 / 0.528; B1xT32768 rdn
        2.077 / 2.050, and rla 1.104 -> 1.125 dependent after its scan, 1.103 as it is now (session
        43). sGLA and gdn stay independent: at B8xT2048 sGLA 0.208 / 0.211, gdn 0.352 / 0.353
        (session 42); at B2xT8192 sGLA 0.225 -> 0.229 (session 41). Forming the additive rule's
        writes before the wait too gave sGLA 0.204 in session 41's run, 0.213 in session 42's; R's
        writes kernel launched dependent on S's pass (K K^T and P before the wait) lost at B8xT2048:
        rla 0.477 -> 0.498, rdn 0.713 -> 0.740 (session 42)."""
        return self.q.is_cuda and self.residual and not self.scans_states()

    def queries_side_launched_dependent(self):
        """Whether the residual rules' keys' gradients' queries side (SIDE 1) is launched as a
        programmatic dependent of S's reverse pass (PDL): on CUDA. It reads only what the
        recomputed forward stored, so all of it but its stores may run while that pass ends.
        H200, H16 D128, forward + backward replayed from CUDA graphs, ms, main / this (session 43,
        two runs each): B8xT2048 rla 2.484-2.489 / 2.481-2.484, rdn 3.688-3.710 / 3.702-3.705;
        B2xT8192 rla 2.692-2.698 / 2.687-2.688, rdn 4.049-4.063 / 4.055-4.057. RDN's reverse S
        pass fills a SM's shared memory (229,888 B), so the queries side gains only the launch gap."""
        return self.q.is_cuda and self.residual


def kept_segments(update, varlen, sequences, HV, NT):
    """(chunks a segment, segments a row) whose start states a training forward keeps for the
    backward's recompute, (0, 1) for none: the delta rule over rows of equal length, fewer than
    KEPT_BELOW_SEQUENCE_HEADS (row, head) pairs. Its passes run one program a value tile and pair,
    chunk after chunk; from the kept starts the recompute runs every segment at once, as many
    programs as KEPT_SEQUENCE_HEADS pairs would. The states cost a few [HV, DK, DV] fp32 tensors a
    row: the 400M model's training step at B4xT4096 (bench_training.py, H8, 24 layers) peaked 0.18
    GiB higher for gdn, 0.38 for rdn (session 48). H200, H16 D128 bf16, forward + backward replayed
    from CUDA graphs, ms, recomputing from S0 / from kept starts (session 46): B1xT32768 (16 pairs,
    8 segments) gdn 4.286 / 4.116, rdn 9.220 / 8.941. At B2xT8192 (32 pairs, 4 segments) the
    forward's pass storing the starts under a mask at every step took rdn's passes 326 -> 402 us,
    more than the recompute saved (325 -> 244): 4.060 / 4.086 ms a call; storing them under an `if`
    on the step, 327 -> 342 us and 4.060 / 4.031 ms, gdn 1.837 / 1.833; B3xT8192 (48 pairs, 2
    segments) rdn 6.615 / 6.505, gdn 3.040 / 3.004. At B4xT4096 (64 pairs, 2 segments) the forward's
    pass at tiles of 64 with the store took 341 -> 502 us: rdn 3.814 / 4.031 ms, gdn 1.700 / 1.803,
    hence none from 64 pairs. Segments for 256 pairs lost to 128 (B2xT8192 rdn 4.013 -> 4.035 ms,
    B1xT32768 8.825 -> 8.842; 512: 8.890) (session 47)."""
    segments = min(KEPT_SEQUENCE_HEADS // (sequences * HV), NT // MIN_KEPT_SEGMENT_CHUNKS)
    if update != "delta" or varlen or sequences * HV >= KEPT_BELOW_SEQUENCE_HEADS or segments < 2:
        return 0, 1
    segment_chunks = _cdiv(NT, segments)
    return segment_chunks, _cdiv(NT, segment_chunks)  # none left empty


def forward_chunk_size(update, residual, sequences, HV):
    """The chunk length of a forward whose backward will not run: LONG_CHUNK_SIZE for sGLA below
    64 sequence-heads and RLA below 32, else CHUNK_SIZE. Below 32 sGLA's state passes are the
    scan's, whose kernels store every chunk's state twice (what it adds, then where it starts);
    from 32 the sequential state loop runs on too few programs to fill the GPU (4 value tiles a
    sequence-head at D128): longer chunks halve both the states stored and the loop's steps.
    Timed (forward kernels, H200, H16 D128, session 16): at B1xT32768 the local-state kernel 161
    -> 124 us, the scan 162 -> 81, the call 590 -> 482; at B2xT8192 the state kernel 137 -> 107,
    the call 264 -> 243. The output kernel over whole chunks of 128 had taken 266 -> 420 us, hence
    its programs of OUTPUT_ROWS rows (275 us). At B8xT2048 (128 sequence-heads) the state kernel
    in chunks of 128 lost (77 -> 82 us); the delta rule's T^-1 costs 4x in chunks of 128 (gdn's
    gram kernel 162 -> 648 us).
    RLA's below 32 sequence-heads, where its passes are scans too: 1,248 -> 1,130 us at
    B1xT32768 (session 17). From 32 its one fused pass lost in chunks of 128 (340 -> 627 us at
    B2xT8192, session 17)."""
    long_chunks = update == "additive" and sequences * HV < (32 if residual else 64)
    return LONG_CHUNK_SIZE if long_chunks else CHUNK_SIZE


@_on_inputs_device
def chunk_forward(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens,
                  chunk_size=None, training=False):
    """Forward of every rule over [B, T] or packed (cu_seqlens) sequences, the same contract as
    kernels_reslin_torch.chunk_reslin: returns (o in v's dtype, S, R) with fp32 states. With
    `training` two values more, what chunk_backward reads if given: the inverses (`inverse`, [1 or
    2, tokens, HV, chunk]: T^-1 and T_R^-1; None but for the delta rule) and the kept states
    (`kept_states`, [1 or 2 states, rows x segments, HV, Dk, Dv] fp32; None but where
    `kept_segments` keeps some).
    chunk_size None: `forward_chunk_size`'s (a differentiable call passes the backward's,
    CHUNK_SIZE)."""
    if chunk_size is None:
        sequences = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
        chunk_size = forward_chunk_size(update, gamma is not None, sequences, v.shape[2])
    run = _ChunkRun(q, k, v, g, beta, gamma, gamma_write, update, clip, S0, R0, cu_seqlens, chunk_size,
                    training=training)
    outputs = run.output(scale).reshape(v.shape), run.S, (run.R if run.residual else None)
    return (*outputs, run.inverses, run.kept_states) if training else outputs


# ---------------------------------------------------------------------------------------------
# Chunked backward, every rule. The forward runs again (recomputing is cheaper than keeping h),
# storing z = v - pred for the residual rules. With dO and the gradient dh' of a chunk's end
# state (the next chunk's start):
#   dU = scale * A^T dO + e^(G_last - G) K dh',   A = mask(Q K^T) e^(G_i - G_j),
#   dh = e^(G_last) dh' + scale * (e^G Q)^T dO - W^T dU   (no W term for the additive rule).
# Its first term needs no state: every chunk at once (_chunk_local_grad_kernel). The rest runs
# chunk after chunk backwards (_chunk_state_backward_kernel, one value tile a program like the
# forward's state kernel). The residual rules run this for R first, with gamma dO and the
# inclusive mask, then every chunk at once (_chunk_residual_grad_kernel) through R's writes
# U0_R = X_R diag(b_R) r and the clip (zero gradient where z was clipped) into pred =
# e^(G_prev) K h + P U, P = strictly_lower(e^(G_prev_i - G_j) K K^T), whose gradient joins S's
# reverse pass (A is then strictly lower: the base read is exclusive).
# Then every chunk at once, per key tile (_chunk_grad_keys_kernel) and per chunk
# (_chunk_grad_values_kernel): dq, dk, dv, the gates' gradients, through
# U = U0 - W h with W = X diag(b e^G) K, U0 = X diag(b) V and X = (I + A)^-1
# (dA = -X^T dX X^T, A = diag(b) strictly_lower(e^(G_i - G_j) K K^T)). Every dependence on the
# cumulative decay G is gathered as dG and turned into dg by a reverse cumulative sum within the
# chunk (G_last is G at the chunk's last row, padding included; G_prev_t = G_t - g_t).
# ---------------------------------------------------------------------------------------------

@_Launcher
@triton.jit
def _chunk_local_grad_kernel(q_ptr, k_ptr, g_ptr, gamma_ptr, do_ptr, dh_next_ptr, dU_ptr, dU_residual_ptr,
                             cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, scale, T, NT, HV, GROUP, DK, DV,
                             BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                             RESIDUAL: tl.constexpr, STATE_PART: tl.constexpr, VARLEN: tl.constexpr):
    """Every chunk at once: the part of dU that a chunk's own outputs give, scale * A^T dO with
    A = mask(Q K^T) e^(G_i - G_j) (strictly lower for the residual rules' exclusive base read),
    and R's, scale * A^T diag(gamma) dO. The reverse state kernel adds what flows through the
    states; computed here, no Q K^T is formed in its sequential loop. With STATE_PART (the additive
    rule) this runs after the first reverse pass, S's for sGLA and R's for RLA, and adds that
    state's part too, e^(G_last - G) K dh', from the dh' the pass stored (dh_next_ptr)."""
    value_tile, chunk, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, row_ok, kcols, vcols, q, k, G = _chunk_queries_keys(
        q_ptr, k_ptr, g_ptr, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, value_tile, chunk, head, T, NT, HV,
        GROUP, DK, BC, BK, BV, VARLEN)
    do = _load_rows(do_ptr, rows, row_ok, head, HV, vcols, DV).to(tl.float32)
    attend_t = tl.trans(_causal_attend(q, k, G, BC, DT))
    if STATE_PART:
        h_offsets, tile_ok = _state_tile(chunk * HV + head, kcols, vcols, DK, DV)
        dh_next = tl.load(dh_next_ptr + h_offsets, mask=tile_ok, other=0.0)
        G_last = tl.sum(tl.where(tl.arange(0, BC) == BC - 1, G, 0.0), axis=0)  # padded rows add 0
        state_part = tl.exp(G_last - G)[:, None] * _mm(k, dh_next, DT)
    if RESIDUAL:
        gamma = _token_scalars(gamma_ptr, rows, row_ok, head, HV)
        dU_residual = scale * _mm(attend_t, gamma[:, None] * do, DT)
        if STATE_PART:
            dU_residual += state_part
        _store_rows(dU_residual_ptr, rows, row_ok, head, HV, vcols, DV, dU_residual)
        r = tl.arange(0, BC)
        attend_t = tl.where(r[:, None] < r[None, :], attend_t, 0.0)
    dU = scale * _mm(attend_t, do, DT)
    if STATE_PART and not RESIDUAL:
        dU += state_part
    _store_rows(dU_ptr, rows, row_ok, head, HV, vcols, DV, dU)


@_Launcher
@triton.jit
def _chunk_state_backward_kernel(q_ptr, k_ptr, g_ptr, G_ptr, gamma_ptr, W_ptr, do_ptr, dz_ptr, dS_ptr, dS0_ptr,
                                 dh_next_ptr, dU_ptr, cu_seqlens_ptr, chunk_offsets_ptr, scale, T, NT, HV, GROUP, DK,
                                 DV, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                                 DELTA: tl.constexpr, GATED_READ: tl.constexpr, PRED: tl.constexpr,
                                 WHOLE_DU: tl.constexpr, FINAL_GRAD: tl.constexpr, LAUNCHES_DEPENDENTS: tl.constexpr,
                                 VARLEN: tl.constexpr):
    """One state's reverse pass from the final state's gradient (dS_ptr, any float dtype; zero
    without FINAL_GRAD, when the final state was not used), storing the initial state's at
    dS0_ptr, in fp32, and dh' of every chunk. With WHOLE_DU, dU_ptr holds the chunks' own parts
    of dU on entry (`_chunk_local_grad_kernel`, and for S of the residual rules pred's -P^T dz,
    `_chunk_residual_grad_kernel`) and the whole dU on exit; without (the additive rule, whose dh
    never reads dU), a later kernel adds dU's state part (`chunk_backward` says which). R's
    pass reads gamma dO (GATED_READ); S's pass of the residual rules (PRED) adds pred's reading of
    the chunk-start state, -(e^(G_prev) K)^T dz. LAUNCHES_DEPENDENTS (compiled, not interpreted): a
    kernel launched as its programmatic dependent may start once every program's loop is done."""
    value_tile, seq_head = tl.program_id(0), tl.program_id(1)
    seq, head = seq_head // HV, seq_head % HV
    bos, eos, first_chunk = _sequence_bounds(seq, cu_seqlens_ptr, chunk_offsets_ptr, T, NT, VARLEN)
    kcols, vcols = tl.arange(0, BK), value_tile * BV + tl.arange(0, BV)
    state_offsets, tile_ok = _state_tile(seq_head, kcols, vcols, DK, DV)
    tile = kcols[:, None] * DV + vcols[None, :]
    if FINAL_GRAD:
        dh = tl.load(dS_ptr + state_offsets, mask=tile_ok, other=0.0).to(tl.float32)
    else:
        dh = tl.zeros([BK, BV], dtype=tl.float32)
    r = tl.arange(0, BC)
    num_chunks = tl.cdiv(eos - bos, BC)
    for i in range(num_chunks):
        index = num_chunks - 1 - i
        tl.store(dh_next_ptr + ((first_chunk + index) * HV + head) * DK * DV + tile,
                 dh.to(dh_next_ptr.dtype.element_ty), mask=tile_ok)
        rows = bos + index * BC + r
        row_ok = rows < eos
        if PRED:
            G, G_last, G_prev = _scanned_chunk_decay(g_ptr, rows, row_ok, head, HV)
        else:
            G, G_last = _chunk_decay(G_ptr, bos + index * BC, rows, row_ok, eos, head, HV, BC)
        do = _load_rows(do_ptr, rows, row_ok, head, HV, vcols, DV).to(tl.float32)
        if GATED_READ:
            do = _token_scalars(gamma_ptr, rows, row_ok, head, HV)[:, None] * do
        if WHOLE_DU:
            k = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
            dU = _load_rows(dU_ptr, rows, row_ok, head, HV, vcols, DV) + \
                tl.exp(G_last - G)[:, None] * _mm(k, dh, DT)
            _store_rows(dU_ptr, rows, row_ok, head, HV, vcols, DV, dU)
        q_t = _load_columns(q_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
        dh = tl.exp(G_last) * dh + scale * _mm(q_t, tl.exp(G)[:, None] * do, DT)
        if PRED:
            dz = _load_rows(dz_ptr, rows, row_ok, head, HV, vcols, DV)
            # K is loaded already: its transpose, not a second load (shared memory 189 -> 156 KB;
            # H200, H16 D128, session 15: RDN's backward call 4,599 -> 4,547 us at B8xT2048).
            if WHOLE_DU:
                k_t = tl.trans(k)
            else:
                k_t = _load_columns(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
            dh -= _mm(k_t, tl.exp(G_prev)[:, None] * dz, DT)
        if DELTA:
            dh -= _mm(_load_columns(W_ptr, rows, row_ok, head, HV, kcols, DK), dU, DT)
    if LAUNCHES_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(dS0_ptr + state_offsets, dh, mask=tile_ok)


@_Launcher
@triton.jit
def _chunk_residual_grad_kernel(residual_strength_ptr, X_residual_ptr, P_ptr, z_ptr, dU_residual_ptr, dz_ptr,
                                dU_ptr, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, HV, DV,
                                BC: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr,
                                VARLEN: tl.constexpr):
    """Every chunk at once, between R's reverse pass and S's (the adjoint of
    `_chunk_residual_writes_kernel`): from R's whole dU_R through its writes U0_R = X_R diag(b_R) r
    (the additive rule: diag(b_R) r) and the clip, dz, the gradient of z = v - pred (zero where
    the forward clipped); then pred = e^(G_prev) K h + P U reads S's writes U: dU -= P^T dz."""
    value_tile, chunk, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
    rows = start + tl.arange(0, BC)
    row_ok = rows < end
    vcols = value_tile * BV + tl.arange(0, BV)
    dr = _load_rows(dU_residual_ptr, rows, row_ok, head, HV, vcols, DV)
    if DELTA:
        dr = _mm(tl.trans(_load_lower(X_residual_ptr, rows, row_ok, head, HV, BC)), dr, DT)
    dr = _token_scalars(residual_strength_ptr, rows, row_ok, head, HV)[:, None] * dr
    z = _load_rows(z_ptr, rows, row_ok, head, HV, vcols, DV)
    dz = tl.where(tl.abs(z) < float("inf"), dr, 0.0)  # +-inf where the forward clipped
    _store_rows(dz_ptr, rows, row_ok, head, HV, vcols, DV, dz)
    dU = _load_rows(dU_ptr, rows, row_ok, head, HV, vcols, DV) - \
        _mm(tl.trans(_load_lower(P_ptr, rows, row_ok, head, HV, BC)), dz, DT)
    _store_rows(dU_ptr, rows, row_ok, head, HV, vcols, DV, dU)


@triton.jit
def _wy_write_backward(X, dW, k, G, strength, DT: tl.constexpr):
    """Through W = X diag(b e^G) K for some of K's columns (with dW's): the contributions to dk
    (those columns), db and dG, and dW's share of dX, dW (diag(b e^G) K)^T."""
    k_scaled = (strength * tl.exp(G))[:, None] * k
    dk_scaled = _mm(tl.trans(X), dW, DT)
    dk = (strength * tl.exp(G))[:, None] * dk_scaled
    dstrength = tl.sum(dk_scaled * k * tl.exp(G)[:, None], axis=1)
    dG = tl.sum(dk_scaled * k_scaled, axis=1)
    return dk, dstrength, dG, _mm(dW, tl.trans(k_scaled), DT)


@triton.jit
def _wy_inverse_backward(X, dX, k, gram, decay_strict, strength, DT: tl.constexpr):
    """Through X = (I + A)^-1, A = diag(b) strictly_lower(e^(G_i - G_j) K K^T) (`gram` =
    strictly_lower(e^(G_i - G_j) K K^T)), given the whole dX: the contributions to dk, db and dG."""
    dA = -_mm(tl.trans(X), _mm(dX, tl.trans(X), DT), DT)  # only its strictly lower part is read
    dgram = strength[:, None] * dA * decay_strict
    dk = _mm(dgram, k, DT) + _mm(tl.trans(dgram), k, DT)
    dstrength = tl.sum(dA * gram, axis=1)
    decay_grad = dA * strength[:, None] * gram
    dG = tl.sum(decay_grad, axis=1) - tl.sum(decay_grad, axis=0)
    return dk, dstrength, dG


@triton.jit
def _store_part(ptr, part_rows, row_ok, head, HV, FIELD: tl.constexpr, x):
    """What a key tile's program leaves per row for `_chunk_grad_values_kernel`, in a
    [key tiles, tokens, HV, 5] buffer: its shares of dG (FIELD 0), of dG_prev (1), of db (2), of
    R's write strength's gradient (3) and of dgamma (4)."""
    tl.store(ptr + (part_rows * HV + head) * 5 + FIELD, x, mask=row_ok)


@triton.jit
def _load_part(ptr, part_rows, row_ok, head, HV, FIELD: tl.constexpr):
    """One key tile's part, as `_store_part` left it."""
    return tl.load(ptr + (part_rows * HV + head) * 5 + FIELD, mask=row_ok, other=0.0)


@triton.jit
def _load_parts(ptr, rows, row_ok, head, HV, L, KEY_TILES: tl.constexpr, FIELD: tl.constexpr, BC: tl.constexpr):
    """A row quantity summed over the key tiles' parts (`_store_part`)."""
    total = tl.zeros([BC], dtype=tl.float32)
    for part in range(KEY_TILES):
        total += _load_part(ptr, part * L + rows, row_ok, head, HV, FIELD)
    return total


@triton.jit
def _load_dX_parts(ptr, rows, row_ok, head, HV, L, WHICH: tl.constexpr, KEY_TILES: tl.constexpr,
                   BC: tl.constexpr):
    """dX's shares through W (WHICH 0) or W_R (1), summed over the key tiles."""
    total = tl.zeros([BC, BC], dtype=tl.float32)
    for part in range(KEY_TILES):
        total += _load_rows(ptr, (part * 2 + WHICH) * L + rows, row_ok, head, HV, tl.arange(0, BC), BC)
    return total


@_Launcher
@triton.jit
def _chunk_grad_keys_kernel(q_ptr, k_ptr, v_ptr, g_ptr, strength_ptr, gamma_ptr, residual_strength_ptr, X_ptr,
                            U_ptr, h_ptr, X_residual_ptr, U_residual_ptr, h_residual_ptr, do_ptr, dh_next_ptr,
                            dU_ptr, dh_next_residual_ptr, dU_residual_ptr, dz_ptr, dq_ptr, dk_ptr, parts_ptr,
                            dX_parts_ptr, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, scale, T, NT, L, HV,
                            GROUP, DK, DV, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                            DELTA: tl.constexpr, RESIDUAL: tl.constexpr, SIDE: tl.constexpr, DEPENDENT: tl.constexpr,
                            VARLEN: tl.constexpr):
    """Per key tile, chunk and value head: dq, and dk but for its part through X (the delta
    rule's; `_chunk_grad_values_kernel` adds it). Their accumulators span BK of the key columns,
    so that a chunk's key tiles run side by side; what needs every key column (the gates'
    gradients, and dX's share through W = X diag(b e^G) K) is stored per key tile (parts_ptr,
    dX_parts_ptr) and summed by `_chunk_grad_values_kernel`. Every product with Q K^T or K K^T
    is linear in them, so each tile takes its own columns' share.
    SIDE 0 does all of it. The residual rules, with twice the accumulators, run it in several
    launches, each adding to what the one before stored: SIDE 1, the queries' side (dO's products
    with the states and the writes: dq, dgamma, and the dqk^T Q parts of dk and dG), then for RLA
    SIDE 2, the keys' side (the products of dh', dU and dz), and for RDN that side split by state:
    SIDE 3, S's (dh', dU and dz), then SIDE 4, R's (dh'_R and dU_R).
    The queries' side reads nothing of the reverse passes: DEPENDENT, it is launched as a
    programmatic dependent of S's reverse pass (PDL, Hopper) and waits for it (`gdc_wait`) only
    before its stores (`_ChunkRun.queries_side_launched_dependent`)."""
    QUERIES: tl.constexpr = SIDE <= 1
    S_KEYS: tl.constexpr = SIDE == 0 or SIDE == 2 or SIDE == 3
    R_KEYS: tl.constexpr = RESIDUAL and (SIDE == 0 or SIDE == 2 or SIDE == 4)
    S_READS: tl.constexpr = QUERIES or S_KEYS
    key_tile, chunk, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
    r = tl.arange(0, BC)
    rows = start + r
    row_ok = rows < end
    kcols = key_tile * BK + tl.arange(0, BK)
    # Kept in the inputs' dtype through the value loop (fewer registers), as the dots take them.
    # The loads keep their order of the one-launch kernel (q first, dh' before dO): in another
    # order SIDE 0 compiled differently and sGLA's launch ran 332 -> 360 us (H200, session 23).
    if QUERIES:
        q = _load_rows(q_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
    k = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
    g = _token_scalars(g_ptr, rows, row_ok, head, HV)
    strength = _token_scalars(strength_ptr, rows, row_ok, head, HV)
    G = tl.cumsum(g, axis=0)
    G_last = tl.sum(g, axis=0)
    zeros_k, zeros_c = tl.zeros([BC, BK], dtype=tl.float32), tl.zeros([BC, BC], dtype=tl.float32)
    dq_reads, dq_reads_residual = zeros_k, zeros_k  # dO h^T and dO h_R^T
    dk_state = zeros_k      # U dh'^T over both states: the gradient of e^(G_last - G) K
    dW, dW_residual = zeros_k, zeros_k              # -dU h^T, -dU_R h_R^T
    dk_pred = zeros_k       # pred's: -dz h^T
    dP, dP_residual, dP_pred = zeros_c, zeros_c, zeros_c  # dO U^T, dO U_R^T, -dz U^T
    decay_grad_rows = tl.zeros([BK], dtype=tl.float32)  # <dh', h> by key row: the gradient of e^(G_last)
    for value_start in range(0, DV, BV):
        vcols = value_start + tl.arange(0, BV)
        h_offsets, tile_ok = _state_tile(chunk * HV + head, kcols, vcols, DK, DV)
        if S_READS:
            h = tl.load(h_ptr + h_offsets, mask=tile_ok, other=0.0)
        if S_KEYS:
            dh_next = tl.load(dh_next_ptr + h_offsets, mask=tile_ok, other=0.0)
        if QUERIES:
            do = _load_rows(do_ptr, rows, row_ok, head, HV, vcols, DV)
        if S_READS:
            if DELTA:
                U = _load_rows(U_ptr, rows, row_ok, head, HV, vcols, DV)
                if S_KEYS:
                    dW -= _mm(_load_rows(dU_ptr, rows, row_ok, head, HV, vcols, DV), tl.trans(h), DT)
            else:
                U = strength[:, None] * _load_rows(v_ptr, rows, row_ok, head, HV, vcols, DV).to(tl.float32)
        if QUERIES:
            dq_reads += _mm(do, tl.trans(h), DT)
            dP += _mm(do, tl.trans(U), DT)
        if S_KEYS:
            dk_state += _mm(U, tl.trans(dh_next), DT)
            decay_grad_rows += tl.sum(dh_next * h.to(tl.float32), axis=1)
        if RESIDUAL and S_KEYS:
            # pred = e^(G_prev) K h + P U reads h and U with gradient -dz (zero where clipped)
            dz = _load_rows(dz_ptr, rows, row_ok, head, HV, vcols, DV)
            dk_pred -= _mm(dz, tl.trans(h), DT)
            dP_pred -= _mm(dz, tl.trans(U), DT)
        if RESIDUAL and (QUERIES or R_KEYS):
            h = tl.load(h_residual_ptr + h_offsets, mask=tile_ok, other=0.0)
            U_residual = _load_rows(U_residual_ptr, rows, row_ok, head, HV, vcols, DV)
            if QUERIES:
                dq_reads_residual += _mm(do, tl.trans(h), DT)
                dP_residual += _mm(do, tl.trans(U_residual), DT)
            if R_KEYS:
                dh_next = tl.load(dh_next_residual_ptr + h_offsets, mask=tile_ok, other=0.0)
                dk_state += _mm(U_residual, tl.trans(dh_next), DT)
                decay_grad_rows += tl.sum(dh_next * h.to(tl.float32), axis=1)
                if DELTA:
                    dW_residual -= _mm(_load_rows(dU_residual_ptr, rows, row_ok, head, HV, vcols, DV),
                                       tl.trans(h), DT)
    if QUERIES:
        to_row = scale * tl.exp(G)  # the scaled decay from the chunk's start to each row
        decay = tl.exp(tl.where(r[:, None] >= r[None, :], G[:, None] - G[None, :], float("-inf")))
        qk = _mm(q, tl.trans(k), DT)  # this key tile's share of Q K^T
        q, k = q.to(tl.float32), k.to(tl.float32)
    part_rows = key_tile * L + rows
    if QUERIES:
        if RESIDUAL:
            gamma = _token_scalars(gamma_ptr, rows, row_ok, head, HV)
            dq_inter_residual = to_row[:, None] * dq_reads_residual
            dgamma = tl.sum(dq_inter_residual * q, axis=1) + scale * tl.sum(dP_residual * decay * qk, axis=1)
            dq_inter = to_row[:, None] * dq_reads + gamma[:, None] * dq_inter_residual
            decay_strict = tl.where(r[:, None] > r[None, :], decay, 0.0)
            dqk = scale * (dP * decay_strict + gamma[:, None] * dP_residual * decay)  # the gradient of Q K^T
        else:
            dq_inter = to_row[:, None] * dq_reads
            dqk = scale * dP * decay
        dG = tl.sum(dq_inter * q, axis=1) + tl.sum(dqk * qk, axis=1) - tl.sum(dqk * qk, axis=0)
        dq = dq_inter + _mm(dqk, k, DT)
        dk = _mm(tl.trans(dqk), q, DT)
    else:  # the queries' side's parts, stored by the launch before
        dG = _load_part(parts_ptr, part_rows, row_ok, head, HV, 0)
        dk = _load_rows(dk_ptr, rows, row_ok, head, HV, kcols, DK).to(tl.float32)
    if S_KEYS or R_KEYS:
        k = k.to(tl.float32)
        to_chunk_end = tl.exp(G_last - G)
        dk += to_chunk_end[:, None] * dk_state
        state_grad = tl.sum(dk_state * k, axis=1) * to_chunk_end
        dG -= state_grad
        dG_last = tl.sum(decay_grad_rows, axis=0) * tl.exp(G_last) + tl.sum(state_grad, axis=0)
        if RESIDUAL and S_KEYS:
            G_prev = G - g
            pred_decay = tl.exp(tl.where(r[:, None] > r[None, :], G_prev[:, None] - G[None, :], float("-inf")))
            kk = _mm(k, tl.trans(k), DT)  # this key tile's share of K K^T
            dk += tl.exp(G_prev)[:, None] * dk_pred
            dG_prev = tl.sum(dk_pred * k, axis=1) * tl.exp(G_prev)
            dkk = dP_pred * pred_decay
            dk += _mm(dkk, k, DT) + _mm(tl.trans(dkk), k, DT)
            dG_prev += tl.sum(dkk * kk, axis=1)
            dG += dG_prev - tl.sum(dkk * kk, axis=0)
            _store_part(parts_ptr, part_rows, row_ok, head, HV, 1, dG_prev)
        if DELTA:
            if S_KEYS:
                dk_write, dstrength, dG_write, dX = _wy_write_backward(
                    _load_lower(X_ptr, rows, row_ok, head, HV, BC), dW, k, G, strength, DT)
                dk += dk_write
                dG += dG_write
                _store_part(parts_ptr, part_rows, row_ok, head, HV, 2, dstrength)
                _store_rows(dX_parts_ptr, key_tile * 2 * L + rows, row_ok, head, HV, r, BC, dX)
            if R_KEYS:
                residual_strength = _token_scalars(residual_strength_ptr, rows, row_ok, head, HV)
                dk_write, dstrength, dG_write, dX = _wy_write_backward(
                    _load_lower(X_residual_ptr, rows, row_ok, head, HV, BC), dW_residual, k, G, residual_strength,
                    DT)
                dk += dk_write
                dG += dG_write
                _store_part(parts_ptr, part_rows, row_ok, head, HV, 3, dstrength)
                _store_rows(dX_parts_ptr, (key_tile * 2 + 1) * L + rows, row_ok, head, HV, r, BC, dX)
        # dg is dG's reverse cumulative sum within the chunk: dG_last reaches every row from the last real one.
        dG += tl.where(r == tl.minimum(end - start, BC) - 1, dG_last, 0.0)
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()
    if QUERIES and RESIDUAL:
        _store_part(parts_ptr, part_rows, row_ok, head, HV, 4, dgamma)
    _store_part(parts_ptr, part_rows, row_ok, head, HV, 0, dG)
    if QUERIES:
        _store_rows(dq_ptr, rows, row_ok, head, HV, kcols, DK, dq)
    _store_rows(dk_ptr, rows, row_ok, head, HV, kcols, DK, dk)


@_Launcher
@triton.jit
def _chunk_grad_values_kernel(k_ptr, v_ptr, g_ptr, strength_ptr, residual_strength_ptr, X_ptr, X_residual_ptr,
                              z_ptr, dh_next_ptr, dU_ptr, dU_residual_ptr, dz_ptr, dk_keys_ptr, parts_ptr,
                              dX_parts_ptr, dk_ptr, dv_ptr, dg_ptr, dstrength_ptr, dgamma_ptr, dresidual_strength_ptr,
                              cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, clip, T, NT, L, HV, GROUP, DK, DV,
                              KEY_TILES: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                              DT: tl.constexpr, DELTA: tl.constexpr, RESIDUAL: tl.constexpr,
                              STATE_PART: tl.constexpr, SIDE: tl.constexpr, VARLEN: tl.constexpr):
    """Per chunk and value head, after `_chunk_grad_keys_kernel`: dv, the gates' gradients (the
    key tiles' parts summed), and for the delta rule dk's part through X = (I + A)^-1 (and X_R),
    added to the key tiles' dk_keys. With STATE_PART (RLA, whose S pass leaves dU without it,
    no kernel before this one reading it) dU's state part e^(G_last - G) K dh' is added here.
    SIDE 0 does all of it. RDN, with two inverses to hold, runs it as two launches: SIDE 1, R's
    side (dX_R, the gradients of b_R, and X_R's parts of dk, added to dk_keys, and of dG, left in
    dg), then SIDE 2, S's side (dv and the rest), which adds R's share of dG before its cumsum."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    start, end = _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
    r = tl.arange(0, BC)
    rows = start + r
    row_ok = rows < end
    if STATE_PART:
        kcols = tl.arange(0, BK)
        k_state = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
        G = tl.cumsum(_token_scalars(g_ptr, rows, row_ok, head, HV), axis=0)
        G_last = tl.sum(tl.where(r == BC - 1, G, 0.0), axis=0)  # padded rows add 0
        to_chunk_end = tl.exp(G_last - G)
    strength = _token_scalars(strength_ptr, rows, row_ok, head, HV)
    if SIDE == 1:
        dG = tl.zeros([BC], dtype=tl.float32)
    else:
        dG = _load_parts(parts_ptr, rows, row_ok, head, HV, L, KEY_TILES, 0, BC)
    dstrength = tl.zeros([BC], dtype=tl.float32)
    dresidual_strength = tl.zeros([BC], dtype=tl.float32)
    if DELTA and SIDE != 1:
        dstrength += _load_parts(parts_ptr, rows, row_ok, head, HV, L, KEY_TILES, 2, BC)
        X = _load_lower(X_ptr, rows, row_ok, head, HV, BC)
        dX = _load_dX_parts(dX_parts_ptr, rows, row_ok, head, HV, L, 0, KEY_TILES, BC)
    if RESIDUAL and SIDE != 2:
        residual_strength = _token_scalars(residual_strength_ptr, rows, row_ok, head, HV)
        if DELTA:
            dresidual_strength += _load_parts(parts_ptr, rows, row_ok, head, HV, L, KEY_TILES, 3, BC)
            X_residual = _load_lower(X_residual_ptr, rows, row_ok, head, HV, BC)
            dX_residual = _load_dX_parts(dX_parts_ptr, rows, row_ok, head, HV, L, 1, KEY_TILES, BC)
    for value_start in range(0, DV, BV):
        vcols = value_start + tl.arange(0, BV)
        if SIDE != 1:
            v = _load_rows(v_ptr, rows, row_ok, head, HV, vcols, DV).to(tl.float32)
            dU = _load_rows(dU_ptr, rows, row_ok, head, HV, vcols, DV)
            if STATE_PART:
                h_offsets, tile_ok = _state_tile(chunk * HV + head, kcols, vcols, DK, DV)
                dU += to_chunk_end[:, None] * _mm(k_state, tl.load(dh_next_ptr + h_offsets, mask=tile_ok, other=0.0),
                                                  DT)
            if DELTA:
                dV_scaled = _mm(tl.trans(X), dU, DT)  # the gradient of diag(b) V
                dX += _mm(dU, tl.trans(strength[:, None] * v), DT)
            else:
                dV_scaled = dU
            dv = strength[:, None] * dV_scaled
            dstrength += tl.sum(dV_scaled * v, axis=1)
        if RESIDUAL:
            if SIDE != 1:
                dv += _load_rows(dz_ptr, rows, row_ok, head, HV, vcols, DV)
            if SIDE != 2:
                residual = tl.minimum(tl.maximum(_load_rows(z_ptr, rows, row_ok, head, HV, vcols, DV), -clip), clip)
                dU_residual = _load_rows(dU_residual_ptr, rows, row_ok, head, HV, vcols, DV)
                dr_scaled = dU_residual  # the gradient of diag(b_R) r
                if DELTA:
                    dr_scaled = _mm(tl.trans(X_residual), dU_residual, DT)
                    dX_residual += _mm(dU_residual, tl.trans(residual_strength[:, None] * residual), DT)
                dresidual_strength += tl.sum(dr_scaled * residual, axis=1)
        if SIDE != 1:
            _store_rows(dv_ptr, rows, row_ok, head, HV, vcols, DV, dv)
    if DELTA:
        kcols = tl.arange(0, BK)
        k = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK).to(tl.float32)
        G = tl.cumsum(_token_scalars(g_ptr, rows, row_ok, head, HV), axis=0)
        decay_strict = tl.exp(tl.where(r[:, None] > r[None, :], G[:, None] - G[None, :], float("-inf")))
        gram = decay_strict * _mm(k, tl.trans(k), DT)
        if SIDE != 1:
            dk_inverse, dstrength_inverse, dG_inverse = _wy_inverse_backward(X, dX, k, gram, decay_strict, strength,
                                                                             DT)
            dk = _load_rows(dk_keys_ptr, rows, row_ok, head, HV, kcols, DK) + dk_inverse
            dstrength += dstrength_inverse
            dG += dG_inverse
        else:
            dk = _load_rows(dk_keys_ptr, rows, row_ok, head, HV, kcols, DK).to(tl.float32)
        if RESIDUAL and SIDE != 2:
            dk_inverse, dstrength_inverse, dG_inverse = _wy_inverse_backward(X_residual, dX_residual, k, gram,
                                                                             decay_strict, residual_strength, DT)
            dk += dk_inverse
            dresidual_strength += dstrength_inverse
            dG += dG_inverse
        if SIDE == 1:
            _store_rows(dk_keys_ptr, rows, row_ok, head, HV, kcols, DK, dk)
        else:
            _store_rows(dk_ptr, rows, row_ok, head, HV, kcols, DK, dk)
    if RESIDUAL and SIDE != 2:
        tl.store(dresidual_strength_ptr + rows * HV + head, dresidual_strength, mask=row_ok)
    if SIDE == 1:  # R's share of dG, for SIDE 2
        tl.store(dg_ptr + rows * HV + head, dG, mask=row_ok)
    else:
        if SIDE == 2:
            dG += tl.load(dg_ptr + rows * HV + head, mask=row_ok, other=0.0)
        dg = tl.cumsum(dG, axis=0, reverse=True)
        if RESIDUAL:
            dg -= _load_parts(parts_ptr, rows, row_ok, head, HV, L, KEY_TILES, 1, BC)  # G_prev_t = G_t - g_t
            tl.store(dgamma_ptr + rows * HV + head,
                     _load_parts(parts_ptr, rows, row_ok, head, HV, L, KEY_TILES, 4, BC), mask=row_ok)
        tl.store(dg_ptr + rows * HV + head, dg, mask=row_ok)
        tl.store(dstrength_ptr + rows * HV + head, dstrength, mask=row_ok)


@_on_inputs_device
def chunk_backward(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens, do, dS, dR,
                   chunk_size=CHUNK_SIZE, inverse=None, kept_states=None):
    """Gradients of chunk_forward, (dq, dk, dv, dg, dbeta, dgamma, dgamma_write, dS0, dR0) (None
    where there is no residual state), given those of its output (do) and of its final states
    (dS, dR: tensors or None); `inverse` and `kept_states`: what a training chunk_forward kept, or
    None (the forward's passes are then recomputed from S0 and R0 alone)."""
    B, T, H, Dk = q.shape
    HV, Dv = v.shape[2:]
    L = B * T
    run = _ChunkRun(q, k, v, g, beta, gamma, gamma_write, update, clip, S0, R0, cu_seqlens, chunk_size,
                    for_backward=True, inverse=inverse, kept_states=kept_states)
    layout, residual = run.layout, run.residual
    do = do.reshape(L, HV, Dv).contiguous()
    dS0 = _fresh_state(S0)
    dR0 = _fresh_state(R0) if residual else dS0
    f32 = dict(device=q.device, dtype=torch.float32)
    # The intermediate gradients (dh', dU, dU_R, dz, dX's parts, dk's key part) are kept in the
    # inputs' dtype, as FLA keeps its dh and dv: every dot that reads them casts them so anyway,
    # and the backward is bound by their traffic (RDN's at B8xT2048 H16 D128 on an H200: 4,448 ->
    # 3,794 us for dh', dU, dU_R and dz alone). Sums over them accumulate in fp32 inside the
    # kernels; dU rounds once for each kernel that adds a part to it.
    low = dict(device=q.device, dtype=q.dtype)
    dh_next = torch.empty(layout.num_chunks, HV, Dk, Dv, **low)
    dU = torch.empty(L, HV, Dv, **low)
    dh_next_residual, dU_residual, dz = ((torch.empty_like(dh_next), torch.empty_like(dU), torch.empty_like(dU))
                                         if residual else (dh_next, dU, dU))
    read_gate = run.gamma if residual else run.g  # gamma; never read without the residual state
    gates = (run.beta, read_gate, run.gamma_write)
    common = dict(BC=chunk_size, BK=run.BK, DT=run.DT, RESIDUAL=residual, VARLEN=layout.varlen)
    BV = min(run.BV_full, 64)
    # The additive rule's reverse passes carry dh' alone (its dh never reads dU), which keeps the
    # sequential loop short; a state's part of dU joins the rest afterwards, every chunk at once:
    # the first pass's (sGLA's S, RLA's R) in the local-grad kernel run after it, RLA's S's in the
    # values kernel, the only one reading dU after it.
    state_part_after = not run.delta

    def local_grad():
        local_tile = local_grad_tile(run.delta, residual, run.BV_full)
        _chunk_local_grad_kernel[(_cdiv(Dv, local_tile), layout.num_chunks, HV)](
            run.q, run.k, run.g, read_gate, do, dh_next_residual if residual else dh_next, dU, dU_residual,
            *run.tables, scale, **run.shape, BV=local_tile, **common, STATE_PART=state_part_after,
            num_warps=run.warps, maxnreg=run.register_cap(_chunk_local_grad_kernel))

    if not state_part_after:
        local_grad()

    reverse_tile = run.state_tile(reverse=True)

    queries_dependent = run.queries_side_launched_dependent()

    def reverse_pass(d_final, d_initial, dh_next, dU, W, gated_read, pred):
        _chunk_state_backward_kernel[(_cdiv(Dv, reverse_tile), layout.num_sequences * HV)](
            run.q, run.k, run.g, run.cumulative_decays(scan=pred), read_gate, W, do, dz,
            d_initial if d_final is None else d_final.contiguous(), d_initial, dh_next, dU, layout.cu_seqlens,
            layout.chunk_offsets, scale, **run.shape, BV=reverse_tile, BC=chunk_size, BK=run.BK, DT=run.DT,
            DELTA=run.delta, GATED_READ=gated_read, PRED=pred, WHOLE_DU=not state_part_after,
            FINAL_GRAD=d_final is not None, LAUNCHES_DEPENDENTS=pred and queries_dependent, VARLEN=layout.varlen,
            num_warps=reverse_warps(reverse_tile, run.warps),
            num_stages=run.backward_stages)
        if state_part_after and not pred:
            local_grad()

    if residual:  # R's pass first: its gradient reaches S's through pred (dz), never the other way
        reverse_pass(dR, dR0, dh_next_residual, dU_residual, run.W_residual, gated_read=True, pred=False)
        _chunk_residual_grad_kernel[(_cdiv(Dv, BV), layout.num_chunks, HV)](
            run.gamma_write, run.X_residual, run.P, run.z, dU_residual, dz, dU, *run.tables, layout.T,
            layout.NT, HV, Dv, BC=chunk_size, BV=BV, DT=run.DT, DELTA=run.delta, VARLEN=layout.varlen,
            num_warps=run.warps, maxnreg=run.register_cap(_chunk_residual_grad_kernel))
    reverse_pass(dS, dS0, dh_next, dU, run.W, gated_read=False, pred=residual)
    # dq, dk and dv are stored in their inputs' dtypes (the one rounding a cast would make), but dq
    # and dk in fp32 where a key head serves several value heads: their shares are summed first.
    grouped = HV > H
    key_grad = dict(device=q.device, dtype=torch.float32 if grouped else q.dtype)
    dq, dk = torch.empty(L, HV, Dk, **key_grad), torch.empty(L, HV, Dk, **key_grad)
    dv = torch.empty(L, HV, Dv, device=q.device, dtype=v.dtype)
    dg, dbeta = torch.empty(L, HV, **f32), torch.empty(L, HV, **f32)
    dgamma, dgamma_write = (torch.empty(L, HV, **f32), torch.empty(L, HV, **f32)) if residual else (dg, dg)
    # The key tiles' programs: dq, and dk but for X's part (which the values' kernel adds).
    key_tile, keys_launches = grad_keys_launches(run.delta, residual, run.BV_full, q.dtype == torch.float32)
    key_tile = min(run.BK, key_tile)
    key_tiles = _cdiv(Dk, key_tile)
    parts = torch.empty(key_tiles, L, HV, 5, **f32)
    dX_parts = torch.empty(key_tiles, 2, L, HV, chunk_size, **low) if run.delta else parts
    dk_keys = torch.empty(L, HV, Dk, **key_grad) if run.delta else dk
    for side, keys_warps, keys_stages, keys_value_tile in keys_launches:
        dependent = side == 1 and queries_dependent
        _chunk_grad_keys_kernel[(key_tiles, layout.num_chunks, HV)](
            run.q, run.k, run.v, run.g, *gates, run.X, run.U, run.h, run.X_residual, run.U_residual, run.h_residual,
            do, dh_next, dU, dh_next_residual, dU_residual, dz, dq, dk_keys, parts, dX_parts, *run.tables, scale,
            **run.shape, L=L, **{**common, "BK": key_tile, "BV": keys_value_tile}, DELTA=run.delta, SIDE=side,
            DEPENDENT=dependent, num_warps=keys_warps, num_stages=keys_stages, launch_pdl=dependent)
    for side in grad_values_sides(run.delta, residual):
        _chunk_grad_values_kernel[(layout.num_chunks, HV)](
            run.k, run.v, run.g, run.beta, run.gamma_write, run.X, run.X_residual, run.z, dh_next, dU, dU_residual,
            dz, dk_keys, parts, dX_parts, dk, dv, dg, dbeta, dgamma, dgamma_write, *run.tables, clip, **run.shape,
            L=L, KEY_TILES=key_tiles, **common, DELTA=run.delta, STATE_PART=state_part_after and residual,
            SIDE=side, BV=min(run.BV_full, 64), num_warps=GRAD_VALUES_WARPS, num_stages=2,
            maxnreg=run.register_cap(_chunk_grad_values_kernel))
    group = lambda x: x.view(L, H, HV // H, Dk).sum(2) if grouped else x  # noqa: E731  a key head's value heads
    shaped = lambda x, like: x.reshape(like.shape).to(like.dtype)  # noqa: E731
    grads = (shaped(group(dq), q), shaped(group(dk), k), shaped(dv, v), shaped(dg, g), shaped(dbeta, beta))
    if not residual:
        return (*grads, None, None, dS0, None)
    return (*grads, shaped(dgamma, gamma), shaped(dgamma_write, gamma_write), dS0, dR0)


# ---------------------------------------------------------------------------------------------
# The chunked forward, its backward and the decode step as torch.library custom ops, with fake
# implementations (shapes only), so that torch.compile traces through them without graph
# breaks; the forward's gradient is registered as the backward op. Eager autograd runs the same
# forward, saved tensors and backward through `_EagerChunkAttention`, without the ops' dispatch.
# Remote code can import this file under several module names (and two checkpoints may carry
# different versions of it): the op namespace carries a hash of the file, so that identical code
# shares one registration.
# ---------------------------------------------------------------------------------------------

def _op_namespace():
    with open(__file__, "rb") as source:
        return "reslin_" + hashlib.sha1(source.read()).hexdigest()[:12]


OP_NAMESPACE = _op_namespace()
def _absent(like):
    """An absent optional output: ops return tensors only."""
    return like.new_empty(0)


def _contiguous_like(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _optional(x):
    return None if x.numel() == 0 else x


def _chunk_forward_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           gamma: Optional[torch.Tensor], gamma_write: Optional[torch.Tensor], S0: torch.Tensor,
                           R0: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], update: str, clip: float,
                           scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor]:
    """chunk_forward as its op returns it, tensors only: (o, S, R, and the inverses and the states
    kept for the backward)."""
    o, S, R, inverse, kept_states = chunk_forward(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0,
                                                  cu_seqlens, CHUNK_SIZE, training=True)
    return (o, S, (_absent(S) if R is None else R), (_absent(q) if inverse is None else inverse),
            (_absent(S) if kept_states is None else kept_states))


def _chunk_backward_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            gamma: Optional[torch.Tensor], gamma_write: Optional[torch.Tensor], S0: torch.Tensor,
                            R0: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], do: torch.Tensor,
                            dS: Optional[torch.Tensor], dR: Optional[torch.Tensor], inverse: Optional[torch.Tensor],
                            kept_states: Optional[torch.Tensor], update: str, clip: float,
                            scale: float) -> List[torch.Tensor]:
    """chunk_backward as its op returns it, tensors only."""
    grads = chunk_backward(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens, do, dS, dR,
                           inverse=inverse, kept_states=kept_states)
    return [_absent(q) if grad is None else grad for grad in grads]


def _save_for_backward(ctx, inputs, output):
    q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, update, clip, scale = inputs
    inverse, kept_states = output[3:]
    ctx.mark_non_differentiable(inverse, kept_states)
    # Gradients of unused outputs arrive as None, not as zeros: T^-1 and the kept states never
    # have one, and the backward takes dS and dR as None already.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, inverse, kept_states)
    ctx.update, ctx.clip, ctx.scale = update, clip, scale


def _backward_through(chunk_backward_call):
    """The chunked forward's gradient, computed by `chunk_backward_call`: the backward op where
    torch.compile traces it, its body under eager autograd."""
    def backward(ctx, do, dS, dR, _inverse, _kept_states):
        q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, inverse, kept_states = ctx.saved_tensors
        do = torch.zeros_like(v) if do is None else do  # o unused: only the final states carry a gradient
        grads = chunk_backward_call(q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, do, dS,
                                    dR if gamma is not None else None, _optional(inverse), _optional(kept_states),
                                    ctx.update, ctx.clip, ctx.scale)
        return (*(_optional(grad) for grad in grads), None, None, None, None)
    return backward


class _EagerChunkAttention(torch.autograd.Function):
    """The chunked forward under eager autograd: the op's forward, saved tensors and backward
    without the op's dispatch, which costs ~0.1 ms of host time a training call (forward and
    backward through reslin_attention on a CPU, kernels stubbed out: sGLA 287 us through the op,
    174 here; gdn 304 and 191)."""
    @staticmethod
    def forward(ctx, *inputs):  # no setup_context: apply would then bind the arguments by signature (~45 us)
        output = _chunk_forward_tensors(*inputs)
        _save_for_backward(ctx, inputs, output)
        return output

    backward = staticmethod(_backward_through(_chunk_backward_tensors))


def _register_ops():
    ops = getattr(torch.ops, OP_NAMESPACE)
    if hasattr(ops, "chunk_forward"):  # registered by another import of this same file
        return ops.chunk_forward, ops.decode_step

    chunk_forward_op = torch.library.custom_op(f"{OP_NAMESPACE}::chunk_forward", mutates_args=())(
        _chunk_forward_tensors)

    # The kernels write fresh contiguous tensors whatever the inputs' strides; the fakes must say
    # so (inductor checks the real strides against them).
    @chunk_forward_op.register_fake
    def _(q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, update, clip, scale):
        S = _contiguous_like(S0)
        B, T, HV = v.shape[:3]
        inverse = q.new_empty(1 + (gamma is not None), B * T, HV, CHUNK_SIZE) if update == "delta" else _absent(q)
        segment_chunks, segments = kept_segments(update, cu_seqlens is not None, B, HV, _cdiv(T, CHUNK_SIZE))
        kept_states = S.new_empty(1 + (gamma is not None), B * segments, *S.shape[1:]) if segment_chunks else \
            _absent(S)
        return _contiguous_like(v), S, (_absent(S) if gamma is None else torch.empty_like(S)), inverse, kept_states

    chunk_backward_op = torch.library.custom_op(f"{OP_NAMESPACE}::chunk_backward", mutates_args=())(
        _chunk_backward_tensors)

    @chunk_backward_op.register_fake
    def _(q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, do, dS, dR, inverse, kept_states, update, clip,
          scale):
        like = (q, k, v, g, beta, gamma, gamma_write, S0, R0 if gamma is not None else None)
        return [_absent(q) if x is None else _contiguous_like(x) for x in like]

    chunk_forward_op.register_autograd(_backward_through(chunk_backward_op), setup_context=_save_for_backward)

    @torch.library.custom_op(f"{OP_NAMESPACE}::decode_step", mutates_args=("S", "R"))
    def decode_step_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       gamma: Optional[torch.Tensor], gamma_write: Optional[torch.Tensor], S: torch.Tensor,
                       R: Optional[torch.Tensor], update: str, clip: float, scale: float) -> torch.Tensor:
        return decode_step(q, k, v, g, beta, gamma, gamma_write, S, R, update, clip, scale)

    @decode_step_op.register_fake
    def _(q, k, v, g, beta, gamma, gamma_write, S, R, update, clip, scale):
        return _contiguous_like(v)

    return chunk_forward_op, decode_step_op


chunk_forward_op, decode_step_op = _register_ops()


def chunk_attention(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens):
    """The chunked forward, differentiable: (o, S, R), R None without the residual state. Through
    its custom op where torch.compile traces it, through `_EagerChunkAttention` where eager
    autograd needs a backward, otherwise chunk_forward itself (the op's dispatch costs tens of
    microseconds a call)."""
    inputs = (q, k, v, g, beta, gamma, gamma_write, S0, R0)
    if torch.compiler.is_compiling():
        differentiable = chunk_forward_op
    elif torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        differentiable = _EagerChunkAttention.apply
    else:
        return chunk_forward(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens)
    o, S, R, _, _ = differentiable(q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, update, clip, scale)
    return o, S, (R if gamma is not None else None)


def decode_step_call(*args):
    """decode_step, through its custom op while torch.compile traces (the op's dispatch costs a
    one-token step more than its kernel when run eagerly)."""
    return decode_step_op(*args) if torch.compiler.is_compiling() else decode_step(*args)
