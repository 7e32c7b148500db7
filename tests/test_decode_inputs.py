"""kernels_reslin_triton_decode.decode_inputs, a generation step's decode inputs in one launch,
against what ResLinLinearAttention itself computes from the same projections: its forward at a
decode step, whose call of `reslin_decode_step` is replaced by one that records its inputs.

Without a GPU the kernel runs in Triton's CPU interpreter in fp32: q, k, v and the gates within a
relative error of 1e-5, the convolution states (copies of inputs) exactly equal. On the GPU
(`pytest -m gpu`) in bf16 at a 400M model's sizes: against the layer's own bf16 CUDA path (the
fused kernels it replaces) within 2e-3 (q, k and v may differ by a bf16 ulp where a head's L2
norm sums in another order; the gates within 1e-5), and against the layer in fp32 on the CPU run
on the same bf16 projections within 1e-2 (bf16 rounding of q, k and v; KLA's step takes the norm
of the bf16 k); the states exactly.
"""

import copy

import pytest
import torch

from conftest import build_config
from test_kernels import rel_err

decode = pytest.importorskip("kernels_reslin_triton_decode", reason="needs the triton package")

OUTPUTS = ("q", "k", "v", "g", "beta", "gamma", "gamma_write")


def make_layer(reslin, rule, H, HV, Dk, Dv, K, hidden_size=32, seed=0):
    """A layer with random weights: taps of scale 0.5, and Mamba2's A_log and dt_bias."""
    torch.manual_seed(seed)
    config = build_config(rule, hidden_size=hidden_size, num_heads=H, num_v_heads=HV, head_dim=Dk,
                          expand_v=Dv / Dk, conv_size=K)
    layer = reslin.modeling.ResLinLinearAttention(config, 0).eval()
    with torch.no_grad():
        for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
            torch.nn.init.normal_(conv.weight, 0.0, 0.5)
        layer.A_log.copy_(torch.empty(HV).uniform_(0, 16).log())
        layer.dt_bias.copy_(torch.randn(HV))
    return layer


def convolutions(layer):
    return layer.q_conv1d, layer.k_conv1d, layer.v_conv1d


def projected_of(layer, x):
    """One token's projections side by side as the layer forms them (q | k | v | a | b | c | gate)."""
    return torch.cat([p for p in layer.input_projections(x, inference=True) if p is not None], dim=-1)


def kernel_step(layer, projected, states):
    """decode_inputs as the layer would call it, advancing `states` in place."""
    return decode.decode_inputs(
        projected, tuple(conv.weight for conv in convolutions(layer)), states, layer.A_log, layer.dt_bias,
        num_heads=layer.num_heads, head_dim=layer.head_dim, num_v_heads=layer.num_v_heads,
        head_v_dim=layer.head_v_dim, residual=layer.use_residual, kaczmarz=layer.step_rule == "kaczmarz",
        kaczmarz_eps=layer.kaczmarz_eps)


def module_step(reslin, monkeypatch, layer, x, states, projected=None):
    """The layer's forward at a decode step from conv `states` (advanced in place, as the cache
    does): the inputs it hands the decode step, as kernel_step returns them (gamma_write the
    residual state's write strength, gamma itself unless KLA). With `projected`, its projections
    are those columns instead of its own of x."""
    recorded = {}

    def record(q, k, v, g, beta, state, *, gamma=None, gamma_write=None, **options):
        recorded.update(q=q, k=k, v=v, g=g, beta=beta, gamma=gamma,
                        gamma_write=gamma if gamma_write is None else gamma_write)
        return torch.zeros_like(v)

    B = x.shape[0]
    cache = reslin.ResLinCache(build_config("gdn"), B)  # the layer reads and writes only its entry 0
    cache.conv_states[0] = states
    S = torch.zeros(B, layer.num_v_heads, layer.head_dim, layer.head_v_dim, device=x.device)
    cache.recurrent_states[0] = (S, S.clone() if layer.use_residual else None)
    cache.advance(1)
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(reslin.modeling, "reslin_decode_step", record)
        if projected is not None:
            widths = [p.out_features for p in (layer.q_proj, layer.k_proj, layer.v_proj, layer.a_proj, layer.b_proj)]
            widths += [layer.num_v_heads] * layer.use_residual + [layer.g_proj.out_features]
            pieces = list(projected.split(widths, dim=-1))
            if not layer.use_residual:
                pieces.insert(5, None)
            patch.setattr(layer, "input_projections", lambda *args, **kwargs: tuple(pieces))
        layer(x, cache=cache)
    return tuple(recorded[name] for name in OUTPUTS)


def random_states(layer, B, dtype=torch.float32, device="cpu"):
    K = layer.q_conv1d.kernel_size[0]
    return tuple(torch.randn(B, conv.weight.shape[0], K - 1, device=device).to(dtype) for conv in convolutions(layer))


def assert_outputs_close(got, expected, tolerances):
    """Each output within its relative tolerance (OUTPUTS order); None where expected is None."""
    for name, x, ref, tolerance in zip(OUTPUTS, got, expected, tolerances):
        if ref is None:
            assert x is None, name
            continue
        assert x.shape == ref.shape and x.dtype == ref.dtype, f"{name}: {x.shape} {x.dtype}, {ref.shape} {ref.dtype}"
        assert rel_err(x, ref) <= tolerance, f"{name}: {rel_err(x, ref):.2e}"


RULES = ["gdn", "kla", "rdn", "rkla"]  # kaczmarz no/yes x residual no/yes
# (B, H, HV, Dk, Dv, K): one row and three, grouped value heads, Dk != Dv, heads that are not
# powers of two (masked lanes), K = 2, 3 and 4.
SHAPES = [(1, 2, 2, 16, 16, 4), (3, 2, 4, 48, 24, 3), (3, 1, 2, 32, 64, 2), (3, 2, 2, 48, 48, 4)]
STEPS = 3


@pytest.mark.parametrize("B,H,HV,Dk,Dv,K", SHAPES, ids=str)
@pytest.mark.parametrize("rule", RULES)
def test_decode_inputs_match_the_layer(reslin, monkeypatch, rule, B, H, HV, Dk, Dv, K):
    """Several steps in a row from random states: every output within 1e-5 of the layer's, the
    states exactly the layer's after each step, and the steps' q, k and v those of the layer's
    convolutions run over the whole sequence at once."""
    layer = make_layer(reslin, rule, H, HV, Dk, Dv, K)
    states = random_states(layer, B)
    initial = tuple(s.clone() for s in states)
    reference_states = tuple(s.clone() for s in states)
    xs = 2 * torch.randn(STEPS, B, 1, layer.q_proj.in_features)  # gate inputs spread around softplus's bend
    steps = []
    with torch.no_grad():
        for x in xs:
            projected = projected_of(layer, x)
            got = kernel_step(layer, projected, states)
            expected = module_step(reslin, monkeypatch, layer, x, reference_states)
            assert_outputs_close(got, expected, [1e-5] * len(OUTPUTS))
            if layer.step_rule != "kaczmarz":
                assert got[6] is got[5]  # gamma_write is gamma (both None without the residual state)
            for state, reference in zip(states, reference_states):
                assert torch.equal(state, reference)
            steps.append((projected, got))
        # The whole sequence through the layer's convolutions.
        sequence = torch.cat([projected for projected, _ in steps], dim=1)
        widths = (H * Dk, H * Dk, HV * Dv)
        inputs = sequence[..., :sum(widths)].split(widths, dim=-1)
        norms = (Dk, None if layer.step_rule == "kaczmarz" else Dk, None)
        for i, (conv, x, state, head_size) in enumerate(zip(convolutions(layer), inputs, initial, norms)):
            y, final = conv(x, state, None, head_size)
            stepped = torch.cat([got[i].flatten(-2) for _, got in steps], dim=1)
            assert rel_err(stepped, y) <= 1e-5
            assert torch.equal(states[i], final)


def test_decode_inputs_read_a_row_strided_projection(reslin):
    """projected read at its own row stride (a column slice of a wider tensor), the columns after
    the ones read ignored: exactly the results and states of a contiguous copy."""
    layer = make_layer(reslin, "rkla", 2, 4, 16, 8, 4)
    with torch.no_grad():
        projected = projected_of(layer, torch.randn(3, 1, 32))
        wide = torch.randn(3, 1, projected.shape[-1] + 10)
        wide[..., 5:5 + projected.shape[-1]] = projected
        initial = random_states(layer, 3)
        results = []
        for x in (wide[..., 5:], projected):
            states = tuple(s.clone() for s in initial)
            results.append((*kernel_step(layer, x, states), *states))
    assert not wide[..., 5:].is_contiguous()
    for got, expected in zip(*results):
        assert torch.equal(got, expected)


def test_decode_inputs_check_their_arguments(reslin):
    layer = make_layer(reslin, "rdn", 2, 2, 16, 16, 4)
    weights = tuple(conv.weight.detach() for conv in convolutions(layer))
    states = random_states(layer, 2)
    A_log, dt_bias = layer.A_log.detach(), layer.dt_bias.detach()
    sizes = dict(num_heads=2, head_dim=16, num_v_heads=2, head_v_dim=16, residual=True, kaczmarz=False,
                 kaczmarz_eps=1e-6)
    projected = torch.randn(2, 1, 3 * 32 + 3 * 2 + 32)  # q | k | v | a | b | c | gate
    decode.decode_inputs(projected, weights, states, A_log, dt_bias, **sizes)  # the valid call
    bad_calls = {
        "num_v_heads": dict(args=(projected, weights, states, A_log, dt_bias), num_v_heads=3),
        "head_dim": dict(args=(projected, weights, states, A_log, dt_bias), head_dim=0),
        "head_dim and head_v_dim": dict(args=(projected, weights, states, A_log, dt_bias), head_v_dim=264),
        "projected": dict(args=(projected[..., :100], weights, states, A_log, dt_bias)),
        "projected must be a float": dict(args=(projected.expand(2, 2, -1), weights, states, A_log, dt_bias)),
        "conv_weights and conv_states": dict(args=(projected, weights[:2], states, A_log, dt_bias)),
        "conv_weights' k": dict(args=(projected, (weights[0], weights[1][:8], weights[2]), states, A_log, dt_bias)),
        "conv_weights must be": dict(args=(projected, tuple(w[..., :1] for w in weights), states, A_log, dt_bias)),
        "conv_states' v": dict(args=(projected, weights, (*states[:2], states[2].double()), A_log, dt_bias)),
        "conv_states' q": dict(args=(projected, weights, (states[0].transpose(0, 1).contiguous().transpose(0, 1),
                                                          *states[1:]), A_log, dt_bias)),
        "dt_bias": dict(args=(projected, weights, states, A_log, dt_bias[:1])),
    }
    for message, call in bad_calls.items():
        args = call.pop("args")
        with pytest.raises(ValueError, match=message):
            decode.decode_inputs(*args, **{**sizes, **call})
    with pytest.raises(ValueError, match="without gradients"):
        decode.decode_inputs(projected.clone().requires_grad_(), weights, states, A_log, dt_bias, **sizes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("B", [1, 16])
@pytest.mark.parametrize("rule", RULES)
def test_decode_inputs_in_bf16_at_real_sizes(reslin, monkeypatch, rule, B):
    """A 400M model's layer (hidden 1024, 8 heads of 128), two steps: against the layer's own bf16
    CUDA path and against the layer in fp32 on the CPU from the same bf16 projections (tolerances
    in the module docstring)."""
    layer = make_layer(reslin, rule, 8, 8, 128, 128, 4, hidden_size=1024).to("cuda", torch.bfloat16)
    reference = copy.deepcopy(layer).float().cpu()  # the bf16 model's weights, in fp32
    states = random_states(layer, B, torch.bfloat16, "cuda")
    layer_states = tuple(s.clone() for s in states)
    reference_states = tuple(s.float().cpu() for s in states)
    with torch.no_grad():
        for x in 2 * torch.randn(2, B, 1, 1024, device="cuda", dtype=torch.bfloat16):
            projected = projected_of(layer, x)
            got = kernel_step(layer, projected, states)
            assert_outputs_close(got, module_step(reslin, monkeypatch, layer, x, layer_states),
                                 [2e-3] * 3 + [1e-5] * 4)
            expected = module_step(reslin, monkeypatch, reference, x.float().cpu(), reference_states,
                                   projected=projected.float().cpu())
            got_on_cpu = [None if t is None else t.float().cpu() for t in got]
            assert_outputs_close(got_on_cpu, expected, [1e-2] * 3 + [1e-5] + [1e-2 if rule.endswith("kla") else 1e-5]
                                 + [1e-5] + [1e-2])
            for state, layer_state, reference_state in zip(states, layer_states, reference_states):
                assert torch.equal(state, layer_state)
                assert torch.equal(state.float().cpu(), reference_state)
