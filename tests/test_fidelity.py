"""Fidelity to the papers (issue 58): the raw keys' scale at initialisation, and the residual clip's
measurement (benchmarks/residual_clip.py) on a CPU."""

import json
import sys

import pytest
import torch

from conftest import REPO_ROOT, _configuration, _modeling

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import residual_clip  # noqa: E402

from test_compare_rules import CORPUS, TINY_TRAIN, tiny_argv  # noqa: E402

# (hidden size, layers, heads, head size): the shipped config, the KLA paper's 0.4B widths, and
# head sizes from 32 to 256. The key path is the same in every layer; the deep stacks are cut short.
SIZES = [(384, 8, 6, 64), (256, 1, 8, 32), (1024, 1, 8, 128), (2048, 1, 16, 128), (512, 1, 2, 256)]


def key_squared_norms(model, tokens):
    """||k||^2 per layer, token and head, of the keys each layer's attention reads: k_conv1d's output
    (after its SiLU, and its L2 norm where the rule has one)."""
    norms, handles = [], []
    for layer in model.model.layers:
        attn = layer.attn

        def keep(module, inputs, output, attn=attn):
            k = output[0]
            norms.append(k.float().unflatten(-1, (attn.num_heads, attn.head_dim)).square().sum(-1).flatten(0, 1))

        handles.append(attn.k_conv1d.register_forward_hook(keep))
    with torch.no_grad():
        model(tokens, use_cache=False)
    for handle in handles:
        handle.remove()
    return norms


def fresh_model(rule, hidden, layers, heads, head_dim):
    torch.manual_seed(0)
    config = _configuration.ResLinConfig(attn_type=rule, vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers,
                                         num_heads=heads, head_dim=head_dim, intermediate_size=hidden,
                                         kernel_backend="torch")
    return _modeling.ResLinForCausalLM(config).eval()


def random_tokens():
    return torch.randint(1000, (2, 64), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"hidden{s[0]}-{s[2]}x{s[3]}")
@pytest.mark.parametrize("rule", ["kla", "rkla"])
def test_raw_keys_have_squared_norm_near_one_at_init(rule, sizes):
    # Issue 58's criterion: every head's median ||k||^2 in [0.25, 4]; the init rule aims at
    # 1 + 3 / head_dim, and the heads' mean (seed 0: 0.98-1.04 at these sizes) stays near it.
    model = fresh_model(rule, *sizes)
    medians = torch.stack([norms.median(0).values for norms in key_squared_norms(model, random_tokens())])
    assert ((medians >= 0.25) & (medians <= 4)).all(), medians
    assert 0.8 <= medians.mean().item() <= 1.25, medians


@pytest.mark.parametrize("rule", ["gdn", "rdn"])
def test_normalised_keys_keep_their_init_and_unit_norm(rule):
    model = fresh_model(rule, 384, 2, 6, 64)
    for layer in model.model.layers:
        assert abs(layer.attn.k_conv1d.weight.std().item() - model.config.initializer_range) < 0.002
    for norms in key_squared_norms(model, random_tokens()):
        # Unit norm up to the L2 norm's eps (1e-6), which shortens a key whose raw norm is small.
        assert norms.max() <= 1 + 1e-5 and (norms.median(0).values >= 0.99).all(), norms


def test_the_tap_rule_matches_its_derivation():
    # 2 / (std * sqrt(conv_size * hidden_size * head_dim)); initializer_range 0 means 0.02, as in transformers.
    config = _configuration.ResLinConfig(attn_type="kla", hidden_size=384, num_heads=6, head_dim=64, initializer_range=0)
    assert _modeling.raw_key_tap_std(config) == pytest.approx(2 / (0.02 * (4 * 384 * 64) ** 0.5))


@pytest.mark.parametrize("update", ["additive", "delta"])
def test_base_predictions_are_the_old_state_read_with_the_key(update):
    B, T, H, HV, Dk, Dv = 1, 41, 2, 4, 8, 6
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(B, T, H, Dk, generator=generator) * 0.5
    v = torch.randn(B, T, HV, Dv, generator=generator)
    g = -torch.rand(B, T, HV, generator=generator)
    beta = torch.rand(B, T, HV, generator=generator)
    cu_seqlens = torch.tensor([0, 17, 17, 41])  # an empty sequence too
    expected = []
    expanded = k.repeat_interleave(HV // H, dim=2)
    for start, end in [(0, 17), (17, 41)]:
        S = torch.zeros(B, HV, Dk, Dv)
        for t in range(start, end):
            expected.append(torch.einsum("bhkv,bhk->bhv", S, expanded[:, t]))
            S = residual_clip.torch_reference._write(S, expanded[:, t], v[:, t], g[:, t].exp(), beta[:, t], update)
    got = residual_clip.base_predictions(k, v, g, beta, update, cu_seqlens)
    torch.testing.assert_close(got, torch.stack(expected, dim=1), rtol=1e-5, atol=1e-5)


def test_the_residual_clip_script_measures_both_clips(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in CORPUS.items():
        (corpus / name).write_text(text)
    results = tmp_path / "results"
    # A clip far below the tiny model's residuals, so that it bites, beside no clip.
    argv = ["--results", str(results), "--corpus", str(corpus), "--rules", "rla", "--clips", "0.001", "off",
            "--seeds", "0", "--max-steps", "2", "--measure-tokens", "256", f"--train-args={TINY_TRAIN}"]
    residual_clip.main(argv)

    gathered = json.loads((results / "residual_clip.json").read_text())
    runs = {residual_clip.clip_label(run["clip"]): run for run in gathered["runs"]}
    assert set(runs) == {"0.001", "off"}
    for label, run in runs.items():
        saved = json.loads((results / f"rla-clip{label}-seed0" / "config.json").read_text())
        assert saved["residual_clip"] == run["clip"]  # the run trained with its clip
        for moment in ("init", "end"):
            assert [layer["layer"] for layer in run[moment]] == [0, 1]
            for layer in run[moment]:
                assert 0 <= layer["clipped_fraction"] <= 1 and layer["entries"] > 0
                assert layer["mean_abs_residual"] <= min(layer["mean_abs_error"], run["clip"])
                shares = [share for _, share in layer["error_exceeding"]]
                assert shares == sorted(shares, reverse=True) and all(0 <= s <= 1 for s in shares)
    assert all(layer["clipped_fraction"] > 0 for layer in runs["0.001"]["init"])
    assert all(layer["clipped_fraction"] == 0 for layer in runs["off"]["init"] + runs["off"]["end"])
    assert runs["0.001"]["final_validation"]["loss"] != runs["off"]["final_validation"]["loss"]
    summary = {entry["clip"]: entry for entry in gathered["summary"]}
    assert summary["off"]["final_loss"]["mean"] == runs["off"]["final_validation"]["loss"]

    # Finished runs are not run again; --summary gathers without running.
    assert residual_clip.main(argv)["runs"] == gathered["runs"]
    assert residual_clip.main(["--results", str(results), "--summary"])["summary"] == gathered["summary"]


def test_the_residual_clip_script_measures_the_comparisons_runs_and_runs_at_once(tmp_path):
    """--lm-runs: the comparison's c = 1 run, trained with the same flags, is measured where it is
    (not trained again); a run of other flags (the clip off here) trains. --jobs 2: each run in a
    process of its own, and the gathered record holds both."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in CORPUS.items():
        (corpus / name).write_text(text)
    comparison = tmp_path / "compare"
    residual_clip.compare_rules.main(tiny_argv(comparison, corpus, "--parts", "lm", "--rules", "rla", "--seeds", "0",
                                               steps=2))
    compared = residual_clip.compare_rules.lm_run_dir(comparison, "rla", 0)
    results = tmp_path / "results"
    argv = ["--results", str(results), "--corpus", str(corpus), "--rules", "rla", "--clips", "1", "off",
            "--seeds", "0", "--max-steps", "2", "--measure-tokens", "256", f"--train-args={TINY_TRAIN}",
            "--lm-runs", str(comparison), "--jobs", "2"]
    gathered = residual_clip.main(argv)

    runs = {residual_clip.clip_label(run["clip"]): run for run in gathered["runs"]}
    assert runs["1"]["trained_in"] == str(compared) and "trained_in" not in runs["off"]
    metrics = json.loads((compared / "metrics.json").read_text())
    assert runs["1"]["final_validation"] == metrics["final_validation"]
    assert not (results / "rla-clip1-seed0" / "config.json").exists()  # measured in place: nothing trained here
    assert json.loads((results / "rla-clipoff-seed0" / "config.json").read_text())["residual_clip"] == 1e9
    for run in runs.values():
        assert [layer["layer"] for layer in run["init"]] == [layer["layer"] for layer in run["end"]] == [0, 1]
    assert sorted(log.name for log in (results / "logs").glob("*.log")) == ["rla-clip1-seed0.log",
                                                                           "rla-clipoff-seed0.log"]
    # Trained here instead (no --lm-runs, one run at a time), the same run measures the same: the
    # comparison's run is this run (a CPU repeats a run bit for bit).
    sequential = residual_clip.main(["--results", str(tmp_path / "alone"), *argv[2:-4]])
    alone = {residual_clip.clip_label(run["clip"]): run for run in sequential["runs"]}
    assert alone["1"]["init"] == runs["1"]["init"] and alone["1"]["end"] == runs["1"]["end"]


@pytest.mark.parametrize("argv, message", [
    (["--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["--start-within", "3"], "--start-within needs --jobs 2 or more"),
    (["--lm-runs", "no-such-folder"], "--lm-runs no-such-folder is not a folder"),
])
def test_residual_clip_refuses_bad_arguments(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        residual_clip.main(["--results", str(tmp_path / "results"), *argv])
    assert message in capsys.readouterr().err
