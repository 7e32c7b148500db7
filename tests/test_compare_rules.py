"""benchmarks/compare_rules.py on a CPU: real tiny runs (train.py's tiny model on a corpus written
to a temporary folder, mqar.py --smoke, torch kernels) land per rule and are not run twice; the
table's means and spreads are checked against hand-computed numbers on fabricated results."""

import json
import os
import shlex
import shutil
import signal
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, stop_right_after

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # compare_rules imports its sibling mqar.py
import compare_rules  # noqa: E402

CORPUS = {f"module_{i}.py": "".join(f"def add_{i}_{j}(a, b):\n    return a + b * {j}\n\n" for j in range(30))
          for i in range(5)}
TINY_TRAIN = ("--vocab-size 300 --hidden-size 32 --layers 2 --heads 2 --head-dim 16 --intermediate-size 64 "
              "--kernel-backend torch --seq-len 64 --batch-size 4 --warmup-steps 1 --eval-tokens 256 --device cpu")
TINY_MQAR = "--smoke --steps 4 --kernel-backend torch --device cpu"


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, text in CORPUS.items():
        (folder / name).write_text(text)
    return folder


def tiny_argv(results, corpus, *extra, steps=3):
    return ["--results", str(results), "--corpus", str(corpus), "--max-steps", str(steps), f"--train-args={TINY_TRAIN}",
            f"--mqar-args={TINY_MQAR}", *extra]


def test_each_rule_runs_into_its_own_folder_and_a_rerun_skips_finished_runs(tmp_path, corpus, monkeypatch):
    results = tmp_path / "results"
    table = compare_rules.main(tiny_argv(results, corpus, "--rules", "gdn", "rdn"))

    metrics = {rule: json.loads((results / "lm" / f"{rule}-seed0" / "metrics.json").read_text())
               for rule in ("gdn", "rdn")}
    for rule, run in metrics.items():
        assert run["args"]["attn_type"] == rule and run["step"] == 3 and "final_validation" in run
        assert f"| {rule} | {run['final_validation']['loss']:.4f} | {run['final_validation']['bits_per_byte']:.4f} |" \
            in table
    # One shared config: the runs' flags differ only in the rule and the folder; same data.
    differing = {name for name, value in metrics["gdn"]["args"].items() if metrics["rdn"]["args"][name] != value}
    assert differing == {"attn_type", "out_dir"}
    assert metrics["gdn"]["data"] == metrics["rdn"]["data"]
    for rule in ("gdn", "rdn"):
        saved = json.loads((results / "mqar" / f"{rule}-seed0.json").read_text())
        assert [(run["attn_type"], run["seed"]) for run in saved["runs"]] == [(rule, 0)]
        assert saved["protocol"] == "kla-authors"  # the default
        assert table_rows(table)[rule][-2:] == ["0", "kla-authors"]
    assert not list(results.glob("mqar/*.partial.pt"))  # a finished run removes its saved state

    calls = []

    def stub_mqar_main(argv):  # a result where mqar.py writes it, as if it ran
        calls.append(("mqar", argv[argv.index("--attn-types") + 1]))
        saved = json.loads((results / "mqar" / "gdn-seed0.json").read_text())
        saved.update(runs=[{**saved["runs"][0], "attn_type": "kla"}], best={"kla": 0})
        Path(argv[argv.index("--out") + 1]).write_text(json.dumps(saved))

    monkeypatch.setattr(compare_rules.train, "main",
                        lambda argv: calls.append(("lm", argv[argv.index("--attn-type") + 1])))
    monkeypatch.setattr(compare_rules.mqar, "main", stub_mqar_main)
    table = compare_rules.main(tiny_argv(results, corpus, "--rules", "gdn", "kla", "rdn"))
    assert calls == [("lm", "kla"), ("mqar", "kla")]
    assert "| kla | missing | missing | missing | missing 0 | " in table  # the stub trained nothing


def test_a_stopped_lm_run_resumes_from_its_checkpoint(tmp_path, corpus, monkeypatch):
    results = tmp_path / "results"
    argv = tiny_argv(results, corpus, "--parts", "lm", "--rules", "gdn", f"--train-args={TINY_TRAIN} --save-interval 2",
                     steps=4)
    stop_right_after(monkeypatch, compare_rules.train, "save_checkpoint")  # step 2's checkpoint
    with pytest.raises(KeyboardInterrupt):
        compare_rules.main(argv)
    monkeypatch.undo()
    assert "missing 0" in compare_rules.main(argv[:2] + ["--table", "--parts", "lm", "--rules", "gdn"])
    compare_rules.main(argv)
    run = json.loads((results / "lm" / "gdn-seed0" / "metrics.json").read_text())
    assert run["step"] == 4 and len(run["commands"]) == 2 and run["commands"][1].endswith("--resume")


def test_a_failed_lm_run_leaves_the_others_running(tmp_path, corpus, monkeypatch):
    ran = []

    def stub_main(argv):
        rule = argv[argv.index("--attn-type") + 1]
        ran.append(rule)
        if rule == "kla":
            raise SystemExit("train.py: error: the training loss is nan at step 2")
        write_lm_run(tmp_path / "results", rule, 0, loss=3.0, bits_per_byte=1.0, step_seconds=0.1)

    monkeypatch.setattr(compare_rules.train, "main", stub_main)
    with pytest.raises(SystemExit, match="runs failed:\nlm kla seed 0: train.py: error: the training loss is nan"):
        compare_rules.main(tiny_argv(tmp_path / "results", corpus, "--parts", "lm", "--rules", "gdn", "kla", "rdn"))
    assert ran == ["gdn", "kla", "rdn"]


# ---------------------------------------------------------------------------------------------
# The table, from fabricated results


def write_lm_run(results, rule, seed, loss, bits_per_byte, step_seconds, device="CPU", finished=True):
    """A metrics.json as train.py writes it, trimmed to what the table reads: 4 steps of 4 x 64
    tokens, the first one 10 s long (compiles), then step_seconds each."""
    folder = results / "lm" / f"{rule}-seed{seed}"
    folder.mkdir(parents=True)
    seconds = [10.0 + step_seconds * i for i in range(4)]
    metrics = {"args": {"batch_size": 4, "seq_len": 64}, "step": 4, "tokens_seen": 1024, "precision": "fp32",
               "device": device, "train": [{"step": i + 1, "seconds": round(s, 3)} for i, s in enumerate(seconds)],
               "data": {"corpus_name": "corpus", "splits": {"train": {"files": 4, "tokens": 2048},
                                                            "validation": {"files": 1, "tokens": 500}}}}
    if finished:
        metrics["final_validation"] = {"loss": loss, "bits_per_byte": bits_per_byte, "tokens": 499, "bytes": 1500}
    (folder / "metrics.json").write_text(json.dumps(metrics))


def write_mqar_run(results, rule, seed, accuracy_8x, steps_run=3000, best_step=1000, accuracy_1x=1.0):
    """A JSON result as mqar.py writes it under kla-authors, trimmed to what the table reads."""
    folder = results / "mqar"
    folder.mkdir(parents=True, exist_ok=True)
    run = {"attn_type": rule, "lr": 1e-3, "seed": seed, "steps_run": steps_run, "best_step": best_step,
           "accuracy": {"1x": accuracy_1x, "2x": 0.99, "4x": 0.95, "8x": accuracy_8x}}
    saved = {"protocol": "kla-authors",
             "task": {"kv_pairs": 32, "train_length": 256, "steps": 10000, "batch_size": 32, "eval_examples": 2000,
                      "eval_interval": 200, "patience": 10},
             "eval_lengths": {"1x": 256, "2x": 512, "4x": 1024, "8x": 2048}, "device": "cuda", "runs": [run],
             "best": {rule: 0}}
    (folder / f"{rule}-seed{seed}.json").write_text(json.dumps(saved))


@pytest.fixture
def fabricated(tmp_path):
    results = tmp_path / "results"
    # rdn: loss 3.0, 3.2, 3.4 -> 3.2 ± 0.2; bits per byte 1.0, 1.1, 1.3 -> 1.1333 ± 0.1528;
    # 256 tokens a step at 0.1, 0.2, 0.1 s a step (median) -> 2560, 1280, 2560 -> 2133 ± 739.
    for seed, (loss, bits_per_byte, step_seconds) in enumerate([(3.0, 1.0, 0.1), (3.2, 1.1, 0.2), (3.4, 1.3, 0.1)]):
        write_lm_run(results, "rdn", seed, loss, bits_per_byte, step_seconds)
    write_lm_run(results, "gdn", 0, 3.5, 1.4, 0.1, device="NVIDIA H200")
    write_lm_run(results, "sgla", 0, 9.9, 9.9, 0.1, finished=False)  # stopped: not a result
    # kla at 8x: 90%, 80% -> 85.00 ± 7.07; gdn 70%.
    write_mqar_run(results, "kla", 0, 0.9)
    write_mqar_run(results, "kla", 1, 0.8)
    write_mqar_run(results, "gdn", 0, 0.7, steps_run=2600, best_step=600)
    (results / "mqar" / "rdn-seed0.partial.pt").write_bytes(b"")  # a stopped MQAR run: not a result
    (results / compare_rules.CONFIG_FILE).write_text(json.dumps(
        {"lm": {"flags": ["--max-steps", "500"], "argv": []}, "mqar": {"flags": [], "argv": []}}))
    return results


def table_rows(table):
    """The first table's rows (the means), by rule."""
    first_table = table.split("\n\n")[0]
    return {line.split(" | ")[0].removeprefix("| "): line.strip("| ").split(" | ")[1:]
            for line in first_table.splitlines() if line.startswith("| ") and not line.startswith("| rule")}


def test_table_aggregates_the_seeds_present_and_marks_what_is_missing(fabricated, capsys):
    (fabricated / "lm" / "sgla-seed0" / "checkpoint.pt").write_bytes(b"")  # a stopped LM run, to resume
    table = compare_rules.main(["--results", str(fabricated), "--table", "--seeds", "0", "1", "2"])
    # The last line printed: the GPU job's summary. 6 rules x 3 seeds x 2 parts asked for; done:
    # LM rdn 0 1 2 and gdn 0, MQAR kla 0 1 and gdn 0; started: LM sgla 0, MQAR rdn 0.
    assert capsys.readouterr().out.splitlines()[-1] == \
        "compare: 7 of 36 runs done, 2 more started (they resume from their saved state)"
    rows = table_rows(table)
    assert list(rows) == ["sgla", "rla", "gdn", "kla", "rdn", "rkla"]  # the order
    # rule: loss, bits/byte, tokens/s, LM seeds, MQAR 1x, 2x, 4x, 8x, MQAR seeds, MQAR protocol
    assert rows["rdn"] == ["3.2000 ± 0.2000", "1.1333 ± 0.1528", "2133 ± 739", "0 1 2",
                           "missing", "missing", "missing", "missing", "missing 0 1 2", "—"]
    assert rows["gdn"] == ["3.5000", "1.4000", "2560", "0, missing 1 2", "100.00", "99.00", "95.00", "70.00",
                           "0, missing 1 2", "kla-authors"]
    assert rows["kla"][4:] == ["100.00 ± 0.00", "99.00 ± 0.00", "95.00 ± 0.00", "85.00 ± 7.07", "0 1, missing 2",
                               "kla-authors"]
    assert rows["sgla"] == ["missing"] * 3 + ["missing 0 1 2"] + ["missing"] * 4 + ["missing 0 1 2", "—"]
    assert "| MQAR 1x (256) | MQAR 2x (512) | MQAR 4x (1024) | MQAR 8x (2048) | MQAR seeds | MQAR protocol |" in table
    assert ("MQAR: protocol kla-authors: 32 pairs, trained at length 256, at most 10000 steps of 32 at a constant lr "
            "0.001, validated every 200 steps, stopped after 10 validations without a gain, the best checkpoint "
            "tested; 2000 test sequences per length, on cuda") in table
    assert "MQAR steps run (best step): gdn seed 0 2600 (600), kla seed 0 3000 (1000), kla seed 1 3000 (1000)" \
        in table

    assert "LM (WARNING: its runs differ): corpus: 4 train files (2,048 tokens)" in table  # gdn ran elsewhere
    assert "4 steps of 4 x 64 tokens = 1,024 tokens (0.50 epochs), fp32 on NVIDIA H200" in table
    # Claims pair the seeds both rules have: rdn's seed 0 (3.0) against gdn's (3.5).
    assert "- rdn - gdn validation loss: -0.5000 on average (seeds 0: -0.5000): rdn better at every seed, as in" \
        in table
    assert "- kla - gdn validation loss: missing" in table
    assert "- kla - gdn MQAR accuracy at 8x (points): +20.00 on average (seeds 0: +20.00): kla better at every" \
        in table
    commands = table.split("```")[1].strip().splitlines()
    assert f"python benchmarks/compare_rules.py --results {fabricated} --parts lm --rules rdn --seeds 0 1 2 " \
           "--max-steps 500" in commands
    assert f"python benchmarks/compare_rules.py --results {fabricated} --parts mqar --rules kla --seeds 0 1" in commands
    assert len(commands) == 6 + 6  # a command per row and part


def test_the_papers_claims_compare_the_rules_seed_by_seed(fabricated):
    write_lm_run(fabricated, "gdn", 1, 3.28, 1.0, 0.1)  # rdn - gdn: 3.0 - 3.5 and 3.2 - 3.28
    write_mqar_run(fabricated, "gdn", 1, 0.95)  # kla - gdn at 8x: 90 - 70 and 80 - 95
    table = compare_rules.main(["--results", str(fabricated), "--table"])
    assert "- rdn - gdn validation loss: -0.2900 on average (seeds 0 1: -0.5000, -0.0800): rdn better at every seed" \
        in table
    assert "MQAR accuracy at 8x (points): +2.50 on average (seeds 0 1: +20.00, -15.00): kla better at 1 of 2 seeds (" \
        in table
    write_lm_run(fabricated, "kla", 0, 3.6, 1.0, 0.1)
    assert "- kla - gdn validation loss: +0.1000 on average (seeds 0: +0.1000): kla better at no seed, unlike" \
        in compare_rules.main(["--results", str(fabricated), "--table"])


def test_an_mqar_run_that_never_learned_is_marked_and_left_out_of_the_claims(fabricated):
    write_mqar_run(fabricated, "gdn", 1, 0.0002, accuracy_1x=0.0004)  # chance: 1 in 4096
    table = compare_rules.main(["--results", str(fabricated), "--table"])
    assert "| kla | — | 100.0 / 100.0 | 90.0 / 80.0 |" in table
    assert "| gdn | 3.500 | 100.0 / 0.0* | 70.0 / 0.0* |" in table
    assert "*: never learned (accuracy at 1x below 1%)" in table
    assert "MQAR accuracy at 8x (points): +20.00 on average (seeds 0: +20.00); gdn seed 1 never learned, left out: " \
           "kla better at every seed" in table


def test_a_results_folder_refuses_runs_with_other_flags(tmp_path, corpus, monkeypatch):
    ran = []
    monkeypatch.setattr(compare_rules.train, "main", lambda argv: ran.append(argv))
    results = tmp_path / "results"
    compare_rules.main(tiny_argv(results, corpus, "--parts", "lm", "--rules", "gdn"))
    compare_rules.main(tiny_argv(results, corpus, "--parts", "lm", "--rules", "rdn", "--seeds", "1"))  # same flags
    assert len(ran) == 2
    with pytest.raises(SystemExit, match=f"{results} holds lm runs made with the flags .* --max-steps 3 .*; this "
                                         "command gives .* --max-steps 4 .*: repeat their flags"):
        compare_rules.main(tiny_argv(results, corpus, "--parts", "lm", "--rules", "gdn", steps=4))
    recorded = json.loads((results / compare_rules.CONFIG_FILE).read_text())
    assert recorded["lm"]["flags"] == ["--corpus", str(corpus), "--max-steps", "3", f"--train-args={TINY_TRAIN}"]
    assert shlex.split(TINY_TRAIN)[-2:] == recorded["lm"]["argv"][-2:]
    assert len(ran) == 2


def recording_mqar_main(calls):
    """Stands in for mqar.main: records its argv and writes a kla-authors result where asked."""
    def main(argv):
        calls.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        write_mqar_run(out.parent.parent, argv[argv.index("--attn-types") + 1], int(argv[argv.index("--seed") + 1]),
                       0.5)
    return main


def test_mqar_runs_the_six_rules_under_the_authors_protocol_by_default(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(compare_rules.mqar, "main", recording_mqar_main(calls))
    compare_rules.main(["--results", str(tmp_path / "results"), "--parts", "mqar", "--mqar-args=--compile"])
    assert [argv[argv.index("--attn-types") + 1] for argv in calls] == ["sgla", "rla", "gdn", "kla", "rdn", "rkla"]
    assert all(argv[:3] == ["--protocol", "kla-authors", "--compile"] for argv in calls)
    recorded = json.loads((tmp_path / "results" / compare_rules.CONFIG_FILE).read_text())["mqar"]
    assert recorded["flags"] == ["--mqar-protocol", "kla-authors", "--mqar-args=--compile"]
    assert recorded["argv"] == ["--protocol", "kla-authors", "--compile"]


def test_a_results_folder_refuses_mqar_runs_of_the_other_protocol(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(compare_rules.mqar, "main", recording_mqar_main(calls))
    results = tmp_path / "results"
    compare_rules.main(["--results", str(results), "--parts", "mqar", "--rules", "gdn", "--mqar-protocol", "reslin-gap"])
    assert calls[0][:2] == ["--protocol", "reslin-gap"]
    with pytest.raises(SystemExit, match="holds mqar runs made with the flags --protocol reslin-gap; this command "
                                         "gives --protocol kla-authors"):
        compare_rules.main(["--results", str(results), "--parts", "mqar", "--rules", "kla"])
    assert len(calls) == 1


def test_mqar_results_from_before_the_protocol_flag_are_labelled_reslin_gap(fabricated):
    saved = json.loads((fabricated / "mqar" / "gdn-seed0.json").read_text())
    del saved["protocol"]
    saved["task"] = {name: saved["task"][name] for name in mqar_task_names_before_the_protocols}
    del saved["runs"][0]["steps_run"], saved["runs"][0]["best_step"]
    (fabricated / "mqar" / "gdn-seed0.json").write_text(json.dumps(saved))
    table = compare_rules.main(["--results", str(fabricated), "--table"])
    assert table_rows(table)["gdn"][-1] == "reslin-gap" and table_rows(table)["kla"][-1] == "kla-authors"
    assert ("MQAR (WARNING: its runs differ): protocol reslin-gap: 32 pairs, trained at length 256, 10000 steps of "
            "32, lr 0.001 (warm-up, cosine decay), the last model tested") in table
    assert "MQAR steps run (best step): kla seed 0 3000 (1000), kla seed 1 3000 (1000)" in table


mqar_task_names_before_the_protocols = ("kv_pairs", "train_length", "steps", "batch_size", "eval_examples")


def error_of(argv, capsys):
    with pytest.raises(SystemExit) as raised:
        compare_rules.main(argv)
    return f"{raised.value.code} {capsys.readouterr().err}"


@pytest.mark.parametrize("argv, message", [
    (["--rules", "mamba"], "argument --rules: invalid choice: 'mamba'"),
    (["--seeds"], "argument --seeds: expected at least one argument"),
    (["--seeds", "1", "1"], "--seeds must be distinct and >= 0, got 1 1"),
    (["--seeds", "-1"], "--seeds must be distinct and >= 0, got -1"),
    (["--parts", "nlp"], "argument --parts: invalid choice: 'nlp'"),
    (["--train-args=--attn-type gdn --seed 3"], "--train-args must not set --attn-type, --seed: compare_rules sets"),
    (["--train-args=--time-budget 5"], "--train-args must not set --time-budget"),
    (["--train-args=--max-steps=9"], "--train-args must not set --max-steps"),
    (["--mqar-args=--smoke --seed=3"], "--mqar-args must not set --seed=3"),
    (["--mqar-args=--protocol reslin-gap"], "--mqar-args must not set --protocol: compare_rules sets them"),
    (["--mqar-protocol", "zoology"], "argument --mqar-protocol: invalid choice: 'zoology'"),
    (["--table"], "is not a folder: nothing to tabulate"),
])
def test_bad_arguments_fail_clearly(tmp_path, capsys, monkeypatch, argv, message):
    def must_not_run(*args):
        raise AssertionError("a run started despite the bad arguments")

    for module, name in ((compare_rules.train, "main"), (compare_rules.train, "prepare_data"),
                         (compare_rules.mqar, "main")):
        monkeypatch.setattr(module, name, must_not_run)
    assert message in error_of(["--results", str(tmp_path / "results"), *argv], capsys)
    assert not (tmp_path / "results").exists()  # refused before anything was written


def test_concurrent_runs_give_the_sequential_results(tmp_path, corpus):
    """--jobs 3: each run in its own process, the same results as one after another (the CPU
    repeats a run bit for bit), every log kept, and the table says the GPU was shared."""
    argv = ["--rules", "gdn", "rdn", "--seeds", "0", "1"]
    compare_rules.main(tiny_argv(tmp_path / "one", corpus, *argv))
    # Seed 0's runs as finished ones: a process's start-up is most of a tiny run's time, and seed 1's
    # 4 runs still queue behind --jobs 3, each part, rule and seed passed on to its own process.
    for part, name, copy in (("lm", "{}-seed0", shutil.copytree), ("mqar", "{}-seed0.json", shutil.copyfile)):
        (tmp_path / "three" / part).mkdir(parents=True)
        for rule in ("gdn", "rdn"):
            copy(tmp_path / "one" / part / name.format(rule), tmp_path / "three" / part / name.format(rule))
    table = compare_rules.main(tiny_argv(tmp_path / "three", corpus, *argv, "--jobs", "3"))
    for rule in ("gdn", "rdn"):
        alone, shared = (json.loads((tmp_path / folder / "lm" / f"{rule}-seed1" / "metrics.json").read_text())
                         for folder in ("one", "three"))
        assert shared["final_validation"] == alone["final_validation"]
        mqar_alone, mqar_shared = (json.loads((tmp_path / folder / "mqar" / f"{rule}-seed1.json").read_text())
                                   for folder in ("one", "three"))
        assert mqar_shared["runs"][0]["accuracy"] == mqar_alone["runs"][0]["accuracy"]
    assert sorted(log.name for log in (tmp_path / "three" / "logs").glob("*.log")) == [
        f"{part}-{rule}-seed1.log" for part in ("lm", "mqar") for rule in ("gdn", "rdn")]  # seed 0's not rerun
    assert "Up to 3 runs at once shared the GPU(s)" in table
    assert json.loads((tmp_path / "three" / compare_rules.CONFIG_FILE).read_text())["lm"]["jobs"] == 3


def test_concurrent_runs_spread_over_the_visible_gpus(tmp_path, corpus, monkeypatch):
    """Each run starts on the visible GPU running the fewest, named as CUDA_VISIBLE_DEVICES names it."""
    started = []

    class Run:  # a run that starts, and ends once all four have started
        returncode = 0

        def __init__(self, command, env, **_):
            started.append(env["CUDA_VISIBLE_DEVICES"])

        def poll(self):
            return 0 if len(started) == 4 else None

    monkeypatch.setattr(compare_rules.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setattr(compare_rules.subprocess, "Popen", Run)
    compare_rules.main(tiny_argv(tmp_path / "results", corpus, "--parts", "lm", "--rules", "gdn", "rdn",
                                 "--seeds", "0", "1", "--jobs", "4"))
    assert started == ["3", "5", "3", "5"]


def test_no_run_starts_after_start_within(tmp_path, corpus, capsys):
    table = compare_rules.main(tiny_argv(tmp_path / "results", corpus, "--parts", "lm", "--rules", "gdn", "rdn",
                                         "--jobs", "2", "--start-within", "0"))
    assert "compare: 2 runs not started: --start-within 0 minutes has passed" in capsys.readouterr().out
    assert "| gdn | missing |" in table and "| rdn | missing |" in table
    with pytest.raises(SystemExit):
        compare_rules.main(tiny_argv(tmp_path / "results", corpus, "--start-within", "1"))


@pytest.mark.parametrize("protocol, message", [
    ("kla-authors", "compare: 1 runs not started: --start-within 0 minutes has passed (1 that resume where stopped "
                    "still start)"),
    ("reslin-gap", "compare: 2 runs not started: --start-within 0 minutes has passed\n"),
])
def test_after_start_within_only_runs_that_resume_where_stopped_start(tmp_path, corpus, capsys, protocol, message):
    """kla-authors' MQAR runs save their state at each validation: started late, they continue in
    the next call. reslin-gap's save nothing, and the LM runs' first checkpoint comes too late."""
    results = tmp_path / "results"
    table = compare_rules.main(tiny_argv(results, corpus, "--rules", "gdn", "--jobs", "2", "--start-within", "0",
                                         "--mqar-protocol", protocol))
    assert message in capsys.readouterr().out
    made = protocol == "kla-authors"
    assert table_rows(table)["gdn"][-2:] == (["0", "kla-authors"] if made else ["missing 0", "—"])
    assert table_rows(table)["gdn"][0] == "missing"


def test_a_stopped_mqar_run_counts_as_started_and_resumes_from_its_saved_state(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    argv = ["--results", str(results), "--parts", "mqar", "--rules", "gdn",
            f"--mqar-args={TINY_MQAR} --eval-interval 2"]
    stop_right_after(monkeypatch, compare_rules.mqar, "save_partial_state")  # step 2's validation
    with pytest.raises(KeyboardInterrupt):
        compare_rules.main(argv)
    monkeypatch.undo()
    capsys.readouterr()
    table = compare_rules.main(argv[:2] + ["--table", "--parts", "mqar", "--rules", "gdn"])
    assert table_rows(table)["gdn"][-2:] == ["missing 0", "—"]
    assert capsys.readouterr().out.splitlines()[-1] == \
        "compare: 0 of 1 runs done, 1 more started (they resume from their saved state)"
    compare_rules.main(argv)
    out = capsys.readouterr().out
    assert "compare: mqar: 0 of 1 runs finished already, 1 to resume from their saved state" in out
    assert out.splitlines()[-1] == "compare: 1 of 1 runs done"
    run = json.loads((results / "mqar" / "gdn-seed0.json").read_text())["runs"][0]
    assert (run["resumed_at_steps"], run["steps_run"]) == ([2], 4)
    assert not (results / "mqar" / "gdn-seed0.partial.pt").exists()


def test_sigterm_stops_the_runs_and_returns(tmp_path, monkeypatch, capsys):
    """`timeout`, at the end of a GPU call, sends SIGTERM: run_processes stops its runs and returns,
    so that the table and the summary line still print."""
    sleeper = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"]
    runs = [(f"run{index}", sleeper) for index in range(3)]
    logs = tmp_path / "logs"
    real_sleep, signalled, handler = compare_rules.time.sleep, [], signal.getsignal(signal.SIGTERM)

    def sleep_or_stop(seconds):  # once both running runs have printed their process id
        if not signalled and all((logs / f"run{index}.log").is_file() and (logs / f"run{index}.log").read_text()
                                 for index in range(2)):
            signalled.append(True)
            signal.raise_signal(signal.SIGTERM)
        real_sleep(0.1)

    monkeypatch.setattr(compare_rules.time, "sleep", sleep_or_stop)
    assert compare_rules.run_processes(runs, 2, None, logs, "compare") == []
    assert signalled
    assert "compare: stopped by SIGTERM: 2 runs cut short (run0, run1; those that save their state resume in the " \
           "next call), 1 not started" in capsys.readouterr().out
    for index in range(2):
        with pytest.raises(ProcessLookupError):  # ended and reaped
            os.kill(int((logs / f"run{index}.log").read_text()), 0)
    assert signal.getsignal(signal.SIGTERM) is handler  # put back
