"""The README's Python snippets run as pasted.

Each ```python block of README.md runs in a fresh Python process whose working directory is a
copy of this repository with a tiny random model in place of the shipped one (the repository's
code and tokenizer, a 2-layer config of the same vocabulary), so the snippets' "." loads it as it
would load the shipped model, in seconds on a CPU. A block that needs what a CPU test cannot
have (several processes, a GPU) is preceded by the marker `<!-- readme-test: skip (why) -->`
and counted apart; the rest must run, and there must be at least MIN_RUNNABLE of them, so that a
README that loses its examples, or marks them all skipped, fails here.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, build_model, copy_repo_code

README = REPO_ROOT / "README.md"
SKIP_MARKER = re.compile(r"<!--\s*readme-test:\s*skip\b")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
MIN_RUNNABLE = 5


def readme_blocks():
    """(line number, code, skipped) of every ```python block, in order."""
    text = README.read_text()
    blocks = []
    for match in BLOCK.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        line = text.count("\n", 0, match.start()) + 1
        blocks.append((line, match.group(1), bool(SKIP_MARKER.search(before))))
    return blocks


BLOCKS = readme_blocks()
RUNNABLE = [(line, code) for line, code, skipped in BLOCKS if not skipped]


def test_the_readme_keeps_its_runnable_examples():
    assert len(RUNNABLE) >= MIN_RUNNABLE, f"{len(RUNNABLE)} runnable ```python blocks in README.md"


@pytest.fixture(scope="module")
def tiny_repository(tmp_path_factory):
    """A copy of the repository's model files with a tiny random RDN of the shipped vocabulary."""
    import json

    folder = copy_repo_code(tmp_path_factory.mktemp("readme") / "reslin")
    shipped = json.loads((REPO_ROOT / "config.json").read_text())
    special = {name: shipped[name] for name in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")}
    build_model("rdn", tie_word_embeddings=True, **special).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO_ROOT / name, folder / name)
    return folder


@pytest.mark.parametrize("line, code", RUNNABLE, ids=[f"line{line}" for line, _ in RUNNABLE])
def test_snippet_runs_as_pasted(line, code, tiny_repository):
    env = {**os.environ, "HF_MODULES_CACHE": str(tiny_repository.parent / f"hf_modules_{line}"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    # stdin closed: a snippet that would stop at an interactive prompt fails at once instead.
    result = subprocess.run([sys.executable, "-c", code], cwd=tiny_repository, env=env, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"README.md line {line}:\n{code}\n{result.stderr[-4000:]}"
