"""What every source layout shares: fetching from the Hub, reading weights, checks, writing the
ResLin folder, the probe.

A conversion never holds the model twice: tensors stream from one source file at a time into
safetensors shards of at most `max_shard_size` bytes, each written as soon as it is full. The
destination is assembled in a hidden folder beside it (or in the nearest existing folder above it)
and renamed into place only when everything (weights, config, code, checks, probe) succeeded, so a
failure leaves nothing half-written and makes no folders.
"""

import functools
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROBE_SHAPE = (2, 64)  # the probe batch: seeded random tokens


class ConversionError(Exception):
    """A problem with the input or the destination; the CLI prints it and exits with status 1."""


def parse_size(text):
    match = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([KMG]?B)\s*", text.upper())
    if not match:
        raise ConversionError(f"--max-shard-size must look like 5GB, 500MB or 100KB, got {text!r}")
    size = int(float(match[1]) * {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}[match[2]])
    if size < 1:
        raise ConversionError(f"--max-shard-size must be at least 1 byte, got {text!r}")
    return size


def read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConversionError(f"cannot read {path}: {error}") from None


def iter_tensors(path):
    """(name, tensor) of one weight file, one tensor in memory at a time where the format allows."""
    path = Path(path)
    if path.suffix == ".safetensors":
        try:
            # Checks the header and that the data covers every tensor it lists.
            handle = safe_open(str(path), framework="pt")
        except SafetensorError as error:
            raise ConversionError(f"cannot read {path}: {error} (a truncated or corrupt file, e.g. an "
                                  "interrupted download?)") from None
        with handle as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
        return
    try:
        # weights_only: a pickle may run code otherwise; mmap: tensors are read when touched.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise ConversionError(f"cannot read {path} with torch.load(weights_only=True): {error}") from None
    if isinstance(state, dict) and len(state) == 1 and isinstance(next(iter(state.values())), dict):
        state = next(iter(state.values()))  # lit_gpt / Lightning save {"model": state_dict}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ConversionError(f"{path.name}: entry {name!r} is a {type(tensor).__name__}, not a tensor")
        yield name, tensor


# A transformers-style folder's weights, in the order transformers prefers them: (index, single file).
WEIGHT_FORMATS = (("model.safetensors.index.json", "model.safetensors"),
                  ("pytorch_model.bin.index.json", "pytorch_model.bin"))
# What a conversion reads from a Hub repository besides the weights: exact top-level names, so that
# no checkpoint-*/ folder, optimizer state, training_args.bin or README is fetched.
HUB_SMALL_FILES = ("config.json", *TOKENIZER_FILES, *(index for index, _ in WEIGHT_FORMATS))


def index_shards(path):
    """The shard file names an index's weight_map lists, sorted, each once."""
    weight_map = read_json(path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConversionError(f"{path} has no weight_map of tensor name -> shard file name")
    outside = sorted({shard for shard in weight_map.values() if Path(shard).name != shard})
    if outside:  # shards sit beside their index: a path would read files outside the source
        raise ConversionError(f"{path} names shards that are not file names in its folder: {outside}")
    return sorted(set(weight_map.values()))


def hf_weight_files(folder):
    """The weight files of a transformers-style folder, shards in order."""
    for index_name, single_name in WEIGHT_FORMATS:
        if (folder / index_name).is_file():
            shards = index_shards(folder / index_name)
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise ConversionError(f"{index_name} lists shards that are not in {folder}: {missing}")
            return [folder / s for s in shards]
        if (folder / single_name).is_file():
            return [folder / single_name]
    raise ConversionError(f"no weights in {folder}: expected model.safetensors, a sharded model.safetensors.index.json, "
                          "pytorch_model.bin or pytorch_model.bin.index.json")


class ShardWriter:
    """Writes tensors into safetensors shards named and indexed like transformers' save_pretrained."""

    def __init__(self, folder, max_shard_bytes):
        self.folder, self.max_shard_bytes = Path(folder), max_shard_bytes
        self.pending, self.pending_bytes, self.shards, self.total_bytes = {}, 0, [], 0

    def add(self, name, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self):
        path = self.folder / f"shard-{len(self.shards):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self):
        if self.pending or not self.shards:
            self.flush()
        if len(self.shards) == 1:
            self.shards[0][0].rename(self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
            path.rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def resolve_hf_source(src, revision=None):
    """A local folder as it is; anything else of the form owner/name is a Hub repo id, fetched."""
    path = Path(src)
    if path.is_dir():
        if revision is not None:
            raise ConversionError(f"--revision is for Hub repo ids, but --src {src} is a local folder")
        return path.resolve()
    if path.exists() or src.startswith((".", "/", "~")) or src.count("/") != 1:
        raise ConversionError(f"--src {src!r} is neither a folder nor a Hub repo id (owner/name)")
    return fetch_from_hub(src, revision)


def fetch_from_hub(repo_id, revision=None):
    """The snapshot folder of `repo_id` in huggingface_hub's cache, holding what a conversion reads.

    First the small files (HUB_SMALL_FILES), which also fixes the commit; then, from that same
    commit, one weight format: the safetensors (the shards its index lists) when the repository
    has them, else the .bin files. With HF_HUB_OFFLINE=1 everything comes from huggingface_hub's
    cache (local_files_only: huggingface_hub 1.x's snapshot_download at a commit hash would list
    the repository online regardless); without a connection, huggingface_hub 2.x answers from
    its cache too."""
    from huggingface_hub import constants, snapshot_download

    where = repr(repo_id) + (f" (revision {revision!r})" if revision is not None else "")
    fetch = functools.partial(snapshot_download, repo_id, local_files_only=constants.HF_HUB_OFFLINE)
    try:
        folder = Path(fetch(revision=revision, allow_patterns=list(HUB_SMALL_FILES)))
        commit = folder.name  # .../snapshots/<commit hash>
        weights = hub_weight_names(repo_id, commit, folder)
        if weights:
            fetch(revision=commit, allow_patterns=weights)
    except ConversionError as error:
        raise ConversionError(f"Hub repo {where}: {error}") from None
    except Exception as error:
        raise ConversionError(f"--src {where} is not a local folder, and fetching it from the Hugging Face Hub "
                              f"failed: {type(error).__name__}: {error}") from None
    print(f"Hub repo {where}: commit {commit}, {folder}")
    return folder


def hub_weight_names(repo_id, commit, folder):
    """The weight files to fetch: one format, chosen in hf_weight_files' order from the repository's file list."""
    names = repo_file_names(repo_id, commit, folder)
    for index_name, single_name in WEIGHT_FORMATS:
        if index_name in names and (folder / index_name).is_file():
            return index_shards(folder / index_name)
        if single_name in names:
            return [single_name]
    return []  # hf_weight_files then says what is missing


def repo_file_names(repo_id, commit, folder):
    """The repository's file names at `commit`: the listing huggingface_hub cached with the first
    download (recent versions), else the Hub's; offline without a cached listing, what the cached
    snapshot holds."""
    import huggingface_hub

    try:
        return {f.path for f in huggingface_hub.get_cached_repo_tree(repo_id, revision=commit)}
    except Exception:  # an older huggingface_hub, or no listing cached
        pass
    try:
        return set(huggingface_hub.HfApi().list_repo_files(repo_id, revision=commit))
    except Exception:  # offline
        return {p.name for p in folder.iterdir()}


def nearest_existing_parent(path):
    return next(parent for parent in path.parents if parent.exists())


def check_destination(src, dst, force):
    src, dst = Path(src).resolve(), Path(dst).resolve()
    for a, b, relation in ((dst, src, "inside the source"), (src, dst, "a folder that holds the source")):
        if a == b or b in a.parents:
            raise ConversionError(f"--dst {dst} is {relation} {src}: refusing to write there")
    parent = nearest_existing_parent(dst)
    if not parent.is_dir():
        raise ConversionError(f"--dst {dst} cannot be made: {parent} is a file, not a folder")
    if dst.exists() and not force:
        raise ConversionError(f"--dst {dst} exists: pass --force to replace it")
    if dst.exists() and not dst.is_dir():
        raise ConversionError(f"--dst {dst} exists and is not a folder")
    if dst.exists():
        # --force deletes the folder: only one a conversion could have written (flat, with a
        # config.json), never a repository or a folder of other things.
        subfolders = sorted(entry.name for entry in dst.iterdir() if entry.is_dir())
        if subfolders or not (dst / "config.json").is_file():
            what = f"holds folders ({', '.join(subfolders[:3])})" if subfolders else "has no config.json"
            raise ConversionError(f"--dst {dst} {what}: --force replaces only a model folder (files only, a "
                                  f"config.json among them); remove it yourself if it must go")
    return dst


def expected_tensors(folder):
    """name -> tensor (shape and dtype, on the meta device) of every tensor the ResLin model in `folder` loads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    tensors = model.state_dict()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight")  # saved once, as the embeddings
    return tensors


def convert(src, dst, attn_type, layout, dtype=None, max_shard_size="5GB", force=False, probe=True):
    """Convert `src` (read through `layout`) into a ResLin folder `dst`; raises ConversionError."""
    max_shard_bytes = parse_size(max_shard_size)
    src = layout.resolve_source(src)
    dst = check_destination(src, dst, force)
    weight_files = layout.weight_files(src)
    config = layout.reslin_config(src, weight_files)
    config["attn_type"] = attn_type
    if dtype is not None:
        config["dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]

    # Staged in the nearest existing folder above dst: the same file system as dst, so the final rename
    # is atomic, and the folders dst lacks are made only once everything succeeded.
    stage = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=nearest_existing_parent(dst)))
    try:
        write_code_and_config(stage, config)
        expected = expected_tensors(stage)
        write_weights(stage, layout, weight_files, expected, DTYPES.get(dtype), max_shard_bytes,
                      residual=attn_type in ("rdn", "rkla"))
        source_folder = src if src.is_dir() else src.parent
        for name in TOKENIZER_FILES:
            if (source_folder / name).is_file():
                shutil.copy(source_folder / name, stage / name)
        if probe and attn_type != "gdn":
            print_probe(stage, attn_type)
        if dst.exists():
            shutil.rmtree(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(stage, dst)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    print(f"wrote {dst} ({attn_type}, from {layout.name} {src})")
    return dst


def write_code_and_config(folder, config):
    for path in sorted(REPO_ROOT.glob("*_reslin*.py")):
        shutil.copy(path, folder / path.name)
    from transformers import AutoConfig

    auto_map = read_json(REPO_ROOT / "config.json")["auto_map"]
    (folder / "config.json").write_text(json.dumps({"model_type": "reslin", "auto_map": auto_map, **config}))
    try:
        # Loading it through remote code runs ResLinConfig's checks and writes every field and auto_map.
        AutoConfig.from_pretrained(str(folder), trust_remote_code=True).save_pretrained(str(folder))
    except ValueError as error:
        raise ConversionError(f"the source's configuration has no ResLin equivalent: {error}") from None


def write_weights(folder, layout, weight_files, expected, dtype, max_shard_bytes, residual):
    writer, written = ShardWriter(folder, max_shard_bytes), {}
    for path in weight_files:
        for name, tensor in iter_tensors(path):
            for target in layout.target_names(name):
                if target not in expected:
                    raise ConversionError(f"unexpected tensor {name!r} in {path.name}: the converted model has no "
                                          f"{target!r} (a source option that this conversion does not support?)")
                if target in written:
                    raise ConversionError(f"tensor {name!r} in {path.name} appears twice (as {written[target]!r})")
                if tensor.shape != expected[target].shape:
                    raise ConversionError(f"tensor {name!r} has shape {tuple(tensor.shape)}, but the configuration "
                                          f"implies {tuple(expected[target].shape)}")
                if expected[target].is_floating_point() and not tensor.is_floating_point():
                    raise ConversionError(f"tensor {name!r} in {path.name} has dtype {tensor.dtype}: {target!r} is a "
                                          "floating-point weight")
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    raise ConversionError(f"tensor {name!r} in {path.name} holds NaN or inf values")
                out = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
                writer.add(target, out)
                written[target] = name
                gamma_name = target.replace(".attn.b_proj.", ".attn.gamma_proj.")
                if residual and gamma_name != target:
                    # The correction gate starts as the write strength: gamma = beta, so that the residual
                    # state's write of the current token matches GDN's (DESIGN.md section 8, "Upcycling").
                    writer.add(gamma_name, out.clone())
                    written[gamma_name] = name
    missing = sorted(set(expected) - set(written))
    if missing:
        raise ConversionError(f"the source lacks {len(missing)} tensor(s) the model needs (ResLin names): "
                              f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    writer.finish()


def print_probe(folder, attn_type):
    """Print how far the upcycled model is from the source on a probe batch.

    The source is the same model with each linear layer switched back to GDN (gated step, no
    residual state): with `--attn-type gdn` the conversion is exact, so this is the source model,
    and only one copy of the weights is in memory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(model.config.vocab_size, PROBE_SHAPE, generator=generator)
    with torch.no_grad():
        converted = model(tokens, labels=tokens, use_cache=False)
        for module in model.modules():
            if type(module).__name__ == "ResLinLinearAttention":
                module.step_rule, module.use_residual = "gated", False
        source = model(tokens, labels=tokens, use_cache=False)
    diff = (converted.logits - source.logits).abs()
    relative = diff.norm() / source.logits.norm()
    print(f"probe ({PROBE_SHAPE[0]} x {PROBE_SHAPE[1]} random tokens), {attn_type} vs the source: "
          f"logits relative L2 distance {relative:.4f}, max abs difference {diff.max():.4f}; "
          f"loss {converted.loss:.4f} vs {source.loss:.4f} (difference {converted.loss - source.loss:+.4f}; "
          f"uniform guess {math.log(model.config.vocab_size):.4f})")
    return relative.item(), (converted.loss - source.loss).item()
