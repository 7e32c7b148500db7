"""The fused layer kernels (kernels_reslin_triton_layers.py) against the torch code they replace
in modeling_reslin.py, forward and gradients.

Without a GPU they run in Triton's CPU interpreter in fp32: relative error <= 1e-5. The model
tests there route every layer through them (the modeling file itself takes them on CUDA only).
On the GPU (`pytest -m gpu`) the kernels run compiled in bf16 at a 400M model's sizes against
the fp32 torch code: relative error <= 1e-2 (bf16 rounding of outputs and gradients).
"""

import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import build_config, build_model
from test_generate import cache_of
from test_kernels import rel_err

layers = pytest.importorskip("kernels_reslin_triton_layers", reason="needs the triton package")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


def reference_modules(reslin, N, K=4):
    """The modeling file's own modules with the fused path off: the reference."""
    norm = reslin.modeling.ResLinRMSNorm(N)
    gated = reslin.modeling.ResLinGatedRMSNorm(N)
    conv = reslin.modeling.ResLinShortConvolution(N, K)
    for module in (norm, gated):
        torch.nn.init.normal_(module.weight, 1.0, 0.5)
    torch.nn.init.normal_(conv.weight, 0.0, 0.5)
    return norm, gated, conv


def grads(y, inputs, dy):
    return torch.autograd.grad(y, inputs, dy)


def assert_close(fused, reference, tolerance):
    (y, dxs), (y_ref, dxs_ref) = fused, reference
    assert y.dtype == y_ref.dtype
    assert rel_err(y, y_ref) <= tolerance
    for dx, dx_ref in zip(dxs, dxs_ref):
        assert rel_err(dx, dx_ref) <= tolerance


def random(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype).requires_grad_()


# Rows that do not fill a block, sizes that are not powers of two, one row of 1000.
NORM_SHAPES = [(3, 5, 48), (2, 7, 3, 130), (1, 1000), (4, 9, 64)]


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rms_norms_match_the_modules(reslin, shape):
    torch.manual_seed(0)
    N = shape[-1]
    norm, gated, _ = (m.to(DEVICE) for m in reference_modules(reslin, N))
    x, gate, dy = random(*shape), random(*shape), torch.randn(*shape, device=DEVICE)
    for fused, reference, inputs in (
            (lambda: layers.rms_norm(x, norm.weight, norm.eps), lambda: norm(x), (x, norm.weight)),
            (lambda: layers.rms_norm(x, gated.weight, gated.eps, gate=gate), lambda: gated(x, gate),
             (x, gated.weight, gate))):
        assert_close((y := fused(), grads(y, inputs, dy)), (y := reference(), grads(y, inputs, dy)), 1e-5)


# (x's shape, the projections' widths, gated, frozen weights): two projections reading the normed
# rows as they are (the MLP's), one reading 3 heads of 16 side by side (the output's gated norm),
# rows that do not fill a block.
NORM_PROJECTION_CASES = [((3, 5, 48), (24, 7), False, False), ((2, 7, 3, 16), (10,), True, False),
                         ((2, 7, 3, 16), (10, 5), True, True), ((1, 1000), (9,), False, False)]


@pytest.mark.parametrize("shape,widths,gated,frozen", NORM_PROJECTION_CASES, ids=str)
def test_rms_norm_with_projections(reslin, monkeypatch, shape, widths, gated, frozen):
    """rms_norm(x, ..., projections=Ws) = F.linear(the norm's rows side by side, W) for each W,
    the normed x formed again in the backward: outputs and every gradient (x, the norm's weight,
    the gate, the projections') against the module's norm then F.linear, relative error <= 1e-5
    in fp32; and through the modules, where a projection that is not a plain nn.Linear takes the
    normed x as before."""
    torch.manual_seed(0)
    norm = reference_modules(reslin, shape[-1])[1 if gated else 0].to(DEVICE)
    K = shape[-1] * (shape[-2] if gated else 1)
    x, gate = random(*shape), (random(*shape) if gated else None)
    weights = [torch.randn(width, K, device=DEVICE).requires_grad_(not frozen) for width in widths]
    dys = [torch.randn(x.numel() // K, width, device=DEVICE) for width in widths]
    inputs = [t for t in (x, norm.weight, gate) if t is not None] + ([] if frozen else weights)

    def reference():
        y = (norm(x, gate) if gated else norm(x)).reshape(-1, K)
        return [F.linear(y, weight) for weight in weights]

    fused = layers.rms_norm(x, norm.weight, norm.eps, gate, weights)
    expected = reference()
    for got, want in zip(fused, expected):
        assert rel_err(got, want) <= 1e-5
    for got, want in zip(grads(fused, inputs, dys), grads(expected, inputs, dys)):
        assert rel_err(got, want) <= 1e-5

    monkeypatch.setattr(reslin.modeling, "runs_fused", lambda fused, x: fused)
    norm.fused = True
    linears = [torch.nn.Linear(K, width, bias=False, device=DEVICE) for width in widths]
    for linear, weight in zip(linears, weights):
        linear.weight.data.copy_(weight)
    for hooked in (False, True):
        if hooked:  # not plain: it reads the normed x, kept as before
            linears[-1].register_forward_hook(lambda *args: None)
        outputs = norm(x, gate, linears) if gated else norm(x, linears)
        for got, want in zip(outputs, expected):
            assert got.shape == (*shape[:len(shape) - (2 if gated else 1)], want.shape[-1])
            assert rel_err(got.reshape(want.shape), want) <= 1e-5


@pytest.mark.parametrize("numel", [1, 77, 4096 + 5])
def test_swiglu_matches_silu_times_up(numel):
    torch.manual_seed(0)
    gate, up, dy = random(numel), random(numel), torch.randn(numel, device=DEVICE)
    assert_close((y := layers.swiglu(gate, up), grads(y, (gate, up), dy)),
                 (y := F.silu(gate) * up, grads(y, (gate, up), dy)), 1e-5)


@pytest.mark.parametrize("frozen", [False, True])
def test_swiglu_with_the_down_projection(frozen):
    """swiglu(gate, up, W) = F.linear(silu(gate) * up, W), also when W takes no gradient."""
    torch.manual_seed(0)
    gate, up, dy = random(3, 5, 40), random(3, 5, 40), torch.randn(3, 5, 24, device=DEVICE)
    weight = torch.randn(24, 40, device=DEVICE).requires_grad_(not frozen)
    inputs = (gate, up) if frozen else (gate, up, weight)
    assert_close((y := layers.swiglu(gate, up, weight), grads(y, inputs, dy)),
                 (y := F.linear(F.silu(gate) * up, weight), grads(y, inputs, dy)), 1e-5)


def packed_positions(T, starts, B):
    """Each token's index in its own sequence, for sequences starting at `starts` (0 first)."""
    bounds = list(starts) + [T]
    return torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])[None].expand(B, T).to(DEVICE)


# (B, T, D, K, with a state, packed sequence starts): T below, at and past the block of 32, one
# token (a decode step), channels not a multiple of the block of 128, K = 3 and 4, sequences of
# one token.
# With l2_head_size: heads of 16, 24 (not a power of two: masked lanes) and 130 (past the block of 128).
CONV_CASES = [(2, 37, 130, 4, False, None, None), (2, 5, 16, 4, True, None, None), (3, 1, 24, 4, True, None, None),
              (1, 2, 8, 4, True, None, None), (1, 70, 40, 3, False, (0, 20, 21, 22), None),
              (1, 64, 32, 4, False, (0, 3), None), (2, 37, 48, 4, True, None, 16), (1, 70, 48, 4, False, (0, 20), 24),
              (3, 1, 32, 4, True, None, 16), (1, 33, 260, 4, False, None, 130)]


@pytest.mark.parametrize("B,T,D,K,with_state,starts,l2_head_size", CONV_CASES)
def test_short_convolution_matches_the_module(reslin, B, T, D, K, with_state, starts, l2_head_size):
    torch.manual_seed(0)
    _, _, conv = reference_modules(reslin, D, K)
    conv = conv.to(DEVICE)
    x, dy = random(B, T, D), torch.randn(B, T, D, device=DEVICE)
    state = random(B, D, K - 1) if with_state else None
    positions = packed_positions(T, starts, B) if starts else None
    inputs = [t for t in (x, conv.weight, state) if t is not None]
    y_ref, state_ref = conv(x, state, positions, l2_head_size)
    assert_close((y := layers.short_convolution(x, conv.weight, state, positions, l2_head_size), grads(y, inputs, dy)),
                 (y_ref, grads(y_ref, inputs, dy)), 1e-5)
    assert torch.equal(conv.last_inputs(x, state), state_ref)


@pytest.mark.parametrize("B,T,D,K,with_state,starts,l2_head_size", [CONV_CASES[i] for i in (0, 2, 4, 8)])
def test_short_convolution_of_a_column_slice(reslin, B, T, D, K, with_state, starts, l2_head_size):
    """x a slice of a wider tensor's columns (a generation step's q, k or v from one GEMM), read in
    place: the output, the updated state and the gradients exactly those of a contiguous copy."""
    torch.manual_seed(0)
    _, _, conv = reference_modules(reslin, D, K)
    wide, dy = torch.randn(B, T, D + 40, device=DEVICE), torch.randn(B, T, D, device=DEVICE)
    state = torch.randn(B, D, K - 1, device=DEVICE) if with_state else None
    positions = packed_positions(T, starts, B) if starts else None
    results = []
    for x in (wide[..., 24:24 + D].requires_grad_(), wide[..., 24:24 + D].contiguous().requires_grad_()):
        y = layers.short_convolution(x, conv.weight.to(DEVICE), state, positions, l2_head_size)
        results.append((y, *torch.autograd.grad(y, x, dy)))
        if state is not None:
            with torch.no_grad():
                held = state.clone()
                layers.short_convolution(x, conv.weight.to(DEVICE), held, positions, l2_head_size, update_state=True)
                results[-1] += (held,)
    assert not wide[..., 24:24 + D].is_contiguous()
    for got, expected in zip(*results):
        assert torch.equal(got, expected)


def check_state_update(reslin, B, T, D, K, l2_head_size, dtype):
    """update_state: the same output as without it, and the state tensor itself now the module's
    state after x (its last K - 1 inputs), exactly; the output within 1e-5 of the module's in fp32
    (bf16 and fp16: within their rounding, 1e-2)."""
    torch.manual_seed(0)
    _, _, conv = reference_modules(reslin, D, K)
    conv = conv.to(DEVICE)
    x, state = torch.randn(B, T, D, device=DEVICE), torch.randn(B, D, K - 1, device=DEVICE)
    with torch.no_grad():
        y_ref, state_ref = conv(x, state, None, l2_head_size)
        held = state.to(dtype, copy=True)
        y = layers.short_convolution(x.to(dtype), conv.weight, held, None, l2_head_size, update_state=True)
        assert torch.equal(y, layers.short_convolution(x.to(dtype), conv.weight, state.to(dtype), None, l2_head_size))
    assert rel_err(y, y_ref) <= (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(held, state_ref.to(dtype))


@pytest.mark.parametrize("B,T,D,K,with_state,starts,l2_head_size",
                         [case for case in CONV_CASES if case[4]] + [(2, 40, 24, 4, True, None, None)])
def test_short_convolution_updates_its_state_in_place(reslin, B, T, D, K, with_state, starts, l2_head_size):
    """`check_state_update` in fp32: a step's token, T below K - 1, and T past the block of 32
    (whose second tile must not read the state being overwritten)."""
    check_state_update(reslin, B, T, D, K, l2_head_size, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@on_gpu
def test_short_convolution_updates_its_state_in_place_at_real_sizes(reslin, dtype):
    """`check_state_update` at a 400M model's widths: a generation step of 64 rows and a prefill of
    4096 tokens continuing from a cache, with and without the L2 norm of heads of 128."""
    for B, T in ((64, 1), (2, 4096)):
        for l2_head_size in (None, 128):
            check_state_update(reslin, B, T, 1024, 4, l2_head_size, dtype)


def check_gates(reslin, monkeypatch, mixer_name, dtype, **overrides):
    """The layer's gates fused and by its torch code, relative error <= 1e-6 (both compute in fp32
    from the same projections): a generation step's few elements (its a, b and c column slices of
    one GEMM's output), and more than one program's block with softplus on both sides of its
    threshold of 20; without gamma (gdn) and with it (rdn)."""
    if DEVICE == "cpu":  # the modeling file takes the kernels on CUDA only: here, in the interpreter
        monkeypatch.setattr(reslin.modeling, "runs_fused", lambda fused, x: fused)
    layer = build_model(mixer_name, **overrides).to(DEVICE, dtype).model.layers[0].attn
    torch.manual_seed(0)
    for B, T in ((2, 1), (3, 1500)):
        x = torch.randn(B, T, layer.a_proj.in_features, device=DEVICE, dtype=dtype)
        with torch.no_grad():
            x *= 60 / layer.a_proj(x).abs().max()  # a_proj x + dt_bias spans about -60 to 60
            layer.fused = True
            a, b, c = layer.input_projections(x, inference=True)[3:6]
            fused = layer.gates(a, b, c, inference=True)
            layer.fused = False
            reference = layer.gates(a, b, c, inference=True)
        assert a.is_contiguous() == (T > 1)
        assert (fused[2] is None) == (reference[2] is None) == (mixer_name == "gdn")
        for got, expected in zip(fused, reference):
            if expected is not None:
                assert got.dtype == torch.float32 and got.shape == expected.shape
                assert rel_err(got, expected) <= 1e-6
    assert B * T * layer.num_v_heads > layers.TILE_ELEMENTS


@pytest.mark.parametrize("mixer_name", ["gdn", "rdn"])
def test_gates_match_the_torch_code(reslin, monkeypatch, mixer_name):
    """The fused gates (inference only), a tiny fp32 model's (`check_gates`)."""
    check_gates(reslin, monkeypatch, mixer_name, torch.float32)


@pytest.mark.parametrize("mixer_name", ["gdn", "rdn"])
@on_gpu
def test_gates_in_bf16_at_real_sizes(reslin, monkeypatch, mixer_name):
    """`check_gates` on a bf16 layer of a 400M model's width (hidden 1024, 8 value heads), where
    A_log and dt_bias are bf16 too."""
    check_gates(reslin, monkeypatch, mixer_name, torch.bfloat16, hidden_size=1024, num_heads=8, head_dim=128)


def test_gates_read_each_input_at_its_own_row_stride():
    """a, b and c with rows apart by different strides (column slices of tensors of other widths,
    and a contiguous one) give exactly what their contiguous copies give."""
    torch.manual_seed(0)
    A_log, dt_bias = torch.randn(8, device=DEVICE), torch.randn(8, device=DEVICE)
    a = torch.randn(3, 5, 20, device=DEVICE)[..., 4:12]
    b = torch.randn(3, 5, 8, device=DEVICE)
    c = torch.randn(3, 5, 13, device=DEVICE)[..., 1:9]
    for got, expected in zip(layers.gates(a, b, c, A_log, dt_bias),
                             layers.gates(a.contiguous(), b, c.contiguous(), A_log, dt_bias)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("mixer_name", ["gdn", "rdn"])
def test_input_projections_in_one_gemm_at_a_step(reslin, monkeypatch, mixer_name):
    """At a generation step (one token a row, no autograd) the layer's q, k, v, a, b (and c) and
    the output norm's gate are column slices of one GEMM, equal to each projection's own call
    within 1e-6 (fp32); a prefill, or a projection that is not a plain nn.Linear (a hook here, as
    PEFT's wrappers), calls each. With the block's norm handed over, the same of the normed x."""
    if DEVICE == "cpu":
        monkeypatch.setattr(reslin.modeling, "runs_fused", lambda fused, x: fused)
    block = build_model(mixer_name).to(DEVICE).model.layers[0]
    layer = block.attn
    torch.nn.init.normal_(block.attn_norm.weight, 1.0, 0.5)
    projections = [layer.q_proj, layer.k_proj, layer.v_proj, layer.a_proj, layer.b_proj,
                   getattr(layer, "gamma_proj", None), layer.g_proj]
    torch.manual_seed(0)
    for T, hooked, norm in ((1, False, None), (4, False, None), (1, True, None), (1, False, block.attn_norm),
                            (4, False, block.attn_norm), (4, True, block.attn_norm)):
        x = torch.randn(3, T, layer.q_proj.in_features, device=DEVICE)
        hook = layer.k_proj.register_forward_hook(lambda module, args, out: out + 1) if hooked else None
        with torch.no_grad():
            outputs = layer.input_projections(x, norm, inference=True)
            normed = x if norm is None else F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)
            expected = [None if projection is None else projection(normed) for projection in projections]
        if hook is not None:
            hook.remove()
        assert outputs[0].is_contiguous() == (T > 1 or hooked)
        assert (outputs[5] is None) == (mixer_name == "gdn")
        for got, want in zip(outputs, expected):
            if want is not None:
                assert got.shape == want.shape and rel_err(got, want) <= 1e-6


def test_bad_shapes_are_named():
    x = torch.randn(2, 5, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        layers.rms_norm(x, torch.ones(7, device=DEVICE))
    with pytest.raises(ValueError, match="gate must be shaped like x"):
        layers.rms_norm(x, torch.ones(8, device=DEVICE), gate=torch.ones(2, 5, 4, device=DEVICE))
    with pytest.raises(ValueError, match="at most 16384"):
        layers.rms_norm(torch.randn(1, 16385, device=DEVICE), torch.ones(16385, device=DEVICE))
    with pytest.raises(ValueError, match="projections must be one or more weights"):
        layers.rms_norm(x, torch.ones(8, device=DEVICE), projections=[torch.ones(3, 8), torch.ones(3, 16)])
    with pytest.raises(ValueError, match="projections must be one or more weights"):
        layers.rms_norm(x, torch.ones(8, device=DEVICE), projections=[torch.ones(3, 12, device=DEVICE)])
    with pytest.raises(ValueError, match="gate and up must match"):
        layers.swiglu(x, x[..., :4])
    with pytest.raises(ValueError, match=r"down_weight must be \[hidden, 8\]"):
        layers.swiglu(x, x, torch.ones(4, 7, device=DEVICE))
    with pytest.raises(ValueError, match=r"weight must be \[D=8, 1, K\]"):
        layers.short_convolution(x, torch.ones(8, 4, device=DEVICE))
    with pytest.raises(ValueError, match=r"state must be \[B, D, K - 1\]"):
        layers.short_convolution(x, torch.ones(8, 1, 4, device=DEVICE), torch.zeros(2, 8, 4, device=DEVICE))
    with pytest.raises(ValueError, match="l2_head_size must divide D = 8"):
        layers.short_convolution(x, torch.ones(8, 1, 4, device=DEVICE), l2_head_size=3)
    with pytest.raises(ValueError, match=r"positions must be \[B, T\]"):
        layers.short_convolution(x, torch.ones(8, 1, 4, device=DEVICE), None, torch.zeros(2, 4, device=DEVICE))
    taps, window = torch.ones(8, 1, 4, device=DEVICE), torch.zeros(2, 8, 3, device=DEVICE)
    with pytest.raises(ValueError, match="update_state needs a state"):
        layers.short_convolution(x, taps, update_state=True)
    with pytest.raises(ValueError, match="contiguous and of x's dtype"):
        layers.short_convolution(x, taps, window.double(), update_state=True)
    with pytest.raises(ValueError, match="without gradients"):
        layers.short_convolution(x.clone().requires_grad_(), taps, window, update_state=True)
    with pytest.raises(ValueError, match=r"gate input b must be \[\.\.\., 8\] like a"):
        layers.gates(x, x[..., :4], None, torch.zeros(8, device=DEVICE), torch.zeros(8, device=DEVICE))
    with pytest.raises(ValueError, match=r"dt_bias must be \[8\] like A_log"):
        layers.gates(x, x, x, torch.zeros(8, device=DEVICE), torch.zeros(4, device=DEVICE))


def set_fused(model, fused):
    for module in model.modules():
        if hasattr(module, "fused"):
            module.fused = fused


def model_loss_and_grads(model, fused, autocast=False, attention_backend=None, **inputs):
    set_fused(model, fused)
    if attention_backend is not None:
        for module in model.modules():
            if hasattr(module, "kernel_backend"):
                module.kernel_backend = attention_backend
    model.zero_grad()
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("mixer_name", ["rdn", "kla", "hybrid"])
def test_model_through_the_fused_layers(reslin, monkeypatch, mixer_name):
    """A tiny fp32 model's loss and gradients with every norm, convolution and SwiGLU fused equal
    those of its torch code, also with packed sequences; prefill then decode steps through a cache
    give the logits of one long forward."""
    if DEVICE == "cpu":  # the modeling file takes the kernels on CUDA only: here, in the interpreter
        monkeypatch.setattr(reslin.modeling, "runs_fused", lambda fused, x: fused)
    model = build_model(mixer_name).to(DEVICE).train()
    assert all(module.fused for module in model.modules() if hasattr(module, "fused"))
    ids = torch.randint(1, 100, (2, 21), device=DEVICE)
    packed = {"input_ids": ids[:1], "position_ids": packed_positions(21, (0, 8, 9), 1)}
    for inputs in ({"input_ids": ids}, packed):
        (loss, grads_fused) = model_loss_and_grads(model, True, **inputs)
        (loss_ref, grads_ref) = model_loss_and_grads(model, False, **inputs)
        assert rel_err(loss, loss_ref) <= 1e-5
        assert len(grads_fused) == len(grads_ref) == len(list(model.parameters()))
        for grad, grad_ref in zip(grads_fused, grads_ref):
            assert rel_err(grad, grad_ref) <= 1e-4

    model.eval()
    set_fused(model, True)
    with torch.no_grad():
        full = model(ids).logits
        output = model(ids[:, :13], use_cache=True)
        steps = [output.logits]
        for t in range(13, 21):
            output = model(ids[:, t:t + 1], cache=cache_of(output))
            steps.append(output.logits)
    assert rel_err(torch.cat(steps, dim=1), full) <= 1e-5


def test_down_projection_taken_along_only_when_plain(reslin, monkeypatch):
    """The MLP hands its down projection's weight to the fused SwiGLU only when calling the module
    would run nothing else; a LoRA-wrapped model through the fused layers keeps its gradients."""
    from peft import LoraConfig, get_peft_model

    plain = torch.nn.Linear(4, 3, bias=False)
    assert reslin.modeling.is_plain_linear(plain)
    assert not reslin.modeling.is_plain_linear(torch.nn.Linear(4, 3))
    hooked = torch.nn.Linear(4, 3, bias=False)
    hooked.register_forward_hook(lambda *args: None)
    assert not reslin.modeling.is_plain_linear(hooked)
    replaced = torch.nn.Linear(4, 3, bias=False)
    replaced.forward = lambda x: x  # what accelerate's offloading hooks do
    assert not reslin.modeling.is_plain_linear(replaced)

    if DEVICE == "cpu":
        monkeypatch.setattr(reslin.modeling, "runs_fused", lambda fused, x: fused)
    torch.manual_seed(0)
    model = get_peft_model(build_model("gdn"), LoraConfig(r=4, target_modules=["down_proj", "q_proj"],
                                                           init_lora_weights=False)).to(DEVICE).train()
    assert not reslin.modeling.is_plain_linear(model.base_model.model.model.layers[0].mlp.down_proj)
    ids = torch.randint(1, 100, (2, 9), device=DEVICE)
    (loss, grads_fused), (loss_ref, grads_ref) = (model_loss_and_grads(model, fused, input_ids=ids)
                                                  for fused in (True, False))
    assert rel_err(loss, loss_ref) <= 1e-5
    assert len(grads_fused) == len(grads_ref) > 0
    for grad, grad_ref in zip(grads_fused, grads_ref):
        assert rel_err(grad, grad_ref) <= 1e-4


@pytest.mark.parametrize("mixer_name", ["gdn", "kla", "rdn"])
def test_fused_block_keeps_few_activations(reslin, monkeypatch, mixer_name):
    """A block through the fused layers keeps, per token, 10 tensors as wide as the hidden size
    (the two norms' inputs, q, k, v before and after their convolutions, the output gate and the
    attention's output: the norms hand their outputs to the projections after them without
    keeping them), SwiGLU's two inputs, for the delta rule T^-1's row of 64 (the chunk) per head,
    and T_R^-1's with the residual state, which the backward takes from the forward, and the
    gates: within 3% of that sum in fp32 (the gates and the per-sequence initial states). The torch code keeps 1.5x as much or more (SiLU's outputs, q
    and k before their norms, SwiGLU's product; in bf16 also its fp32 copies)."""
    sys.path.insert(0, str(reslin.repo_root / "benchmarks"))
    from saved_activations import kept_bytes_per_token

    if DEVICE == "cpu":
        monkeypatch.setattr(reslin.modeling, "runs_fused", lambda fused, x: fused)
    hidden, inner = 64, 128
    config = build_config(mixer_name, hidden_size=hidden, num_heads=2, head_dim=32, intermediate_size=inner,
                          kernel_backend="triton")
    block = reslin.modeling.ResLinBlock(config, 0).to(DEVICE)
    x = torch.randn(1, 256, hidden, device=DEVICE, requires_grad=True)
    kept_inverse = 2 * 64 * (2 if mixer_name == "rdn" else 1)  # 2 heads; RDN keeps two inverses
    expected = 4 * (10 * hidden + 2 * inner + kept_inverse)
    fused = kept_bytes_per_token(block, x)
    assert expected <= fused < 1.03 * expected
    set_fused(block, False)
    assert kept_bytes_per_token(block, x) > 1.5 * fused


# --- GPU: compiled, bf16, a 400M model's sizes ----------------------------------------------------

def real_size_case(fused, reference, inputs, dtype):
    """The fused function on `inputs` in `dtype`, the reference in fp32 on the same rounded values,
    one bf16 output gradient: relative errors of the output and of each input's gradient."""
    low = [x.detach().to(dtype).requires_grad_() for x in inputs]
    exact = [x.detach().to(dtype).float().requires_grad_() for x in inputs]
    y, y_ref = fused(*low), reference(*exact)
    dy = torch.randn_like(y_ref).to(dtype)
    return [rel_err(y, y_ref)] + [rel_err(a, b) for a, b in zip(grads(y, low, dy), grads(y_ref, exact, dy.float()))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@on_gpu
def test_fused_layers_in_low_precision_at_real_sizes(reslin, dtype):
    """A 400M model's shapes, B4 x T4096: the hidden norm (1024), the per-head gated norm (128),
    the convolution with packed sequences, without and with the L2 norm of heads of 128, SwiGLU
    of 2816."""
    torch.manual_seed(0)
    B, T, hidden, heads, head_dim, inner = 4, 4096, 1024, 8, 128, 2816
    norm, _, conv = reference_modules(reslin, hidden)
    _, gated, _ = reference_modules(reslin, head_dim)
    norm, gated, conv = norm.cuda(), gated.cuda(), conv.cuda()
    positions = packed_positions(T, (0, 1000, 1001, 3000), B)
    x = torch.randn(B, T, hidden, device="cuda")
    heads_x, gate = torch.randn(2, B, T, heads, head_dim, device="cuda")
    cases = {
        "norm": (lambda x, w: layers.rms_norm(x, w, norm.eps), lambda x, w: F.rms_norm(x, (hidden,), w, norm.eps),
                 (x, norm.weight)),
        "gated": (lambda x, w, z: layers.rms_norm(x, w, gated.eps, gate=z),
                  lambda x, w, z: F.rms_norm(x, (head_dim,), w, gated.eps) * F.silu(z), (heads_x, gated.weight, gate)),
        "conv": (lambda x, w: layers.short_convolution(x, w, None, positions),
                 lambda x, w: torch.func.functional_call(conv, {"weight": w}, (x, None, positions))[0],
                 (x, conv.weight)),
        "conv, L2 per head": (lambda x, w: layers.short_convolution(x, w, None, positions, head_dim),
                              lambda x, w: torch.func.functional_call(conv, {"weight": w},
                                                                      (x, None, positions, head_dim))[0],
                              (x, conv.weight)),
        "swiglu": (layers.swiglu, lambda a, b: F.silu(a) * b, torch.randn(2, B * T, inner, device="cuda")),
    }
    for name, (fused, reference, inputs) in cases.items():
        errors = real_size_case(fused, reference, inputs, dtype)
        assert max(errors) <= 1e-2, (name, errors)


@pytest.mark.parametrize("mixer_name", ["gdn", "rdn"])
@on_gpu
def test_model_bf16_fused_as_accurate_as_torch_code(mixer_name):
    """A 2-layer model of hidden 1024, heads of 128, B2 x T2048 under bf16 autocast, with the fused
    layers and with the torch code, each against the torch code in fp32 (its attention too: the
    torch backend, which spares compiling RDN's fp32 Triton kernels at D128, minutes on a first
    run): the fused layers' errors in the loss and in every gradient are at most 1.5x the torch
    code's (+ 1e-3). Both bf16 runs take the Triton attention."""
    model = build_model(mixer_name, hidden_size=1024, num_heads=8, head_dim=128, intermediate_size=2816,
                        vocab_size=32000).cuda().train()
    ids = torch.randint(3, 32000, (2, 2048), device="cuda")
    exact_loss, exact_grads = model_loss_and_grads(model, False, attention_backend="torch", input_ids=ids)
    (loss, grads_fused), (loss_torch, grads_torch) = (
        model_loss_and_grads(model, fused, autocast=True, attention_backend="triton", input_ids=ids)
        for fused in (True, False))
    assert rel_err(loss, exact_loss) <= 1.5 * rel_err(loss_torch, exact_loss) + 1e-3
    for grad, grad_torch, exact in zip(grads_fused, grads_torch, exact_grads):
        assert rel_err(grad, exact) <= 1.5 * rel_err(grad_torch, exact) + 1e-3
