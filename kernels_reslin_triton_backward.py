"""The chunked backward of every rule. The forward runs again (recomputing is cheaper than keeping
h), storing z = v - pred for the residual rules. With dO and the gradient dh' of a chunk's end
state (the next chunk's start):

    dU = scale * A^T dO + e^(G_last - G) K dh',   A = mask(Q K^T) e^(G_i - G_j),
    dh = e^(G_last) dh' + scale * (e^G Q)^T dO - W^T dU   (no W term for the additive rule).

Its first term needs no state: every chunk at once (_chunk_local_grad_kernel). The rest runs
chunk after chunk backwards (_chunk_state_backward_kernel, one value tile a program like the
forward's state kernel). The residual rules run this for R first, with gamma dO and the
inclusive mask, then every chunk at once (_chunk_residual_grad_kernel) through R's writes
U0_R = X_R diag(b_R) r and the clip (zero gradient where z was clipped) into pred =
e^(G_prev) K h + P U, P = strictly_lower(e^(G_prev_i - G_j) K K^T), whose gradient joins S's
reverse pass (A is then strictly lower: the base read is exclusive).

Then every chunk at once, per key tile (_chunk_grad_keys_kernel) and per chunk
(_chunk_grad_values_kernel): dq, dk, dv, the gates' gradients, through
U = U0 - W h with W = X diag(b e^G) K, U0 = X diag(b) V and X = (I + A)^-1
(dA = -X^T dX X^T, A = diag(b) strictly_lower(e^(G_i - G_j) K K^T)). Every dependence on the
cumulative decay G is gathered as dG and turned into dg by a reverse cumulative sum within the
chunk (G_last is G at the chunk's last row, padding included; G_prev_t = G_t - g_t).
"""

import torch

try:
    from .kernels_reslin_triton_common import (_chunk_bounds, _load_columns, _load_lower, _load_rows, _mm,
                                               _sequence_bounds, _state_tile, _store_rows, _token_scalars)
    from .kernels_reslin_triton_forward import _ChunkRun, _fresh_state
    from .kernels_reslin_triton_launch import _cdiv, _Launcher, _on_inputs_device, tl, triton
    from .kernels_reslin_triton_output import _causal_attend, _chunk_queries_keys
    from .kernels_reslin_triton_state import _chunk_decay, _scanned_chunk_decay
    from .kernels_reslin_triton_tuning import (CHUNK_SIZE, GRAD_VALUES_WARPS, grad_keys_launches, grad_values_sides,
                                               local_grad_tile, queries_side_launched_dependent, reverse_warps,
                                               state_tile)
except ImportError:
    from kernels_reslin_triton_common import (_chunk_bounds, _load_columns, _load_lower, _load_rows, _mm,
                                              _sequence_bounds, _state_tile, _store_rows, _token_scalars)
    from kernels_reslin_triton_forward import _ChunkRun, _fresh_state
    from kernels_reslin_triton_launch import _cdiv, _Launcher, _on_inputs_device, tl, triton
    from kernels_reslin_triton_output import _causal_attend, _chunk_queries_keys
    from kernels_reslin_triton_state import _chunk_decay, _scanned_chunk_decay
    from kernels_reslin_triton_tuning import (CHUNK_SIZE, GRAD_VALUES_WARPS, grad_keys_launches, grad_values_sides,
                                              local_grad_tile, queries_side_launched_dependent, reverse_warps,
                                              state_tile)


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
            # K is loaded already: its transpose, not a second load (less shared memory).
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
    before its stores (`queries_side_launched_dependent`)."""
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
    # order SIDE 0 compiles differently, and slower.
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
    run = _ChunkRun(q, k, v, g, beta, gamma, gamma_write, update, clip, cu_seqlens, chunk_size, for_backward=True,
                    inverse=inverse, kept_states=kept_states)
    run.forward_states(S0, R0)
    layout, residual = run.layout, run.residual
    do = do.reshape(L, HV, Dv).contiguous()
    dS0 = _fresh_state(S0)
    dR0 = _fresh_state(R0) if residual else dS0
    f32 = dict(device=q.device, dtype=torch.float32)
    # The intermediate gradients (dh', dU, dU_R, dz, dX's parts, dk's key part) are kept in the
    # inputs' dtype, as FLA keeps its dh and dv: every dot that reads them casts them so anyway,
    # and the backward is bound by their traffic. Sums over them accumulate in fp32 inside the
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

    reverse_tile = state_tile(run.BV_full, run.sequence_heads, reverse=True)

    queries_dependent = queries_side_launched_dependent(run.q.is_cuda, residual)

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

