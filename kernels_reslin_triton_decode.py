"""The one-token decode step of every rule (DESIGN.md section 1) as one Triton kernel, advancing
the fp32 states S and R in place.

A program owns one (sequence, value head) pair and a tile of BV value columns with all Dk key
rows: every quantity of the step (the reads S^T k and S^T q, the clip, both writes) is
column-separable, so the tiles never talk to each other and each state element is read and
written exactly once.
"""

import torch

try:
    from .kernels_reslin_triton_launch import _cdiv, _Launcher, _next_power_of_2, _on_inputs_device, tl, triton
except ImportError:
    from kernels_reslin_triton_launch import _cdiv, _Launcher, _next_power_of_2, _on_inputs_device, tl, triton


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
