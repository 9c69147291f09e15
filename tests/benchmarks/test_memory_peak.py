"""benchmarks/memory_peak.py: the replay of an allocator trace (peak, the blocks live then, the blocks live before
the trace), the attribution to held tensors and allocation sites, and its refusal without CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import memory_peak  # noqa: E402

SPARTRON = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 7, "name": "linear"},
            {"filename": "/repo/spartron/layers/mla.py", "line": 42, "name": "forward"}]
TORCH_ONLY = [{"filename": "/x/site-packages/torch/optim/adamw.py", "line": 9, "name": "_init_group"}]


def ev(action: str, addr: int, size: int, frames: list[dict] | None = None) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames or []}


def test_site_prefers_the_innermost_project_or_compiled_frame():
    assert memory_peak.site(SPARTRON) == "layers/mla.py:42 forward"
    inductor = [TORCH_ONLY[0], {"filename": "/tmp/torchinductor_root/ab/cabc.py", "line": 3, "name": "call"}]
    assert memory_peak.site(inductor) == "/tmp/torchinductor_root/ab/cabc.py:3 call"
    assert memory_peak.site(TORCH_ONLY) == "/x/site-packages/torch/optim/adamw.py:9 _init_group"
    assert memory_peak.site([]) == "(no frames recorded)"


def test_replay_finds_the_peak_and_the_blocks_live_then():
    trace = [ev("segment_alloc", 0, 4096), ev("alloc", 100, 512, SPARTRON), ev("alloc", 200, 1024, TORCH_ONLY),
             ev("free_requested", 100, 512), ev("free_completed", 100, 512), ev("alloc", 300, 2048, SPARTRON),
             ev("free_requested", 200, 1024), ev("free_requested", 10, 256), ev("alloc", 400, 512)]
    peak, at, live = memory_peak.live_at_peak(trace, {10: 256})
    # 256 -> 768 -> 1792 -> 1280 -> 3328 (peak, event 5) -> 2304 -> 2048 -> 2560
    assert (peak, at) == (3328, 5)
    assert live == {10: (256, "(allocated before the recorded step)"), 200: (1024, memory_peak.site(TORCH_ONLY)),
                    300: (2048, "layers/mla.py:42 forward")}


def test_a_trace_that_only_frees_peaks_at_its_start():
    peak, at, live = memory_peak.live_at_peak([ev("free_requested", 10, 256)], {10: 256, 20: 512})
    assert (peak, at) == (768, -1) and set(live) == {10, 20}


def test_blocks_before_the_trace_are_the_freed_unallocated_and_the_untouched_live_ones():
    trace = [ev("free_requested", 1000, 512), ev("alloc", 2000, 512), ev("alloc", 1000, 1024)]
    snapshot = {"segments": [{"device": 0, "address": 1000, "blocks": [
        {"size": 1024, "state": "active_allocated"}, {"size": 512, "state": "inactive"},
        {"size": 512, "state": "active_allocated"}, {"size": 2048, "state": "active_pending_free"}]},
        {"device": 1, "address": 9000, "blocks": [{"size": 512, "state": "active_allocated"}]}]}
    # 1000: freed before the trace allocated it (512), then re-allocated (its live block is the trace's);
    # 2024 is inactive; 2536 and 3048 were live and never touched; device 1 is another device's
    assert memory_peak.blocks_before(snapshot, trace, 0) == {1000: 512, 2536: 512, 3048: 2048}


def test_attribute_names_held_tensors_by_the_block_their_data_starts_in():
    live = {1000: (4096, "a.py:1 f"), 8000: (512, "a.py:1 f"), 9000: (1024, "b.py:2 g")}
    held = [(1000, "fp32 masters"), (1512, "fp32 masters"), (9100, "optimizer state")]
    assert memory_peak.attribute(live, held) == {"fp32 masters": {"bytes": 4096, "blocks": 1},
                                                 "optimizer state": {"bytes": 1024, "blocks": 1},
                                                 "a.py:1 f": {"bytes": 512, "blocks": 1}}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so_in_one_line():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_peak.py"), "--smoke"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ("spartron: error: memory_peak records the CUDA allocator's history: "
                                   "no CUDA device here")
