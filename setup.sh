#!/usr/bin/env bash
# Creates .venv with the pinned packages of requirements.txt (once; again when it changes).
# Used by both README commands and by CI.
set -euo pipefail
cd "$(dirname "$0")"
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
echo "$want" > "$stamp"
