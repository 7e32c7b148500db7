"""Fused Triton kernels for the layers around the recurrence: the RMS norms (plain and gated by
SiLU), the short causal convolution with its SiLU (and for q and k the L2 normalisation of each
head), SwiGLU, and the gates (forward only, for inference).

Their reference is the torch code in modeling_reslin.py (ResLinRMSNorm, ResLinGatedRMSNorm,
l2_normalize, ResLinShortConvolution, ResLinMLP), which the modeling file runs on the CPU and
under torch.compile (whose inductor fuses it by itself). Eagerly on CUDA that code is dozens of
elementwise passes a layer, each a kernel launch and a trip through memory, and autograd keeps
their fp32 intermediates for the backward: a 400M model's training step spent more than twice
FLA's time and memory. Each function here is one kernel forward and one or two backward,
computes in fp32, returns its input's dtype, and saves only its inputs for the backward, which
recomputes the rest; SwiGLU can take the down projection along, so that its product is not kept
either.
"""

import contextlib

import torch

try:
    from .kernels_reslin_triton_launch import _cdiv, _Launcher, _next_power_of_2, tl, triton
except ImportError:
    from kernels_reslin_triton_launch import _cdiv, _Launcher, _next_power_of_2, tl, triton

TILE_ELEMENTS = 4096  # elements per program in the row-wise kernels
# Warps per program for every kernel here: with 4, ptxas spilled registers in the backward kernels
# (tools/compile_for_gpu.py --registers --layers-only), with 8 it does not.
NUM_WARPS = 8
MAX_NORM_SIZE = 16384  # one program holds a whole row
MAX_L2_HEAD_SIZE = 256  # the convolution's tile holds a whole head


def _on_device(x):
    """Triton launches on the current CUDA device, not on the tensors' (see
    kernels_reslin_triton_launch._on_inputs_device)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def token_rows(x):
    """x [..., N] as rows [M, N] of unit-stride columns, a view where x's rows are evenly spaced (a
    column slice of a wider tensor: a generation step's projections come from one GEMM), else a
    contiguous copy. The kernels taking it read row m at m * stride(0)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# ---------------------------------------------------------------------------------------------
# RMS norm: y = x / sqrt(mean(x^2) + eps) * weight [* silu(gate)], row by row
# ---------------------------------------------------------------------------------------------

@_Launcher
@triton.jit
def _rms_norm_forward_kernel(x_ptr, weight_ptr, gate_ptr, y_ptr, M, N, eps,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * rstd[:, None] * tl.load(weight_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if GATED:
        gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        y = y * gate * tl.sigmoid(gate)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@_Launcher
@triton.jit
def _rms_norm_backward_kernel(x_ptr, weight_ptr, gate_ptr, dy_ptr, dx_ptr, dgate_ptr, dweight_ptr,
                              M, N, eps, blocks_per_program,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    # A program walks `blocks_per_program` row blocks, summing its share of dweight in registers;
    # the host adds up the programs' shares, stored [N, programs] so that each sum is contiguous.
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dweight = tl.zeros([BLOCK_N], dtype=tl.float32)
    for block in range(program * blocks_per_program, (program + 1) * blocks_per_program):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        x_hat = x * rstd[:, None]
        if GATED:
            gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            normed = x_hat * weight
            # d silu(z) / dz = sig(z) (1 + z (1 - sig(z)))
            tl.store(dgate_ptr + offsets, (dy * normed * sig * (1.0 + gate * (1.0 - sig))).to(dgate_ptr.dtype.element_ty),
                     mask=mask)
            dy = dy * gate * sig
        dweight += tl.sum(dy * x_hat, axis=0)
        dx_hat = dy * weight
        dx = rstd[:, None] * (dx_hat - x_hat * (tl.sum(dx_hat * x_hat, axis=1) / N)[:, None])
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dweight_ptr + cols * tl.num_programs(0) + program, dweight, mask=col_ok)


def _norm_blocks(N):
    BLOCK_N = _next_power_of_2(N)
    return max(1, TILE_ELEMENTS // BLOCK_N), BLOCK_N


def _rms_norm_forward(x2, weight, gate2, eps):
    """The normed rows [M, N] of x2 (times silu(gate2) when given), in x2's dtype."""
    M, N = x2.shape
    y = torch.empty_like(x2)
    BLOCK_M, BLOCK_N = _norm_blocks(N)
    with _on_device(x2):
        _rms_norm_forward_kernel[(_cdiv(M, BLOCK_M),)](
            x2, weight, gate2, y, M, N, eps, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GATED=gate2 is not None,
            num_warps=NUM_WARPS)
    return y


def _rms_norm_backward(x2, weight, gate2, dy, eps):
    """(dx, dweight, dgate) of _rms_norm_forward given dy [M, N]; dgate None without a gate."""
    M, N = x2.shape
    dy = dy.reshape(M, N).contiguous()
    dx = torch.empty_like(x2)
    dgate = torch.empty_like(gate2) if gate2 is not None else None
    BLOCK_M, BLOCK_N = _norm_blocks(N)
    row_blocks = _cdiv(M, BLOCK_M)
    programs = min(row_blocks, 1024)
    blocks_per_program = _cdiv(row_blocks, programs)
    programs = _cdiv(row_blocks, blocks_per_program)
    dweight = x2.new_empty(N, programs, dtype=torch.float32)
    with _on_device(x2):
        _rms_norm_backward_kernel[(programs,)](
            x2, weight, gate2, dy, dx, dgate, dweight, M, N, eps, blocks_per_program,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GATED=gate2 is not None, num_warps=NUM_WARPS)
    return dx, dweight.sum(1).to(weight.dtype), dgate


def _rows(x, N):
    return None if x is None else x.reshape(-1, N).contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps):
        x2, gate2 = _rows(x, x.shape[-1]), _rows(gate, x.shape[-1])
        ctx.save_for_backward(x2, weight, gate2)
        ctx.eps, ctx.shape = eps, x.shape
        return _rms_norm_forward(x2, weight, gate2, eps).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        dx, dweight, dgate = _rms_norm_backward(*ctx.saved_tensors, dy, ctx.eps)
        return dx.view(ctx.shape), dweight, None if dgate is None else dgate.view(ctx.shape), None


class _RMSNormProjections(torch.autograd.Function):
    """F.linear(y, W) for each projection W of y = the norm of x, without keeping y (as wide as x)
    for the projections' weight gradients, as each nn.Linear after a norm would: the backward
    forms y again from x (and the gate), which the norm's own gradient reads anyway, one kernel.
    y is read as rows of W's input width (K, a multiple of the norm's N: heads side by side).
    Under autocast the products autocast as nn.Linear's would."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, gate, eps, *projections):
        x2, gate2 = _rows(x, x.shape[-1]), _rows(gate, x.shape[-1])
        ctx.save_for_backward(x2, weight, gate2, *projections)
        ctx.eps, ctx.shape = eps, x.shape
        y = _rms_norm_forward(x2, weight, gate2, eps).view(-1, projections[0].shape[1])
        return tuple(torch.nn.functional.linear(y, projection) for projection in projections)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, *d_outputs):  # every one a tensor: autograd gives zeros for an unused output
        x2, weight, gate2, *projections = ctx.saved_tensors
        dy = d_outputs[0] @ projections[0]
        for dz, projection in zip(d_outputs[1:], projections[1:]):
            dy = torch.addmm(dy, dz, projection)  # the sum over the projections, in the GEMM's epilogue
        dx, dweight, dgate = _rms_norm_backward(x2, weight, gate2, dy, ctx.eps)
        needed = ctx.needs_input_grad[4:]
        y = _rms_norm_forward(x2, weight, gate2, ctx.eps).view(dy.shape) if any(needed) else None
        dprojections = [(dz.t() @ y).to(projection.dtype) if wanted else None
                        for dz, projection, wanted in zip(d_outputs, projections, needed)]
        return (dx.view(ctx.shape), dweight, None if dgate is None else dgate.view(ctx.shape), None,
                *dprojections)


def rms_norm(x, weight, eps=1e-6, gate=None, projections=None):
    """x / sqrt(mean(x^2) + eps) over the last dimension, times `weight`, times silu(`gate`) when
    given (gate shaped like x); in fp32, returned in x's dtype. With `projections` (bias-free
    weights [out_i, K], K a multiple of x's last dimension: K // N normed rows side by side), the
    tuple of F.linear(normed x as rows [x.numel() // K, K], W_i) instead, the normed x not kept
    for the backward (formed again there)."""
    N = x.shape[-1]
    if N > MAX_NORM_SIZE:
        raise ValueError(f"the fused RMS norm takes rows of at most {MAX_NORM_SIZE} elements, got {N}")
    if weight.shape != (N,):
        raise ValueError(f"weight must be [{N}], got {tuple(weight.shape)}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate must be shaped like x {tuple(x.shape)}, got {tuple(gate.shape)}")
    if projections is None:
        return _RMSNorm.apply(x, weight, gate, float(eps))
    K = projections[0].shape[-1] if projections else 0
    if (not projections or any(p.dim() != 2 or p.shape[1] != K for p in projections) or K % N
            or x.numel() % K):
        raise ValueError(f"projections must be one or more weights [out, K] of one K, a multiple of {N} that "
                         f"divides x's {x.numel()} elements; got {[tuple(p.shape) for p in projections]}")
    return _RMSNormProjections.apply(x, weight, gate, float(eps), *projections)


# ---------------------------------------------------------------------------------------------
# SwiGLU: silu(gate) * up
# ---------------------------------------------------------------------------------------------

@_Launcher
@triton.jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, y_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, (gate * tl.sigmoid(gate) * up).to(y_ptr.dtype.element_ty), mask=mask)


@_Launcher
@triton.jit
def _swiglu_backward_kernel(gate_ptr, up_ptr, dy_ptr, dgate_ptr, dup_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    tl.store(dgate_ptr + offsets, (dy * up * sig * (1.0 + gate * (1.0 - sig))).to(dgate_ptr.dtype.element_ty),
             mask=mask)
    tl.store(dup_ptr + offsets, (dy * gate * sig).to(dup_ptr.dtype.element_ty), mask=mask)


def _swiglu_forward(gate, up):
    y = torch.empty_like(gate)
    with _on_device(gate):
        _swiglu_forward_kernel[(_cdiv(gate.numel(), TILE_ELEMENTS),)](gate, up, y, gate.numel(), BLOCK=TILE_ELEMENTS,
                                                                      num_warps=NUM_WARPS)
    return y


def _swiglu_backward(gate, up, dy):
    dy = dy.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    with _on_device(gate):
        _swiglu_backward_kernel[(_cdiv(gate.numel(), TILE_ELEMENTS),)](gate, up, dy, dgate, dup, gate.numel(),
                                                                       BLOCK=TILE_ELEMENTS, num_warps=NUM_WARPS)
    return dgate, dup


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return _swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dy):
        return _swiglu_backward(*ctx.saved_tensors, dy)


class _SwiGLUDown(torch.autograd.Function):
    """down(silu(gate) * up) without keeping silu(gate) * up (the largest activation of a block):
    the backward recomputes it. Under autocast the matmuls autocast as nn.Linear's would."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, gate, up, weight):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up, weight)
        return torch.nn.functional.linear(_swiglu_forward(gate, up), weight)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        gate, up, weight = ctx.saved_tensors
        dgate, dup = _swiglu_backward(gate, up, dy @ weight)
        dweight = None
        if ctx.needs_input_grad[2]:
            hidden = _swiglu_forward(gate, up)
            dweight = (dy.flatten(0, -2).t() @ hidden.flatten(0, -2)).to(weight.dtype)
        return dgate, dup, dweight


def swiglu(gate, up, down_weight=None):
    """silu(gate) * up in fp32, returned in gate's dtype; with `down_weight` [hidden, inner], that
    product's projection F.linear(silu(gate) * up, down_weight), recomputing the product in the
    backward rather than keeping it."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match, got {tuple(gate.shape)} {gate.dtype} and "
                         f"{tuple(up.shape)} {up.dtype}")
    if down_weight is None:
        return _SwiGLU.apply(gate, up)
    if down_weight.dim() != 2 or down_weight.shape[1] != gate.shape[-1]:
        raise ValueError(f"down_weight must be [hidden, {gate.shape[-1]}], got {tuple(down_weight.shape)}")
    return _SwiGLUDown.apply(gate, up, down_weight)


# ---------------------------------------------------------------------------------------------
# The gates, forward only: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), gamma =
# sigmoid(c), per token and value head, in fp32
# ---------------------------------------------------------------------------------------------

@_Launcher
@triton.jit
def _gates_kernel(a_ptr, b_ptr, c_ptr, A_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, gamma_ptr, numel, HV,
                  a_stride, b_stride, c_stride, HAS_GAMMA: tl.constexpr, BLOCK: tl.constexpr):
    """Over numel outputs, HV a row; the inputs' rows lie a_stride, b_stride and c_stride apart."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    row, head = offsets // HV, offsets % HV
    x = tl.load(a_ptr + row * a_stride + head, mask=mask, other=0.0).to(tl.float32) + \
        tl.load(dt_bias_ptr + head, mask=mask, other=0.0).to(tl.float32)
    # softplus as torch computes it (threshold 20), written so that exp never overflows.
    softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))
    rate = tl.exp(tl.load(A_log_ptr + head, mask=mask, other=0.0).to(tl.float32))
    tl.store(g_ptr + offsets, -rate * softplus, mask=mask)
    b = tl.load(b_ptr + row * b_stride + head, mask=mask, other=0.0).to(tl.float32)
    tl.store(beta_ptr + offsets, tl.sigmoid(b), mask=mask)
    if HAS_GAMMA:
        c = tl.load(c_ptr + row * c_stride + head, mask=mask, other=0.0).to(tl.float32)
        tl.store(gamma_ptr + offsets, tl.sigmoid(c), mask=mask)


def gates(a, b, c, A_log, dt_bias):
    """(g, beta, gamma) in fp32 from the gate projections a, b and c (None without the residual
    state; gamma then None) [..., HV] and the per-head A_log and dt_bias [HV], in one kernel where
    the torch code (ResLinLinearAttention.gates) launches eight or more: a generation step is bound
    by its launches. No gradients: the model calls it where autograd is off."""
    HV = A_log.shape[0]
    for name, x in (("a", a), ("b", b), ("c", c)):
        if x is not None and (x.shape != a.shape or x.shape[-1] != HV):
            raise ValueError(f"gate input {name} must be [..., {HV}] like a, got {tuple(x.shape)}")
    if dt_bias.shape != A_log.shape:
        raise ValueError(f"dt_bias must be [{HV}] like A_log, got {tuple(dt_bias.shape)}")
    a_rows, b_rows = token_rows(a), token_rows(b)
    c_rows = b_rows if c is None else token_rows(c)
    g, beta = (torch.empty(a.shape, device=a.device, dtype=torch.float32) for _ in range(2))
    gamma = None if c is None else torch.empty_like(g)
    block, warps = gates_launch(a.numel())
    with _on_device(a):
        _gates_kernel[(_cdiv(a.numel(), block),)](
            a_rows, b_rows, c_rows, A_log, dt_bias, g, beta, beta if gamma is None else gamma, a.numel(), HV,
            a_rows.stride(0), b_rows.stride(0), c_rows.stride(0), HAS_GAMMA=c is not None, BLOCK=block,
            num_warps=warps)
    return g, beta, gamma


def gates_launch(numel):
    """Block and warps of `_gates_kernel` for numel elements: a generation step's few elements in
    a block of their size on one warp, where a block of TILE_ELEMENTS on NUM_WARPS costs several
    microseconds a call."""
    block = min(TILE_ELEMENTS, max(128, _next_power_of_2(numel)))
    return block, max(1, block * NUM_WARPS // TILE_ELEMENTS)


# ---------------------------------------------------------------------------------------------
# Short convolution: y_t = silu(sum_i w_i x_{t - (K-1) + i}), depthwise and causal, optionally
# followed by the L2 normalisation of each head (q and k)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _conv_tile(x_ptr, state_ptr, positions_ptr, b, times, channels, time_ok, channel_ok, T, D, x_stride, i,
               K: tl.constexpr, HAS_STATE: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """The inputs that tap i reads for the outputs at `times` x `channels` of row b, in fp32: from
    x, whose tokens lie x_stride apart, from the state [B, D, K - 1] before t = 0 (zeros without
    one), and zero where a packed sequence's start lies in between (positions[b, t] < reach)."""
    reach = K - 1 - i
    source = times - reach
    ok = (time_ok & (source >= 0))[:, None] & channel_ok[None, :]
    if HAS_POSITIONS:
        positions = tl.load(positions_ptr + b * T + times, mask=time_ok, other=0)
        ok = ok & (positions >= reach)[:, None]
    x = tl.load(x_ptr + (b * T + source).to(tl.int64)[:, None] * x_stride + channels[None, :], mask=ok, other=0.0)
    x = x.to(tl.float32)
    if HAS_STATE:
        from_state = (time_ok & (source < 0))[:, None] & channel_ok[None, :]
        x += tl.load(state_ptr + (b * D + channels[None, :]) * (K - 1) + (K - 1 + source)[:, None],
                     mask=from_state, other=0.0).to(tl.float32)
    return x


@triton.jit
def _conv_window(x_ptr, state_ptr, positions_ptr, weight_ptr, b, times, channels, time_ok, channel_ok, T, D,
                 x_stride, K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                 HAS_STATE: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """The convolution before its SiLU at `times` x `channels` of row b, in fp32."""
    pre = tl.zeros([BT, BD], dtype=tl.float32)
    for i in tl.static_range(K):
        weight = tl.load(weight_ptr + channels * K + i, mask=channel_ok, other=0.0).to(tl.float32)
        pre += _conv_tile(x_ptr, state_ptr, positions_ptr, b, times, channels, time_ok, channel_ok, T, D, x_stride,
                          i, K, HAS_STATE, HAS_POSITIONS) * weight[None, :]
    return pre


@triton.jit
def _conv_tile_indices(T, D, GROUP, BT: tl.constexpr, BD: tl.constexpr):
    """Row b, the tile's times and channels: the channels of one group (a head when normalising)."""
    times = tl.program_id(0) * BT + tl.arange(0, BT)
    lanes = tl.arange(0, BD)
    channels = tl.program_id(1) * GROUP + lanes
    return tl.program_id(2), times, channels, times < T, (lanes < GROUP) & (channels < D)


@_Launcher
@triton.jit
def _short_conv_forward_kernel(x_ptr, state_ptr, positions_ptr, weight_ptr, y_ptr, T, D, x_stride, GROUP, eps,
                               K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                               HAS_STATE: tl.constexpr, HAS_POSITIONS: tl.constexpr, NORMALIZE: tl.constexpr,
                               UPDATE_STATE: tl.constexpr):
    """y = silu(convolution) of x, whose tokens lie x_stride apart (a slice of a wider projection's
    output at a generation step), L2-normalised per group with NORMALIZE. With UPDATE_STATE the first
    time tile's programs, the only ones that read the state, then write the state after x (the
    last K - 1 inputs of [state, x]) over it."""
    b, times, channels, time_ok, channel_ok = _conv_tile_indices(T, D, GROUP, BT, BD)
    pre = _conv_window(x_ptr, state_ptr, positions_ptr, weight_ptr, b, times, channels, time_ok, channel_ok, T, D,
                       x_stride, K, BT, BD, HAS_STATE, HAS_POSITIONS)
    y = pre * tl.sigmoid(pre)
    if NORMALIZE:  # y / sqrt(||y||^2 + eps) over the group's channels (masked ones are zero)
        y = y / tl.sqrt(tl.sum(y * y, axis=1) + eps)[:, None]
    offsets = (b * T + times).to(tl.int64)[:, None] * D + channels[None, :]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=time_ok[:, None] & channel_ok[None, :])
    if UPDATE_STATE:
        if tl.program_id(0) == 0:
            slots = tl.arange(0, BT)  # slot j of the new state holds input T + j of [state, x]
            source = T + slots
            slot_ok = (slots < K - 1)[:, None] & channel_ok[None, :]
            from_state = slot_ok & (source < K - 1)[:, None]
            window = tl.load(state_ptr + (b * D + channels[None, :]) * (K - 1) + source[:, None], mask=from_state,
                             other=0.0)
            window += tl.load(x_ptr + (b * T + source - (K - 1)).to(tl.int64)[:, None] * x_stride + channels[None, :],
                              mask=slot_ok & (source >= K - 1)[:, None], other=0.0)
            tl.debug_barrier()  # every read of the old state in this program before the first write
            tl.store(state_ptr + (b * D + channels[None, :]) * (K - 1) + slots[:, None], window, mask=slot_ok)


@_Launcher
@triton.jit
def _short_conv_backward_kernel(x_ptr, state_ptr, positions_ptr, weight_ptr, dy_ptr, dpre_ptr, dweight_ptr,
                                T, D, GROUP, eps,
                                K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                                HAS_STATE: tl.constexpr, HAS_POSITIONS: tl.constexpr, NORMALIZE: tl.constexpr):
    """dpre, the gradient before the SiLU (fp32, for the input gradient's kernel), and this tile's
    share of the weight gradient, sum_t dpre_t x_{t - reach}, into dweight [D, K, B * T / BT]: the
    tiles' shares of one weight side by side, so that the host sums contiguous rows."""
    b, times, channels, time_ok, channel_ok = _conv_tile_indices(T, D, GROUP, BT, BD)
    mask = time_ok[:, None] & channel_ok[None, :]
    pre = _conv_window(x_ptr, state_ptr, positions_ptr, weight_ptr, b, times, channels, time_ok, channel_ok, T, D,
                       D, K, BT, BD, HAS_STATE, HAS_POSITIONS)
    offsets = (b * T + times).to(tl.int64)[:, None] * D + channels[None, :]
    sig = tl.sigmoid(pre)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if NORMALIZE:
        y = pre * sig
        rstd = 1.0 / tl.sqrt(tl.sum(y * y, axis=1) + eps)
        y_hat = y * rstd[:, None]
        dy = rstd[:, None] * (dy - y_hat * tl.sum(dy * y_hat, axis=1)[:, None])
    # d silu(z) / dz = sig(z) (1 + z (1 - sig(z)))
    dpre = dy * sig * (1.0 + pre * (1.0 - sig))
    tl.store(dpre_ptr + offsets, dpre, mask=mask)
    tiles = tl.num_programs(0) * tl.num_programs(2)
    tile = b * tl.num_programs(0) + tl.program_id(0)
    for i in tl.static_range(K):
        x = _conv_tile(x_ptr, state_ptr, positions_ptr, b, times, channels, time_ok, channel_ok, T, D, D, i,
                       K, HAS_STATE, HAS_POSITIONS)
        tl.store(dweight_ptr + (channels * K + i).to(tl.int64) * tiles + tile, tl.sum(dpre * x, axis=0),
                 mask=channel_ok)


@_Launcher
@triton.jit
def _short_conv_input_grad_kernel(dpre_ptr, positions_ptr, weight_ptr, dx_ptr, T, D,
                                  K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """dx_s = sum_i w_i dpre_{s + reach_i}, over the outputs s + reach_i that read x_s."""
    b, times, channels, time_ok, channel_ok = _conv_tile_indices(T, D, BD, BT, BD)
    dx = tl.zeros([BT, BD], dtype=tl.float32)
    for i in tl.static_range(K):
        reach = K - 1 - i
        reader = times + reach
        ok = reader < T
        if HAS_POSITIONS:
            ok = ok & (tl.load(positions_ptr + b * T + reader, mask=ok, other=0) >= reach)
        ok = ok[:, None] & channel_ok[None, :]
        dpre = tl.load(dpre_ptr + (b * T + reader).to(tl.int64)[:, None] * D + channels[None, :], mask=ok, other=0.0)
        weight = tl.load(weight_ptr + channels * K + i, mask=channel_ok, other=0.0).to(tl.float32)
        dx += dpre * weight[None, :]
    offsets = (b * T + times).to(tl.int64)[:, None] * D + channels[None, :]
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=time_ok[:, None] & channel_ok[None, :])


CONV_BLOCK_T, CONV_BLOCK_D = 32, 128
# The backward kernel recomputes the window and reloads it for the weight gradient: with 32 times a
# tile it spilled registers, even at 8 warps.
CONV_BACKWARD_BLOCK_T = 16
L2_EPS = 1e-6  # modeling_reslin.l2_normalize's


def _conv_grid(B, T, D, group, block_t=CONV_BLOCK_T):
    return _cdiv(T, block_t), _cdiv(D, group), B


class _ShortConvolution(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, state, positions, l2_head_size, update_state):
        B, T, D = x.shape
        K = weight.shape[-1]
        rows = token_rows(x)
        weight = weight.reshape(D, K).contiguous()
        group = l2_head_size or CONV_BLOCK_D
        y = x.new_empty(B, T, D)
        with _on_device(x):
            _short_conv_forward_kernel[_conv_grid(B, T, D, group)](
                rows, state, positions, weight, y, T, D, rows.stride(0), group, L2_EPS, K=K, BT=CONV_BLOCK_T,
                BD=_next_power_of_2(group), HAS_STATE=state is not None, HAS_POSITIONS=positions is not None,
                NORMALIZE=l2_head_size is not None, UPDATE_STATE=update_state, num_warps=NUM_WARPS)
        ctx.save_for_backward(rows, weight, state, positions)
        ctx.l2_head_size = l2_head_size
        return y

    @staticmethod
    def backward(ctx, dy):
        rows, weight, state, positions = ctx.saved_tensors
        B, T, D = dy.shape
        x = rows.contiguous().view(B, T, D)  # the backward's kernels read rows D apart
        K = weight.shape[-1]
        group = ctx.l2_head_size or CONV_BLOCK_D
        dy = dy.contiguous()
        dpre = torch.empty(B, T, D, device=x.device, dtype=torch.float32)
        grid = _conv_grid(B, T, D, group, CONV_BACKWARD_BLOCK_T)
        dweight = x.new_empty(D, K, B * grid[0], dtype=torch.float32)
        dx = torch.empty_like(x)
        with _on_device(x):
            _short_conv_backward_kernel[grid](
                x, state, positions, weight, dy, dpre, dweight, T, D, group, L2_EPS, K=K, BT=CONV_BACKWARD_BLOCK_T,
                BD=_next_power_of_2(group), HAS_STATE=state is not None, HAS_POSITIONS=positions is not None,
                NORMALIZE=ctx.l2_head_size is not None, num_warps=NUM_WARPS)
            _short_conv_input_grad_kernel[_conv_grid(B, T, D, CONV_BLOCK_D)](
                dpre, positions, weight, dx, T, D, K=K, BT=CONV_BLOCK_T, BD=CONV_BLOCK_D,
                HAS_POSITIONS=positions is not None, num_warps=NUM_WARPS)
        dstate = None
        if state is not None and ctx.needs_input_grad[2]:
            # The state's inputs sit at t = j - (K - 1), read by the outputs t + reach that exist.
            dstate = torch.zeros_like(state, dtype=torch.float32)
            for j in range(K - 1):
                for i in range(j + 1):  # output t = j - i >= 0 reads state slot j through tap i
                    if j - i < T:
                        dstate[:, :, j] += weight[:, i].float() * dpre[:, j - i]
            dstate = dstate.to(state.dtype)
        return dx, dweight.sum(-1).to(weight.dtype).view(D, 1, K), dstate, None, None, None


def short_convolution(x, weight, state=None, positions=None, l2_head_size=None, update_state=False):
    """silu(causal depthwise convolution) of x [B, T, D] with taps weight [D, 1, K], fp32 inside,
    in x's dtype. `state` [B, D, K - 1]: the inputs before x (zeros if None). `positions` [B, T]:
    each token's index in its own packed sequence, so no window crosses a sequence's start.
    `l2_head_size`: then each head of that many channels is L2-normalised after the SiLU,
    y / sqrt(||y||^2 + 1e-6), without keeping the unnormalised output for the backward.
    `update_state`: `state` then becomes the state after x, its last K - 1 inputs, in place (a
    cache's state, without gradients: a generation step's `torch.cat` and copy are kernels too)."""
    B, T, D = x.shape
    if weight.dim() != 3 or weight.shape[:2] != (D, 1):
        raise ValueError(f"weight must be [D={D}, 1, K], got {tuple(weight.shape)}")
    K = weight.shape[-1]
    if state is not None:
        if state.shape != (B, D, K - 1):
            raise ValueError(f"state must be [B, D, K - 1] = {(B, D, K - 1)}, got {tuple(state.shape)}")
        if not update_state:
            state = state.to(x.dtype).contiguous()
        elif state.dtype != x.dtype or not state.is_contiguous():
            raise ValueError(f"a state updated in place must be contiguous and of x's dtype {x.dtype}, "
                             f"got {state.dtype}{'' if state.is_contiguous() else ', not contiguous'}")
    if update_state:
        if state is None:
            raise ValueError("update_state needs a state to update")
        if K - 1 > CONV_BLOCK_T:  # only the first time tile's programs may read the state
            raise ValueError(f"update_state takes kernels of at most {CONV_BLOCK_T + 1} taps, got {K}")
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or state.requires_grad):
            raise ValueError("update_state overwrites the state that the backward would read: use it without "
                             "gradients")
    if positions is not None:
        if positions.shape != (B, T):
            raise ValueError(f"positions must be [B, T] = {(B, T)}, got {tuple(positions.shape)}")
        positions = positions.contiguous()
    if l2_head_size is not None and not (0 < l2_head_size <= MAX_L2_HEAD_SIZE and D % l2_head_size == 0):
        raise ValueError(f"l2_head_size must divide D = {D} and be at most {MAX_L2_HEAD_SIZE}, got {l2_head_size}")
    return _ShortConvolution.apply(x, weight, state, positions, l2_head_size, update_state)
