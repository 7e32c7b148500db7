"""reslin_attention: every backend against the fp32 per-token reference, and the reference
against the formulas of DESIGN.md section 1 written out a second time, plainly, in float64.

Tolerances: relative error ||x - ref|| / ||ref|| <= 1e-4 between fp32 backends (measured
~3e-7: they differ only in summation order), 1e-5 between the reference and the float64 spec.
"""

import pytest
import torch

from kernels_reslin import reslin_attention, reslin_decode_step

RULES = [  # (name, update, residual)
    ("sgla", "additive", False),
    ("gdn", "delta", False),
    ("rla", "additive", True),
    ("rdn", "delta", True),
]
RESIDUAL_RULES = [rule for rule in RULES if rule[2]]
# Every rule with its step: KLA and RKLA are the delta rule with raw keys and the Kaczmarz beta.
STEPPED_RULES = [rule + (False,) for rule in RULES] + [("kla", "delta", False, True),
                                                       ("rkla", "delta", True, True)]
# (B, T, H, HV, Dk, Dv): T = 1, T < chunk (32), T = 2 chunks, T not a multiple of the chunk,
# several heads, grouped value heads, Dk != Dv.
SHAPES = [
    (2, 1, 2, 2, 16, 16),
    (1, 7, 1, 1, 8, 12),
    (2, 64, 2, 4, 16, 8),
    (1, 150, 3, 3, 12, 20),
]
REL_TOL = 1e-4


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_inputs(B, T, H, HV, Dk, Dv, residual, kaczmarz=False, seed=0, requires_grad=False):
    """Random inputs shaped like the model's: L2-normalised keys and beta in (0, 1), or for
    KLA raw keys with beta = eta / (||k||^2 + eps)."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = randn(B, T, H, Dk)
    k = randn(B, T, H, Dk)
    v = randn(B, T, HV, Dv)
    g = -torch.nn.functional.softplus(randn(B, T, HV)) * 0.5
    beta = torch.sigmoid(randn(B, T, HV))
    gamma = torch.sigmoid(randn(B, T, HV)) if residual else None
    gamma_write = None
    if kaczmarz:
        k_norm2 = k.pow(2).sum(-1).repeat_interleave(HV // H, dim=2)
        beta = beta / (k_norm2 + 1e-6)
        gamma_write = None if gamma is None else gamma / (k_norm2 + 1e-6)
    else:
        k = torch.nn.functional.normalize(k, dim=-1)
    S0 = randn(B, HV, Dk, Dv) * 0.3
    R0 = randn(B, HV, Dk, Dv) * 0.3 if residual else None
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta, gamma=gamma, gamma_write=gamma_write, S0=S0, R0=R0)
    if requires_grad:
        for x in tensors.values():
            if x is not None:
                x.requires_grad_(True)
    return tensors


def run(x, update, backend, cu_seqlens=None, with_state=True):
    initial = (x["S0"], x["R0"]) if with_state else None
    o, (S, R) = reslin_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], x["gamma"], update=update,
                                 initial_state=initial, output_final_state=True,
                                 cu_seqlens=cu_seqlens, backend=backend, gamma_write=x["gamma_write"])
    return o, S, R


def spec_reference(x, update, clip=1.0):
    """DESIGN.md section 1 per head and per token, float64, with explicit matrices. Independent
    of kernels_reslin_torch on purpose: it is how the reference itself is checked."""
    q, k, v, g, beta, gamma, gamma_write = (None if x[n] is None else x[n].detach().double()
                                            for n in ("q", "k", "v", "g", "beta", "gamma", "gamma_write"))
    if gamma_write is None:
        gamma_write = gamma
    B, T, H, Dk = q.shape
    HV = v.shape[2]
    scale = Dk ** -0.5
    out = torch.zeros(B, T, HV, v.shape[3], dtype=torch.float64)
    for b in range(B):
        for h in range(HV):
            hq = h // (HV // H)
            S = x["S0"][b, h].detach().double().clone()
            R = None if gamma is None else x["R0"][b, h].detach().double().clone()
            for t in range(T):
                a = torch.exp(g[b, t, h])
                kt, qt, vt, bt = k[b, t, hq], q[b, t, hq], v[b, t, h], beta[b, t, h]
                if gamma is not None:
                    c = gamma[b, t, h]
                    r = torch.clamp(vt - S.T @ kt, -clip, clip)
                    inner = r - a * (R.T @ kt) if update == "delta" else r
                    R = a * R + gamma_write[b, t, h] * torch.outer(kt, inner)
                    out[b, t, h] = scale * (a * (S.T @ qt) + c * (R.T @ qt))
                inner = vt - a * (S.T @ kt) if update == "delta" else vt
                S = a * S + bt * torch.outer(kt, inner)
                if gamma is None:
                    out[b, t, h] = scale * (S.T @ qt)
    return out


@pytest.mark.parametrize("name,update,residual,kaczmarz", STEPPED_RULES)
def test_reference_matches_spec(name, update, residual, kaczmarz):
    x = make_inputs(2, 9, 1, 2, 3, 4, residual, kaczmarz=kaczmarz)
    o, _, _ = run(x, update, "recurrent")
    assert rel_err(o, spec_reference(x, update)) < 1e-5


@pytest.mark.parametrize("name,update,residual", RESIDUAL_RULES)
def test_reference_clips_residual(name, update, residual):
    """Values far from the state's prediction make the clip bind; c = inf must then differ."""
    x = make_inputs(1, 6, 1, 1, 3, 4, residual)
    x["v"] = x["v"] * 10
    o_clip, _, _ = run(x, update, "recurrent")
    assert rel_err(o_clip, spec_reference(x, update, clip=1.0)) < 1e-5
    o_free, _ = reslin_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], x["gamma"], update=update,
                                 clip=float("inf"), initial_state=(x["S0"], x["R0"]), backend="recurrent")
    assert rel_err(o_free, spec_reference(x, update, clip=float("inf"))) < 1e-5
    assert rel_err(o_free, o_clip) > 1e-2


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}HV{}Dk{}Dv{}".format(*s))
@pytest.mark.parametrize("name,update,residual,kaczmarz", STEPPED_RULES)
def test_torch_backend_forward_and_grads(name, update, residual, kaczmarz, shape):
    x = make_inputs(*shape, residual, kaczmarz=kaczmarz, requires_grad=True)
    leaves = [t for t in x.values() if t is not None]
    outputs = {}
    for backend in ("recurrent", "torch"):
        o, S, R = run(x, update, backend)
        parts = [o, S] + ([R] if residual else [])
        gen = torch.Generator().manual_seed(1)
        loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in parts)
        outputs[backend] = parts + list(torch.autograd.grad(loss, leaves))
    names = ["o", "S", "R"][: 2 + residual] + [n for n, t in x.items() if t is not None]
    for label, got, ref in zip(names, outputs["torch"], outputs["recurrent"]):
        assert torch.isfinite(got).all(), label
        assert rel_err(got, ref) < REL_TOL, f"{label}: {rel_err(got, ref):.2e}"


@pytest.mark.parametrize("backend", ["recurrent", "torch"])
@pytest.mark.parametrize("name,update,residual", RULES)
def test_varlen_equals_separate_sequences(name, update, residual, backend):
    lengths = [1, 70, 5, 64]
    H, HV, Dk, Dv = 2, 2, 8, 12
    pieces = [make_inputs(1, n, H, HV, Dk, Dv, residual, seed=i) for i, n in enumerate(lengths)]
    packed = {n: (None if pieces[0][n] is None else
                  torch.cat([p[n] for p in pieces], dim=0 if n in ("S0", "R0") else 1))
              for n in pieces[0]}
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
    o, S, R = run(packed, update, backend, cu_seqlens=cu_seqlens)
    for i, piece in enumerate(pieces):
        o_i, S_i, R_i = run(piece, update, "recurrent")
        assert rel_err(o[:, cu_seqlens[i]:cu_seqlens[i + 1]], o_i) < REL_TOL
        assert rel_err(S[i:i + 1], S_i) < REL_TOL
        if residual:
            assert rel_err(R[i:i + 1], R_i) < REL_TOL


@pytest.mark.parametrize("backend", ["recurrent", "torch"])
@pytest.mark.parametrize("name,update,residual", RULES)
def test_zero_gates_leave_states_unchanged(name, update, residual, backend):
    """What the model relies on for padding: g = beta = gamma = 0 steps pass states through."""
    x = make_inputs(2, 70, 2, 2, 8, 8, residual)
    for n in ("g", "beta") + (("gamma",) if residual else ()):
        x[n] = torch.zeros_like(x[n])
    _, S, R = run(x, update, backend)
    assert torch.equal(S, x["S0"])
    if residual:
        assert torch.equal(R, x["R0"])


@pytest.mark.parametrize("name,update,residual", RULES)
def test_split_sequence_continues_from_state(name, update, residual):
    """Prefill in two parts through the final state equals one pass (what generate relies on)."""
    x = make_inputs(2, 100, 2, 2, 8, 8, residual)
    o, S, R = run(x, update, "torch")
    first = {n: (t if t is None or n in ("S0", "R0") else t[:, :37]) for n, t in x.items()}
    second = {n: (t if t is None or n in ("S0", "R0") else t[:, 37:]) for n, t in x.items()}
    o1, S1, R1 = run(first, update, "torch")
    second["S0"], second["R0"] = S1, R1
    o2, S2, R2 = run(second, update, "torch")
    assert rel_err(torch.cat([o1, o2], dim=1), o) < REL_TOL
    assert rel_err(S2, S) < REL_TOL


def test_grouped_heads_equal_repeated_heads():
    x = make_inputs(1, 20, 2, 6, 8, 8, residual=True)
    o, S, R = run(x, "delta", "torch")
    y = dict(x, q=x["q"].repeat_interleave(3, dim=2), k=x["k"].repeat_interleave(3, dim=2))
    o_ref, S_ref, R_ref = run(y, "delta", "torch")
    assert rel_err(o, o_ref) < 1e-6 and rel_err(S, S_ref) < 1e-6 and rel_err(R, R_ref) < 1e-6


def test_defaults_zero_state_and_dtype():
    x = make_inputs(1, 10, 1, 1, 8, 8, residual=True)
    zero = dict(x, S0=torch.zeros_like(x["S0"]), R0=torch.zeros_like(x["R0"]))
    o_ref, _, _ = run(zero, "delta", "torch")
    o, state = reslin_attention(*(x[n] for n in ("q", "k", "v", "g", "beta", "gamma")))
    assert state is None and rel_err(o, o_ref) < 1e-6
    o16, _ = reslin_attention(*(x[n].bfloat16() for n in ("q", "k", "v", "g", "beta", "gamma")))
    assert o16.dtype == torch.bfloat16 and rel_err(o16.float(), o_ref) < 2e-2


def test_bad_inputs_raise_clear_errors():
    x = make_inputs(1, 8, 2, 4, 8, 8, residual=True)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    cases = [
        (dict(update="mystery"), "update must be one of"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(clip=0.0), "clip must be > 0"),
        (dict(gamma=x["gamma"][:, :4]), "gamma must be"),
        (dict(initial_state=(x["S0"][:, :2], None)), "initial_state's S0 must be"),
        (dict(initial_state=(x["S0"], x["R0"])), "initial_state has a residual state R0 but gamma is None"),
        (dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), "never decrease"),
        (dict(cu_seqlens=torch.tensor([0, 5])), "end at T"),
        (dict(cu_seqlens=[0, 8]), "cu_seqlens must be a 1-D integer tensor"),
        (dict(gamma_write=x["gamma"]), "needs gamma"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            reslin_attention(*args, **kwargs)
    with pytest.raises(ValueError, match=r"hold no tokens \(B = 1, T = 0\)"):
        reslin_attention(*(a[:, :0] for a in args))
    with pytest.raises(ValueError, match="multiple of"):
        reslin_attention(x["q"], x["k"], x["v"][:, :, :3], x["g"][..., :3], x["beta"][..., :3])
    with pytest.raises(ValueError, match="key head size"):
        big = torch.randn(1, 2, 1, 300)
        reslin_attention(big, big, torch.randn(1, 2, 1, 8), torch.zeros(1, 2, 1), torch.ones(1, 2, 1))
    with pytest.raises(ValueError, match="same shape"):
        reslin_attention(x["q"], x["k"][:, :, :1], *args[2:])


def test_bad_decode_states_raise_clear_errors():
    x = make_inputs(2, 1, 2, 2, 8, 8, residual=True)
    step = [x[n] for n in ("q", "k", "v", "g", "beta")]
    S, R = x["S0"].contiguous(), x["R0"].contiguous()
    cases = [
        (None, {}, "advances a state"),
        ((S, R), {}, "state has a residual state R but gamma is None"),
        ((S, None), {"gamma": x["gamma"]}, "exactly when gamma"),
        ((S[:1], None), {}, "state's S must be"),
        ((S.transpose(-1, -2), None), {}, "state's S must be contiguous"),
        ((S.double(), None), {}, "state's S must be fp32"),
    ]
    for state, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            reslin_decode_step(*step, state, **kwargs)
    with pytest.raises(ValueError, match="one token"):
        reslin_decode_step(*(torch.cat([a, a], 1) for a in step), (S, None))


def test_sequence_bounds_reads_a_tensor_once_until_it_changes():
    """Every layer reads the same cu_seqlens: the host read (a device sync on a GPU) happens once,
    and again only for another tensor or after an in-place change."""
    from kernels_reslin_torch import sequence_bounds

    cu_seqlens = torch.tensor([0, 3, 7])
    first = sequence_bounds(cu_seqlens)
    assert first == [0, 3, 7] and sequence_bounds(cu_seqlens) is first
    same_values = torch.tensor([0, 3, 7])
    assert sequence_bounds(same_values) == first and sequence_bounds(same_values) is not first
    same_values[1] = 5
    assert sequence_bounds(same_values) == [0, 5, 7]


@pytest.mark.parametrize("backend", ["recurrent", "torch"])
def test_torch_backends_compute_in_fp32_under_autocast(backend):
    """Under bf16 autocast (Trainer(bf16=True)) the torch backends still compute in fp32, as the
    Triton kernels do; autocast used to run their matmuls in bf16 (relative error ~7e-3)."""
    x = make_inputs(1, 40, 2, 2, 16, 16, residual=True)
    o_ref, S_ref, R_ref = run(x, "delta", backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, S, R = run(x, "delta", backend)
    assert o.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-6 and rel_err(S, S_ref) < 1e-6 and rel_err(R, R_ref) < 1e-6


def test_states_and_cu_seqlens_on_another_device_are_refused():
    """meta stands in for another device: the checks name the argument, where torch used to fail
    deep inside a backend."""
    x = make_inputs(2, 4, 2, 2, 8, 8, residual=True)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "gamma")]
    elsewhere = lambda t: t.to("meta")  # noqa: E731
    with pytest.raises(ValueError, match="initial_state's S0 is on meta, the inputs on cpu"):
        reslin_attention(*args, initial_state=(elsewhere(x["S0"]), None))
    with pytest.raises(ValueError, match="initial_state's R0 is on meta"):
        reslin_attention(*args, initial_state=(x["S0"], elsewhere(x["R0"])))
    packed = [a[:1] for a in args]
    with pytest.raises(ValueError, match="cu_seqlens must be on the inputs' device cpu or the CPU, got meta"):
        reslin_attention(*packed, cu_seqlens=torch.tensor([0, 2, 4], device="meta"))
    step = {n: x[n][:, :1] for n in ("q", "k", "v", "g", "beta", "gamma")}
    S, R = x["S0"].contiguous(), x["R0"].contiguous()
    with pytest.raises(ValueError, match="state's S is on meta"):
        reslin_decode_step(**step, state=(elsewhere(S), R))
    with pytest.raises(ValueError, match="state's R is on meta"):
        reslin_decode_step(**step, state=(S, elsewhere(R)))


@pytest.mark.parametrize("scale,message", [
    (0.0, "scale must be finite and > 0, got 0.0"),
    (-1.0, "scale must be finite and > 0"),
    (float("nan"), "scale must be finite and > 0, got nan"),
    (float("inf"), "scale must be finite and > 0, got inf"),
    (True, "scale must be a real number"),
    ("0.5", "scale must be a real number"),
    (torch.tensor([0.5, 0.5]), "scale must be a real number"),
])
def test_bad_scale_is_refused(scale, message):
    x = make_inputs(2, 3, 1, 1, 8, 8, residual=False)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match=message):
        reslin_attention(*args, scale=scale)
    with pytest.raises(ValueError, match=message):
        reslin_decode_step(*(a[:, :1] for a in args), (x["S0"].contiguous(), None), scale=scale)


@pytest.mark.parametrize("backend", ["recurrent", "torch"])
def test_scale_may_be_any_real_number(backend):
    x = make_inputs(1, 5, 1, 1, 8, 8, residual=True)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "gamma")]
    o_ref, _ = reslin_attention(*args, scale=2.0, backend=backend)
    for scale in (2, torch.tensor(2.0), torch.tensor([2])):
        assert torch.equal(reslin_attention(*args, scale=scale, backend=backend)[0], o_ref)


@pytest.mark.parametrize("log_decay", [-100.0, -1e4, -1e30, float("-inf")])
@pytest.mark.parametrize("name,update,residual", RULES)
def test_chunked_form_takes_any_log_decay_down_to_a_hard_reset(name, update, residual, log_decay):
    """A (near) reset mid-chunk, g <= -100 down to -inf: the chunked form used to give NaN at
    -inf (its decays exp(G_i - G_j) took -inf - -inf) and to lose accuracy below ~-1e4."""
    x = make_inputs(1, 40, 1, 2, 16, 16, residual)
    x["g"] = x["g"].clone()
    x["g"][0, 10, 0] = log_decay
    x["g"][0, 20:23, 1] = log_decay
    o_ref, S_ref, R_ref = run(x, update, "recurrent")
    o, S, R = run(x, update, "torch")
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5
    if residual:
        assert rel_err(R, R_ref) < 1e-5


def test_log_decay_floor_keeps_the_gradient_of_ordinary_decays():
    """The chunked forms floor g at -100: the gradient of every g above the floor is unchanged,
    and g below it, where the output no longer depends on it, gets none."""
    x = make_inputs(1, 20, 1, 1, 8, 8, residual=True, requires_grad=True)
    x["g"].data[0, 5, 0] = -500.0
    weights = torch.randn(1, 20, 1, 8)
    grads = {}
    for backend in ("recurrent", "torch"):
        o, S, R = run(x, "delta", backend)
        grads[backend], = torch.autograd.grad((o * weights).sum() + S.sum() + R.sum(), x["g"])
    assert grads["torch"][0, 5, 0] == 0
    assert rel_err(grads["torch"], grads["recurrent"]) < 1e-5


def test_reference_passes_an_empty_packed_sequence_through():
    x = make_inputs(1, 8, 2, 2, 8, 8, residual=True)
    x["S0"], x["R0"] = (torch.randn(3, 2, 8, 8) for _ in range(2))
    cu_seqlens = torch.tensor([0, 3, 3, 8])
    o, S, R = run(x, "delta", "recurrent", cu_seqlens=cu_seqlens)
    assert torch.equal(S[1], x["S0"][1]) and torch.equal(R[1], x["R0"][1])
    for got, ref in zip((o, S, R), run(x, "delta", "torch", cu_seqlens=cu_seqlens)):
        assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
@pytest.mark.parametrize("name", ["g", "beta", "gamma", "gamma_write", "S0", "R0"])
def test_gates_and_states_that_are_not_floating_point_are_refused(name, dtype):
    x = make_inputs(1, 3, 1, 1, 8, 8, residual=True, kaczmarz=True)
    x[name] = x[name].to(dtype)
    label = {"S0": "initial_state's S0", "R0": "initial_state's R0"}.get(name, name)
    with pytest.raises(ValueError, match=f"{label} must be a floating-point tensor, got {dtype}"):
        run(x, "delta", "torch")


def test_decode_state_that_cannot_be_advanced_in_place_is_named():
    x = make_inputs(2, 1, 2, 2, 8, 8, residual=False)
    step = [x[n] for n in ("q", "k", "v", "g", "beta")]
    with torch.inference_mode():
        made_in_inference = torch.zeros(2, 2, 8, 8)
    with pytest.raises(ValueError, match="state's S was made under torch.inference_mode()"):
        reslin_decode_step(*step, (made_in_inference, None))
    with torch.inference_mode():  # where torch allows it
        reslin_decode_step(*step, (made_in_inference, None))
    leaf = torch.zeros(2, 2, 8, 8, requires_grad=True)
    with pytest.raises(ValueError, match="state's S requires grad, but the step advances it in place"):
        reslin_decode_step(*step, (leaf, None))
    with torch.no_grad():
        reslin_decode_step(*step, (leaf, None))


def test_no_heads_and_clips_that_are_no_number_are_refused():
    x = make_inputs(1, 4, 2, 2, 8, 8, residual=True)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "gamma")]
    with pytest.raises(ValueError, match=r"at least one head, got H = 0 \(q, k\) and HV = 0"):
        reslin_attention(*(a[:, :, :0] for a in args))
    for clip in (None, torch.tensor([1.0, 2.0]), "1"):
        with pytest.raises(ValueError, match=r"clip must be a real number, > 0 \(use float\('inf'\) for no clipping\)"):
            reslin_attention(*args, clip=clip)
    o_ref, _ = reslin_attention(*args, clip=0.5)
    assert torch.equal(reslin_attention(*args, clip=torch.tensor(0.5))[0], o_ref)
