#!/usr/bin/env bash
# Install the pure-Python wheels carried in .whl/ (what the GPU image lacks) into /tmp/site, logging to
# OUTDIR/wheels.log. Sourced by run_gpu.sh and compare_commits.sh from the repository root.
# Usage: source benchmarks/install_wheels.sh OUTDIR
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"${1:?OUTDIR}/wheels.log" 2>&1 || echo "wheel install failed (see wheels.log)"
fi
