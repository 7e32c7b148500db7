"""PyTorch implementations of the ResLin recurrences (DESIGN.md section 1).

Two backends, both in fp32 whatever the input dtype, both differentiable by autograd:

- ``recurrent_reslin``: the per-token reference. It is the definition every other backend is
  tested against, so it is written to be read, not to be fast.
- ``chunk_reslin``: the chunked (WY) form for training and prefill on any device. Intra-chunk
  work runs for all chunks at once; only a short scan over chunks is sequential.

Both take q and k already expanded to the value heads, ``scale`` already resolved, and return
``(o, S, R)`` in fp32; ``kernels_reslin.reslin_attention`` does the checking and dispatch.
Layouts: q, k ``[B, T, H, Dk]``, v ``[B, T, H, Dv]``, g, beta, gamma ``[B, T, H]``,
states ``[B, H, Dk, Dv]`` (key-first: a read is ``S^T x``).
"""

import weakref

import torch

# Measured on 2 CPU cores at T=2048, D=64: 32 beats 16 and 64 (the C^2 work outweighs the scan).
CHUNK_SIZE = 32


# ---------------------------------------------------------------------------------------------
# Per-token reference
# ---------------------------------------------------------------------------------------------

def _read(state, x):
    """``S^T x`` per head: state [B, H, Dk, Dv], x [B, H, Dk] -> [B, H, Dv]. (A batched matmul:
    an einsum costs a CPU decode step about twice the operations.)"""
    return (x.unsqueeze(-2) @ state).squeeze(-2)


def _write(state, k, v, decay, strength, update):
    """One state update of section 1: additive ``a S + b k v^T`` or delta
    ``a S + b k (v - a S^T k)^T``. Shapes: state [B, H, Dk, Dv], k [B, H, Dk], v [B, H, Dv],
    decay and strength [B, H]."""
    decayed = decay[..., None, None] * state
    if update == "delta":
        v = v - _read(decayed, k)
    return decayed + (strength[..., None] * k).unsqueeze(-1) * v.unsqueeze(-2)


def _recurrent_one(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S, R):
    """The recurrence over one batch of equal-length sequences; S and R are updated copies."""
    outputs = []
    for t in range(q.shape[1]):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]
        a_t = g[:, t].exp()
        if gamma is None:
            S = _write(S, k_t, v_t, a_t, beta[:, t], update)
            o_t = _read(S, q_t)
        else:
            gamma_t = gamma[:, t]
            # The residual reads the OLD base state S_{t-1}: not decayed, not yet written.
            pred_t = _read(S, k_t)
            r_t = (v_t - pred_t).clamp(-clip, clip)
            base_read = a_t[..., None] * _read(S, q_t)
            R = _write(R, k_t, r_t, a_t, gamma_write[:, t], update)
            o_t = base_read + gamma_t[..., None] * _read(R, q_t)
            S = _write(S, k_t, v_t, a_t, beta[:, t], update)
        outputs.append(scale * o_t)
    return torch.stack(outputs, dim=1), S, R


_last_bounds = (None, None, None)  # (weak reference to a cu_seqlens, its version, its values)


def sequence_bounds(cu_seqlens):
    """cu_seqlens as a list of ints. Reading a GPU tensor on the host is a device sync, which
    stops the host from queueing work ahead; every layer of a forward, and the backward, take
    the same cu_seqlens, so the last tensor read is remembered by identity and version."""
    global _last_bounds
    reference, version, bounds = _last_bounds
    if reference is None or reference() is not cu_seqlens or version != cu_seqlens._version:
        bounds = cu_seqlens.tolist()
        _last_bounds = (weakref.ref(cu_seqlens), cu_seqlens._version, bounds)
    return bounds


def recurrent_reslin(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens=None):
    """Per-token fp32 reference. S0 / R0: [N, H, Dk, Dv] fp32 (R0 only with gamma); gamma_write
    is the residual state's write strength (gamma itself unless the caller says otherwise)."""
    f32 = [None if x is None else x.float() for x in (q, k, v, g, beta, gamma, gamma_write)]
    if cu_seqlens is None:
        return _recurrent_one(*f32, update, clip, scale, S0, R0)
    outputs, finals_S, finals_R = [], [], []
    bounds = sequence_bounds(cu_seqlens)
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        S, R = S0[n:n + 1], None if R0 is None else R0[n:n + 1]
        if start == end:  # an empty sequence: no outputs, its states pass through
            finals_S.append(S)
            finals_R.append(R)
            continue
        piece = [None if x is None else x[:, start:end] for x in f32]
        o, S, R = _recurrent_one(*piece, update, clip, scale, S, R)
        outputs.append(o)
        finals_S.append(S)
        finals_R.append(R)
    R = None if R0 is None else torch.cat(finals_R)
    return torch.cat(outputs, dim=1), torch.cat(finals_S), R


# ---------------------------------------------------------------------------------------------
# Chunked form
# ---------------------------------------------------------------------------------------------

def _decay_matrix(row_log, col_log, strict):
    """exp(row_log_i - col_log_j) on (strictly) lower triangle, 0 elsewhere; masked before the
    exp so the upper triangle, where the difference is positive, never overflows."""
    C = row_log.shape[-1]
    mask = torch.ones(C, C, dtype=torch.bool, device=row_log.device).tril(-1 if strict else 0)
    diff = row_log[..., :, None] - col_log[..., None, :]
    return torch.where(mask, diff, float("-inf")).exp()


def _chunk_scan(q, k, v, g, strength, state, update, exclusive):
    """The chunked form (DESIGN.md section 3) for one state. Inputs chunked and fp32: q, k [B, H, N, C, Dk],
    v [B, H, N, C, Dv], g, strength [B, H, N, C]; state [B, H, Dk, Dv].

    Returns (o, pred, final state). With ``exclusive`` the outputs read the decayed OLD state,
    a_t S_{t-1}^T q_t, and pred = S_{t-1}^T k_t is returned too (what the residual rules need);
    otherwise o_t = S_t^T q_t and pred is None.
    """
    G = g.cumsum(-1)                                                  # log decay since chunk start
    decay_in = G.exp()                                                # exp(G_i)
    A_incl = _decay_matrix(G, G, strict=False)                        # exp(G_i - G_j), j <= i
    A_strict = _decay_matrix(G, G, strict=True)
    KK = k @ k.transpose(-1, -2)

    # WY form: the write of chunk n is U = U0 - W S_start, with U0 and W independent of the state.
    # Delta: [I + B (A^- * K K^T)] U = B (V - diag(exp G) K S_start).
    # Additive: U = B V (the write does not read the state).
    bv = strength[..., None] * v
    if update == "delta":
        C = q.shape[-2]
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        lower = eye + strength[..., None] * (A_strict * KK)
        rhs = torch.cat([bv, (strength * decay_in)[..., None] * k], dim=-1)  # one solve for both
        U0, W = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True).split(
            [v.shape[-1], k.shape[-1]], dim=-1)
    else:
        U0, W = bv, None

    QK = q @ k.transpose(-1, -2)
    attend = (A_strict if exclusive else A_incl) * QK
    q_in = decay_in[..., None] * q
    if exclusive:
        # S_{t-1} read at step t: decay exp(G_{t-1} - G_j) = exp(G_t - g_t - G_j), computed
        # directly; dividing a decayed read by a_t would divide by numbers that can be ~0.
        G_prev = G - g
        pred_attend = _decay_matrix(G_prev, G, strict=True) * KK
        k_prev = G_prev.exp()[..., None] * k
    G_last = G[..., -1]
    k_out = (G_last[..., None] - G).exp()[..., None] * k              # exp(G_C - G_j) k_j

    # The only sequential part: each chunk's start state. Everything that reads those states
    # then runs for all chunks at once.
    last_decay = G_last.exp()[..., None, None]
    k_out_T = k_out.transpose(-1, -2)
    if W is None:
        increments = k_out_T @ U0                                     # additive: writes ignore the state
    starts, writes = [], []
    for n in range(q.shape[2]):
        starts.append(state)
        if W is None:
            state = last_decay[:, :, n] * state + increments[:, :, n]
        else:
            U = U0[:, :, n] - W[:, :, n] @ state
            writes.append(U)
            state = last_decay[:, :, n] * state + k_out_T[:, :, n] @ U
    starts = torch.stack(starts, dim=2)
    U = U0 if W is None else torch.stack(writes, dim=2)
    o = q_in @ starts + attend @ U
    pred = k_prev @ starts + pred_attend @ U if exclusive else None
    return o, pred, state


def _to_chunks(x, chunk_size):
    """[B, T, H, ...] -> [B, H, N, C, ...], zero-padded at the end. Zero padding is inert:
    g = 0 does not decay, beta = gamma = 0 and k = 0 write nothing, so padded steps leave
    the states exactly as the last real token left them."""
    B, T, H = x.shape[:3]
    N = -(-T // chunk_size)
    pad = N * chunk_size - T
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], dim=1)
    x = x.reshape(B, N, chunk_size, H, *x.shape[3:])
    return x.movedim(3, 1)


def _from_chunks(x, T):
    B, H, N, C = x.shape[:4]
    return x.movedim(1, 3).reshape(B, N * C, H, *x.shape[4:])[:, :T]


def _chunk_batch(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, chunk_size):
    T = q.shape[1]
    qc, kc, vc = (_to_chunks(x, chunk_size) for x in (q * scale, k, v))
    gc, bc = _to_chunks(g, chunk_size), _to_chunks(beta, chunk_size)
    if gamma is None:
        o, _, S = _chunk_scan(qc, kc, vc, gc, bc, S0, update, exclusive=False)
        return _from_chunks(o, T), S, None
    base_read, pred, S = _chunk_scan(qc, kc, vc, gc, bc, S0, update, exclusive=True)
    residual = (vc - pred).clamp(-clip, clip)
    residual_read, _, R = _chunk_scan(qc, kc, residual, gc, _to_chunks(gamma_write, chunk_size), R0,
                                      update, exclusive=False)
    o = base_read + _to_chunks(gamma, chunk_size)[..., None] * residual_read
    return _from_chunks(o, T), S, R


def _pack_to_batch(x, cu_seqlens, max_len):
    """Packed [1, T, ...] -> zero right-padded [N, max_len, ...] (see _to_chunks on padding)."""
    pieces = []
    bounds = sequence_bounds(cu_seqlens)
    for start, end in zip(bounds[:-1], bounds[1:]):
        piece = x[0, start:end]
        pad = max_len - (end - start)
        pieces.append(torch.cat([piece, piece.new_zeros(pad, *piece.shape[1:])]) if pad else piece)
    return torch.stack(pieces)


def chunk_reslin(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens=None,
                 chunk_size=CHUNK_SIZE):
    """Chunked fp32 computation of exactly what ``recurrent_reslin`` computes."""
    f32 = [None if x is None else x.float() for x in (q, k, v, g, beta, gamma, gamma_write)]
    if cu_seqlens is None:
        if q.shape[1] == 1:
            # One decode step: the chunk machinery (a triangular solve of size 1) is pure overhead.
            return _recurrent_one(*f32, update, clip, scale, S0, R0)
        return _chunk_batch(*f32, update, clip, scale, S0, R0, chunk_size)
    bounds = sequence_bounds(cu_seqlens)
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    max_len = max(lengths)
    padded = [None if x is None else _pack_to_batch(x, cu_seqlens, max_len) for x in f32]
    o, S, R = _chunk_batch(*padded, update, clip, scale, S0, R0, chunk_size)
    o = torch.cat([o[n, :length] for n, length in enumerate(lengths)])[None]
    return o, S, R
