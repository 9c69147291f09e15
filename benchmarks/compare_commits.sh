#!/usr/bin/env bash
# Same-call speed comparison of two commits on the GPU: benchmarks/e2e.py of two exported trees,
# alternating, each with the same arguments. Export each tree first (on the developer machine):
#   git archive SHA spartron benchmarks configs pyproject.toml | tar -x -C .carry/<base|head>
# Usage (repo root, GPU machine): bash benchmarks/compare_commits.sh OUTDIR BASE_SHA HEAD_SHA TAG [e2e args...]
set -uo pipefail
out=$(realpath -m "${1:?OUTDIR}"); base=${2:?BASE_SHA}; head=${3:?HEAD_SHA}; tag=${4:?TAG}; shift 4
mkdir -p "$out"
export PYTHONUNBUFFERED=1
source benchmarks/install_wheels.sh "$out"
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
for which in base head; do
  if [ $which = base ]; then sha=$base; else sha=$head; fi
  name="e2e_${tag}_${which}_${sha:0:7}"
  (cd ".carry/$which" && python3 benchmarks/e2e.py --commit "$sha" --out "$out/$name.json" "$@") >"$out/$name.log" 2>&1
  echo "=== $which $sha rc=$?"; tail -n 12 "$out/$name.log"
done
