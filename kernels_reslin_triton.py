"""The Triton backend of ResLin as kernels_reslin calls it: the chunked forward, its backward and
the decode step registered as torch.library custom ops, with fake implementations (shapes
only), so that torch.compile traces through them without graph breaks; the forward's gradient
is registered as the backward op. Eager autograd runs the same forward, saved tensors and
backward through `_EagerChunkAttention`, without the ops' dispatch.

The kernels live in the kernels_reslin_triton_* modules: launch (the launcher), common (tile
helpers), decode, wy (T^-1, P, the WY terms), state (the state passes), output, forward (the
chain of launches), backward, and tuning (every tile, warp and path choice); layers and gemv
hold the model's fused layer kernels and a generation step's products, which the model calls
directly.
"""

import hashlib
import pathlib
from typing import List, Optional, Tuple

import torch

try:
    from .kernels_reslin_triton_backward import chunk_backward
    from .kernels_reslin_triton_decode import decode_step
    from .kernels_reslin_triton_forward import chunk_forward
    from .kernels_reslin_triton_launch import _cdiv
    from .kernels_reslin_triton_tuning import CHUNK_SIZE, kept_segments
except ImportError:
    from kernels_reslin_triton_backward import chunk_backward
    from kernels_reslin_triton_decode import decode_step
    from kernels_reslin_triton_forward import chunk_forward
    from kernels_reslin_triton_launch import _cdiv
    from kernels_reslin_triton_tuning import CHUNK_SIZE, kept_segments


def _op_namespace():
    """"reslin_" and a hash of this file and its kernels_reslin_triton_* siblings: remote code can
    import them under several module names (and two checkpoints may carry different versions of
    them), and identical code shares one registration."""
    folder = pathlib.Path(__file__).resolve().parent
    digest = hashlib.sha1()
    for path in [pathlib.Path(__file__).resolve(), *sorted(folder.glob("kernels_reslin_triton_*.py"))]:
        digest.update(path.read_bytes())
    return "reslin_" + digest.hexdigest()[:12]


OP_NAMESPACE = _op_namespace()


def _absent(like):
    """An absent optional output: ops return tensors only."""
    return like.new_empty(0)


def _contiguous_like(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _optional(x):
    return None if x.numel() == 0 else x


def _chunk_forward_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           gamma: Optional[torch.Tensor], gamma_write: Optional[torch.Tensor], S0: torch.Tensor,
                           R0: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], update: str, clip: float,
                           scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor]:
    """chunk_forward as its op returns it, tensors only: (o, S, R, and the inverses and the states
    kept for the backward)."""
    o, S, R, inverse, kept_states = chunk_forward(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0,
                                                  cu_seqlens, CHUNK_SIZE, training=True)
    return (o, S, (_absent(S) if R is None else R), (_absent(q) if inverse is None else inverse),
            (_absent(S) if kept_states is None else kept_states))


def _chunk_backward_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            gamma: Optional[torch.Tensor], gamma_write: Optional[torch.Tensor], S0: torch.Tensor,
                            R0: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], do: torch.Tensor,
                            dS: Optional[torch.Tensor], dR: Optional[torch.Tensor], inverse: Optional[torch.Tensor],
                            kept_states: Optional[torch.Tensor], update: str, clip: float,
                            scale: float) -> List[torch.Tensor]:
    """chunk_backward as its op returns it, tensors only."""
    grads = chunk_backward(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens, do, dS, dR,
                           inverse=inverse, kept_states=kept_states)
    return [_absent(q) if grad is None else grad for grad in grads]


def _save_for_backward(ctx, inputs, output):
    q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, update, clip, scale = inputs
    inverse, kept_states = output[3:]
    ctx.mark_non_differentiable(inverse, kept_states)
    # Gradients of unused outputs arrive as None, not as zeros: T^-1 and the kept states never
    # have one, and the backward takes dS and dR as None already.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, inverse, kept_states)
    ctx.update, ctx.clip, ctx.scale = update, clip, scale


def _backward_through(chunk_backward_call):
    """The chunked forward's gradient, computed by `chunk_backward_call`: the backward op where
    torch.compile traces it, its body under eager autograd."""
    def backward(ctx, do, dS, dR, _inverse, _kept_states):
        q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, inverse, kept_states = ctx.saved_tensors
        do = torch.zeros_like(v) if do is None else do  # o unused: only the final states carry a gradient
        grads = chunk_backward_call(q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, do, dS,
                                    dR if gamma is not None else None, _optional(inverse), _optional(kept_states),
                                    ctx.update, ctx.clip, ctx.scale)
        return (*(_optional(grad) for grad in grads), None, None, None, None)
    return backward


class _EagerChunkAttention(torch.autograd.Function):
    """The chunked forward under eager autograd: the op's forward, saved tensors and backward
    without the op's dispatch, which costs about a tenth of a millisecond of host time a training
    call (tools/host_time.py)."""
    @staticmethod
    def forward(ctx, *inputs):  # no setup_context: apply would then bind the arguments by signature
        output = _chunk_forward_tensors(*inputs)
        _save_for_backward(ctx, inputs, output)
        return output

    backward = staticmethod(_backward_through(_chunk_backward_tensors))


def _register_ops():
    ops = getattr(torch.ops, OP_NAMESPACE)
    if hasattr(ops, "chunk_forward"):  # registered by another import of this same file
        return ops.chunk_forward, ops.decode_step

    chunk_forward_op = torch.library.custom_op(f"{OP_NAMESPACE}::chunk_forward", mutates_args=())(
        _chunk_forward_tensors)

    # The kernels write fresh contiguous tensors whatever the inputs' strides; the fakes must say
    # so (inductor checks the real strides against them).
    @chunk_forward_op.register_fake
    def _(q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, update, clip, scale):
        S = _contiguous_like(S0)
        B, T, HV = v.shape[:3]
        inverse = q.new_empty(1 + (gamma is not None), B * T, HV, CHUNK_SIZE) if update == "delta" else _absent(q)
        segment_chunks, segments = kept_segments(update, cu_seqlens is not None, B, HV, _cdiv(T, CHUNK_SIZE))
        kept_states = S.new_empty(1 + (gamma is not None), B * segments, *S.shape[1:]) if segment_chunks else \
            _absent(S)
        return _contiguous_like(v), S, (_absent(S) if gamma is None else torch.empty_like(S)), inverse, kept_states

    chunk_backward_op = torch.library.custom_op(f"{OP_NAMESPACE}::chunk_backward", mutates_args=())(
        _chunk_backward_tensors)

    @chunk_backward_op.register_fake
    def _(q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, do, dS, dR, inverse, kept_states, update, clip,
          scale):
        like = (q, k, v, g, beta, gamma, gamma_write, S0, R0 if gamma is not None else None)
        return [_absent(q) if x is None else _contiguous_like(x) for x in like]

    chunk_forward_op.register_autograd(_backward_through(chunk_backward_op), setup_context=_save_for_backward)

    @torch.library.custom_op(f"{OP_NAMESPACE}::decode_step", mutates_args=("S", "R"))
    def decode_step_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       gamma: Optional[torch.Tensor], gamma_write: Optional[torch.Tensor], S: torch.Tensor,
                       R: Optional[torch.Tensor], update: str, clip: float, scale: float) -> torch.Tensor:
        return decode_step(q, k, v, g, beta, gamma, gamma_write, S, R, update, clip, scale)

    @decode_step_op.register_fake
    def _(q, k, v, g, beta, gamma, gamma_write, S, R, update, clip, scale):
        return _contiguous_like(v)

    return chunk_forward_op, decode_step_op


chunk_forward_op, decode_step_op = _register_ops()


def chunk_attention(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens, needs_grad):
    """The chunked forward: (o, S, R), R None without the residual state. Through its custom op
    where torch.compile traces it, through `_EagerChunkAttention` where eager autograd needs a
    backward (`needs_grad`, which the caller decides once a call), otherwise chunk_forward itself
    (the op's dispatch costs tens of microseconds a call)."""
    if torch.compiler.is_compiling():
        differentiable = chunk_forward_op
    elif needs_grad:
        differentiable = _EagerChunkAttention.apply
    else:
        return chunk_forward(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens)
    o, S, R, _, _ = differentiable(q, k, v, g, beta, gamma, gamma_write, S0, R0, cu_seqlens, update, clip, scale)
    return o, S, (R if gamma is not None else None)


def decode_step_call(*args):
    """decode_step, through its custom op while torch.compile traces (the op's dispatch costs a
    one-token step more than its kernel when run eagerly)."""
    return decode_step_op(*args) if torch.compiler.is_compiling() else decode_step(*args)
