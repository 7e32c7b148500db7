"""Triton kernels of ResLin.

``decode_step``: one token of every rule (DESIGN.md section 1), advancing the fp32 states S and
R in place. A program owns one (sequence, value head) pair and a tile of BV value columns with
all Dk key rows: every quantity of the step (the reads S^T k and S^T q, the clip, both writes)
is column-separable, so the tiles never talk to each other and each state element is read and
written exactly once.
"""

try:
    import triton
    import triton.language as tl
except ImportError:  # kernels_reslin falls back to the "torch" backend without Triton
    raise

import torch


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
    BK = triton.next_power_of_2(Dk)
    # Enough programs to fill the GPU at small batches, and state tiles of <= 4K fp32 a program.
    BV = min(triton.next_power_of_2(Dv), max(16, 4096 // BK))
    grid = (N * HV, triton.cdiv(Dv, BV))
    _decode_step_kernel[grid](
        q, k, v, g, beta, gamma if residual else g, gamma_write if residual else g,
        S, R if residual else S, o, scale, clip, HV, HV // H, Dk, Dv,
        BK=BK, BV=BV, DELTA=update == "delta", RESIDUAL=residual,
    )
    return o


# ---------------------------------------------------------------------------------------------
# Chunked forward (DESIGN.md section 1, "Chunked form"), two kernels a pass:
#   _chunk_write_kernel, all chunks at once: the WY terms U0 = T^-1 B V and W = T^-1 B diag(e^G) K,
#       T = I + B (A^- * K K^T) (delta rule; the additive rule writes U0 = B V, W = 0);
#   _chunk_scan_kernel, one program per (sequence, value head, value tile), chunk after chunk:
#       U = U0 - W S, the outputs, pred = S_{t-1}^T k_t when asked, and the state update.
# Tokens of every sequence are laid out one after another ([total tokens, heads, dim]); a chunk
# never straddles two sequences, and the rows of a short tail chunk load as zeros (g = 0,
# strength = 0, k = 0), which neither decays nor writes any state.
# ---------------------------------------------------------------------------------------------

@triton.jit
def _chunk_write_kernel(k_ptr, v_ptr, g_ptr, strength_ptr, chunk_start_ptr, chunk_end_ptr, U0_ptr, W_ptr,
                        HV, GROUP, DK, DV, BC: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
                        DELTA: tl.constexpr):
    chunk, head = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(chunk_start_ptr + chunk), tl.load(chunk_end_ptr + chunk)
    rows, kcols, vcols = tl.arange(0, BC), tl.arange(0, BK), tl.arange(0, BVF)
    tokens = (start + rows).to(tl.int64)
    row_ok = start + rows < end
    g = tl.load(g_ptr + tokens * HV + head, mask=row_ok, other=0.0).to(tl.float32)
    strength = tl.load(strength_ptr + tokens * HV + head, mask=row_ok, other=0.0).to(tl.float32)
    k_rows = (tokens * (HV // GROUP) + head // GROUP) * DK
    k = tl.load(k_ptr + k_rows[:, None] + kcols[None, :], mask=row_ok[:, None] & (kcols < DK)[None, :],
                other=0.0).to(tl.float32)
    v = tl.load(v_ptr + (tokens * HV + head)[:, None] * DV + vcols[None, :],
                mask=row_ok[:, None] & (vcols < DV)[None, :], other=0.0).to(tl.float32)
    G = tl.cumsum(g, axis=0)
    U = strength[:, None] * v
    out_rows = (tokens * HV + head)
    if DELTA:
        W = (strength * tl.exp(G))[:, None] * k
        below = rows[:, None] > rows[None, :]
        decay = tl.exp(tl.where(below, G[:, None] - G[None, :], float("-inf")))
        A = strength[:, None] * decay * tl.dot(k, tl.trans(k), input_precision="ieee")
        # Forward substitution, row by row: X_i = RHS_i - sum_{j<i} A_ij X_j, rows j < i final.
        for i in range(1, BC):
            a_row = tl.sum(tl.where(rows[:, None] == i, A, 0.0), axis=0)
            this_row = (rows == i)[:, None]
            U = tl.where(this_row, U - tl.sum(a_row[:, None] * U, axis=0)[None, :], U)
            W = tl.where(this_row, W - tl.sum(a_row[:, None] * W, axis=0)[None, :], W)
        tl.store(W_ptr + out_rows[:, None] * DK + kcols[None, :], W,
                 mask=row_ok[:, None] & (kcols < DK)[None, :])
    tl.store(U0_ptr + out_rows[:, None] * DV + vcols[None, :], U, mask=row_ok[:, None] & (vcols < DV)[None, :])


@triton.jit
def _chunk_scan_kernel(q_ptr, k_ptr, g_ptr, U0_ptr, W_ptr, state_ptr, cu_seqlens_ptr, o_ptr, pred_ptr,
                       scale, HV, GROUP, DK, DV, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       DELTA: tl.constexpr, EXCLUSIVE: tl.constexpr):
    value_tile, seq_head = tl.program_id(0), tl.program_id(1)
    seq, head = seq_head // HV, seq_head % HV
    bos, eos = tl.load(cu_seqlens_ptr + seq), tl.load(cu_seqlens_ptr + seq + 1)
    rows, kcols = tl.arange(0, BC), tl.arange(0, BK)
    vcols = value_tile * BV + tl.arange(0, BV)
    kcol_ok, vcol_ok = kcols < DK, vcols < DV
    state_offsets = seq_head.to(tl.int64) * DK * DV + kcols[:, None] * DV + vcols[None, :]
    state_ok = kcol_ok[:, None] & vcol_ok[None, :]
    S = tl.load(state_ptr + state_offsets, mask=state_ok, other=0.0)
    inclusive = rows[:, None] >= rows[None, :]
    strictly_below = rows[:, None] > rows[None, :]
    for start in range(bos, eos, BC):
        tokens = (start + rows).to(tl.int64)
        row_ok = start + rows < eos
        k_rows = (tokens * (HV // GROUP) + head // GROUP) * DK
        kq_ok = row_ok[:, None] & kcol_ok[None, :]
        q = scale * tl.load(q_ptr + k_rows[:, None] + kcols[None, :], mask=kq_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + k_rows[:, None] + kcols[None, :], mask=kq_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + tokens * HV + head, mask=row_ok, other=0.0).to(tl.float32)
        out_rows = tokens * HV + head
        uv_ok = row_ok[:, None] & vcol_ok[None, :]
        U = tl.load(U0_ptr + out_rows[:, None] * DV + vcols[None, :], mask=uv_ok, other=0.0)
        if DELTA:
            W = tl.load(W_ptr + out_rows[:, None] * DK + kcols[None, :], mask=kq_ok, other=0.0)
            U = U - tl.dot(W, S, input_precision="ieee")
        G = tl.cumsum(g, axis=0)
        read_mask = strictly_below if EXCLUSIVE else inclusive
        attend = tl.exp(tl.where(read_mask, G[:, None] - G[None, :], float("-inf")))
        attend = attend * tl.dot(q, tl.trans(k), input_precision="ieee")
        o = tl.dot(tl.exp(G)[:, None] * q, S, input_precision="ieee") + tl.dot(attend, U, input_precision="ieee")
        tl.store(o_ptr + out_rows[:, None] * DV + vcols[None, :], o, mask=uv_ok)
        if EXCLUSIVE:
            # pred_t = S_{t-1}^T k_t: decay exp(G_{t-1} - G_j), computed directly, never divided by a_t.
            G_prev = G - g
            pred_attend = tl.exp(tl.where(strictly_below, G_prev[:, None] - G[None, :], float("-inf")))
            pred_attend = pred_attend * tl.dot(k, tl.trans(k), input_precision="ieee")
            pred = tl.dot(tl.exp(G_prev)[:, None] * k, S, input_precision="ieee")
            pred = pred + tl.dot(pred_attend, U, input_precision="ieee")
            tl.store(pred_ptr + out_rows[:, None] * DV + vcols[None, :], pred, mask=uv_ok)
        G_last = tl.sum(g, axis=0)  # padded rows add 0: the last real token's cumulative decay
        k_out = tl.exp(G_last - G)[:, None] * k
        S = tl.exp(G_last) * S + tl.dot(tl.trans(k_out), U, input_precision="ieee")
    tl.store(state_ptr + state_offsets, S, mask=state_ok)


CHUNK_SIZE = 64


def _chunk_pass(q, k, v, g, strength, state, cu_seqlens, chunk_table, update, scale, exclusive, chunk_size):
    """One state's pass over packed tokens. q, k [L, H, Dk]; v [L, HV, Dv]; g, strength [L, HV];
    state [N, HV, Dk, Dv] fp32, advanced in place. Returns o (and pred) [L, HV, Dv] fp32."""
    L, H, Dk = q.shape
    HV, Dv = v.shape[1:]
    delta = update == "delta"
    chunk_starts, chunk_ends = chunk_table
    U0 = torch.empty(L, HV, Dv, device=q.device, dtype=torch.float32)
    W = torch.empty(L, HV, Dk, device=q.device, dtype=torch.float32) if delta else U0
    BK, BVF = max(16, triton.next_power_of_2(Dk)), max(16, triton.next_power_of_2(Dv))
    _chunk_write_kernel[(len(chunk_starts), HV)](
        k, v, g, strength, chunk_starts, chunk_ends, U0, W, HV, HV // H, Dk, Dv,
        BC=chunk_size, BK=BK, BVF=BVF, DELTA=delta)
    o = torch.empty(L, HV, Dv, device=q.device, dtype=torch.float32)
    pred = torch.empty_like(o) if exclusive else o
    BV = min(BVF, 32)
    _chunk_scan_kernel[(triton.cdiv(Dv, BV), state.shape[0] * HV)](
        q, k, g, U0, W, state, cu_seqlens, o, pred, scale, HV, HV // H, Dk, Dv,
        BC=chunk_size, BK=BK, BV=BV, DELTA=delta, EXCLUSIVE=exclusive)
    return o, (pred if exclusive else None)


def chunk_forward(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens,
                  chunk_size=CHUNK_SIZE):
    """Forward of every rule over [B, T] or packed (cu_seqlens) sequences, the same contract as
    kernels_reslin_torch.chunk_reslin: returns (o in v's dtype, S, R) with fp32 states."""
    B, T, H, Dk = q.shape
    HV, Dv = v.shape[2:]
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, B + 1, device=q.device, dtype=torch.int64) * T
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int64)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    chunks = (lengths + chunk_size - 1) // chunk_size
    sequence_of_chunk = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), chunks)
    first_chunk = torch.cumsum(chunks, 0) - chunks
    index_in_sequence = torch.arange(len(sequence_of_chunk), device=q.device) - first_chunk[sequence_of_chunk]
    chunk_table = (cu_seqlens[sequence_of_chunk] + index_in_sequence * chunk_size, cu_seqlens[1:][sequence_of_chunk])

    flat = lambda x: None if x is None else x.reshape(B * T, *x.shape[2:]).contiguous()  # noqa: E731
    q, k, v, g, beta, gamma, gamma_write = map(flat, (q, k, v, g, beta, gamma, gamma_write))
    S = S0.clone(memory_format=torch.contiguous_format)
    run = lambda values, strength, state, exclusive: _chunk_pass(  # noqa: E731
        q, k, values, g, strength, state, cu_seqlens, chunk_table, update, scale, exclusive, chunk_size)
    if gamma is None:
        o, _ = run(v, beta, S, exclusive=False)
        return o.reshape(B, T, HV, Dv).to(v.dtype), S, None
    base_read, pred = run(v, beta, S, exclusive=True)
    residual = (v.float() - pred).clamp(-clip, clip)
    R = R0.clone(memory_format=torch.contiguous_format)
    residual_read, _ = run(residual, gamma_write, R, exclusive=False)
    o = base_read + gamma.float()[..., None] * residual_read
    return o.reshape(B, T, HV, Dv).to(v.dtype), S, R
