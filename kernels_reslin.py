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
Backends: "recurrent" (per-token fp32 reference), "torch" (chunked, fp32 accumulation),
"triton" (the one-token decode kernel; the chunked forward for head sizes that are multiples
of 16, with its backward), "auto" (Triton on CUDA where the head sizes allow; "torch"
elsewhere). ``reslin_decode_step`` advances a generation cache's states in place by one token.
"""

import contextlib
import math
import numbers
import os
from typing import Optional, Tuple

import torch

# Every module imports its siblings relatively (`from .x import y`: the remote-code loader follows
# these and copies the files), else plainly, for a folder on sys.path (`import kernels_reslin`).
try:
    from .constants_reslin import BACKENDS, CHUNKED_HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, UPDATE_RULES
    from .kernels_reslin_torch import chunk_reslin, recurrent_reslin, sequence_bounds
except ImportError:
    from constants_reslin import BACKENDS, CHUNKED_HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, UPDATE_RULES
    from kernels_reslin_torch import chunk_reslin, recurrent_reslin, sequence_bounds
try:
    try:
        from .kernels_reslin_triton import chunk_attention as triton_chunk_attention
        from .kernels_reslin_triton import decode_step_call as triton_decode_step
    except ImportError:
        from kernels_reslin_triton import chunk_attention as triton_chunk_attention
        from kernels_reslin_triton import decode_step_call as triton_decode_step
except ImportError:  # no Triton installed: the "torch" backend serves everywhere
    triton_chunk_attention = triton_decode_step = None
# Whether the Triton kernels run in Triton's CPU interpreter, which computes anything but fp32
# wrongly without an error. triton.jit reads the variable where the kernels are defined: at the
# import just above.
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


State = Tuple[torch.Tensor, Optional[torch.Tensor]]


def _positive_float(name, value, infinity_means=None):
    """`value`, a real number or a tensor of one, as a float; refused unless > 0, and finite unless
    `infinity_means` says what infinity stands for. A bool is refused: never a threshold or scale."""
    requirement = f"> 0 (use float('inf') for {infinity_means})" if infinity_means else "finite and > 0"
    is_tensor = torch.is_tensor(value)
    if isinstance(value, bool) or not (is_tensor or isinstance(value, numbers.Real)) or \
            (is_tensor and (value.numel() != 1 or value.dtype == torch.bool or value.is_complex())):
        raise ValueError(f"{name} must be a real number, {requirement}, got {value!r}")
    number = float(value)
    if not number > 0 or (math.isinf(number) and not infinity_means):
        raise ValueError(f"{name} must be {requirement}, got {number!r}")
    return number


def _check_inputs(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, initial_state, cu_seqlens, backend,
                  state_name="initial_state"):
    """`state_name`: what the caller calls the states: initial_state (S0, R0) or a decode step's state (S, R).
    Reads no tensor values on the host but a tensor clip or scale and cu_seqlens (once per tensor,
    see sequence_bounds). Returns (clip, scale) as floats, scale defaulting to Dk ** -0.5."""
    if update not in UPDATE_RULES:
        raise ValueError(f"update must be one of {UPDATE_RULES}, got {update!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    clip = _positive_float("clip", clip, infinity_means="no clipping")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be [B, T, heads, head_dim], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, Dk = q.shape
    if B == 0 or T == 0:
        raise ValueError(f"q, k and v hold no tokens (B = {B}, T = {T}): give at least one row of one token")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, HV, Dv] like q, got {tuple(v.shape)}")
    HV, Dv = v.shape[2], v.shape[3]
    if H == 0 or HV == 0:
        raise ValueError(f"q, k and v must have at least one head, got H = {H} (q, k) and HV = {HV} (v)")
    if HV % H:
        raise ValueError(f"v's head count {HV} must be a multiple of q/k's head count {H}")
    for name, size in (("key head size Dk", Dk), ("value head size Dv", Dv)):
        if not 1 <= size <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be between 1 and {MAX_HEAD_DIM}, got {size}")
    for name, x in (("g", g), ("beta", beta), ("gamma", gamma), ("gamma_write", gamma_write)):
        if x is not None and x.shape != (B, T, HV):
            raise ValueError(f"{name} must be [B, T, HV] = {(B, T, HV)}, got {tuple(x.shape)}")
        if x is not None and not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if gamma_write is not None and gamma is None:
        raise ValueError("gamma_write is the residual state's write strength: it needs gamma")
    devices = {x.device for x in (q, k, v, g, beta, gamma, gamma_write) if x is not None}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    scale = Dk ** -0.5 if scale is None else _positive_float("scale", scale)

    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B == 1, got B = {B}")
        if not torch.is_tensor(cu_seqlens) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
                or cu_seqlens.is_floating_point():
            raise ValueError("cu_seqlens must be a 1-D integer tensor [0, ..., T] of length N + 1")
        if cu_seqlens.device != q.device and cu_seqlens.device.type != "cpu":  # the Triton backend copies a CPU one
            raise ValueError(f"cu_seqlens must be on the inputs' device {q.device} or the CPU, got {cu_seqlens.device}")
        message = f"cu_seqlens must start at 0, end at T = {T} and never decrease"
        if torch.compiler.is_compiling():
            # Reading the values on the host would break torch.compile's graph: the device checks them.
            torch._assert_async((cu_seqlens[0] == 0) & (cu_seqlens[-1] == T) & (cu_seqlens.diff() >= 0).all(), message)
        else:
            bounds = sequence_bounds(cu_seqlens)
            if bounds[0] != 0 or bounds[-1] != T or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
                raise ValueError(f"{message}, got {bounds}")
        N = cu_seqlens.numel() - 1

    if initial_state is not None:
        base, residual = ("S0", "R0") if state_name == "initial_state" else ("S", "R")
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise ValueError(f"{state_name} must be a pair ({base}, {residual}); {residual} is None without gamma")
        S0, R0 = initial_state
        if gamma is None and R0 is not None:
            raise ValueError(f"{state_name} has a residual state {residual} but gamma is None")
        for name, state in ((base, S0), (residual, R0)):
            if state is None:
                continue
            if not torch.is_tensor(state) or state.shape != (N, HV, Dk, Dv):
                raise ValueError(f"{state_name}'s {name} must be [N, HV, Dk, Dv] = {(N, HV, Dk, Dv)}, got "
                                 f"{tuple(state.shape) if torch.is_tensor(state) else type(state).__name__}")
            if not state.is_floating_point():
                raise ValueError(f"{state_name}'s {name} must be a floating-point tensor, got {state.dtype}")
            if state.device != q.device:
                raise ValueError(f"{state_name}'s {name} is on {state.device}, the inputs on {q.device}: "
                                 f"give it on the inputs' device")
    return clip, scale


def reslin_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     gamma: Optional[torch.Tensor] = None, *, update: str = "delta", clip: float = 1.0,
                     scale: Optional[float] = None, initial_state: Optional[State] = None,
                     output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                     backend: str = "auto",
                     gamma_write: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[State]]:
    """Residual / Kaczmarz / gated-delta / gated-linear attention over a sequence.

    Args:
        q, k: [B, T, H, Dk]. v: [B, T, HV, Dv], HV a multiple of H; each q/k head serves
            HV / H consecutive value heads.
        g: [B, T, HV] log decay (<= 0; -inf resets the state). beta: [B, T, HV] base write strength.
        gamma: [B, T, HV] correction gate of the residual state, or None for no residual state.
        The rest are keyword-only.
        update: "delta" (GDN, KLA, RDN) or "additive" (sGLA, RLA).
        clip: the residual clip threshold c > 0 (inf: none). scale: > 0, defaults to Dk ** -0.5.
        initial_state: None or (S0, R0), each [N, HV, Dk, Dv] fp32 (N = B, or the number of
            sequences with cu_seqlens); R0 is None without gamma, and may be None (zeros) with it.
        output_final_state: also return the final (S, R).
        cu_seqlens: packed variable-length sequences in one row (B == 1), like FLA: an integer
            tensor on the inputs' device or the CPU.
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
    if torch.is_tensor(cu_seqlens):
        # The Triton kernels index its memory directly; a no-op for the contiguous ones callers make.
        cu_seqlens = cu_seqlens.contiguous()
    clip, scale = _check_inputs(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, initial_state, cu_seqlens,
                                backend)
    needs_grad = _needs_grad(q, k, v, g, beta, gamma, gamma_write, *(initial_state or ()))
    backend = _resolve_backend(backend, (q, k, v, g, beta, gamma, gamma_write), cu_seqlens, needs_grad)
    B, T, H, Dk = q.shape
    HV, Dv = v.shape[2:]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    S0, R0 = initial_state if initial_state is not None else (None, None)
    zeros = lambda: q.new_zeros(N, HV, Dk, Dv, dtype=torch.float32)  # noqa: E731
    S0 = zeros() if S0 is None else S0.float()
    R0 = None if gamma is None else (zeros() if R0 is None else R0.float())
    if backend == "triton" and _is_decode(q, cu_seqlens, needs_grad):
        # The decode kernel advances states in place: give it copies, never the caller's state.
        S0, R0 = (None if x is None else x.clone(memory_format=torch.contiguous_format) for x in (S0, R0))
    o, S, R = _run(backend, q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens, needs_grad)
    return o, ((S, R) if output_final_state else None)


def reslin_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: State, *, gamma: Optional[torch.Tensor] = None,
                       gamma_write: Optional[torch.Tensor] = None, update: str = "delta", clip: float = 1.0,
                       scale: Optional[float] = None, backend: str = "auto") -> torch.Tensor:
    """One token for a batch of sequences, advancing ``state = (S, R)`` in place: what generation
    calls at every step. Inputs shaped as for reslin_attention with T = 1 (the arguments after
    `state` keyword-only); S and R fp32 [B, HV, Dk, Dv] (R None without gamma). Returns
    o [B, 1, HV, Dv] in v's dtype."""
    if state is None:
        raise ValueError("reslin_decode_step advances a state (S, R) in place: pass one (zeros to start)")
    clip, scale = _check_inputs(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, state, None, backend,
                                state_name="state")
    S, R = state
    if S is None:
        raise ValueError("state's S is None: a decode step advances a base state S")
    if q.shape[1] != 1:
        raise ValueError(f"reslin_decode_step takes one token (T = 1), got T = {q.shape[1]}")
    if (gamma is None) != (R is None):
        raise ValueError("state must hold a residual state R exactly when gamma is given")
    for name, x in (("S", S), ("R", R)):
        if x is not None and x.dtype != torch.float32:
            raise ValueError(f"state's {name} must be fp32, got {x.dtype}")
        if x is not None and not x.is_contiguous():
            raise ValueError(f"state's {name} must be contiguous (the step advances it in place): pass .contiguous()")
        if x is not None and x.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(f"state's {name} was made under torch.inference_mode() and the step advances it in "
                             f"place, which torch allows only inside inference_mode: step inside it too, or pass "
                             f"a state made outside it")
        if x is not None and x.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"state's {name} requires grad, but the step advances it in place: pass a state "
                             f"that does not (.detach()), or use reslin_attention for a differentiable step")
    needs_grad = _needs_grad(q, k, v, g, beta, gamma, gamma_write, S, R)
    backend = _resolve_backend(backend, (q, k, v, g, beta, gamma, gamma_write), None, needs_grad)
    o, S_next, R_next = _run(backend, q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S, R, None,
                             needs_grad)
    if S_next is not S:  # the torch backends return new states; the Triton kernel wrote in place
        S.copy_(S_next)
        if R is not None:
            R.copy_(R_next)
    return o


# The chunked forms decay by exp(G_i - G_j), G the cumulative log decay in a chunk: g = -inf (a hard
# reset) makes that -inf - (-inf) = NaN, and a very negative finite g swamps the small g summed
# after it in fp32. exp(-100) ~ 4e-44 is zero for every fp32 purpose, so this floor changes no
# output, and the floor's zero gradient below it is right: the output does not depend on g there.
# The per-token forms (the reference, the decode step) take exp(g) alone and are exact at any g.
LOG_DECAY_FLOOR = -100.0


def _run(backend, q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens, needs_grad):
    """Checked inputs (clip and scale floats), a concrete backend and fp32 states (the decode kernel
    advances them in place); `needs_grad`: whether autograd needs a backward of this call.
    Returns (o in v's dtype, S, R)."""
    H, HV = q.shape[2], v.shape[2]
    if gamma is not None and gamma_write is None:
        gamma_write = gamma
    decode = _is_decode(q, cu_seqlens, needs_grad)
    if backend == "triton" and decode:
        o = triton_decode_step(q, k, v, g, beta, gamma, gamma_write, S0, R0, update, clip, scale)
        return o, S0, R0
    if backend != "recurrent" and not decode:
        g = g.clamp(min=LOG_DECAY_FLOOR)
    if backend == "triton":
        return triton_chunk_attention(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens,
                                      needs_grad)
    if HV != H:
        q, k = (x.repeat_interleave(HV // H, dim=2) for x in (q, k))
    run = recurrent_reslin if backend == "recurrent" else chunk_reslin
    # The torch backends compute in fp32, as the Triton kernels do: autocast would run their
    # matmuls in bf16. (A device without autocast, such as meta, has nothing to turn off.)
    device = q.device.type
    with torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext():
        o, S, R = run(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens)
    return o.to(v.dtype), S, R


def _needs_grad(*tensors):
    """Whether autograd needs a backward of a call on `tensors` (every input and state): decided
    once a call, and passed down."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def _is_decode(q, cu_seqlens, needs_grad):
    """One token without a gradient takes the decode kernel; everything else the chunked kernels."""
    return q.shape[1] == 1 and cu_seqlens is None and not needs_grad


def _not_fp32(tensors):
    """The dtypes other than fp32 among `tensors` (None skipped), as sorted names."""
    return sorted({str(x.dtype) for x in tensors if x is not None and x.dtype != torch.float32})


def _resolve_backend(backend, inputs, cu_seqlens, needs_grad):
    """The concrete backend for this call: "auto" takes Triton where a Triton kernel applies.
    `inputs`: q, k, v, g, beta, gamma, gamma_write (the last two may be None)."""
    q, v = inputs[0], inputs[2]
    decode = _is_decode(q, cu_seqlens, needs_grad)
    # The chunked kernels take head sizes in multiples of CHUNKED_HEAD_DIM_MULTIPLE: on the H200 a
    # key head size of 100 gave wrong outputs and illegal addresses (48, 64, 72, 80, 128, 256 were
    # right), while Triton's interpreter computes it right: not yet understood.
    head_sizes_fit = all(x.shape[-1] % CHUNKED_HEAD_DIM_MULTIPLE == 0 for x in (q, v))
    if backend == "auto":
        triton_applies = triton_decode_step is not None and q.is_cuda and (decode or head_sizes_fit)
        return "triton" if triton_applies and not (TRITON_INTERPRETED and _not_fp32(inputs)) else "torch"
    if backend == "triton":
        if triton_decode_step is None:
            raise ImportError("backend='triton' needs the triton package: install it, or use backend='torch'")
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend='triton' runs on CUDA tensors (or in Triton's interpreter, "
                             f"TRITON_INTERPRET=1), got tensors on {q.device}")
        if TRITON_INTERPRETED and _not_fp32(inputs):
            raise ValueError(f"Triton's interpreter (TRITON_INTERPRET=1) computes only fp32 right, got inputs in "
                             f"{', '.join(_not_fp32(inputs))}: pass fp32 inputs, or use backend='torch' or 'auto'")
        if not (decode or head_sizes_fit):
            raise ValueError(f"the chunked Triton kernels take head sizes that are multiples of "
                             f"{CHUNKED_HEAD_DIM_MULTIPLE}; got Dk = {q.shape[-1]}, Dv = {v.shape[-1]}: "
                             f"use backend='torch' or 'auto'")
    return backend
