"""The model this repository ships: it loads as a Hub user loads it, it is trained, and the
README's main command (generate.py) completes a prompt with it."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from conftest import REPO_ROOT

# A Python function written for this test (not in any corpus): held-out text of the kind the
# model was trained on.
SNIPPET = '''def read_lines(path, encoding="utf-8"):
    """Return the lines of a text file, without their line endings."""
    with open(path, encoding=encoding) as handle:
        return [line.rstrip("\\n") for line in handle]


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts[key]
'''


@pytest.fixture(scope="module")
def shipped():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(REPO_ROOT), trust_remote_code=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(REPO_ROOT), trust_remote_code=True)
    return model, tokenizer


def test_weights_are_finite_bf16_as_the_config_says():
    config = json.loads((REPO_ROOT / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    with safe_open(REPO_ROOT / "model.safetensors", "pt") as weights:
        for name in weights.keys():
            tensor = weights.get_tensor(name)
            assert tensor.dtype == torch.bfloat16, name
            assert torch.isfinite(tensor).all(), name


def test_tokenizer_matches_the_config(shipped):
    model, tokenizer = shipped
    config = model.config
    assert len(tokenizer) == config.vocab_size
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        config.pad_token_id, config.bos_token_id, config.eos_token_id)
    ids = tokenizer(SNIPPET).input_ids
    assert ids[0] == config.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == SNIPPET  # byte-level BPE: exact


def test_model_is_trained(shipped):
    """A random model scores ln(8192) = 9.0 nats a token; the shipped one scored 1.63 on its
    validation files. 3.5 leaves room for this snippet being unlike them, not for an untrained
    or mismatched model (wrong tokenizer, wrong weights)."""
    model, tokenizer = shipped
    ids = tokenizer(SNIPPET, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 3.5, loss


def test_generation_length_is_the_callers(shipped):
    """The shipped generation config sets no length of its own: `max_length` as tools pass it
    (lm-eval, pipelines) is obeyed, which a `max_new_tokens` there would override."""
    model, tokenizer = shipped
    ids = tokenizer("def add(a, b):", return_tensors="pt").input_ids
    with torch.no_grad():
        assert model.generate(ids, max_length=ids.shape[1] + 5, do_sample=False).shape[1] == ids.shape[1] + 5
        assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


def test_main_command_streams_a_completion():
    """The README's main command, as a user runs it (greedy, on the CPU)."""
    prompt = "def fibonacci(n):"
    result = subprocess.run([sys.executable, "generate.py", prompt, "--max-new-tokens", "24", "--device", "cpu"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(prompt)
    assert len(result.stdout.strip()) > len(prompt) + 20
    assert "24 new tokens" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["--model", str(REPO_ROOT / "tests")], "tests: the folder holds no config.json"),
    (["--device", "foo"], "--device foo: not a device"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device cuda: CUDA is not available here")]))
def test_main_command_refuses_bad_flags_clearly(flags, message, capsys):
    import generate

    with pytest.raises(SystemExit):
        generate.main(["def f():", *flags])
    assert message in capsys.readouterr().err
