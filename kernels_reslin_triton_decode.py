"""A generation step's linear attention in Triton: the step's inputs formed from the
in-projection's output row (`decode_inputs`), then the one-token decode step of every rule
(DESIGN.md section 1, `decode_step`), advancing the fp32 states S and R in place.

`decode_inputs` is one launch for what the layer's torch code (ResLinLinearAttention with
ResLinShortConvolution) does in three convolution kernels, a gates kernel and KLA's four small
ops: at one token a step is bound by its launches, not its bytes.

`decode_step`: a program owns one (sequence, value head) pair and a tile of BV value columns with
all Dk key rows: every quantity of the step (the reads S^T k and S^T q, the clip, both writes) is
column-separable, so the tiles never talk to each other and each state element is read and
written exactly once.
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


# ---------------------------------------------------------------------------------------------
# The step's inputs: q, k and v through their short convolutions (q, and k unless KLA, then
# L2-normalised per head), the gates, and KLA's step 1 / (||k||^2 + eps)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _convolve_token(x_ptr, weight_ptr, state_ptr, y_ptr, width, l2_eps,
                    K: tl.constexpr, BLOCK: tl.constexpr, BS: tl.constexpr, NORMALIZE: tl.constexpr):
    """One token's `width` channels, each pointer at the first of them: y = silu(the taps
    [width, K] times the window [state, x]), in fp32 as ResLinShortConvolution's fused kernel
    sums it, L2-normalised over the channels with NORMALIZE, stored in y's dtype and returned in
    fp32. The state [width, K - 1] then moves along by one input, to [state[:, 1:], x]."""
    lanes = tl.arange(0, BLOCK)
    ok = lanes < width
    newest = tl.load(x_ptr + lanes, mask=ok, other=0.0)
    pre = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(K):
        if i < K - 1:
            window = tl.load(state_ptr + lanes * (K - 1) + i, mask=ok, other=0.0)
        else:
            window = newest
        pre += window.to(tl.float32) * tl.load(weight_ptr + lanes * K + i, mask=ok, other=0.0).to(tl.float32)
    y = pre * tl.sigmoid(pre)
    if NORMALIZE:  # masked channels are zero
        y = y / tl.sqrt(tl.sum(y * y, axis=0) + l2_eps)
    tl.store(y_ptr + lanes, y.to(y_ptr.dtype.element_ty), mask=ok)

    slots = tl.arange(0, BS)
    source = slots + 1  # slot j of the new state holds input j + 1 of the window
    slot_ok = ok[:, None] & (slots < K - 1)[None, :]
    offsets = lanes[:, None] * (K - 1) + slots[None, :]
    shifted = tl.load(state_ptr + offsets + 1, mask=slot_ok & (source < K - 1)[None, :], other=0.0)
    shifted = tl.where((source == K - 1)[None, :], newest[:, None], shifted)
    tl.debug_barrier()  # every read of the old state in this program before the first write
    tl.store(state_ptr + offsets, shifted, mask=slot_ok)
    return y


@_Launcher
@triton.jit
def _decode_inputs_kernel(projected_ptr, q_weight_ptr, k_weight_ptr, v_weight_ptr,
                          q_state_ptr, k_state_ptr, v_state_ptr, A_log_ptr, dt_bias_ptr,
                          q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, gamma_ptr, gamma_write_ptr,
                          row_stride, H, HV, GROUP, DK, DV, l2_eps, kaczmarz_eps,
                          K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BG: tl.constexpr,
                          BS: tl.constexpr, RESIDUAL: tl.constexpr, KACZMARZ: tl.constexpr, PDL: tl.constexpr):
    """Program (unit, b) owns row b's unit: a q head (unit < H), a k head with the gates of its
    GROUP value heads (H <= unit < 2H: KLA's step needs that head's ||k||^2), or a v head. So
    each channel's convolution state is read and written by its one program."""
    _wait_for_previous_kernel(PDL)
    unit, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    row = projected_ptr + b * row_stride  # columns q | k | v | a | b | c
    if unit < H:
        channel = unit * DK
        _convolve_token(row + channel, q_weight_ptr + channel * K, q_state_ptr + (b * H * DK + channel) * (K - 1),
                        q_ptr + b * H * DK + channel, DK, l2_eps, K, BK, BS, True)
    elif unit < 2 * H:
        head = unit - H
        channel = head * DK
        k = _convolve_token(row + H * DK + channel, k_weight_ptr + channel * K,
                            k_state_ptr + (b * H * DK + channel) * (K - 1), k_ptr + b * H * DK + channel, DK, l2_eps,
                            K, BK, BS, not KACZMARZ)
        # The gates of the GROUP value heads this key head serves, in fp32.
        members = tl.arange(0, BG)
        member_ok = members < GROUP
        heads = head * GROUP + members
        gate_inputs = row + 2 * H * DK + HV * DV + heads
        x = tl.load(gate_inputs, mask=member_ok, other=0.0).to(tl.float32) + \
            tl.load(dt_bias_ptr + heads, mask=member_ok, other=0.0).to(tl.float32)
        # softplus as torch computes it (threshold 20), written so that exp never overflows.
        softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))
        rate = tl.exp(tl.load(A_log_ptr + heads, mask=member_ok, other=0.0).to(tl.float32))
        outputs = b * HV + heads
        tl.store(g_ptr + outputs, -rate * softplus, mask=member_ok)
        beta = tl.sigmoid(tl.load(gate_inputs + HV, mask=member_ok, other=0.0).to(tl.float32))
        if KACZMARZ:
            # ||k||^2 of k as the decode kernel will read it: rounded to its dtype (the torch code
            # takes the norm of the stored k too).
            stored = k.to(k_ptr.dtype.element_ty).to(tl.float32)
            denominator = tl.sum(stored * stored, axis=0) + kaczmarz_eps
            beta = beta / denominator
        tl.store(beta_ptr + outputs, beta, mask=member_ok)
        if RESIDUAL:
            gamma = tl.sigmoid(tl.load(gate_inputs + 2 * HV, mask=member_ok, other=0.0).to(tl.float32))
            tl.store(gamma_ptr + outputs, gamma, mask=member_ok)
            if KACZMARZ:
                tl.store(gamma_write_ptr + outputs, gamma / denominator, mask=member_ok)
    else:
        channel = (unit - 2 * H) * DV
        _convolve_token(row + 2 * H * DK + channel, v_weight_ptr + channel * K,
                        v_state_ptr + (b * HV * DV + channel) * (K - 1), v_ptr + b * HV * DV + channel, DV, l2_eps,
                        K, BV, BS, False)


def decode_inputs_launch(head_dim, head_v_dim, group, conv_size):
    """The constexpr blocks and warps of `_decode_inputs_kernel`: one warp a program up to heads
    of 128 (its L2 norm then a reduction within the warp), two past it."""
    BK, BV = _next_power_of_2(head_dim), _next_power_of_2(head_v_dim)
    blocks = dict(K=conv_size, BK=BK, BV=BV, BG=_next_power_of_2(group), BS=_next_power_of_2(conv_size - 1))
    return blocks, max(1, max(BK, BV) // 128)


@_on_inputs_device
def decode_inputs(projected, conv_weights, conv_states, A_log, dt_bias, *, num_heads, head_dim, num_v_heads,
                  head_v_dim, residual, kaczmarz, kaczmarz_eps):
    """A generation step's decode inputs from the in-projection's output, in one launch.

    `projected` [B, 1, P] (unit column stride): one token's projections side by side, q (H*Dk) |
    k (H*Dk) | v (HV*Dv) | a (HV) | b (HV) | c (HV, only with `residual`), any columns after them
    (the output gate) not read. `conv_weights` (q, k, v) [D, 1, K] the short convolutions' taps;
    `conv_states` (q, k, v) [B, D, K - 1] contiguous in projected's dtype, the K - 1 inputs before
    this token (oldest first), moved along by this token in place.

    As ResLinLinearAttention computes them: silu(convolution) of q, k and v, summed in fp32;
    q, and k unless `kaczmarz`, L2-normalised per head, y / sqrt(||y||^2 + 1e-6); g =
    -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), gamma = sigmoid(c) in fp32; with
    `kaczmarz` beta and gamma_write = gamma divided by ||k||^2 + kaczmarz_eps of their key head's
    k (as returned, in projected's dtype), else gamma_write is gamma itself.

    Returns (q, k [B, 1, H, Dk], v [B, 1, HV, Dv] in projected's dtype; g, beta [B, 1, HV] fp32;
    gamma, gamma_write [B, 1, HV] fp32, or None without `residual`). No gradients: the states are
    overwritten."""
    H, Dk, HV, Dv = num_heads, head_dim, num_v_heads, head_v_dim
    B, K = _check_decode_inputs(projected, conv_weights, conv_states, A_log, dt_bias, H, Dk, HV, Dv, residual)
    q = projected.new_empty(B, 1, H, Dk)
    k = projected.new_empty(B, 1, H, Dk)
    v = projected.new_empty(B, 1, HV, Dv)
    g, beta = (torch.empty(B, 1, HV, device=projected.device, dtype=torch.float32) for _ in range(2))
    gamma = torch.empty_like(g) if residual else None
    gamma_write = torch.empty_like(g) if residual and kaczmarz else gamma
    blocks, warps = decode_inputs_launch(Dk, Dv, HV // H, K)
    _decode_inputs_kernel[(2 * H + HV, B)](
        projected, *conv_weights, *conv_states, A_log, dt_bias, q, k, v, g, beta, gamma,
        gamma_write if residual and kaczmarz else None, projected.stride(0), H, HV, HV // H, Dk, Dv, L2_EPS,
        float(kaczmarz_eps), **blocks, RESIDUAL=residual, KACZMARZ=kaczmarz, **programmatic_launch(projected),
        num_warps=warps)
    return q, k, v, g, beta, gamma, gamma_write


def _check_decode_inputs(projected, conv_weights, conv_states, A_log, dt_bias, H, Dk, HV, Dv, residual):
    """ValueErrors naming the argument at fault, from shapes, dtypes and devices alone (no sync).
    Returns (B, K)."""
    for name, size in (("num_heads", H), ("head_dim", Dk), ("num_v_heads", HV), ("head_v_dim", Dv)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    if HV % H:
        raise ValueError(f"num_v_heads ({HV}) must be a multiple of num_heads ({H})")
    if max(Dk, Dv) > MAX_L2_HEAD_SIZE:
        raise ValueError(f"head_dim and head_v_dim must be at most {MAX_L2_HEAD_SIZE}, got {Dk} and {Dv}")
    read = 2 * H * Dk + HV * Dv + (3 if residual else 2) * HV
    if (projected.dim() != 3 or projected.shape[1] != 1 or projected.shape[2] < read
            or projected.stride(2) != 1 or not projected.is_floating_point()):
        raise ValueError(f"projected must be a float [B, 1, P >= {read}] with unit column stride (q | k | v | a | b"
                         f"{' | c' if residual else ''} side by side), got {projected.dtype} "
                         f"{tuple(projected.shape)} strides {projected.stride()}")
    if torch.is_grad_enabled() and projected.requires_grad:
        raise ValueError("decode_inputs overwrites the convolution states and keeps no graph: call it without "
                         "gradients")
    B = projected.shape[0]
    if len(conv_weights) != 3 or len(conv_states) != 3:
        raise ValueError(f"conv_weights and conv_states must each be (q, k, v), got {len(conv_weights)} and "
                         f"{len(conv_states)} tensors")
    K = conv_weights[0].shape[-1] if conv_weights[0].dim() == 3 else 0
    if K < 2:
        raise ValueError(f"conv_weights must be [D, 1, K] with K >= 2, got q's {tuple(conv_weights[0].shape)}")
    for name, weight, state, D in zip("qkv", conv_weights, conv_states, (H * Dk, H * Dk, HV * Dv)):
        if weight.shape != (D, 1, K) or not weight.is_contiguous() or weight.device != projected.device:
            raise ValueError(f"conv_weights' {name} must be contiguous [{D}, 1, {K}] on {projected.device}, got "
                             f"{tuple(weight.shape)} on {weight.device}")
        if (state.shape != (B, D, K - 1) or state.dtype != projected.dtype or not state.is_contiguous()
                or state.device != projected.device):
            raise ValueError(f"conv_states' {name} must be contiguous [{B}, {D}, {K - 1}] {projected.dtype} on "
                             f"{projected.device}, got {tuple(state.shape)} {state.dtype} on {state.device}"
                             f"{'' if state.is_contiguous() else ', not contiguous'}")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x.shape != (HV,) or x.device != projected.device:
            raise ValueError(f"{name} must be [{HV}] on {projected.device}, got {tuple(x.shape)} on {x.device}")
    return B, K


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
        BK=BK, BV=BV, DELTA=update == "delta", RESIDUAL=residual, **programmatic_launch(q),
    )
    return o
