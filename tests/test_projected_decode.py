"""A linear attention layer's generation step as the model's fused step runs it on CUDA: the
in-projection with its short convolutions (kernels_reslin_triton_gemv.rms_norm_linear with
`convolutions`), then the decode kernel on that projection, which forms the L2 norms, the gates and
KLA's step itself (kernels_reslin_triton_decode.projected_decode_step), against the layer's own
forward at a decode step from the same states.

Without a GPU the kernels run in Triton's CPU interpreter in fp32: the layer's decode output and
every state (S, R, the convolutions' windows) within a relative error of 1e-5, step after step,
and the windows those of the layer's convolutions run over the whole sequence at once. On the GPU
(`pytest -m gpu`) in bf16 at a 400M model's sizes, against the layer in fp32 on the CPU fed the
same bf16 inputs and states: the output within 2e-2 and S and R within 1e-2 (bf16 rounding of the
product, the convolutions, q and k; q and k are rounded before their L2 norm, where the layer's
torch code rounds after it), the windows within 1e-2.
"""

import copy

import pytest
import torch

from conftest import build_config
from test_kernels import rel_err

decode = pytest.importorskip("kernels_reslin_triton_decode", reason="needs the triton package")
gemv = pytest.importorskip("kernels_reslin_triton_gemv", reason="needs the triton package")


def make_layer(reslin, rule, H, HV, Dk, Dv, K, hidden_size=32, seed=0):
    """A layer with random weights, taps of scale 0.5, Mamba2's A_log and dt_bias; and a block norm
    with a random weight."""
    torch.manual_seed(seed)
    config = build_config(rule, hidden_size=hidden_size, num_heads=H, num_v_heads=HV, head_dim=Dk,
                          expand_v=Dv / Dk, conv_size=K)
    layer = reslin.modeling.ResLinLinearAttention(config, 0).eval()
    norm = reslin.modeling.ResLinRMSNorm(hidden_size, eps=config.norm_eps)
    with torch.no_grad():
        for conv in convolutions(layer):
            torch.nn.init.normal_(conv.weight, 0.0, 0.5)
        layer.A_log.copy_(torch.empty(HV).uniform_(0, 16).log())
        layer.dt_bias.copy_(torch.randn(HV))
        norm.weight.copy_(torch.randn(hidden_size) * 0.3 + 1.0)
    return layer, norm


def convolutions(layer):
    return layer.q_conv1d, layer.k_conv1d, layer.v_conv1d


def random_states(layer, B, dtype=torch.float32, device="cpu"):
    """(conv states (q, k, v), (S, R)) as a cache holds them."""
    K = layer.q_conv1d.kernel_size[0]
    conv = tuple(torch.randn(B, c.weight.shape[0], K - 1, device=device).to(dtype) for c in convolutions(layer))
    shape = (B, layer.num_v_heads, layer.head_dim, layer.head_v_dim)
    S = 0.1 * torch.randn(shape, device=device)
    return conv, (S, 0.1 * torch.randn(shape, device=device) if layer.use_residual else None)


def kernel_step(layer, norm, x, states, states_just_written=True):
    """The fused step's attention part, advancing `states` in place: the decode output o."""
    conv_states, (S, R) = states
    weight = torch.cat([p.weight for p in layer.projections()])
    taps = tuple(conv.weight for conv in convolutions(layer))
    projected = gemv.rms_norm_linear(x, norm.weight, norm.eps, weight, convolutions=(taps, conv_states))
    return decode.projected_decode_step(
        projected, layer.A_log, layer.dt_bias, S, R, num_heads=layer.num_heads, head_dim=layer.head_dim,
        num_v_heads=layer.num_v_heads, head_v_dim=layer.head_v_dim, update=layer.update_rule,
        clip=layer.residual_clip, kaczmarz=layer.step_rule == "kaczmarz", kaczmarz_eps=layer.kaczmarz_eps,
        states_just_written=states_just_written)


def layer_step(reslin, monkeypatch, layer, norm, x, states):
    """The layer's forward at a decode step from `states`, advanced in place as the cache does: the
    output of its call of reslin_decode_step."""
    recorded = {}
    decode_step = reslin.modeling.reslin_decode_step

    def record(*args, **kwargs):
        recorded["o"] = decode_step(*args, **kwargs)
        return recorded["o"]

    cache = reslin.ResLinCache(build_config("gdn"), x.shape[0])  # the layer reads and writes only its entry 0
    cache.conv_states[0], cache.recurrent_states[0] = states
    cache.advance(1)
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(reslin.modeling, "reslin_decode_step", record)
        layer(x, cache=cache, norm=norm)
    return recorded["o"]


def state_list(states):
    conv_states, recurrent = states
    return [x for x in (*conv_states, *recurrent) if x is not None]


RULES = ["gdn", "kla", "rla", "rdn", "rkla"]  # delta / additive, kaczmarz, residual
# (B, H, HV, Dk, Dv, K): one row and three, grouped value heads, Dk != Dv, heads that are not
# powers of two (masked lanes), K = 2, 3 and 4.
SHAPES = [(1, 2, 2, 16, 16, 4), (3, 2, 4, 48, 24, 3), (3, 1, 2, 32, 64, 2), (3, 2, 2, 48, 48, 4)]
STEPS = 3


@pytest.mark.parametrize("B,H,HV,Dk,Dv,K", SHAPES, ids=str)
@pytest.mark.parametrize("rule", RULES)
def test_the_fused_attention_step_matches_the_layer(reslin, monkeypatch, rule, B, H, HV, Dk, Dv, K):
    """Several steps in a row from random states: the output and every state within 1e-5 of the
    layer's after each step, and the convolutions' windows those of the layer's convolutions run
    over the whole sequence at once."""
    layer, norm = make_layer(reslin, rule, H, HV, Dk, Dv, K)
    states = random_states(layer, B)
    initial = copy.deepcopy(states)
    reference = copy.deepcopy(states)
    xs = 2 * torch.randn(STEPS, B, 1, layer.q_proj.in_features)  # gate inputs spread around softplus's bend
    with torch.no_grad():
        for x in xs:
            o = kernel_step(layer, norm, x, states)
            expected = layer_step(reslin, monkeypatch, layer, norm, x, reference)
            assert o.shape == expected.shape and o.dtype == expected.dtype
            assert rel_err(o, expected) <= 1e-5
            for got, want in zip(state_list(states), state_list(reference)):
                assert rel_err(got, want) <= 1e-5
        # The windows: the last K - 1 inputs of the whole sequence through the layer's convolutions.
        projections = [layer.input_projections(norm(x), inference=True)[:3] for x in xs]
        for i, (conv, initial_state) in enumerate(zip(convolutions(layer), initial[0])):
            sequence = torch.cat([step[i] for step in projections], dim=1)
            _, final = conv(sequence, initial_state.clone(), None, None)
            assert rel_err(states[0][i], final) <= 1e-5


def test_the_decode_kernel_reads_a_row_strided_projection(reslin):
    """projected read at its own row stride (a column slice of a wider tensor), the columns after
    the ones read ignored: exactly the output and states of a contiguous copy."""
    layer, _ = make_layer(reslin, "rkla", 2, 4, 16, 8, 4)
    projected = torch.randn(3, 1, 2 * 32 + 32 + 3 * 4 + 32)
    wide = torch.randn(3, 1, projected.shape[-1] + 10)
    wide[..., 5:5 + projected.shape[-1]] = projected
    initial = random_states(layer, 3)[1]
    results = []
    with torch.no_grad():
        for x in (wide[..., 5:], projected):
            S, R = (s.clone() for s in initial)
            o = decode.projected_decode_step(x, layer.A_log, layer.dt_bias, S, R, num_heads=2, head_dim=16,
                                             num_v_heads=4, head_v_dim=8, update="delta", clip=1.0, kaczmarz=True,
                                             kaczmarz_eps=1e-6)
            results.append((o, S, R))
    assert not wide[..., 5:].is_contiguous()
    for got, expected in zip(*results):
        assert torch.equal(got, expected)


def test_the_kernels_check_their_arguments(reslin):
    layer, norm = make_layer(reslin, "rdn", 2, 2, 16, 16, 4)
    (conv_states, (S, R)) = random_states(layer, 2)
    A_log, dt_bias = layer.A_log.detach(), layer.dt_bias.detach()
    sizes = dict(num_heads=2, head_dim=16, num_v_heads=2, head_v_dim=16, update="delta", clip=1.0, kaczmarz=False,
                 kaczmarz_eps=1e-6)
    projected = torch.randn(2, 1, 3 * 32 + 3 * 2 + 32)  # q | k | v | a | b | c | gate
    decode.projected_decode_step(projected, A_log, dt_bias, S, R, **sizes)  # the valid call
    bad_calls = {
        "num_v_heads": dict(args=(projected, A_log, dt_bias, S, R), num_v_heads=3),
        "head_dim": dict(args=(projected, A_log, dt_bias, S, R), head_dim=0),
        "head_dim and head_v_dim": dict(args=(projected, A_log, dt_bias, S, R), head_v_dim=264),
        "projected": dict(args=(projected[..., :100], A_log, dt_bias, S, R)),
        "projected must be a float": dict(args=(projected.expand(2, 2, -1), A_log, dt_bias, S, R)),
        "S must be": dict(args=(projected, A_log, dt_bias, S.double(), R)),
        "R must be": dict(args=(projected, A_log, dt_bias, S, R[:1])),
        "A_log": dict(args=(projected, A_log[:1], dt_bias, S, R)),
        "dt_bias": dict(args=(projected, A_log, dt_bias[None], S, R)),
    }
    for message, call in bad_calls.items():
        args = call.pop("args")
        with pytest.raises(ValueError, match=message):
            decode.projected_decode_step(*args, **{**sizes, **call})
    with pytest.raises(ValueError, match="without gradients"):
        decode.projected_decode_step(projected.clone().requires_grad_(), A_log, dt_bias, S, R, **sizes)

    x = torch.randn(2, 1, 32)
    weight = torch.cat([p.weight.detach() for p in layer.projections()])
    taps = tuple(conv.weight.detach() for conv in convolutions(layer))
    gemv.rms_norm_linear(x, norm.weight.detach(), 1e-6, weight, convolutions=(taps, conv_states))  # valid
    bad_convolutions = {  # message: (taps, states, weight, x)
        "convolutions must be": (taps[:2], conv_states, weight, x),
        "C >= 2": (tuple(t[..., :1] for t in taps), conv_states, weight, x),
        "k taps": ((taps[0], taps[1][:8], taps[2]), conv_states, weight, x),
        "v state": (taps, (*conv_states[:2], conv_states[2].double()), weight, x),
        "q state": (taps, (conv_states[0].transpose(0, 1).contiguous().transpose(0, 1), *conv_states[1:]), weight, x),
        "exceed the product": (taps, conv_states, weight[:90], x),
        "one token a row": (taps, conv_states, weight, torch.randn(2, 2, 32)),
    }
    for message, (bad_taps, bad_states, bad_weight, bad_x) in bad_convolutions.items():
        with pytest.raises(ValueError, match=message):
            gemv.rms_norm_linear(bad_x, norm.weight.detach(), 1e-6, bad_weight, convolutions=(bad_taps, bad_states))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preload", [False, True], ids=["states after the wait", "states before it"])
@pytest.mark.parametrize("B", [1, 4, 16])
@pytest.mark.parametrize("rule", RULES)
def test_the_fused_attention_step_in_bf16_at_real_sizes(reslin, monkeypatch, rule, B, preload):
    """A 400M model's layer (hidden 1024, 8 heads of 128), two steps, against the layer in fp32 on
    the CPU fed the same bf16 inputs and states (tolerances in the module docstring). `preload`:
    states_just_written=False, as the model's step passes it (under PDL, up to 4 rows, the states
    load before the wait for the in-projection)."""
    layer, norm = make_layer(reslin, rule, 8, 8, 128, 128, 4, hidden_size=1024)
    layer, norm = layer.to("cuda", torch.bfloat16), norm.to("cuda", torch.bfloat16)
    reference_layer, reference_norm = copy.deepcopy(layer).float().cpu(), copy.deepcopy(norm).float().cpu()
    states = random_states(layer, B, torch.bfloat16, "cuda")
    with torch.no_grad():
        for x in 2 * torch.randn(2, B, 1, 1024, device="cuda", dtype=torch.bfloat16):
            reference = ((tuple(s.float().cpu() for s in states[0])),
                         tuple(None if s is None else s.cpu() for s in states[1]))
            o = kernel_step(layer, norm, x, states, states_just_written=not preload)
            expected = layer_step(reslin, monkeypatch, reference_layer, reference_norm, x.float().cpu(), reference)
            assert rel_err(o.float().cpu(), expected) <= 2e-2
            for got, want in zip(state_list(states), state_list(reference)):
                assert rel_err(got.float().cpu(), want) <= 1e-2
