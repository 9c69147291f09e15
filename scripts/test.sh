#!/usr/bin/env bash
# The whole test suite, from nothing: venv, a real single-machine Slurm (as root), pytest on 2 workers.
# Extra arguments go to pytest (they win over the defaults here: `scripts/test.sh -n 0` runs serially).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
source scripts/venv.sh
started_slurm=0
if command -v sinfo >/dev/null && bash scripts/slurm.sh status >/dev/null 2>&1; then
  :  # a Slurm already answers (started by hand or by someone else): use it and leave it running
elif [ "$(id -u)" = 0 ]; then
  if bash scripts/slurm.sh start 2 >/tmp/spartron-slurm-start.log 2>&1; then
    started_slurm=1
  else
    echo "note: scripts/slurm.sh could not start Slurm (log: /tmp/spartron-slurm-start.log); the Slurm tests skip"
  fi
else
  echo "note: not root, so no Slurm is started; the Slurm tests skip (run as root, or start one: scripts/slurm.sh)"
fi
cleanup() { if [ "$started_slurm" = 1 ]; then bash scripts/slurm.sh stop >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT
# Independent tests run on 2 workers; the Slurm tests share one worker (tests/conftest.py). Tests that
# signal a command stop it at a chosen point first (tests/conftest.py, paused_cli): no race under load.
# Two workers on a 2-core machine: one intra-op thread each (two each oversubscribed the cores; the tests
# added in one wave ran 28% faster this way). Exported, so each worker's subprocesses and ranks inherit it.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# --durations: the 25 slowest tests close the output, for whoever trims CI's time (the aim is 15 minutes)
python -m pytest -q -n 2 --dist loadgroup --durations=25 "$@"
