"""Shared fixtures of the model tests.

How the model code is imported: the repository's model files use relative imports
(`from .kernels_reslin import ...`), as the Hub's remote-code loader requires, so they must be
imported as modules of a package. Each test session links the repository root into a fresh
temporary folder under the package name `reslin_repo` (a namespace package: no __init__.py
needed) and imports `reslin_repo.modeling_reslin` etc. from there. The tests thus run the
working tree's files, exactly as they are. The remote-code tests instead load copies of the
files through transformers' Auto classes with trust_remote_code=True (helpers below).

Under pytest-xdist each worker runs torch on one thread. Each session (and each worker) also
gets its own HF_MODULES_CACHE, so the remote-code loader never shares its module cache between
concurrent workers.
"""

import importlib
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="reslin-tests-"))
os.environ["HF_MODULES_CACHE"] = str(_SESSION_DIR / "hf_modules")  # before transformers is imported

import torch  # noqa: E402

# Without a GPU, Triton kernels run in Triton's CPU interpreter (trustworthy in fp32 only: it
# computes bf16 wrongly). Set before any kernel module is imported, since triton.jit reads it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers already fill the cores; more intra-op threads per worker only contend (~4x slower here).
    torch.set_num_threads(1)

(_SESSION_DIR / "reslin_repo").symlink_to(REPO_ROOT, target_is_directory=True)
sys.path.insert(0, str(_SESSION_DIR))
_configuration = importlib.import_module("reslin_repo.configuration_reslin")
_modeling = importlib.import_module("reslin_repo.modeling_reslin")
_cache = importlib.import_module("reslin_repo.cache_reslin")

# The tiny models the tests run: every preset, grouped value heads, and hybrid stacks with a
# full attention layer (GQA), without and with a sliding window. A test that takes a `mixer`
# argument runs once for each (see pytest_generate_tests).
MIXERS = {
    "sgla": {"attn_type": "sgla"},
    "gdn": {"attn_type": "gdn"},
    "kla": {"attn_type": "kla"},
    "rla": {"attn_type": "rla"},
    "rdn": {"attn_type": "rdn"},
    "rkla": {"attn_type": "rkla"},
    "rdn_grouped_v": {"attn_type": "rdn", "num_v_heads": 4, "expand_v": 0.5},
    "hybrid": {"attn_type": "rdn", "layer_types": ["linear_attention", "full_attention"],
               "num_attention_heads": 4, "num_key_value_heads": 2},
    "hybrid_window": {"attn_type": "kla", "layer_types": ["full_attention", "linear_attention"],
                      "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 3},
}
TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16,
            intermediate_size=64, pad_token_id=0, max_position_embeddings=64)


def pytest_generate_tests(metafunc):
    if "mixer" in metafunc.fixturenames:
        metafunc.parametrize("mixer", list(MIXERS))


@pytest.fixture(scope="session")
def reslin():
    """The model modules, imported from the working tree (see the module docstring)."""
    return types.SimpleNamespace(
        ResLinConfig=_configuration.ResLinConfig,
        ResLinModel=_modeling.ResLinModel,
        ResLinForCausalLM=_modeling.ResLinForCausalLM,
        ResLinCache=_cache.ResLinCache,
        configuration=_configuration,
        modeling=_modeling,
        repo_root=REPO_ROOT,
    )


def build_config(mixer="rdn", **overrides):
    return _configuration.ResLinConfig(**{**TINY, **MIXERS[mixer], **overrides})


def build_model(mixer="rdn", seed=0, **overrides):
    """A tiny fp32 ResLinForCausalLM in eval mode, seeded."""
    torch.manual_seed(seed)
    return _modeling.ResLinForCausalLM(build_config(mixer, **overrides)).eval()


@pytest.fixture
def tiny_config():
    """Factory: tiny_config(mixer="rdn", **overrides) -> ResLinConfig."""
    return build_config


@pytest.fixture
def tiny_model():
    """Factory: tiny_model(mixer="rdn", seed=0, **overrides) -> ResLinForCausalLM (eval, fp32)."""
    return build_model


def copy_repo_code(folder):
    """Copy what the Hub repository serves for remote code: the root .py files and json configs."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for path in REPO_ROOT.iterdir():
        if path.is_file() and path.suffix in (".py", ".json"):
            shutil.copy(path, folder / path.name)
    return folder


@pytest.fixture
def repo_copy(tmp_path):
    """A copy of the repository's remote-code files and configs in a fresh folder."""
    return copy_repo_code(tmp_path / "reslin_repo_copy")


@pytest.fixture
def load_remote():
    """Factory: load_remote(folder, auto_class="AutoModelForCausalLM", **kwargs), trust_remote_code=True."""
    import transformers

    def load(folder, auto_class="AutoModelForCausalLM", **kwargs):
        return getattr(transformers, auto_class).from_pretrained(str(folder), trust_remote_code=True, **kwargs)

    return load


def left_pad(rows, pad_id=0):
    """Left-pad a list of 1-D token tensors: (input_ids [B, L], attention_mask [B, L])."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, length - len(r):] = r
        mask[i, length - len(r):] = 1
    return ids, mask


def stop_right_after(monkeypatch, module, name):
    """`module.name` runs, then raises KeyboardInterrupt: as if a run were stopped (the GPU call's
    time ran out, say) right after it saved its state."""
    save = getattr(module, name)

    def save_then_stop(*args):
        save(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(module, name, save_then_stop)


@pytest.fixture
def make_left_padded():
    """Factory: make_left_padded(rows, pad_id=0) -> (input_ids, attention_mask)."""
    return left_pad
