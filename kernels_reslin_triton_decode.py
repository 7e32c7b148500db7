"""A generation step's linear attention in Triton: the one-token decode step of every rule
(DESIGN.md section 1), advancing the fp32 states S and R in place, from its inputs (`decode_step`,
behind `reslin_decode_step`) or from the layer's projections (`projected_decode_step`, the model's
fused step).

A program owns one (sequence, value head) pair and a tile of BV value columns with all Dk key
rows: every quantity of the step (the reads S^T k and S^T q, the clip, both writes) is
column-separable, so the tiles never talk to each other and each state element is read and
written exactly once. `projected_decode_step` forms the step's inputs in that program (the L2
norms of whole q and k heads, the gates, KLA's step) from the in-projection's output, whose short
convolutions its GEMV applied (kernels_reslin_triton_gemv): at one token a step is bound by its
launches, not its bytes, and the torch code takes three convolution kernels, a gates kernel and
KLA's four small ops for them.
"""

import torch

try:
    from .kernels_reslin_triton_launch import (_cdiv, _Launcher, _next_power_of_2, _on_inputs_device,
                                               _wait_for_previous_kernel, programmatic_launch, tl, triton)
    from .kernels_reslin_triton_layers import L2_EPS, MAX_L2_HEAD_SIZE
except ImportError:
    from kernels_reslin_triton_launch import (_cdiv, _Launcher, _next_power_of_2, _on_inputs_device,
                                              _wait_for_previous_kernel, programmatic_launch, tl, triton)
    from kernels_reslin_triton_layers import L2_EPS, MAX_L2_HEAD_SIZE

# Warps a decode program: a state tile of 128 x 32 fp32 is 32 registers a thread on 4 warps. With
# R beside S ptxas spills 148-204 bytes there (tools/compile_for_gpu.py --registers) and nothing on
# 8, yet 8 warps took the residual rules' step up to 2.9 us longer a layer and gained gdn ~0.05
# (bench_decode, benchmarks/README.md).
DECODE_WARPS = 4


@_Launcher
@triton.jit
def _projected_decode_step_kernel(projected_ptr, A_log_ptr, dt_bias_ptr, S_ptr, R_ptr, o_ptr, row_stride, scale,
                                  clip, l2_eps, kaczmarz_eps, H, HV, GROUP, DK, DV,
                                  BK: tl.constexpr, BV: tl.constexpr, DELTA: tl.constexpr, RESIDUAL: tl.constexpr,
                                  KACZMARZ: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr):
    """`_decode_step_kernel`'s program on one token's projections as the in-projection with its
    short convolutions leaves them (`projected_decode_step`), forming the step's inputs itself.
    PRELOAD (under PDL): the state tiles are loaded before the wait for the previous kernel, which
    then must not be what wrote them."""
    seq_head = tl.program_id(0)                    # n * HV + value head
    head = seq_head % HV
    key_head = head // GROUP
    row = projected_ptr + (seq_head // HV).to(tl.int64) * row_stride  # q | k | v | a | b | c | ...
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BK)
    row_ok, col_ok = rows < DK, cols < DV
    if PRELOAD:
        S, R, state_offsets, state_ok = _state_tiles(S_ptr, R_ptr, seq_head, rows, cols, row_ok, col_ok, DK, DV,
                                                     RESIDUAL)
    _wait_for_previous_kernel(PDL)
    if not PRELOAD:
        S, R, state_offsets, state_ok = _state_tiles(S_ptr, R_ptr, seq_head, rows, cols, row_ok, col_ok, DK, DV,
                                                     RESIDUAL)

    q = tl.load(row + key_head * DK + rows, mask=row_ok, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + l2_eps)
    k = tl.load(row + (H + key_head) * DK + rows, mask=row_ok, other=0.0).to(tl.float32)
    if not KACZMARZ:
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + l2_eps)
    v = tl.load(row + 2 * H * DK + head * DV + cols, mask=col_ok, other=0.0).to(tl.float32)
    gate_inputs = row + 2 * H * DK + HV * DV + head
    x = tl.load(gate_inputs).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
    # softplus as torch computes it (threshold 20), written so that exp never overflows.
    softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))
    decay = tl.exp(-tl.exp(tl.load(A_log_ptr + head).to(tl.float32)) * softplus)
    beta = tl.sigmoid(tl.load(gate_inputs + HV).to(tl.float32))
    gamma = beta  # unused without RESIDUAL
    gamma_write = beta
    if RESIDUAL:
        gamma = tl.sigmoid(tl.load(gate_inputs + 2 * HV).to(tl.float32))
        gamma_write = gamma
    if KACZMARZ:
        denominator = tl.sum(k * k, axis=0) + kaczmarz_eps  # of k as stored, in the projection's dtype
        beta = beta / denominator
        gamma_write = gamma_write / denominator
    o = _advance_states(q, k, v, decay, beta, gamma, gamma_write, S, R, S_ptr, R_ptr, state_offsets, state_ok, clip,
                        DELTA, RESIDUAL)
    tl.store(o_ptr + seq_head * DV + cols, (scale * o).to(o_ptr.dtype.element_ty), mask=col_ok)


@_on_inputs_device
def projected_decode_step(projected, A_log, dt_bias, S, R, *, num_heads, head_dim, num_v_heads, head_v_dim, update,
                          clip, kaczmarz, kaczmarz_eps, states_just_written=True):
    """One token of a linear attention layer from its projections, advancing S and R in place:
    `decode_step` with its inputs formed here, as ResLinLinearAttention forms them.

    `projected` [B, 1, P] (unit column stride): q (H*Dk) | k (H*Dk) | v (HV*Dv) after their short
    convolutions (`rms_norm_linear` with `convolutions`), then the gates' raw a (HV) | b (HV) | c
    (HV, only with R), any columns after them (the output gate) not read. q, and k unless
    `kaczmarz`, are L2-normalised per head in fp32, y / sqrt(||y||^2 + 1e-6) (from the convolution
    rounded to projected's dtype, where the layer's torch code rounds after the norm); g =
    -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), gamma = sigmoid(c); with `kaczmarz`
    beta and the residual write divided by ||k||^2 + kaczmarz_eps. S, R [B, HV, Dk, Dv] fp32
    contiguous (R None without the residual state). Returns o [B, 1, HV, Dv] in projected's dtype,
    scaled by Dk ** -0.5. No gradients: the states are overwritten.

    `states_just_written`: whether the kernel launched just before on this stream may have written S
    or R. Where it did not (the model's step: its in-projection), pass False, and under
    programmatic dependent launch the state tiles load while that kernel still runs."""
    H, Dk, HV, Dv = num_heads, head_dim, num_v_heads, head_v_dim
    B = _check_projected(projected, A_log, dt_bias, S, R, H, Dk, HV, Dv)
    o = projected.new_empty(B, 1, HV, Dv)
    BK, BV = _state_tile(Dk, Dv)
    residual = R is not None
    pdl = programmatic_launch(projected)
    _projected_decode_step_kernel[(B * HV, _cdiv(Dv, BV))](
        projected, A_log, dt_bias, S, R if residual else S, o, projected.stride(0), Dk ** -0.5, float(clip), L2_EPS,
        float(kaczmarz_eps), H, HV, HV // H, Dk, Dv, BK=BK, BV=BV, DELTA=update == "delta", RESIDUAL=residual,
        KACZMARZ=kaczmarz, PRELOAD=pdl["PDL"] and not states_just_written, **pdl, num_warps=DECODE_WARPS)
    return o


def _check_projected(projected, A_log, dt_bias, S, R, H, Dk, HV, Dv):
    """ValueErrors naming the argument at fault, from shapes, dtypes and devices alone (no sync).
    Returns B."""
    for name, size in (("num_heads", H), ("head_dim", Dk), ("num_v_heads", HV), ("head_v_dim", Dv)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    if HV % H:
        raise ValueError(f"num_v_heads ({HV}) must be a multiple of num_heads ({H})")
    if max(Dk, Dv) > MAX_L2_HEAD_SIZE:
        raise ValueError(f"head_dim and head_v_dim must be at most {MAX_L2_HEAD_SIZE}, got {Dk} and {Dv}")
    read = 2 * H * Dk + HV * Dv + (3 if R is not None else 2) * HV
    if (projected.dim() != 3 or projected.shape[1] != 1 or projected.shape[2] < read
            or projected.stride(2) != 1 or not projected.is_floating_point()):
        raise ValueError(f"projected must be a float [B, 1, P >= {read}] with unit column stride (q | k | v | a | b"
                         f"{' | c' if R is not None else ''} side by side), got {projected.dtype} "
                         f"{tuple(projected.shape)} strides {projected.stride()}")
    if torch.is_grad_enabled() and projected.requires_grad:
        raise ValueError("projected_decode_step overwrites the states and keeps no graph: call it without gradients")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x.shape != (HV,) or not x.is_floating_point() or x.device != projected.device:
            raise ValueError(f"{name} must be a float [{HV}] on {projected.device}, got {x.dtype} {tuple(x.shape)} on "
                             f"{x.device}")
    B = projected.shape[0]
    for name, x in (("S", S), ("R", R)):
        if x is not None and (x.shape != (B, HV, Dk, Dv) or x.dtype != torch.float32 or not x.is_contiguous()
                              or x.device != projected.device):
            raise ValueError(f"{name} must be a contiguous fp32 [{B}, {HV}, {Dk}, {Dv}] on {projected.device}, got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
    return B


def _state_tile(Dk, Dv):
    """(BK, BV) of a decode program: all Dk key rows, and enough programs to fill the GPU at small
    batches with state tiles of <= 4K fp32 a program."""
    BK = _next_power_of_2(Dk)
    return BK, min(_next_power_of_2(Dv), max(16, 4096 // BK))


@_Launcher
@triton.jit
def _decode_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, gamma_ptr, gamma_write_ptr,
                        S_ptr, R_ptr, o_ptr, scale, clip, HV, GROUP, DK, DV,
                        BK: tl.constexpr, BV: tl.constexpr,
                        DELTA: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    _wait_for_previous_kernel(PDL)
    seq_head = tl.program_id(0)                    # n * HV + value head
    key_row = seq_head // GROUP                    # n * H + key head (q and k have H = HV / GROUP)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BK)
    row_ok, col_ok = rows < DK, cols < DV

    q = tl.load(q_ptr + key_row * DK + rows, mask=row_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + key_row * DK + rows, mask=row_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + seq_head * DV + cols, mask=col_ok, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + seq_head).to(tl.float32))
    beta = tl.load(beta_ptr + seq_head).to(tl.float32)
    gamma = beta  # unused without RESIDUAL
    gamma_write = beta
    if RESIDUAL:
        gamma = tl.load(gamma_ptr + seq_head).to(tl.float32)
        gamma_write = tl.load(gamma_write_ptr + seq_head).to(tl.float32)
    S, R, state_offsets, state_ok = _state_tiles(S_ptr, R_ptr, seq_head, rows, cols, row_ok, col_ok, DK, DV, RESIDUAL)
    o = _advance_states(q, k, v, decay, beta, gamma, gamma_write, S, R, S_ptr, R_ptr, state_offsets, state_ok, clip,
                        DELTA, RESIDUAL)
    tl.store(o_ptr + seq_head * DV + cols, (scale * o).to(o_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _state_tiles(S_ptr, R_ptr, seq_head, rows, cols, row_ok, col_ok, DK, DV, RESIDUAL: tl.constexpr):
    """(S, R, their offsets, their mask): the state tile [Dk rows, cols] of one (sequence, value
    head) pair, in fp32 (R is S's again without RESIDUAL, unused)."""
    state_ok = row_ok[:, None] & col_ok[None, :]
    state_offsets = seq_head.to(tl.int64) * DK * DV + rows[:, None] * DV + cols[None, :]
    S = tl.load(S_ptr + state_offsets, mask=state_ok, other=0.0)
    R = S
    if RESIDUAL:
        R = tl.load(R_ptr + state_offsets, mask=state_ok, other=0.0)
    return S, R, state_offsets, state_ok


@triton.jit
def _advance_states(q, k, v, decay, beta, gamma, gamma_write, S, R, S_ptr, R_ptr, state_offsets, state_ok, clip,
                    DELTA: tl.constexpr, RESIDUAL: tl.constexpr):
    """One token of every rule (DESIGN.md section 1) on the state tiles S and R (`_state_tiles`) of
    one (sequence, value head) pair, in fp32: S (and R) advanced in place; returns the tile's
    output columns, unscaled."""
    if RESIDUAL:
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
    return o


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
    BK, BV = _state_tile(Dk, Dv)
    grid = (N * HV, _cdiv(Dv, BV))
    _decode_step_kernel[grid](
        q, k, v, g, beta, gamma if residual else g, gamma_write if residual else g,
        S, R if residual else S, o, scale, clip, HV, HV // H, Dk, Dv,
        BK=BK, BV=BV, DELTA=update == "delta", RESIDUAL=residual, **programmatic_launch(q), num_warps=DECODE_WARPS,
    )
    return o
