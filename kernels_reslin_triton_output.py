"""The output of the chunked forward, every chunk at once: o = e^G (Q h) + (mask(Q K^T)
e^(G_i - G_j)) U from the chunk-start states h and the writes U that the state passes stored;
for the residual rules the exclusive base read plus gamma times R's read (DESIGN.md section 1).
The large dots take their operands in the input dtype (fp32 accumulation).
"""

try:
    from .kernels_reslin_triton_common import (_chunk_bounds, _load_rows, _lower_decay, _mm, _state_tile,
                                               _store_rows, _token_scalars)
    from .kernels_reslin_triton_launch import _Launcher, tl, triton
    from .kernels_reslin_triton_state import _chunk_writes
except ImportError:
    from kernels_reslin_triton_common import (_chunk_bounds, _load_rows, _lower_decay, _mm, _state_tile,
                                              _store_rows, _token_scalars)
    from kernels_reslin_triton_launch import _Launcher, tl, triton
    from kernels_reslin_triton_state import _chunk_writes


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
    (kernels_reslin_triton_tuning.output_launched_dependent)."""
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
