"""torch.compile through the Triton ops (registered as torch.library custom ops with fake
implementations): no graph breaks, and the compiled step gives the eager step's loss and
gradients. On the CPU the kernels run in Triton's interpreter and the graphs in the aot_eager
backend (inductor's CPU code generation would add minutes); test_gpu.py compiles with inductor."""

import pytest
import torch

import kernels_reslin
import kernels_reslin_triton
from conftest import build_model
from kernels_reslin import reslin_attention
from test_kernels import make_inputs, rel_err
from test_kernels_triton import keep_states_of_short_rows

pytestmark = pytest.mark.skipif(kernels_reslin.triton_decode_step is None, reason="needs the triton package")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "inductor" if torch.cuda.is_available() else "aot_eager"


def compiled_and_eager(fn, *inputs):
    """(loss, gradients of `inputs`) of fn eagerly and compiled with fullgraph=True (a graph break
    raises)."""
    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend=BACKEND)):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        loss = run(*leaves)
        results.append([loss] + list(torch.autograd.grad(loss, leaves)))
    return results


@pytest.mark.parametrize("update,residual", [("delta", True), ("additive", False)])
def test_reslin_attention_compiles_without_graph_breaks(update, residual):
    x = make_inputs(1, 70, 2, 2, 16, 16, residual)
    inputs = [x[n].to(DEVICE) for n in ("q", "k", "v", "g", "beta", "gamma") if x[n] is not None]

    def step(*args):
        o, (S, R) = reslin_attention(*args, update=update, output_final_state=True, backend="triton")
        return o.square().sum() + S.sum() + (R.sum() if residual else 0)

    compiled, eager = compiled_and_eager(step, *inputs)
    for got, ref in zip(compiled, eager):
        assert rel_err(got, ref) < 1e-6


@pytest.mark.parametrize("update,residual", [("delta", True), ("delta", False), ("additive", False)])
def test_custom_ops_pass_opcheck_with_strided_inputs(update, residual, monkeypatch):
    """The fake implementations give the real outputs' shapes, dtypes and strides (inductor asserts
    the strides; a model hands the ops views of its projections, not contiguous tensors), and the
    registered autograd formula holds under AOT dispatch; the delta rule hands its inverses (T^-1,
    and T_R^-1 with the residual state) from the forward op to the backward op, and its kept
    states (three segments of a row of three chunks here)."""
    keep_states_of_short_rows(monkeypatch, sequence_heads=6)
    x = make_inputs(1, 140, 2, 2, 16, 16, residual)
    x["gamma_write"] = x["gamma"]  # reslin_attention's default
    strided = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2) if t.dim() == 4 else t  # noqa: E731
    inputs = [None if x[n] is None else strided(x[n].detach().to(DEVICE)).requires_grad_()
              for n in ("q", "k", "v", "g", "beta", "gamma", "gamma_write", "S0", "R0")]
    assert not inputs[2].is_contiguous()
    torch.library.opcheck(kernels_reslin_triton.chunk_forward_op, (*inputs, None, update, 0.5, 0.25))
    o, S, R, inverse, kept_states = kernels_reslin_triton.chunk_forward_op(*inputs, None, update, 0.5, 0.25)
    assert kept_states.shape == ((1 + residual, 3, 2, 16, 16) if update == "delta" else (0,))
    grads_out = [strided(torch.randn_like(o)), torch.randn_like(S), torch.randn_like(R) if residual else None]
    detached = [None if t is None else t.detach() for t in inputs]
    ops = getattr(torch.ops, kernels_reslin_triton.OP_NAMESPACE)
    torch.library.opcheck(ops.chunk_backward.default,
                          (*detached, None, *grads_out, kernels_reslin_triton._optional(inverse),
                           kernels_reslin_triton._optional(kept_states), update, 0.5, 0.25))


@pytest.mark.parametrize("update,residual", [("delta", True), ("delta", False), ("additive", False)])
def test_eager_autograd_function_equals_the_custom_ops(update, residual):
    """Eager training calls skip the op's dispatch through an autograd.Function sharing the op's
    forward, saved tensors and backward: outputs and every gradient equal the op's exactly."""
    x = make_inputs(2, 40, 2, 2, 16, 16, residual)
    x["gamma_write"] = x["gamma"]
    names = ("q", "k", "v", "g", "beta", "gamma", "gamma_write", "S0", "R0")
    results = []
    for differentiable in (kernels_reslin_triton.chunk_forward_op, kernels_reslin_triton._EagerChunkAttention.apply):
        leaves = [None if x[n] is None else x[n].detach().to(DEVICE).requires_grad_() for n in names]
        o, S, R, _, _ = differentiable(*leaves, None, update, 0.5, 0.25)
        loss = o.square().sum() + S.sum() + (R.sum() if residual else 0)
        results.append([o, S] + list(torch.autograd.grad(loss, [t for t in leaves if t is not None])))
    for got, ref in zip(*results, strict=True):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("kernel_backend", ["triton", "torch"])
@pytest.mark.parametrize("mixer_name", ["rdn", "gdn"])
def test_model_training_step_compiles_without_graph_breaks(mixer_name, kernel_backend):
    """The torch backend's chunks hand the gates' gradient back strided: the gates' own backward
    must compile for such gradients too."""
    model = build_model(mixer_name, kernel_backend=kernel_backend, head_dim=16).train().to(DEVICE)
    ids = torch.randint(3, 100, (2, 40), device=DEVICE)
    params = list(model.parameters())
    results = []
    for run in (model, torch.compile(model, fullgraph=True, backend=BACKEND)):
        loss = run(ids, labels=ids).loss
        results.append([loss] + list(torch.autograd.grad(loss, params)))
    for got, ref in zip(*results):
        assert rel_err(got, ref) < 1e-5
