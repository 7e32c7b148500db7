"""The ResLin functional API: one entry point for every rule and every backend.

    from kernels_reslin import reslin_attention
    o, final_state = reslin_attention(q, k, v, g, beta, gamma=None, update="delta", ...)

Rules (DESIGN.md section 1), per head, key-first states S, R of shape [Dk, Dv]:

    update="additive" (sGLA):  S_t = a_t S_{t-1} + b_t k_t v_t^T
    update="delta"    (GDN):   S_t = a_t S_{t-1} + b_t k_t (v_t - a_t S_{t-1}^T k_t)^T
    without gamma:             o_t = scale * S_t^T q_t
    with gamma (RLA / RDN):    r_t = clip(v_t - S_{t-1}^T k_t, -c, c)
                               R_t = same update rule as S, with v := r_t and b := gamma_t
                               o_t = scale * (a_t S_{t-1}^T q_t + gamma_t R_t^T q_t)

with a_t = exp(g_t). KLA is the delta rule with b_t = eta_t / (||k_t||^2 + eps), computed by
the caller. RKLA gives its residual state the Kaczmarz step too: it writes R with
gamma_write = gamma_t / (||k_t||^2 + eps) and reads it with gamma_t (see reslin_attention).
Backends: "recurrent" (per-token fp32 reference), "torch" (chunked, fp32 accumulation), "auto" (the fastest available for the device: "torch" until Triton kernels ship).
"""

import torch

try:
    from .kernels_reslin_torch import chunk_reslin, recurrent_reslin
except ImportError:  # imported as a top-level module: `from kernels_reslin import reslin_attention`
    from kernels_reslin_torch import chunk_reslin, recurrent_reslin

UPDATE_RULES = ("delta", "additive")
BACKENDS = ("auto", "torch", "triton", "recurrent")
MAX_HEAD_DIM = 256


def _check_inputs(q, k, v, g, beta, gamma, gamma_write, update, clip, initial_state, cu_seqlens, backend):
    if update not in UPDATE_RULES:
        raise ValueError(f"update must be one of {UPDATE_RULES}, got {update!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not clip > 0:
        raise ValueError(f"clip must be > 0 (use float('inf') for no clipping), got {clip!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be [B, T, heads, head_dim], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, Dk = q.shape
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, HV, Dv] like q, got {tuple(v.shape)}")
    HV, Dv = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"v's head count {HV} must be a multiple of q/k's head count {H}")
    for name, size in (("key head size Dk", Dk), ("value head size Dv", Dv)):
        if not 1 <= size <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be between 1 and {MAX_HEAD_DIM}, got {size}")
    for name, x in (("g", g), ("beta", beta), ("gamma", gamma), ("gamma_write", gamma_write)):
        if x is not None and x.shape != (B, T, HV):
            raise ValueError(f"{name} must be [B, T, HV] = {(B, T, HV)}, got {tuple(x.shape)}")
    if gamma_write is not None and gamma is None:
        raise ValueError("gamma_write is the residual state's write strength: it needs gamma")
    devices = {x.device for x in (q, k, v, g, beta, gamma, gamma_write) if x is not None}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")

    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B == 1, got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError("cu_seqlens must be a 1-D integer tensor [0, ..., T] of length N + 1")
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != T or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
            raise ValueError(f"cu_seqlens must start at 0, end at T = {T} and never decrease, got {bounds}")
        N = len(bounds) - 1

    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise ValueError("initial_state must be a pair (S0, R0); R0 is None without gamma")
        S0, R0 = initial_state
        if gamma is None and R0 is not None:
            raise ValueError("initial_state has a residual state R0 but gamma is None")
        for name, state in (("S0", S0), ("R0", R0)):
            if state is not None and state.shape != (N, HV, Dk, Dv):
                raise ValueError(f"initial state {name} must be [N, HV, Dk, Dv] = {(N, HV, Dk, Dv)}, "
                                 f"got {tuple(state.shape)}")


def reslin_attention(q, k, v, g, beta, gamma=None, update="delta", clip=1.0, scale=None,
                     initial_state=None, output_final_state=False, cu_seqlens=None, backend="auto",
                     gamma_write=None):
    """Residual / Kaczmarz / gated-delta / gated-linear attention over a sequence.

    Args:
        q, k: [B, T, H, Dk]. v: [B, T, HV, Dv], HV a multiple of H; each q/k head serves
            HV / H consecutive value heads.
        g: [B, T, HV] log decay (<= 0). beta: [B, T, HV] base write strength.
        gamma: [B, T, HV] correction gate of the residual state, or None for no residual state.
        update: "delta" (GDN, KLA, RDN) or "additive" (sGLA, RLA).
        clip: the residual clip threshold c. scale: defaults to Dk ** -0.5.
        initial_state: None or (S0, R0), each [N, HV, Dk, Dv] fp32 (N = B, or the number of
            sequences with cu_seqlens); R0 is None without gamma, and may be None (zeros) with it.
        output_final_state: also return the final (S, R).
        cu_seqlens: packed variable-length sequences in one row (B == 1), like FLA.
        backend: "auto", "torch", "triton" or "recurrent".
        gamma_write: [B, T, HV] write strength of the residual state where it differs from its
            read gate gamma; None means gamma. An extension of DESIGN.md section 3 for RKLA,
            whose raw keys need the Kaczmarz step gamma / (||k||^2 + eps) in the residual
            state's delta rule as in the base state's (with plain gamma that state diverges
            once ||k||^2 > 2), while the read keeps gamma.

    Returns:
        o: [B, T, HV, Dv] in v's dtype; final_state: (S, R) fp32 ([N, HV, Dk, Dv]; R None
        without gamma), or None unless output_final_state.
    """
    _check_inputs(q, k, v, g, beta, gamma, gamma_write, update, clip, initial_state, cu_seqlens, backend)
    if backend == "triton":
        raise NotImplementedError("the Triton backend is not bundled yet: use backend='torch' or 'auto'")
    B, T, H, Dk = q.shape
    HV, Dv = v.shape[2:]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if scale is None:
        scale = Dk ** -0.5
    if HV != H:
        q, k = (x.repeat_interleave(HV // H, dim=2) for x in (q, k))

    S0, R0 = initial_state if initial_state is not None else (None, None)
    zeros = lambda: q.new_zeros(N, HV, Dk, Dv, dtype=torch.float32)  # noqa: E731
    S0 = zeros() if S0 is None else S0.float()
    R0 = None if gamma is None else (zeros() if R0 is None else R0.float())
    if gamma is not None and gamma_write is None:
        gamma_write = gamma

    run = recurrent_reslin if backend == "recurrent" else chunk_reslin
    o, S, R = run(q, k, v, g, beta, gamma, gamma_write, update, float(clip), scale, S0, R0, cu_seqlens)
    return o.to(v.dtype), ((S, R) if output_final_state else None)
