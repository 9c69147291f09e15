#!/usr/bin/env bash
# Assemble the DeepGEMM source tree that build_deep_gemm.sh compiles on the GPU machine, from three local git
# repositories (clones or mirrors, nothing fetched here): DeepGEMM itself and the cutlass and fmt commits its
# submodules pin (their include/ folders only: about 29 MB in all, under the device call's 64 MiB carry).
#   bash benchmarks/assemble_deep_gemm.sh DEEPGEMM_GIT CUTLASS_GIT FMT_GIT OUT [REV]
# OUT (e.g. .carry/DeepGEMM, git-ignored: never commit it) is replaced. REV: DeepGEMM's revision (default HEAD).
set -euo pipefail
dg=${1:?usage: assemble_deep_gemm.sh DEEPGEMM_GIT CUTLASS_GIT FMT_GIT OUT [REV]}
cutlass=${2:?cutlass git}; fmt=${3:?fmt git}; out=${4:?OUT}; rev=${5:-HEAD}
pinned() {  # the commit DeepGEMM's tree pins for submodule path $1
  git -C "$dg" ls-tree "$rev" "$1" | awk '$2 == "commit" {print $3}'
}
cutlass_rev=$(pinned third-party/cutlass); fmt_rev=$(pinned third-party/fmt)
[ -n "$cutlass_rev" ] && [ -n "$fmt_rev" ] || { echo "assemble_deep_gemm: $dg at $rev pins no cutlass / fmt submodule" >&2; exit 2; }
for pair in "$cutlass:$cutlass_rev" "$fmt:$fmt_rev"; do
  git -C "${pair%%:*}" cat-file -e "${pair#*:}^{commit}" 2>/dev/null \
    || { echo "assemble_deep_gemm: ${pair%%:*} lacks the pinned commit ${pair#*:}" >&2; exit 2; }
done
rm -rf "$out"; mkdir -p "$out"
git -C "$dg" archive "$rev" | tar x -C "$out"
rm -rf "$out/third-party/cutlass" "$out/third-party/fmt"
mkdir -p "$out/third-party/cutlass" "$out/third-party/fmt"
git -C "$cutlass" archive "$cutlass_rev" include | tar x -C "$out/third-party/cutlass"
git -C "$fmt" archive "$fmt_rev" include | tar x -C "$out/third-party/fmt"
echo "assembled DeepGEMM $(git -C "$dg" rev-parse --short "$rev") (cutlass ${cutlass_rev:0:12}, fmt ${fmt_rev:0:12}) in $out: $(du -sh "$out" | cut -f1)"
