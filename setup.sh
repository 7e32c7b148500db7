#!/usr/bin/env bash
# Creates .venv with what requirements.txt pins (`bash setup.sh`: running the model), or with the
# test tools too (`bash setup.sh tests`: requirements-tests.txt). Installs only when those files
# changed since the last install.
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in
  "") requirements=requirements.txt ;;
  tests) requirements=requirements-tests.txt ;;
  *) echo "usage: bash setup.sh [tests]" >&2; exit 2 ;;
esac
digest() { cat "$@" | sha256sum | cut -d' ' -f1; }
runtime=$(digest requirements.txt)
with_tests=$(digest requirements-tests.txt requirements.txt)
want=$runtime
[ "$requirements" = requirements-tests.txt ] && want=$with_tests
stamp=.venv/.requirements.sha256
if [ -f "$stamp" ] && grep -qx "$want" "$stamp"; then
  exit 0
fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r "$requirements"
# A test install holds the runtime's packages too.
printf '%s\n' "$want" "$runtime" >"$stamp"
