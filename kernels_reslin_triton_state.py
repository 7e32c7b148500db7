"""The state passes of the chunked forward (DESIGN.md, "Chunked form"): from a chunk's writes to
the chunk-start states h that the output kernel reads.

- `_chunk_state_kernel`, chunk after chunk for one (sequence, value head, value tile): stores h
  and the chunk's writes U = U0 - W h (the additive rule writes U = diag(b) V) and moves on to
  S = e^(G_last) h + (e^(G_last - G) K)^T U. The residual rules run it twice, S's pass then R's;
  RLA over few sequences runs both states in one pass (BOTH_STATES).
- `_chunk_residual_writes_kernel` (residual rules), every chunk at once, between the two passes:
  pred = e^(G_prev) K h + P U from S's chunk-start states, and R's writes from the clipped
  residual clip(v - pred).
- The additive rule over few long sequences, where the sequential loop would leave most SMs
  idle: `_chunk_local_state_kernel` (what each chunk adds, all at once) then
  `_chunk_state_scan_kernel` (the chunk-start states, a few chunks a step); or segments of each
  sequence run side by side from zero states, joined by `_chunk_segment_starts_kernel` and
  `_chunk_state_join_kernel` (S is linear in its start state).
- `_chunk_decay_kernel` and `_chunk_pass_factors_kernel`: the decays and gate factors the
  sequential passes load, so that no scan sits on their loops' chain.

States and decays in fp32; h and U stored in the input dtype; final states fp32.
"""

try:
    from .kernels_reslin_triton_common import (_chunk_bounds, _load_columns, _load_lower, _load_rows, _lower_decay,
                                               _mm, _mm_fp32, _sequence_bounds, _state_tile, _store_rows,
                                               _token_scalars)
    from .kernels_reslin_triton_launch import _Launcher, tl, triton
    from .kernels_reslin_triton_wy import _decayed
except ImportError:
    from kernels_reslin_triton_common import (_chunk_bounds, _load_columns, _load_lower, _load_rows, _lower_decay,
                                              _mm, _mm_fp32, _sequence_bounds, _state_tile, _store_rows,
                                              _token_scalars)
    from kernels_reslin_triton_launch import _Launcher, tl, triton
    from kernels_reslin_triton_wy import _decayed


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
    where nothing is written): cheaper in the loop than scanning g and loading b and gamma apart."""
    factors = tl.load(row_factors_ptr + (rows * HV + head)[:, None] * 4 + tl.arange(0, 4)[None, :],
                      mask=row_ok[:, None], other=0.0)
    first, second = tl.split(tl.reshape(factors, (BC, 2, 2)))  # columns 0 and 2, 1 and 3
    pred_decay, residual_strength = tl.split(first)
    strength, to_end = tl.split(second)
    return tl.load(chunk_factors_ptr + chunk * HV + head), pred_decay, strength, residual_strength, to_end


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
def _chunk_decay(G_ptr, start, rows, row_ok, end, head, HV, BC: tl.constexpr):
    """A sequential pass's chunk decays, G and G at the chunk's last real row: loads of the G that
    the WY kernel (delta rule) or the decay kernel (additive rule) stored, so that no scan sits
    on the loop's chain (rows past the sequence load 0, where every write is 0). RLA's fused
    pass loads its decays with its gates as one tile instead (`_load_pass_factors`); the additive
    rule's pass over many programs scans g (`pass_scans_decays`)."""
    return _token_scalars(G_ptr, rows, row_ok, head, HV), tl.load(G_ptr + (tl.minimum(start + BC, end) - 1) * HV + head)


@triton.jit
def _scanned_chunk_decay(g_ptr, rows, row_ok, head, HV):
    """G, G_last and G_prev = G - g scanned from g: the residual rules' S reverse pass reads
    G_prev (pred) and loads g anyway, which is cheaper than loading G as well."""
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
    chunk, in place of the stored G (`pass_scans_decays`). LAUNCHES_DEPENDENTS
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
    STORE_Z), not read from the gram kernel: a gram launch for P alone costs more."""
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
    # of 64: fewer registers, one more program a SM. The delta rule and chunks of 128 gain no
    # program from it: fp32 there.
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

