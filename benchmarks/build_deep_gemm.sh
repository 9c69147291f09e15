#!/usr/bin/env bash
# Build DeepGEMM (model.fp8.backend = "deep_gemm") on the lent GPU machine and install it into TARGET.
#   bash benchmarks/build_deep_gemm.sh SRC TARGET [CXX]
# SRC: an unmodified DeepGEMM 2.x source tree with its third-party/cutlass and third-party/fmt headers, carried
# with the call (never committed here; benchmarks/assemble_deep_gemm.sh makes it from local git repositories). TARGET: a folder on PYTHONPATH (run_gpu.sh uses /tmp/site).
# The extension is compiled with the system g++ (the third argument, default /usr/bin/g++; the environment's CXX
# is not used: the image sets it to /opt/gcc/bin/g++, which links libstdc++'s locale code into the extension
# itself, and DeepGEMM's first GEMM then segfaults in its own iostream / std::regex calls: session 19, H100,
# cuda-gdb's backtrace).
# Its kernels are compiled at first use by nvcc (CUDA_HOME) into ~/.deep_gemm, a few seconds each shape.
# The build runs in a copy; SRC is left as it is.
set -euo pipefail
src=${1:?usage: build_deep_gemm.sh SRC TARGET}
target=${2:?usage: build_deep_gemm.sh SRC TARGET}
[ -f "$src/setup.py" ] || { echo "build_deep_gemm: $src has no setup.py (is the DeepGEMM source carried?)" >&2; exit 2; }
[ -d "$src/third-party/cutlass/include/cute" ] || { echo "build_deep_gemm: $src lacks third-party/cutlass/include" >&2; exit 2; }
python3 -c "import wheel" 2>/dev/null || { echo "build_deep_gemm: DeepGEMM's setup.py imports 'wheel': install it first" >&2; exit 2; }
cxx=${3:-/usr/bin/g++}
[ -x "$cxx" ] || { echo "build_deep_gemm: no compiler at $cxx" >&2; exit 2; }
export CXX=$cxx CC=${cxx%++}cc
work=$(mktemp -d)
cp -r "$src"/. "$work"
cd "$work"
DG_USE_LOCAL_VERSION=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} python3 setup.py build
mkdir -p "$target"
rm -rf "$target/deep_gemm"
cp -r build/lib*/deep_gemm "$target"/
cd "$target"
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__version__, deep_gemm.__file__)"
if ldd "$target"/deep_gemm/_C*.so | grep -q "libstdc++"; then echo "deep_gemm links libstdc++.so (shared): good"
else echo "build_deep_gemm: the extension does not link libstdc++.so: $cxx linked it statically" >&2; exit 3; fi
