"""The shipped repository loads as users load it, on every supported transformers version.

Each case copies what tools/publish.py would upload into a local folder, or into an offline
Hugging Face cache laid out as a download from the Hub leaves it (`models--ORG--NAME/snapshots/
REV`), then loads the tokenizer and the model in a fresh process (the Hub's paths are read when
transformers is imported) and generates greedily. CI runs this file on the newest and on the
oldest supported transformers (.ci/run).
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import transformers

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
import publish  # noqa: E402

REVISION = "0" * 40
PROMPT = "def fibonacci(n):"

LOAD_AND_GENERATE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
name = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(name)
model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=True).eval()
batch = tokenizer([sys.argv[2]], return_tensors="pt")
with torch.no_grad():
    out = model.generate(**batch, max_new_tokens=6, do_sample=False)
print("RESULT " + json.dumps({"tokens": out[0].tolist(), "padding_side": tokenizer.padding_side,
                              "tokenizer": type(tokenizer).__name__}))
"""


def _module_closure():
    """Every sibling module the model's files import, transitively (what must be copied)."""
    todo, seen = ["configuration_reslin", "modeling_reslin"], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            source = (REPO_ROOT / f"{name}.py").read_text()
            todo.extend(re.findall(r"^\s*from\s+\.(\w+)\s+import", source, flags=re.MULTILINE))
    return seen


def _place(tmp_path, layout):
    """Copy the published files into a local folder or a fake Hub cache; return the name to load."""
    if layout == "local":
        dest, name = tmp_path / "reslin", str(tmp_path / "reslin")
    else:
        repo = tmp_path / "hub" / "models--someone--reslin"
        dest, name = repo / "snapshots" / REVISION, "someone/reslin"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(REVISION)
    for path in publish.files_to_publish():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / path, dest / path)
    return name


@pytest.fixture(scope="module")
def expected_tokens():
    """Greedy tokens of the shipped model imported directly from the working tree."""
    import torch
    from transformers import PreTrainedTokenizerFast

    from conftest import _modeling

    tokenizer = PreTrainedTokenizerFast.from_pretrained(REPO_ROOT)
    model = _modeling.ResLinForCausalLM.from_pretrained(REPO_ROOT).eval()
    batch = tokenizer([PROMPT], return_tensors="pt")
    with torch.no_grad():
        return model.generate(**batch, max_new_tokens=6, do_sample=False)[0].tolist()


@pytest.mark.parametrize("layout", ["local", "hub"])
def test_tokenizer_and_model_load_and_generate(layout, tmp_path, expected_tokens):
    name = _place(tmp_path, layout)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1",
               HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_DISABLE_PROGRESS_BARS="1")
    # No standard input: a prompt for trust_remote_code would fail at once instead of waiting.
    run = subprocess.run([sys.executable, "-c", LOAD_AND_GENERATE, name, PROMPT], env=env, cwd=tmp_path,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.split("RESULT ", 1)[1])
    assert result["tokens"] == expected_tokens
    assert result["padding_side"] == "left"
    copied = {p.stem for p in (tmp_path / "modules").rglob("*.py") if p.stem != "__init__"}
    # A module the loader did not copy would make kernels_reslin fall back to torch silently.
    assert _module_closure() <= copied, _module_closure() - copied


def test_older_transformers_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "4.57.6")
    spec = importlib.util.spec_from_file_location("configuration_reslin_old", REPO_ROOT / "configuration_reslin.py")
    with pytest.raises(ImportError, match=r"needs transformers >= 5\.0\.0, but 4\.57\.6 is installed"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
