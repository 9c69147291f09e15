#!/usr/bin/env bash
# The whole test suite, from nothing: venv, a real single-machine Slurm (when root), pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
source scripts/venv.sh
slurm_tool="$root/../shared/tools/slurm-ci.sh"
started_slurm=0
if [ "$(id -u)" = 0 ] && [ -f "$slurm_tool" ]; then
  if command -v sinfo >/dev/null && sinfo >/dev/null 2>&1; then
    :  # a Slurm is already running (started by someone else): use it and leave it running
  elif SLURM_CI_NODES=2 bash "$slurm_tool" start >/tmp/spartron-slurm-start.log 2>&1; then
    started_slurm=1
  else
    echo "note: Slurm could not be started (see /tmp/spartron-slurm-start.log); Slurm tests will skip"
  fi
fi
cleanup() { [ "$started_slurm" = 1 ] && bash "$slurm_tool" stop >/dev/null 2>&1 || true; }
trap cleanup EXIT
python -m pytest -q "$@"
