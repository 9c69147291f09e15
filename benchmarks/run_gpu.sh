#!/usr/bin/env bash
# Run the GPU checks and benchmarks on a lent CUDA machine in one call and bring the results back.
# Usage (repo root, on the GPU machine): bash benchmarks/run_gpu.sh OUTDIR STEP [STEP ...]
#   STEP = NAME[:SECONDS], NAME one of: env pytest ac_block collectives moe_layer sparse_mla e2e offload overlap
#          megatron_gpt deepep, or build_deepep (DeepEP from the source in $DEEPEP_SRC, default
#          .carry/DeepEP, into /tmp/site: benchmarks/build_deepep.sh), or build_deep_gemm (DeepGEMM from
#          $DEEP_GEMM_SRC, default .carry/DeepGEMM: benchmarks/build_deep_gemm.sh); extra arguments for NAME come
#          from the variable ARGS_NAME. NAME@TAG runs benchmark NAME again with ARGS_NAME_TAG into
#          NAME_TAG.json / .log (e.g. offload@deepep). Wheels in .whl/ (pure-Python deps the image
#          lacks) are installed first.
# Every step writes OUTDIR/NAME.log and, for benchmarks, OUTDIR/NAME.json; a failing step does not
# stop the others. A summary line per step is printed last, and OUTDIR is packed into OUTDIR.tgz (the device
# tool brings back only a few files a call: fetch that one). RUN_GPU_BUDGET=SECONDS (default: none) is the
# call's time: each step's SECONDS is cut to what is left of it, and a step with under 20 s left is skipped,
# so a call ends inside its limit with every finished step's output.
set -uo pipefail
out=${1:?usage: run_gpu.sh OUTDIR STEP...}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source benchmarks/install_wheels.sh "$out"
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"  # the wheels and a DeepEP build land in /tmp/site
summary=()
t0=$(date +%s)
for step in "$@"; do
  name=${step%%:*}; secs=${step#*:}; [ "$secs" = "$step" ] && secs=300
  if [ -n "${RUN_GPU_BUDGET:-}" ]; then
    left=$(( RUN_GPU_BUDGET - ($(date +%s) - t0) ))
    if (( left < 20 )); then summary+=("$name skipped: ${left}s of RUN_GPU_BUDGET left"); continue; fi
    (( secs > left )) && secs=$left
  fi
  file=${name//@/_}  # NAME@TAG -> NAME_TAG: its ARGS_ variable and its .json / .log
  case $name in
    env) cmd=(bash -c 'nvidia-smi -L; python3 -c "import torch,sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), torch.cuda.get_device_name(0))"') ;;
    pytest) cmd=(python3 -m pytest -q -m gpu tests -p no:cacheprovider) ;;
    build_deepep) cmd=(bash benchmarks/build_deepep.sh "${DEEPEP_SRC:-.carry/DeepEP}" /tmp/site) ;;
    build_deep_gemm) cmd=(bash benchmarks/build_deep_gemm.sh "${DEEP_GEMM_SRC:-.carry/DeepGEMM}" /tmp/site) ;;
    *) extra_var="ARGS_$file"; read -r -a extra <<<"${!extra_var:-}"
       cmd=(python3 "benchmarks/${name%%@*}.py" --out "$out/$file.json" "${extra[@]}") ;;
  esac
  start=$(date +%s)
  timeout "$secs" "${cmd[@]}" >"$out/$file.log" 2>&1; rc=$?
  summary+=("$name rc=$rc $(( $(date +%s) - start ))s")
  echo "=== $name (rc=$rc)"; tail -n 15 "$out/$file.log"
done
echo "=== summary"; printf '%s\n' "${summary[@]}"
tar czf "${out%/}.tgz" -C "$(dirname "$out")" "$(basename "$out")" && echo "packed ${out%/}.tgz"
