"""The Triton kernels against the fp32 per-token reference.

On a machine without a GPU they run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET),
in fp32 only (the interpreter computes bf16 wrongly): relative error <= 1e-5. The same tests
run compiled on a GPU; test_gpu.py adds bf16 at real sizes there.
"""

import sys

import pytest
import torch

import kernels_reslin
from kernels_reslin import reslin_attention, reslin_decode_step
from test_kernels import STEPPED_RULES, make_inputs, rel_err

pytestmark = pytest.mark.skipif(kernels_reslin.triton_decode_step is None, reason="needs the triton package")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (B, H, HV, Dk, Dv): one head, several heads, grouped value heads, Dk != Dv, sizes that are
# not powers of two (masked tiles).
DECODE_SHAPES = [(1, 1, 1, 16, 16), (3, 2, 4, 16, 32), (2, 2, 2, 24, 12), (1, 1, 2, 128, 64)]


def on_device(x):
    return {n: None if t is None else t.to(DEVICE) for n, t in x.items()}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "B{}H{}HV{}Dk{}Dv{}".format(*s))
@pytest.mark.parametrize("name,update,residual,kaczmarz", STEPPED_RULES)
def test_decode_step_matches_reference(name, update, residual, kaczmarz, shape, backend):
    """reslin_decode_step in place, through the Triton kernel and through the torch fallback."""
    B, H, HV, Dk, Dv = shape
    x = on_device(make_inputs(B, 3, H, HV, Dk, Dv, residual, kaczmarz=kaczmarz))
    S = x["S0"].clone()
    R = x["R0"].clone() if residual else None
    for t in range(3):  # three steps in place, each against the reference run from the start
        step = {n: x[n][:, t:t + 1] for n in ("q", "k", "v", "g", "beta")}
        gates = {n: None if x[n] is None else x[n][:, t:t + 1] for n in ("gamma", "gamma_write")}
        o = reslin_decode_step(**step, state=(S, R), **gates, update=update, backend=backend)
        prefix = {n: v if v is None or n in ("S0", "R0") else v[:, :t + 1] for n, v in x.items()}
        o_ref, (S_ref, R_ref) = reslin_attention(
            prefix["q"], prefix["k"], prefix["v"], prefix["g"], prefix["beta"], prefix["gamma"],
            update=update, initial_state=(x["S0"], x["R0"]), output_final_state=True,
            backend="recurrent", gamma_write=prefix["gamma_write"])
        assert rel_err(o, o_ref[:, -1:]) < 1e-5
        assert rel_err(S, S_ref) < 1e-5
        if residual:
            assert rel_err(R, R_ref) < 1e-5


@pytest.mark.parametrize("name,update,residual,kaczmarz", STEPPED_RULES)
def test_triton_backend_leaves_the_initial_state_alone(name, update, residual, kaczmarz):
    x = on_device(make_inputs(2, 1, 2, 2, 16, 16, residual, kaczmarz=kaczmarz))
    S0 = x["S0"].clone()
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "gamma")]
    o, (S, R) = reslin_attention(*args, update=update, initial_state=(x["S0"], x["R0"]),
                                 output_final_state=True, backend="triton", gamma_write=x["gamma_write"])
    o_ref, (S_ref, _) = reslin_attention(*args, update=update, initial_state=(x["S0"], x["R0"]),
                                         output_final_state=True, backend="recurrent",
                                         gamma_write=x["gamma_write"])
    assert torch.equal(x["S0"], S0)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


# (B, T, H, HV, Dk, Dv, sequence lengths or None): T not a multiple of the chunk (64), grouped value
# heads, Dk != Dv, a head size that is not a power of two (masked tiles); and packed sequences of
# 1, 69, 5 and 75 tokens.
CHUNK_CASES = [(2, 70, 2, 4, 16, 32, None), (1, 150, 1, 2, 48, 16, [1, 69, 5, 75])]


def case_inputs(case, residual, kaczmarz):
    """(inputs, cu_seqlens or None) of a (B, T, H, HV, Dk, Dv, sequence lengths or None) case;
    packed sequences get one initial state each."""
    B, T, H, HV, Dk, Dv, lengths = case
    x = on_device(make_inputs(B, T, H, HV, Dk, Dv, residual, kaczmarz=kaczmarz))
    if lengths is None:
        return x, None
    for n in ("S0", "R0"):
        x[n] = None if x[n] is None else torch.randn(len(lengths), *x[n].shape[1:], device=DEVICE) * 0.3
    return x, torch.tensor([0] + lengths, device=DEVICE).cumsum(0)


def assert_forward_matches_reference(x, update, residual, cu_seqlens, states_bound=1e-5):
    """The Triton forward without gradients against the per-token reference: relative error <=
    1e-5 for the outputs, <= states_bound for the final states."""
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "gamma")]
    results = {}
    for backend in ("recurrent", "triton"):
        with torch.no_grad():
            o, (S, R) = reslin_attention(*args, update=update, initial_state=(x["S0"], x["R0"]),
                                         output_final_state=True, cu_seqlens=cu_seqlens, backend=backend,
                                         gamma_write=x["gamma_write"])
        results[backend] = [o, S] + ([R] if residual else [])
    for label, got, ref in zip(("o", "S", "R"), results["triton"], results["recurrent"]):
        bound = 1e-5 if label == "o" else states_bound
        assert rel_err(got, ref) < bound, f"{label}: {rel_err(got, ref):.2e}"


@pytest.mark.parametrize("case", CHUNK_CASES, ids=["batch", "varlen"])
@pytest.mark.parametrize("name,update,residual,kaczmarz", STEPPED_RULES)
def test_chunked_forward_matches_reference(name, update, residual, kaczmarz, case):
    x, cu_seqlens = case_inputs(case, residual, kaczmarz)
    assert_forward_matches_reference(x, update, residual, cu_seqlens)


def kernels_modules(role=None):
    """Every import of kernels_reslin_triton, or of kernels_reslin_triton_<role> (plain, and the
    remote-code package's): the custom op runs the first one's code."""
    module_name = "kernels_reslin_triton" + ("" if role is None else f"_{role}")
    return [m for name, m in sys.modules.items() if name.rpartition(".")[2] == module_name]


@pytest.mark.parametrize("case,decay", [(CHUNK_CASES[0], 1), (CHUNK_CASES[1], 1), ((1, 200, 1, 2, 16, 16, None), 8)],
                         ids=["batch", "varlen", "strong_decay"])
@pytest.mark.parametrize("name,update,residual,kaczmarz", STEPPED_RULES)
def test_chunked_forward_in_chunks_of_128_matches_reference(name, update, residual, kaczmarz, case, decay,
                                                            monkeypatch):
    """A forward without gradients in chunks of 128 (`forward_chunk_size`, sGLA's below 64
    sequence-heads, RLA's below 32; forced here for every rule): T^-1 from blocks of 32, RLA's
    writes kernel over whole value rows (`writes_launch`), the output kernel's
    programs over 64 rows each, the second reading the chunk's first 64 rows' writes whole. T not
    a multiple of 64 nor 128, packed sequences, and 8x the log decay (e^(G_i - G_j) across the
    row blocks must stay masked where it would overflow). Relative error <= 1e-5 in fp32, but for
    the final states with 8x the decay: G then falls to ~-200 within a chunk of 128, where fp32
    resolves ~1.5e-5, and e^(G_last - G) near the chunk's end carries that (2.7e-5 here; 1.1e-6 in
    chunks of 64, whose G falls half as far)."""
    sizes = []
    for module in kernels_modules("forward"):
        monkeypatch.setattr(module, "forward_chunk_size", lambda *args: sizes.append(128) or 128)
    x, cu_seqlens = case_inputs(case, residual, kaczmarz)
    x["g"] = x["g"] * decay
    assert_forward_matches_reference(x, update, residual, cu_seqlens, states_bound=5e-5 if decay > 1 else 1e-5)
    assert sizes == [128]


@pytest.mark.parametrize("path", ["sequential", "segments"])
@pytest.mark.parametrize("name,update,residual,kaczmarz", [rule for rule in STEPPED_RULES if rule[1] == "additive"])
def test_additive_forward_in_chunks_of_128_each_way_matches_reference(name, update, residual, kaczmarz, path,
                                                                        monkeypatch):
    """The additive rule's other state passes in chunks of 128: the sequential state kernel (sGLA's
    from 32 sequence-heads), and segments side by side, joined (forced at small sizes: 330 tokens,
    3 chunks of 128, one segment each). Relative error <= 1e-5 in fp32."""
    split = []
    for module in kernels_modules("tuning"):
        if path == "segments":
            monkeypatch.setattr(module, "MIN_SEGMENTS", 2)
            monkeypatch.setattr(module, "PARALLEL_PROGRAMS", 16)  # 4 programs run the state kernel here
            monkeypatch.setattr(module, "MIN_SEGMENT_CHUNKS", 1)
    for module in kernels_modules("forward"):
        monkeypatch.setattr(module, "forward_chunk_size", lambda *args: 128)
        monkeypatch.setattr(module, "scans_states", lambda delta, sequence_heads: False)
        monkeypatch.setattr(module, "fuse_residual_passes", lambda delta, sequence_heads, segments: False)
        monkeypatch.setattr(module._ChunkRun, "advance_in_segments",
                            lambda run, initial, segments, *writes, original=module._ChunkRun.advance_in_segments:
                            split.append(segments) or original(run, initial, segments, *writes))
    x = on_device(make_inputs(2, 330, 2, 2, 32, 16, residual, kaczmarz=kaczmarz))
    assert_forward_matches_reference(x, update, residual, None)
    assert split == ([3] * (2 if residual else 1) if path == "segments" else [])


@pytest.mark.parametrize("name,update,residual,kaczmarz", STEPPED_RULES)
def test_forward_chunk_size_is_long_for_sgla_below_64_and_rla_below_32_sequence_heads_only(name, update, residual,
                                                                                         kaczmarz):
    expected = {"sgla": [128, 128, 128, 128, 64, 64], "rla": [128, 128, 64, 64, 64, 64]}
    for module in kernels_modules("tuning"):
        sizes = [module.forward_chunk_size(update, residual, sequences, heads)
                 for sequences, heads in ((1, 16), (1, 31), (2, 16), (2, 31), (4, 16), (1, 64))]
        assert sizes == expected.get(name, [64] * 6)


@pytest.mark.parametrize("name,update,residual,kaczmarz", [rule for rule in STEPPED_RULES if rule[0] in ("sgla", "rla")])
def test_only_a_forward_without_gradients_takes_forward_chunk_size(name, update, residual, kaczmarz, monkeypatch):
    """A forward that no backward will follow runs in `forward_chunk_size`'s chunks; a
    differentiable call runs its forward in the backward's, CHUNK_SIZE."""
    sizes = []
    for module in kernels_modules("forward"):
        monkeypatch.setattr(module, "forward_chunk_size", lambda *args: 128)
        monkeypatch.setattr(module._ChunkRun, "__init__", lambda run, *args, original=module._ChunkRun.__init__,
                            **kwargs: sizes.append(args[10]) or original(run, *args, **kwargs))
    x = on_device(make_inputs(1, 3, 1, 2, 16, 16, residual, kaczmarz=kaczmarz))
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "gamma")]
    with torch.no_grad():
        reslin_attention(*args, update=update, backend="triton", gamma_write=x["gamma_write"])
    reslin_attention(*(a.requires_grad_() if a is not None else None for a in args), update=update,
                     backend="triton", gamma_write=x["gamma_write"])
    assert sizes == [128, 64]


def test_chunked_triton_forward_names_the_head_sizes_it_takes():
    x = on_device(make_inputs(1, 4, 1, 1, 24, 16, residual=False))
    with pytest.raises(ValueError, match="multiples of 16; got Dk = 24, Dv = 16:"):
        reslin_attention(*(x[n] for n in ("q", "k", "v", "g", "beta")), backend="triton")
    one_token = {n: x[n][:, :1] for n in ("q", "k", "v", "g", "beta")}  # the decode kernel takes any size
    assert rel_err(reslin_attention(**one_token, backend="triton")[0],
                   reslin_attention(**one_token, backend="recurrent")[0]) < 1e-5


def test_triton_backend_names_the_device_it_needs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = make_inputs(1, 4, 1, 1, 16, 16, residual=False)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        reslin_attention(*(x[n] for n in ("q", "k", "v", "g", "beta")), backend="triton")


# and one token; head sizes past one tile of the gradient kernels (64 key columns, 64 value
# columns), so that they sum over key tiles and loop over value tiles as at D = 128 on a GPU; and
# the largest head size, 256 (key tiles of 256 in the state kernels, fewer pipeline stages).
GRAD_CASES = CHUNK_CASES + [(2, 1, 2, 2, 16, 16, None), (1, 70, 1, 1, 80, 96, None), (1, 70, 1, 1, 256, 256, None)]


def outputs_and_gradients(x, update, residual, cu_seqlens, backend, weighed_states=("S", "R")):
    """(labels, tensors) of one backend: o (and the final states of `weighed_states`), then the
    gradient of every input and initial state present, for a random weighting of the output
    and of those final states (the others unused: their gradients arrive as None), with a clip
    (0.5) that clips part of the residuals."""
    names = [n for n in ("q", "k", "v", "g", "beta", "gamma", "gamma_write", "S0", "R0") if x[n] is not None]
    leaves = {n: x[n].detach().clone().requires_grad_() if n in names else None for n in x}
    o, final_states = reslin_attention(*(leaves[n] for n in ("q", "k", "v", "g", "beta", "gamma")), update=update,
                                       clip=0.5, initial_state=(leaves["S0"], leaves["R0"]),
                                       output_final_state=bool(weighed_states), cu_seqlens=cu_seqlens, backend=backend,
                                       gamma_write=leaves["gamma_write"])
    S, R = final_states or (None, None)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    weigh = lambda t: (t * torch.randn(t.shape, device=DEVICE, generator=gen)).sum()  # noqa: E731
    states = [(label, state) for label, state in (("S", S), ("R", R)) if label in weighed_states and state is not None]
    loss = weigh(o) + sum(weigh(state) for _, state in states)
    labels = ["o"] + [label for label, _ in states] + [f"d{n}" for n in names]
    return labels, [o] + [state for _, state in states] + list(torch.autograd.grad(loss, [leaves[n] for n in names]))


def assert_gradients_match_reference(x, update, residual, cu_seqlens, weighed_states=("S", "R")):
    """`outputs_and_gradients` through the Triton kernels against the per-token reference:
    relative error <= 1e-5 in fp32."""
    labels, ref = outputs_and_gradients(x, update, residual, cu_seqlens, "recurrent", weighed_states)
    _, got = outputs_and_gradients(x, update, residual, cu_seqlens, "triton", weighed_states)
    for label, a, b in zip(labels, got, ref):
        assert rel_err(a, b) < 1e-5, f"{label}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("case", GRAD_CASES, ids=["batch", "varlen", "one_token", "wide", "d256"])
@pytest.mark.parametrize("name,update,residual,kaczmarz", STEPPED_RULES)
def test_chunked_backward_matches_reference(name, update, residual, kaczmarz, case):
    """Gradients of every input and initial state through the Triton backward against autograd
    through the per-token reference (`outputs_and_gradients`): relative error <= 1e-5 in fp32."""
    x, cu_seqlens = case_inputs(case, residual, kaczmarz)
    assert_gradients_match_reference(x, update, residual, cu_seqlens)


UNUSED_FINAL_STATES = [(*rule, ()) for rule in STEPPED_RULES] + [(*rule, ("S",)) for rule in STEPPED_RULES if rule[2]]


@pytest.mark.parametrize("name,update,residual,kaczmarz,weighed_states", UNUSED_FINAL_STATES,
                         ids=[f"{case[0]}-{'S_alone' if case[4] else 'none'}" for case in UNUSED_FINAL_STATES])
def test_backward_from_unused_final_states_matches_reference(name, update, residual, kaczmarz, weighed_states):
    """The reverse passes start from a zero gradient where a final state is unused (its
    gradient arrives as None): every one, or R's alone (S's carries the loss). Every gradient,
    the initial states' included, against the reference: relative error <= 1e-5 in fp32."""
    x, cu_seqlens = case_inputs(CHUNK_CASES[0], residual, kaczmarz)
    assert_gradients_match_reference(x, update, residual, cu_seqlens, weighed_states)


@pytest.mark.parametrize("case", GRAD_CASES[3:], ids=["wide", "d256"])
@pytest.mark.parametrize("name,update,residual,kaczmarz", [rule for rule in STEPPED_RULES if not rule[2]])
def test_backward_with_half_precision_key_tiles_matches_reference(name, update, residual, kaczmarz, case,
                                                                   monkeypatch):
    """The keys' gradient kernel launched as for bf16 and fp16 (`grad_keys_launches`: the delta
    rule without R takes key tiles of 128 there, which do not fit fp32's shared memory on the
    GPU), run here in fp32 for the rules without R: head sizes 80 (one tile, masked columns) and
    256 (two tiles). Relative error <= 1e-5."""
    for module in kernels_modules("backward"):
        monkeypatch.setattr(module, "grad_keys_launches", lambda delta, residual, BV_full, fp32,
                            original=module.grad_keys_launches: original(delta, residual, BV_full, False))
    x, cu_seqlens = case_inputs(case, residual, kaczmarz)
    assert_gradients_match_reference(x, update, residual, cu_seqlens)


@pytest.mark.parametrize("name,update,residual,kaczmarz", [rule for rule in STEPPED_RULES if rule[2]])
def test_backward_keeps_the_forwards_clip_decisions(name, update, residual, kaczmarz):
    """The backward's recompute stores z = v - pred in the inputs' dtype, whose rounding near the
    clip could flip a decision, so it stores +-inf where the forward clipped. A sequence's first
    token reads only the initial state, pred = S0^T k: there the stored z must be v - S0^T k
    within the clip and +-inf (z's sign) beyond it, in fp32."""
    B, H, HV, D, clip = 4, 2, 4, 16, 0.5
    x = on_device(make_inputs(B, 1, H, HV, D, D, residual, kaczmarz))
    module = kernels_modules("forward")[0]
    run = module._ChunkRun(x["q"], x["k"], x["v"], x["g"], x["beta"], x["gamma"], x["gamma"], update, clip, None, 64,
                           for_backward=True)
    run.forward_states(x["S0"], x["R0"])
    z = x["v"] - torch.einsum("bhkv,bthk->bthv", x["S0"], x["k"].repeat_interleave(HV // H, dim=2))
    clipped = z.abs() > clip
    assert 0 < clipped.sum() < clipped.numel()
    stored = run.z.view_as(z)
    assert torch.equal(stored[clipped], z[clipped].sign() * float("inf"))
    torch.testing.assert_close(stored[~clipped], z[~clipped], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,update,residual,kaczmarz", [rule for rule in STEPPED_RULES if rule[1] == "delta"])
def test_delta_rule_backward_takes_the_forwards_inverse(name, update, residual, kaczmarz, monkeypatch):
    """The forward op keeps the delta rule's inverses (T^-1, and T_R^-1 with the residual state),
    and the backward uses them instead of forming them again. Here the output
    is left unused (its gradient arrives as None) and the final states carry the loss: every
    gradient against the reference, relative error <= 1e-5 in fp32."""
    kept = []
    for module in kernels_modules():
        monkeypatch.setattr(module, "chunk_backward",
                            lambda *args, original=module.chunk_backward, **kwargs:
                            kept.append(kwargs["inverse"] is not None) or original(*args, **kwargs))
    x, _ = case_inputs(CHUNK_CASES[0], residual, kaczmarz)
    names = [n for n in ("q", "k", "v", "g", "beta", "gamma", "gamma_write", "S0", "R0") if x[n] is not None]
    gradients = []
    for backend in ("recurrent", "triton"):
        leaves = {n: x[n].detach().clone().requires_grad_() if n in names else None for n in x}
        _, (S, R) = reslin_attention(*(leaves[n] for n in ("q", "k", "v", "g", "beta", "gamma")), update=update,
                                     initial_state=(leaves["S0"], leaves["R0"]), output_final_state=True,
                                     backend=backend, gamma_write=leaves["gamma_write"])
        loss = S.square().sum() + (R.square().sum() if residual else 0)
        gradients.append(torch.autograd.grad(loss, [leaves[n] for n in names], materialize_grads=True))  # dq = 0
    assert kept == [True]
    for name, ref, got in zip(names, *gradients):
        assert rel_err(got, ref) < 1e-5, f"d{name}: {rel_err(got, ref):.2e}"


@pytest.mark.parametrize("one_pass", [True, False], ids=["one_pass", "two_passes"])
@pytest.mark.parametrize("case", GRAD_CASES[:2] + [(1, 70, 1, 3, 16, 16, None)], ids=["batch", "varlen", "3_heads"])
def test_residual_additive_states_in_one_pass_or_two_match_reference(case, one_pass, monkeypatch):
    """RLA's S and R advance in one kernel over few (sequence, head) pairs, in two passes and the
    writes kernel between them over many (`fuse_residual_passes`): each way forced here,
    outputs, final states and every gradient against the reference, relative error <= 1e-5 in fp32.
    Three value heads: the fused pass's factors are formed for a power of two of heads, masked."""
    fused = []
    for module in kernels_modules("forward"):
        monkeypatch.setattr(module, "fuse_residual_passes", lambda delta, sequence_heads, segments: one_pass)
        monkeypatch.setattr(module._ChunkRun, "advance_both",
                            lambda run, *args, original=module._ChunkRun.advance_both:
                            fused.append(True) or original(run, *args))
    x, cu_seqlens = case_inputs(case, residual=True, kaczmarz=False)
    labels, ref = outputs_and_gradients(x, "additive", True, cu_seqlens, "recurrent")
    _, got = outputs_and_gradients(x, "additive", True, cu_seqlens, "triton")
    assert fused == ([True] * 2 if one_pass else [])  # the forward and the backward's recompute
    for label, a, b in zip(labels, got, ref):
        assert rel_err(a, b) < 1e-5, f"{label}: {rel_err(a, b):.2e}"


class LaunchRecorder:
    """A kernel whose launches (`kernel[grid](...)`) append their grids to `grids` first."""

    def __init__(self, kernel, grids):
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def keep_states_of_short_rows(monkeypatch, sequence_heads):
    """`kept_segments` as it is, but for rows of a few chunks: segments of one chunk or more (16 or
    more on a GPU), as many as bring the (row, head) pairs to `sequence_heads`."""
    for module in kernels_modules("tuning"):
        monkeypatch.setattr(module, "MIN_KEPT_SEGMENT_CHUNKS", 1)
        monkeypatch.setattr(module, "KEPT_SEQUENCE_HEADS", sequence_heads)


@pytest.mark.parametrize("case,segments", [((2, 300, 1, 2, 16, 32, None), 3), ((1, 200, 2, 2, 16, 16, None), 2),
                                           ((2, 192, 1, 2, 16, 32, None), 3)],
                         ids=["uneven_segments", "even_segments", "segments_tiling_rows"])
@pytest.mark.parametrize("name,update,residual,kaczmarz", [rule for rule in STEPPED_RULES if rule[1] == "delta"])
def test_backward_runs_from_kept_segment_starts(name, update, residual, kaczmarz, case, segments, monkeypatch):
    """A training forward keeps the fp32 states at its rows' segment starts (`kept_segments`);
    the backward's recompute runs every segment at once from them (its state kernel over rows x
    segments x heads programs' pairs, where the forward's ran over rows x heads). Outputs, final
    states and every gradient against the reference, relative error <= 1e-5 in fp32. Five chunks
    a row in three segments leaves the last one short, with a partial chunk; four in two end in
    a partial chunk; three whole chunks in three segments tile the rows, which the recompute then
    passes over as rows of their own, with no tables of their bounds (`kept_segment_rows`)."""
    B, T, H, HV = case[:4]
    keep_states_of_short_rows(monkeypatch, sequence_heads=B * HV * segments)
    launches, tables = [], []
    for module in kernels_modules("forward"):
        monkeypatch.setattr(module, "_chunk_state_kernel", LaunchRecorder(module._chunk_state_kernel, launches))
        monkeypatch.setattr(module._ChunkRun, "segment_tables",
                            lambda run, *args, original=module._ChunkRun.segment_tables:
                            tables.append(args) or original(run, *args))
    x, cu_seqlens = case_inputs(case, residual, kaczmarz)
    assert_gradients_match_reference(x, update, residual, cu_seqlens)
    passes = 2 if residual else 1
    assert [grid[1] for grid in launches] == [B * HV] * passes + [B * segments * HV] * passes
    tiled = T % 64 == 0 and (T // 64) % segments == 0
    assert len(tables) == (0 if tiled else passes)


@pytest.mark.parametrize("from_inverse", [True, False], ids=["from_inverse", "reads_w"])
@pytest.mark.parametrize("case", GRAD_CASES[:2], ids=["batch", "varlen"])
@pytest.mark.parametrize("name,update,residual,kaczmarz", [rule for rule in STEPPED_RULES if rule[1] == "delta"])
def test_delta_state_passes_from_inverse_or_w_match_reference(name, update, residual, kaczmarz, case, from_inverse,
                                                              monkeypatch):
    """The forward's delta-rule state passes form their writes from T^-1, the values and the keys
    from 64 sequence-heads on (32 with one state), no WY kernel running, and read U0 and W below
    and in the backward's recompute (`writes_from_inverse`): each way of the forward
    forced here. Outputs, final states and every gradient against the reference, relative error
    <= 1e-5 in fp32; and that the forward without gradients then scans g in its passes and
    launches no WY kernel, or loads G and launches it once."""
    asked, wy_launches = decays_asked_for(monkeypatch), []
    for module in kernels_modules("forward"):
        monkeypatch.setattr(module, "writes_from_inverse",
                            lambda delta, residual, for_backward, BK, sequence_heads: from_inverse and not for_backward)
        monkeypatch.setattr(module, "_chunk_wy_kernel", LaunchRecorder(module._chunk_wy_kernel, wy_launches))
    x, cu_seqlens = case_inputs(case, residual, kaczmarz)
    assert_forward_matches_reference(x, update, residual, cu_seqlens)
    assert asked == [from_inverse] * (2 if residual else 1)  # S's pass (and R's)
    assert len(wy_launches) == (0 if from_inverse else 1)
    assert_gradients_match_reference(x, update, residual, cu_seqlens)


@pytest.mark.parametrize("name,update,residual,kaczmarz", [rule for rule in STEPPED_RULES if rule[1] == "delta"])
def test_delta_passes_form_writes_from_inverse_from_64_sequence_heads(name, update, residual, kaczmarz, monkeypatch):
    """Unforced (`writes_from_inverse`): the forward without gradients launches the WY
    kernel below 64 sequence-heads (below 32 with one state), and none from there on."""
    wy_launches, launched = [], []
    for module in kernels_modules("forward"):
        monkeypatch.setattr(module, "_chunk_wy_kernel", LaunchRecorder(module._chunk_wy_kernel, wy_launches))
    for heads in (16, 32, 64):
        x = on_device(make_inputs(1, 3, heads, heads, 16, 16, residual, kaczmarz=kaczmarz))
        before = len(wy_launches)
        with torch.no_grad():
            reslin_attention(*(x[n] for n in ("q", "k", "v", "g", "beta", "gamma")), update=update, backend="triton",
                             gamma_write=x["gamma_write"])
        launched.append(len(wy_launches) > before)
    assert launched == ([True, True, False] if residual else [True, False, False])


def decays_asked_for(monkeypatch):
    """A list that records the `scan` argument of every `_ChunkRun.cumulative_decays` call: whether
    a state pass scans g itself (True) or asks for the stored G (False)."""
    asked = []
    for module in kernels_modules("forward"):
        monkeypatch.setattr(module._ChunkRun, "cumulative_decays",
                            lambda run, scan, original=module._ChunkRun.cumulative_decays:
                            asked.append(scan) or original(run, scan))
    return asked


@pytest.mark.parametrize("scan", [True, False], ids=["scans_g", "loads_G"])
@pytest.mark.parametrize("case,decay", [(GRAD_CASES[0], 1), (GRAD_CASES[1], 1), ((1, 200, 1, 2, 16, 16, None), 8)],
                         ids=["batch", "varlen", "strong_decay"])
@pytest.mark.parametrize("name,update,residual,kaczmarz", [rule for rule in STEPPED_RULES if rule[1] == "additive"])
def test_additive_state_pass_scanning_or_loading_decays_matches_reference(name, update, residual, kaczmarz, case,
                                                                          decay, scan, monkeypatch):
    """The additive rule's sequential state pass scans g itself from 128 sequence-heads on, and
    loads the G that the decay kernel stores below (`pass_scans_decays`): each way forced
    here, RLA in two passes. Outputs, final states and every gradient against the reference:
    relative error <= 1e-5 in fp32 (the final states of the forward without gradients, in chunks of
    128 here, 5e-5 with 8x the decay, as in test_chunked_forward_in_chunks_of_128_matches_reference);
    and that forward asks for the stored G only when the pass loads it."""
    asked = decays_asked_for(monkeypatch)
    for module in kernels_modules("forward"):
        monkeypatch.setattr(module, "pass_scans_decays", lambda from_inverse, delta, decays_stored, heads: scan)
        monkeypatch.setattr(module, "scans_states", lambda delta, sequence_heads: False)
        monkeypatch.setattr(module, "fuse_residual_passes", lambda delta, sequence_heads, segments: False)
    x, cu_seqlens = case_inputs(case, residual, kaczmarz)
    x["g"] = x["g"] * decay
    assert_forward_matches_reference(x, update, residual, cu_seqlens, states_bound=5e-5 if decay > 1 else 1e-5)
    assert asked == [scan] * (2 if residual else 1)  # S's pass (and R's)
    assert_gradients_match_reference(x, update, residual, cu_seqlens)


@pytest.mark.parametrize("name,update,residual,kaczmarz", [rule for rule in STEPPED_RULES if rule[1] == "additive"])
def test_additive_state_pass_scans_decays_from_128_sequence_heads(name, update, residual, kaczmarz, monkeypatch):
    """Unforced: 64 sequence-heads load G, 128 scan g (both in the sequential state pass)."""
    asked = decays_asked_for(monkeypatch)
    for B in (1, 2):
        x = on_device(make_inputs(B, 3, 64, 64, 16, 16, residual, kaczmarz=kaczmarz))
        with torch.no_grad():
            reslin_attention(*(x[n] for n in ("q", "k", "v", "g", "beta", "gamma")), update=update, backend="triton",
                             gamma_write=x["gamma_write"])
    passes = 2 if residual else 1
    assert asked == [False] * passes + [True] * passes


def test_output_kernel_is_launched_dependent_compiled_after_a_state_pass_only():
    """PDL (`output_launched_dependent`): the residual rules' on CUDA, but not after RLA's
    scanned states (below 32 sequence-heads); never in Triton's interpreter, which has no
    `gdc_wait` (its kernels then take the other path, which every test here runs; test_gpu's
    forward runs the dependent one)."""
    for module in kernels_modules("tuning"):
        def dependent(cuda, residual, delta, sequences, heads):
            return module.output_launched_dependent(cuda, residual, module.scans_states(delta, sequences * heads))
        chosen = [dependent(*case)
                  for case in ((True, True, False, 1, 16), (True, True, False, 2, 16), (True, True, True, 1, 16),
                               (True, True, False, 8, 16), (True, False, False, 8, 16), (True, False, True, 8, 16),
                               (False, True, True, 8, 16))]
        assert chosen == [False, True, True, True, False, False, False]


def test_keys_queries_side_is_launched_dependent_compiled_for_the_residual_rules_only():
    """PDL of the keys' gradients' queries side (SIDE 1) on S's reverse pass
    (`queries_side_launched_dependent`): compiled, the residual rules' (the others have no queries
    side of their own); never in the interpreter, whose kernels take the other path."""
    for module in kernels_modules("tuning"):
        chosen = [module.queries_side_launched_dependent(*case)
                  for case in ((True, True), (True, False), (False, True))]
        assert chosen == [True, False, False]


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "sequential"])
@pytest.mark.parametrize("case,decay", [(GRAD_CASES[0], 1), (GRAD_CASES[1], 1), (GRAD_CASES[-1], 1),
                                        ((1, 200, 1, 2, 16, 16, None), 8)],
                         ids=["batch", "varlen", "d256", "strong_decay"])
@pytest.mark.parametrize("name,update,residual,kaczmarz", [rule for rule in STEPPED_RULES if rule[1] == "additive"])
def test_additive_states_by_scan_or_sequential_kernel_match_reference(name, update, residual, kaczmarz, case, decay,
                                                                      scan, monkeypatch):
    """The additive rule's state passes run as every chunk's writes at once and a scan over the
    chunks below 32 sequence-heads, the sequential state kernel from there on
    (`scans_states`): each way forced here, RLA in two passes, the scan over 2 chunks at
    a time in the interpreter (so that it carries a state between its steps; compiled, its dot
    takes 16 rows at least, and test_gpu's long sequences carry it). With 8x the log decay over whole
    chunks, e^(L_j - L_i) from a chunk to an earlier one overflows fp32. Outputs, final states and
    every gradient against the reference: relative error <= 1e-5 in fp32."""
    scans = []
    for module in kernels_modules("forward"):
        monkeypatch.setattr(module, "SCAN_CHUNKS", 2 if DEVICE == "cpu" else 16)
        monkeypatch.setattr(module, "scans_states", lambda delta, sequence_heads: scan)
        monkeypatch.setattr(module, "fuse_residual_passes", lambda delta, sequence_heads, segments: False)
        monkeypatch.setattr(module._ChunkRun, "scan", lambda run, *args, original=module._ChunkRun.scan:
                            scans.append(True) or original(run, *args))
    x, cu_seqlens = case_inputs(case, residual, kaczmarz)
    x["g"] = x["g"] * decay
    assert_gradients_match_reference(x, update, residual, cu_seqlens)
    # S's pass (and R's), in the forward and in the backward's recompute
    assert scans == ([True] * (4 if residual else 2) if scan else [])


@pytest.mark.parametrize("programs,segments", [(16, 4), (24, 6)])
@pytest.mark.parametrize("name,update,residual,kaczmarz", [rule for rule in STEPPED_RULES if rule[1] == "additive"])
def test_additive_states_split_into_segments_match_reference(name, update, residual, kaczmarz, programs, segments,
                                                             monkeypatch):
    """Few long sequences of the additive rule: S's recurrence runs in segments side by side,
    then the join kernel adds each segment's start state; with R, R's the same way, after S
    (forced here at small sizes: 6 chunks of 64, the last one partial; 4 segments asked for give
    3 of 2 chunks, 6 give 6 of 1). Outputs, final states and every gradient (the backward recomputes the chunk-start
    states the same way) against the reference:
    relative error <= 1e-5 in fp32 (`outputs_and_gradients`)."""
    split = []
    for module in kernels_modules("tuning"):
        monkeypatch.setattr(module, "MIN_SEGMENTS", 2)
        monkeypatch.setattr(module, "PARALLEL_PROGRAMS", programs)  # 4 programs run a sequence's tiles here
        monkeypatch.setattr(module, "MIN_SEGMENT_CHUNKS", 1)
    for module in kernels_modules("forward"):
        monkeypatch.setattr(module, "scans_states", lambda delta, sequence_heads: False)
        monkeypatch.setattr(module._ChunkRun, "advance_in_segments",
                            lambda run, initial, segments, *writes, original=module._ChunkRun.advance_in_segments:
                            split.append(segments) or original(run, initial, segments, *writes))
    x = on_device(make_inputs(2, 330, 2, 2, 32, 16, residual, kaczmarz=kaczmarz))
    labels, ref = outputs_and_gradients(x, update, residual, None, "recurrent")
    _, got = outputs_and_gradients(x, update, residual, None, "triton")
    # S's pass and R's, in the forward and in the backward's recompute
    assert split == [segments] * (4 if residual else 2)
    for label, a, b in zip(labels, got, ref):
        assert rel_err(a, b) < 1e-5, f"{label}: {rel_err(a, b):.2e}"


def test_non_contiguous_cu_seqlens_is_read_by_its_values():
    """An int64 cu_seqlens with strides: the kernels used to read its raw memory, here
    [0, 99, 7, 99, 20] in place of [0, 7, 20]."""
    x = on_device(make_inputs(1, 20, 1, 1, 16, 16, residual=True))
    x["S0"], x["R0"] = (torch.randn(2, 1, 16, 16, device=DEVICE) for _ in range(2))
    cu_seqlens = torch.tensor([0, 99, 7, 99, 20], device=DEVICE)[::2]
    assert not cu_seqlens.is_contiguous()
    assert_forward_matches_reference(x, "delta", True, cu_seqlens)
    assert_gradients_match_reference(x, "delta", True, cu_seqlens)


@pytest.mark.parametrize("T", [1, 20], ids=["decode", "chunked"])
def test_scale_may_be_an_int_or_a_tensor_of_one_number(T):
    """The kernels take a float: an int or a tensor scale used to reach them as it came."""
    x = on_device(make_inputs(1, T, 1, 1, 16, 16, residual=True))
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "gamma")]
    o_ref, _ = reslin_attention(*args, scale=2.0, backend="recurrent")
    for scale in (2, torch.tensor(2.0)):
        assert rel_err(reslin_attention(*args, scale=scale, backend="triton")[0], o_ref) < 1e-5


@pytest.mark.parametrize("log_decay", [-1e30, float("-inf")])
@pytest.mark.parametrize("name,update,residual,kaczmarz", STEPPED_RULES[:4])
def test_chunked_kernels_take_any_log_decay_down_to_a_hard_reset(name, update, residual, kaczmarz, log_decay):
    """g = -inf (a hard reset) mid-chunk gave NaN in the chunked kernels (exp(G_i - G_j) of
    -inf - -inf); kernels_reslin floors g at -100 before them. Outputs, final states and
    gradients against the reference (the gradient of a floored g is 0, as the reference's):
    relative error <= 1e-5, but 5e-5 for the final states, whose decays exp(G_C - G_j) after
    the reset take G near -100, where fp32 resolves ~8e-6 (2e-5 here)."""
    x = on_device(make_inputs(1, 70, 1, 2, 16, 16, residual, kaczmarz=kaczmarz))
    x["g"] = x["g"].clone()
    x["g"][0, 10, 0] = log_decay
    x["g"][0, 66, 1] = log_decay
    assert_forward_matches_reference(x, update, residual, None, states_bound=5e-5)
    labels, ref = outputs_and_gradients(x, update, residual, None, "recurrent")
    _, got = outputs_and_gradients(x, update, residual, None, "triton")
    for label, a, b in zip(labels, got, ref):
        assert rel_err(a, b) < (5e-5 if label in ("S", "R") else 1e-5), f"{label}: {rel_err(a, b):.2e}"


@pytest.mark.skipif(not kernels_reslin.TRITON_INTERPRETED, reason="Triton's interpreter only")
@pytest.mark.parametrize("T", [1, 20], ids=["decode", "chunked"])
def test_interpreter_refuses_inputs_other_than_fp32(T):
    """Triton's interpreter computes bf16 and fp16 wrongly without an error: backend='triton'
    refuses them there, and 'auto' takes the torch backend."""
    x = make_inputs(1, T, 1, 1, 16, 16, residual=True)
    args = {n: x[n] for n in ("q", "k", "v", "g", "beta", "gamma")}
    for low in ({n: t.bfloat16() for n, t in args.items()}, dict(args, g=args["g"].half())):
        with pytest.raises(ValueError, match="interpreter .* computes only fp32 right, got inputs in torch"):
            reslin_attention(**low, backend="triton")
        o, _ = reslin_attention(**low, backend="auto")
        o_ref, _ = reslin_attention(**low, backend="torch")
        assert torch.equal(o, o_ref)
