"""Uploads this repository to the Hugging Face Hub as a model repository.

    python tools/publish.py --repo-id USER/NAME --dry-run   # list what would be sent; send nothing
    python tools/publish.py --repo-id USER/NAME             # create the repository if needed, upload

What is sent: the files git tracks, less CI's configuration (NOT_SENT below): the model, its code,
its card, the scripts a user runs, and the tests, benchmarks and tools the card's set-up commands
and links name, so that a clone of the Hub repository works as this one does. Untracked or ignored
things (.venv/, scratch/, caches, training outputs) never go. The upload mirrors that list: files on the Hub that are not in it are deleted in the
same commit. It refuses while a file it would send has uncommitted changes, so the Hub holds one
commit's files. Log in first (`hf auth login`) or set HF_TOKEN.
"""

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Paths (a folder ends in "/") that mean nothing on the Hub: the CI machine's job.
NOT_SENT = (".ci/",)


def _git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def files_to_publish():
    """The repository-relative paths the upload sends, sorted."""
    tracked = _git("ls-files", "-z").split("\0")
    return sorted(p for p in tracked if p and not p.startswith(NOT_SENT) and (ROOT / p).is_file())


def uncommitted(paths):
    changed = {line[3:] for line in _git("status", "--porcelain", "--", *paths).splitlines()}
    return sorted(changed & set(paths))


def main(argv=None):
    parser = argparse.ArgumentParser(description="Upload the model repository to the Hugging Face Hub.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--repo-id", required=True, help="the Hub repository, USER/NAME or ORG/NAME")
    parser.add_argument("--dry-run", action="store_true", help="list the files and their sizes, send nothing")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--message", default=None, help="the Hub commit's message (default: this git commit)")
    args = parser.parse_args(argv)

    files = files_to_publish()
    sizes = {p: (ROOT / p).stat().st_size for p in files}
    for p in files:
        print(f"{sizes[p]:>12,d}  {p}")
    print(f"{len(files)} files, {sum(sizes.values()) / 2**20:.1f} MiB")
    if args.dry_run:
        return 0
    dirty = uncommitted(files)
    if dirty:
        print("refusing to upload: uncommitted changes in " + ", ".join(dirty), file=sys.stderr)
        return 1

    from huggingface_hub import HfApi

    commit = _git("rev-parse", "--short", "HEAD").strip()
    api = HfApi()
    api.create_repo(args.repo_id, repo_type="model", private=args.private, exist_ok=True)
    api.upload_folder(folder_path=str(ROOT), repo_id=args.repo_id, repo_type="model",
                      allow_patterns=files, delete_patterns="*",
                      commit_message=args.message or f"ResLin at {commit}")
    print(f"uploaded to https://huggingface.co/{args.repo_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
