#!/usr/bin/env bash
# Create or refresh the project's virtual environment (.venv) idempotently.
# torch is installed FIRST and pinned to the CPU build that pip finds on this machine's disk;
# installing anything that depends on torch before it would pull a multi-GB CUDA build.
# Sourced by scripts/train.sh and scripts/test.sh; re-running is cheap (a stamp keyed by setup.cfg).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.spartron-stamp"
want=$(cat "$root/setup.cfg" "$root/scripts/venv.sh" | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# pip warns once per package about configured index folders that do not exist; only that line is dropped.
pip_install() {
  { "$venv/bin/python" -m pip install -q "$@" 2>&1; } | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
    pip_install "torch==2.13.0"
  fi
  pip_install -e "$root[test]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
