#!/usr/bin/env bash
# Build DeepEP's intranode (NVLink) kernels on the lent GPU machine and install them into TARGET.
#   bash benchmarks/build_deepep.sh SRC TARGET
# SRC: an unmodified DeepEP v1.2.x source tree that travelled with the call (never committed here;
# e.g. carry .carry/DeepEP). TARGET: a folder on PYTHONPATH (run_gpu.sh uses /tmp/site).
# Spartron uses only the intranode kernels (EP within one host), so the build leaves NVSHMEM out
# even where its module is installed, and drops `-rdc=true`: relocatable device code is only
# needed to device-link NVSHMEM, and without that link step the extension fails to load.
# The build runs in a copy; SRC is left as it is. Exits non-zero, naming what did not match, when
# the source is a version whose setup.py reads differently.
set -euo pipefail
src=${1:?usage: build_deepep.sh SRC TARGET}
target=${2:?usage: build_deepep.sh SRC TARGET}
[ -f "$src/setup.py" ] || { echo "build_deepep: $src has no setup.py (is the DeepEP source carried?)" >&2; exit 2; }
work=$(mktemp -d)
cp -r "$src"/. "$work"
cd "$work"
python3 - <<'EOF'
from pathlib import Path

path = Path("setup.py")
text = path.read_text()
edits = {
    "intranode only": ("\n    if not disable_nvshmem:\n        assert os.path.exists(nvshmem_dir)",
                       "\n    disable_nvshmem = True  # spartron: intranode kernels only\n"
                       "    if not disable_nvshmem:\n        assert os.path.exists(nvshmem_dir)"),
    "no -rdc": ("nvcc_flags.extend(['-rdc=true', ", "nvcc_flags.extend(["),
}
for what, (old, new) in edits.items():
    if text.count(old) != 1:
        raise SystemExit(f"build_deepep: setup.py edit '{what}' found {text.count(old)} matches, expected 1")
    text = text.replace(old, new)
path.write_text(text)
EOF
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
python3 setup.py build_ext --inplace
mkdir -p "$target"
cp -r deep_ep deep_ep_cpp*.so "$target"/
cd "$target"
python3 -c "import deep_ep, deep_ep_cpp; print('deep_ep', deep_ep.__file__, 'Buffer' in dir(deep_ep))"
