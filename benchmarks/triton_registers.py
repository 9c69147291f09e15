"""Registers and spills of the FP8 Triton kernels at their launch configs, compiled for sm_90a on any machine with
triton installed (no GPU: triton's own compiler and its bundled ptxas). A kernel that spills at its launch config
runs from local memory: the weights' block quantiser did at 4 warps (2 KB a thread), at about 1.4 TB/s on the H100.

    python benchmarks/triton_registers.py            # a table: kernel, constexprs, warps, registers, spills
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# kernel: (signature, [(constexprs, warps)]) -- the launches of spartron/layers/fp8/triton_backend.py
ROWS_SIG = {"x_ptr": "*bf16", "up_ptr": "*bf16", "idx_ptr": "*i64", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32",
            "K": "i32", "SX": "i32", "POW2": "constexpr", "SWIGLU": "constexpr", "GATHER": "constexpr",
            "BM": "constexpr"}
BLOCKS_SIG = {"w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv", "s_ptr": "*fp32", "N": "i32", "K": "i32",
              "N_OUT": "i32", "ROWS": "constexpr", "COLS": "constexpr", "POW2": "constexpr", "CHUNK": "constexpr"}
COLS_SIG = {"x_ptr": "*bf16", "idx_ptr": "*i64", "counts_ptr": "*i32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
            "C": "i32", "L": "i32", "N_GROUPS": "constexpr", "POW2": "constexpr", "GATHER": "constexpr",
            "BC": "constexpr"}
SLOTS_SIG = {"counts_ptr": "*i32", "source_ptr": "*i64", "dest_ptr": "*i64", "ends_ptr": "*i32",
             "N_GROUPS": "constexpr"}


def launches(k) -> list[tuple[str, object, dict, dict, int]]:
    out = []
    for swiglu in (False, True):
        for gather in (False, True):
            out.append(("quantize_rows", k.quantize_rows_kernel, ROWS_SIG,
                        {"POW2": True, "SWIGLU": swiglu, "GATHER": gather, "BM": 32}, 4))
    for rows, cols in ((True, False), (False, True), (True, True)):
        out.append(("quantize_blocks", k.quantize_blocks_kernel, BLOCKS_SIG,
                    {"ROWS": rows, "COLS": cols, "POW2": True, "CHUNK": k.QUANTIZE_BLOCKS_CONFIG[0]},
                    k.QUANTIZE_BLOCKS_CONFIG[1]))
    for gather in (False, True):
        out.append(("quantize_cols", k.quantize_cols_kernel, COLS_SIG,
                    {"N_GROUPS": 8, "POW2": True, "GATHER": gather, "BC": 64}, 4))
    out.append(("slot_rows", k.slot_rows_kernel, SLOTS_SIG, {"N_GROUPS": 8}, 4))
    return out


def report(fn, signature: dict, constexprs: dict, warps: int, ptxas: str) -> tuple[int, int]:
    """(registers, spill store bytes) of one compiled launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        Path(ptx).write_text(compiled.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True,
                              text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", info).group(1))
    return regs, spills


def main() -> list[dict]:
    import triton

    from spartron.layers.fp8 import triton_kernels as k

    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))
    if not ptxas:
        raise SystemExit("triton_registers: this triton has no bundled ptxas")
    rows = []
    for name, fn, sig, constexprs, warps in launches(k):
        regs, spills = report(fn, sig, constexprs, warps, ptxas[0])
        rows.append({"kernel": name, "constexprs": constexprs, "warps": warps, "registers": regs,
                     "spill_store_bytes": spills})
        print(f"{name:16s} {str(constexprs):60s} warps {warps:2d}  registers {regs:3d}  spill stores {spills} B")
    return rows


if __name__ == "__main__":
    main()
