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
# Chunked forward (DESIGN.md section 1, "Chunked form"). The tokens of every sequence lie one
# after another ([L tokens, heads, dim]); chunks of BC tokens never straddle two sequences, and
# the rows of a short tail chunk load as zeros (g = 0, strength b = 0, k = 0), which neither
# decay nor write any state. One pass over a state is four kernels (two for the additive rule):
#   _chunk_inverse_kernel (delta rule), every chunk at once: T^-1 from 16 x 16 blocks,
#       T = I + strictly_lower(diag(b) e^(G_i - G_j) K K^T); few warps suit its small tiles;
#   _chunk_wy_kernel (delta rule), every chunk at once: the WY terms
#       W = T^-1 diag(b e^G) K and U0 = T^-1 diag(b) V, as full-chunk tensor-core dots;
#   _chunk_state_kernel, chunk after chunk for one (sequence, value head, value tile): stores the
#       chunk-start state h, the chunk's writes U = U0 - W h (the additive rule writes U = diag(b) V)
#       and moves on to S = e^(G_last) h + (e^(G_last - G) K)^T U;
#   _chunk_output_kernel, every chunk at once: o = e^G (Q h) + (mask(Q K^T) e^(G_i - G_j)) U.
# The residual rules run two passes. The base pass reads exclusively (a_t S_{t-1}^T q_t), forms
# pred_t = S_{t-1}^T k_t the same way and writes the clipped residual, the residual pass's values;
# the residual pass's output adds gamma times its own read to the base read.
# Precision: states, decays and the inverse's blocks in fp32 (merged with tf32 dots for bf16/fp16
# inputs); the large dots take their operands in the input dtype (bf16/fp16 tensor cores, fp32
# accumulation); everything is exact fp32 ("ieee") for fp32 inputs. T^-1, W, U0, U and h are
# stored in the input dtype.
# ---------------------------------------------------------------------------------------------

CHUNK_SIZE = 64
BLOCK = 16  # T^-1 is built from BLOCK x BLOCK blocks: CHUNK_SIZE = 4 * BLOCK

# What the output kernel writes: o; the base read and the residual; the base read plus gamma times o.
PLAIN, BASE, COMBINE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _mm(a, b, DT: tl.constexpr):
    """a @ b, fp32 accumulation, operands cast to DT (exact fp32 dots when DT is fp32)."""
    if DT == tl.float32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a.to(DT), b.to(DT))
    return out


@triton.jit
def _load_rows(ptr, rows, row_ok, head, heads, cols, width):
    """x[rows, head, cols] of a [tokens, heads, width] tensor, zero outside it."""
    offsets = (rows * heads + head)[:, None] * width + cols[None, :]
    return tl.load(ptr + offsets, mask=row_ok[:, None] & (cols < width)[None, :], other=0.0)


@triton.jit
def _store_rows(ptr, rows, row_ok, head, heads, cols, width, x):
    offsets = (rows * heads + head)[:, None] * width + cols[None, :]
    tl.store(ptr + offsets, x.to(ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < width)[None, :])


@triton.jit
def _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT,
                  BC: tl.constexpr, VARLEN: tl.constexpr):
    """A chunk's first token and the end of its sequence (int64 token indices)."""
    if VARLEN:
        seq = tl.load(chunk_seq_ptr + chunk)
        bos = tl.load(cu_seqlens_ptr + seq)
        eos = tl.load(cu_seqlens_ptr + seq + 1)
        first_chunk = tl.load(chunk_offsets_ptr + seq)
    else:  # B rows of T tokens, NT chunks each
        seq = chunk // NT
        bos = seq.to(tl.int64) * T
        eos = bos + T
        first_chunk = seq * NT
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
def _key_block(k_ptr, g_ptr, strength_ptr, first_row, end, head, HV, GROUP, DK, G_before,
               BLOCK: tl.constexpr, BK: tl.constexpr):
    """One BLOCK-row block of a chunk: its rows, keys, strength b and cumulative log decay G
    (continuing G_before), and G at its last row."""
    rows = first_row + tl.arange(0, BLOCK)
    row_ok = rows < end
    g = _token_scalars(g_ptr, rows, row_ok, head, HV)
    k = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, tl.arange(0, BK), DK)
    strength = _token_scalars(strength_ptr, rows, row_ok, head, HV)
    return rows, row_ok, k, strength, G_before + tl.cumsum(g, axis=0), G_before + tl.sum(g, axis=0)


@triton.jit
def _gram_block(k_i, k_j, G_i, G_j, strength_i, DIAGONAL: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr):
    """Block (i, j) of diag(b) e^(G_i - G_j) K K^T, strictly lower on the diagonal."""
    log_decay = G_i[:, None] - G_j[None, :]
    if DIAGONAL:
        r = tl.arange(0, BLOCK)
        log_decay = tl.where(r[:, None] > r[None, :], log_decay, float("-inf"))
    return strength_i[:, None] * tl.exp(log_decay) * _mm(k_i, tl.trans(k_j), DT)


@triton.jit
def _invert_unit_lower(A, BLOCK: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular A by forward substitution: row i of the
    inverse is e_i - A_i (I + A)^-1, and A_i only reaches rows above i, which are final."""
    r = tl.arange(0, BLOCK)
    X = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, BLOCK):
        a_row = tl.sum(tl.where(r[:, None] == i, A, 0.0), axis=0)
        X = tl.where(r[:, None] == i, X - tl.sum(a_row[:, None] * X, axis=0)[None, :], X)
    return X


@triton.jit
def _chunk_inverse_kernel(k_ptr, g_ptr, strength_ptr, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, X_ptr,
                          T, NT, HV, GROUP, DK, BC: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr,
                          DT: tl.constexpr, VARLEN: tl.constexpr):
    """X = T^-1 of a chunk, by blocks: X_ii = (I + A_ii)^-1 and X_ij = -X_ii sum_{j <= m < i} A_im X_mj,
    stored as rows [token, head, position in the chunk] (blocks above the diagonal left unwritten)."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    start, end = _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
    fixed = (end, head, HV, GROUP, DK)
    rows0, ok0, k0, b0, G0, G_end = _key_block(k_ptr, g_ptr, strength_ptr, start, *fixed, 0.0, BLOCK, BK)
    rows1, ok1, k1, b1, G1, G_end = _key_block(k_ptr, g_ptr, strength_ptr, start + BLOCK, *fixed, G_end, BLOCK, BK)
    rows2, ok2, k2, b2, G2, G_end = _key_block(k_ptr, g_ptr, strength_ptr, start + 2 * BLOCK, *fixed, G_end,
                                               BLOCK, BK)
    rows3, ok3, k3, b3, G3, G_end = _key_block(k_ptr, g_ptr, strength_ptr, start + 3 * BLOCK, *fixed, G_end,
                                               BLOCK, BK)
    X00 = _invert_unit_lower(_gram_block(k0, k0, G0, G0, b0, True, BLOCK, DT), BLOCK)
    X11 = _invert_unit_lower(_gram_block(k1, k1, G1, G1, b1, True, BLOCK, DT), BLOCK)
    X22 = _invert_unit_lower(_gram_block(k2, k2, G2, G2, b2, True, BLOCK, DT), BLOCK)
    X33 = _invert_unit_lower(_gram_block(k3, k3, G3, G3, b3, True, BLOCK, DT), BLOCK)
    A10 = _gram_block(k1, k0, G1, G0, b1, False, BLOCK, DT)
    A20 = _gram_block(k2, k0, G2, G0, b2, False, BLOCK, DT)
    A21 = _gram_block(k2, k1, G2, G1, b2, False, BLOCK, DT)
    A30 = _gram_block(k3, k0, G3, G0, b3, False, BLOCK, DT)
    A31 = _gram_block(k3, k1, G3, G1, b3, False, BLOCK, DT)
    A32 = _gram_block(k3, k2, G3, G2, b3, False, BLOCK, DT)
    X10 = -_mm_fp32(X11, _mm_fp32(A10, X00, DT), DT)
    X21 = -_mm_fp32(X22, _mm_fp32(A21, X11, DT), DT)
    X20 = -_mm_fp32(X22, _mm_fp32(A20, X00, DT) + _mm_fp32(A21, X10, DT), DT)
    X32 = -_mm_fp32(X33, _mm_fp32(A32, X22, DT), DT)
    X31 = -_mm_fp32(X33, _mm_fp32(A31, X11, DT) + _mm_fp32(A32, X21, DT), DT)
    X30 = -_mm_fp32(X33, _mm_fp32(A30, X00, DT) + _mm_fp32(A31, X10, DT) + _mm_fp32(A32, X20, DT), DT)
    c = tl.arange(0, BLOCK)
    _store_rows(X_ptr, rows0, ok0, head, HV, c, BC, X00)
    _store_rows(X_ptr, rows1, ok1, head, HV, c, BC, X10)
    _store_rows(X_ptr, rows1, ok1, head, HV, c + BLOCK, BC, X11)
    _store_rows(X_ptr, rows2, ok2, head, HV, c, BC, X20)
    _store_rows(X_ptr, rows2, ok2, head, HV, c + BLOCK, BC, X21)
    _store_rows(X_ptr, rows2, ok2, head, HV, c + 2 * BLOCK, BC, X22)
    _store_rows(X_ptr, rows3, ok3, head, HV, c, BC, X30)
    _store_rows(X_ptr, rows3, ok3, head, HV, c + BLOCK, BC, X31)
    _store_rows(X_ptr, rows3, ok3, head, HV, c + 2 * BLOCK, BC, X32)
    _store_rows(X_ptr, rows3, ok3, head, HV, c + 3 * BLOCK, BC, X33)


@triton.jit
def _chunk_wy_kernel(k_ptr, v_ptr, g_ptr, strength_ptr, X_ptr, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr,
                     W_ptr, U0_ptr, T, NT, HV, GROUP, DK, DV, BC: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, DT: tl.constexpr, VARLEN: tl.constexpr):
    """The WY terms W = X diag(b e^G) K and U0 = X diag(b) V of a chunk."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    start, end = _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
    rows = start + tl.arange(0, BC)
    row_ok = rows < end
    r = tl.arange(0, BC)
    X = tl.where(r[:, None] >= r[None, :], _load_rows(X_ptr, rows, row_ok, head, HV, r, BC), 0.0)
    g = _token_scalars(g_ptr, rows, row_ok, head, HV)
    strength = _token_scalars(strength_ptr, rows, row_ok, head, HV)
    kcols, vcols = tl.arange(0, BK), tl.arange(0, BV)
    k = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
    v = _load_rows(v_ptr, rows, row_ok, head, HV, vcols, DV)
    _store_rows(W_ptr, rows, row_ok, head, HV, kcols, DK,
                _mm(X, (strength * tl.exp(tl.cumsum(g, axis=0)))[:, None] * k, DT))
    _store_rows(U0_ptr, rows, row_ok, head, HV, vcols, DV, _mm(X, strength[:, None] * v, DT))


@triton.jit
def _chunk_state_kernel(k_ptr, v_ptr, g_ptr, strength_ptr, W_ptr, U0_ptr, U_ptr, h_ptr, state_ptr,
                        cu_seqlens_ptr, chunk_offsets_ptr, T, NT, HV, GROUP, DK, DV, BC: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr,
                        VARLEN: tl.constexpr):
    value_tile, seq_head = tl.program_id(0), tl.program_id(1)
    seq, head = seq_head // HV, seq_head % HV
    if VARLEN:
        bos, eos = tl.load(cu_seqlens_ptr + seq), tl.load(cu_seqlens_ptr + seq + 1)
        chunk = tl.load(chunk_offsets_ptr + seq)
    else:
        bos = seq.to(tl.int64) * T
        eos = bos + T
        chunk = (seq * NT).to(tl.int64)
    kcols, vcols = tl.arange(0, BK), value_tile * BV + tl.arange(0, BV)
    tile = kcols[:, None] * DV + vcols[None, :]
    tile_ok = (kcols < DK)[:, None] & (vcols < DV)[None, :]
    state_offsets = seq_head.to(tl.int64) * DK * DV + tile
    S = tl.load(state_ptr + state_offsets, mask=tile_ok, other=0.0)
    for start in range(bos, eos, BC):
        tl.store(h_ptr + (chunk * HV + head) * DK * DV + tile, S.to(DT), mask=tile_ok)
        rows = start + tl.arange(0, BC)
        row_ok = rows < eos
        g = _token_scalars(g_ptr, rows, row_ok, head, HV)
        if DELTA:
            W = _load_rows(W_ptr, rows, row_ok, head, HV, kcols, DK)
            U = _load_rows(U0_ptr, rows, row_ok, head, HV, vcols, DV).to(tl.float32) - _mm(W, S, DT)
            _store_rows(U_ptr, rows, row_ok, head, HV, vcols, DV, U)
        else:
            strength = _token_scalars(strength_ptr, rows, row_ok, head, HV)
            U = strength[:, None] * _load_rows(v_ptr, rows, row_ok, head, HV, vcols, DV).to(tl.float32)
        G = tl.cumsum(g, axis=0)
        G_last = tl.sum(g, axis=0)  # padded rows add 0: the last real token's cumulative decay
        k = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
        S = tl.exp(G_last) * S + _mm(tl.trans(tl.exp(G_last - G)[:, None] * k), U, DT)
        chunk += 1
    tl.store(state_ptr + state_offsets, S, mask=tile_ok)


@triton.jit
def _chunk_output_kernel(q_ptr, k_ptr, v_ptr, g_ptr, strength_ptr, U_ptr, h_ptr, gamma_ptr, base_ptr, out_ptr,
                         cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, scale, clip, T, NT, HV, GROUP, DK, DV,
                         BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                         DELTA: tl.constexpr, MODE: tl.constexpr, VARLEN: tl.constexpr):
    value_tile, chunk, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT, BC, VARLEN)
    rows = start + tl.arange(0, BC)
    row_ok = rows < end
    kcols, vcols = tl.arange(0, BK), value_tile * BV + tl.arange(0, BV)
    q = _load_rows(q_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
    k = _load_rows(k_ptr, rows, row_ok, head // GROUP, HV // GROUP, kcols, DK)
    g = _token_scalars(g_ptr, rows, row_ok, head, HV)
    G = tl.cumsum(g, axis=0)
    tile_ok = (kcols < DK)[:, None] & (vcols < DV)[None, :]
    h = tl.load(h_ptr + (chunk.to(tl.int64) * HV + head) * DK * DV + kcols[:, None] * DV + vcols[None, :],
                mask=tile_ok, other=0.0)
    if DELTA:
        U = _load_rows(U_ptr, rows, row_ok, head, HV, vcols, DV)
    else:
        strength = _token_scalars(strength_ptr, rows, row_ok, head, HV)
        U = strength[:, None] * _load_rows(U_ptr, rows, row_ok, head, HV, vcols, DV).to(tl.float32)
    r = tl.arange(0, BC)
    strictly_below = r[:, None] > r[None, :]
    # The base pass of a residual rule reads S_{t-1} (exclusive), every other pass S_t.
    read_mask = strictly_below if MODE == BASE else r[:, None] >= r[None, :]
    attend = tl.exp(tl.where(read_mask, G[:, None] - G[None, :], float("-inf"))) * _mm(q, tl.trans(k), DT)
    o = scale * (tl.exp(G)[:, None] * _mm(q, h, DT) + _mm(attend, U, DT))
    if MODE == PLAIN:
        _store_rows(out_ptr, rows, row_ok, head, HV, vcols, DV, o)
    if MODE == BASE:
        _store_rows(base_ptr, rows, row_ok, head, HV, vcols, DV, o)
        # pred_t = S_{t-1}^T k_t: decay e^(G_{t-1} - G_j), computed directly, never divided by a_t.
        G_prev = G - g
        attend = tl.exp(tl.where(strictly_below, G_prev[:, None] - G[None, :], float("-inf"))) * _mm(k, tl.trans(k), DT)
        pred = tl.exp(G_prev)[:, None] * _mm(k, h, DT) + _mm(attend, U, DT)
        v = _load_rows(v_ptr, rows, row_ok, head, HV, vcols, DV).to(tl.float32)
        _store_rows(out_ptr, rows, row_ok, head, HV, vcols, DV, tl.minimum(tl.maximum(v - pred, -clip), clip))
    if MODE == COMBINE:
        gamma = _token_scalars(gamma_ptr, rows, row_ok, head, HV)
        base = _load_rows(base_ptr, rows, row_ok, head, HV, vcols, DV)
        _store_rows(out_ptr, rows, row_ok, head, HV, vcols, DV, base + gamma[:, None] * o)


class _ChunkLayout:
    """Where the chunks of B rows of T tokens, or of packed sequences (cu_seqlens), lie."""

    def __init__(self, B, T, cu_seqlens, device, chunk_size):
        self.T, self.NT, self.varlen = T, triton.cdiv(T, chunk_size), cu_seqlens is not None
        if self.varlen:
            self.cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int64)
            chunks = (self.cu_seqlens.diff() + chunk_size - 1) // chunk_size
            self.chunk_offsets = torch.nn.functional.pad(torch.cumsum(chunks, 0), (1, 0))
            self.num_sequences = len(chunks)
            self.num_chunks = int(self.chunk_offsets[-1])  # the grid needs it on the host: one sync
            self.chunk_seq = torch.repeat_interleave(torch.arange(self.num_sequences, device=device), chunks,
                                                     output_size=self.num_chunks)
        else:  # computed inside the kernels; the table arguments are never read
            self.num_sequences, self.num_chunks = B, B * self.NT
            self.cu_seqlens = self.chunk_offsets = self.chunk_seq = torch.empty(1, device=device, dtype=torch.int64)

    def tables(self):
        return self.cu_seqlens, self.chunk_seq, self.chunk_offsets


def _chunk_pass(q, k, values, g, strength, state, layout, update, scale, mode, out, base=None, gamma=None,
                clip=1.0, chunk_size=CHUNK_SIZE):
    """One state's pass over packed tokens q, k [L, H, Dk], values [L, HV, Dv], g, strength
    [L, HV]; state [N, HV, Dk, Dv] fp32 is advanced in place. Writes `out` (and `base`), see
    PLAIN / BASE / COMBINE."""
    L, H, Dk = q.shape
    HV, Dv = values.shape[1:]
    delta = update == "delta"
    DT = TRITON_DTYPES[q.dtype]
    tables = layout.tables()
    shape = dict(T=layout.T, NT=layout.NT, HV=HV, GROUP=HV // H, DK=Dk, DV=Dv)
    BK, BV_full = max(16, triton.next_power_of_2(Dk)), max(16, triton.next_power_of_2(Dv))
    warps = 4 if BK <= 128 else 8
    # Pipelined fp32 tiles take twice the shared memory of bf16 ones: with 3 stages the state
    # kernel compiled for an H200 at D = 128 needs 213 KB of its 227, and more at D = 256.
    stages = 1 if q.dtype == torch.float32 else 3
    U0 = W = U = values  # the additive rule writes diag(b) V, recomputed where it is read
    if delta:
        W = torch.empty(L, HV, Dk, device=q.device, dtype=q.dtype)
        U0, U = torch.empty(2, L, HV, Dv, device=q.device, dtype=q.dtype)
        X = torch.empty(L, HV, chunk_size, device=q.device, dtype=q.dtype)
        _chunk_inverse_kernel[(layout.num_chunks, HV)](
            k, g, strength, *tables, X, layout.T, layout.NT, HV, HV // H, Dk,
            BC=chunk_size, BLOCK=BLOCK, BK=BK, DT=DT, VARLEN=layout.varlen, num_warps=2)
        _chunk_wy_kernel[(layout.num_chunks, HV)](
            k, values, g, strength, X, *tables, W, U0, **shape,
            BC=chunk_size, BK=BK, BV=BV_full, DT=DT, VARLEN=layout.varlen, num_warps=warps)
    h = torch.empty(layout.num_chunks, HV, Dk, Dv, device=q.device, dtype=q.dtype)
    # Few sequence-heads leave SMs idle in the sequential state kernel: narrower value tiles then.
    BV_state = min(BV_full, 64 if layout.num_sequences * HV >= 128 else 32)
    _chunk_state_kernel[(triton.cdiv(Dv, BV_state), layout.num_sequences * HV)](
        k, values, g, strength, W, U0, U, h, state, layout.cu_seqlens, layout.chunk_offsets, **shape,
        BC=chunk_size, BK=BK, BV=BV_state, DT=DT, DELTA=delta, VARLEN=layout.varlen, num_warps=warps,
        num_stages=stages)
    BV = min(BV_full, 64)
    _chunk_output_kernel[(triton.cdiv(Dv, BV), layout.num_chunks, HV)](
        q, k, values, g, strength, U, h, gamma if gamma is not None else g, base if base is not None else out, out,
        *tables, scale, clip, **shape,
        BC=chunk_size, BK=BK, BV=BV, DT=DT, DELTA=delta, MODE=mode.value, VARLEN=layout.varlen, num_warps=warps,
        num_stages=stages)


def chunk_forward(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens,
                  chunk_size=CHUNK_SIZE):
    """Forward of every rule over [B, T] or packed (cu_seqlens) sequences, the same contract as
    kernels_reslin_torch.chunk_reslin: returns (o in v's dtype, S, R) with fp32 states."""
    B, T, H, Dk = q.shape
    HV, Dv = v.shape[2:]
    layout = _ChunkLayout(B, T, cu_seqlens, q.device, chunk_size)
    flat = lambda x: None if x is None else x.reshape(B * T, *x.shape[2:]).contiguous()  # noqa: E731
    q, k, v, g, beta, gamma, gamma_write = map(flat, (q, k, v, g, beta, gamma, gamma_write))
    S = S0.clone(memory_format=torch.contiguous_format)
    o = torch.empty_like(v)
    common = dict(layout=layout, update=update, scale=scale, chunk_size=chunk_size)
    if gamma is None:
        _chunk_pass(q, k, v, g, beta, S, mode=PLAIN, out=o, **common)
        return o.reshape(B, T, HV, Dv), S, None
    base_read = torch.empty(B * T, HV, Dv, device=q.device, dtype=torch.float32)
    residual = torch.empty_like(v)
    _chunk_pass(q, k, v, g, beta, S, mode=BASE, out=residual, base=base_read, clip=clip, **common)
    R = R0.clone(memory_format=torch.contiguous_format)
    _chunk_pass(q, k, residual, g, gamma_write, R, mode=COMBINE, out=o, base=base_read, gamma=gamma, **common)
    return o.reshape(B, T, HV, Dv), S, R
