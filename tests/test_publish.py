"""tools/publish.py sends what a model repository needs and nothing else (checked offline)."""

import re
import subprocess
import sys

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
import publish  # noqa: E402


def _relative_imports(module_path):
    """The sibling modules the remote-code loader copies with a file: `from .name import ...`."""
    return set(re.findall(r"^\s*from\s+\.(\w+)\s+import", module_path.read_text(), flags=re.MULTILINE))


def test_sends_the_model_its_code_and_its_card():
    files = set(publish.files_to_publish())
    for needed in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                   "tokenizer_config.json", "README.md", "LICENSE", ".gitattributes"):
        assert needed in files, needed
    # Every module the remote-code loader reaches from the auto_map's files, transitively.
    todo, seen = ["configuration_reslin", "modeling_reslin"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        assert f"{name}.py" in files, f"{name}.py is imported by the model but would not be sent"
        todo.extend(_relative_imports(REPO_ROOT / f"{name}.py"))
    assert len(seen) >= 4


def test_sends_the_tracked_files_but_ci_and_nothing_untracked():
    """The card's set-up commands run the tests: a clone of the Hub repository holds them."""
    files = publish.files_to_publish()
    for needed in ("setup.sh", "requirements.txt", "requirements-tests.txt", "pytest.ini", "tests/conftest.py",
                   "DESIGN.md", "DEVELOPMENT.md", "benchmarks/README.md"):
        assert needed in files, needed
    for path in files:
        assert not path.startswith((".venv/", "scratch/", "out/", ".whl/", ".carry-parts/", ".ci/")), path
        assert "__pycache__" not in path and not path.endswith(".pyc"), path
    tracked = set(subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True,
                                 check=True).stdout.split())
    assert set(files) <= tracked


def test_dry_run_lists_without_sending(capsys):
    assert publish.main(["--repo-id", "someone/reslin", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "model.safetensors" in printed and re.search(r"^\d+ files, [\d.]+ MiB$", printed, flags=re.MULTILINE)
