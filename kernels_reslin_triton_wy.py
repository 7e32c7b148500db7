"""The chunk's triangular system (DESIGN.md, "Chunked form"): T = I + diag(b) strictly_lower(
e^(G_i - G_j) K K^T), its inverse T^-1 by 16 x 16 blocks, the residual rules' prediction
operator P = strictly_lower(e^(G_prev_i - G_j) K K^T), and the WY terms W = T^-1 diag(b e^G) K and
U0 = T^-1 diag(b) V that the state passes read. Every chunk at once.

Precision: the inverse's blocks in fp32 (merged with tf32 dots for bf16/fp16 inputs), exact fp32
("ieee") for fp32 inputs; T^-1, P, W and U0 are stored in the input dtype.
"""

try:
    from .kernels_reslin_triton_common import (_chunk_bounds, _load_lower, _load_rows, _mm, _mm_fp32, _store_rows,
                                               _token_scalars)
    from .kernels_reslin_triton_launch import _Launcher, tl, triton
except ImportError:
    from kernels_reslin_triton_common import (_chunk_bounds, _load_lower, _load_rows, _mm, _mm_fp32, _store_rows,
                                              _token_scalars)
    from kernels_reslin_triton_launch import _Launcher, tl, triton


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
    inverse itself: on repeated keys as close to the fp32 reference as forward substitution.
    The power series (I - A)(I + A^2)(I + A^4)(I + A^8), as many products, cancels binomially
    large terms there; forward substitution, a row at a time, is slower."""
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


@_Launcher
@triton.jit
def _chunk_wy_kernel(k_ptr, v_ptr, g_ptr, strength_ptr, residual_strength_ptr, X_ptr, X_residual_ptr,
                     cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, W_ptr, U0_ptr, W_residual_ptr, G_ptr,
                     T, NT, HV, GROUP, DK, DV, NUM_CHUNKS, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     DT: tl.constexpr, RESIDUAL: tl.constexpr, VARLEN: tl.constexpr):
    """The WY terms of a chunk: U0 = X diag(b) V for S and W = X diag(b e^G) K for S and R (R's U0
    needs the residual, which the writes kernel forms), for the state passes that read them (the
    passes that form their writes from X need neither: `writes_from_inverse`). A program takes
    every num_programs-th (chunk, head) of the NUM_CHUNKS * HV (`wy_programs`). The cumulative log
    decay G is stored too (fp32), so that no scan sits on the state passes' loops."""
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

