"""benchmarks/rehearse_sweep.py --smoke on CPU: the tiny preset at 1, 8 and 16 ranks; the layout whose planned
peak exceeds the device is reported with the planner's answer and not rehearsed, the others carry measured
memory, communication and predicted throughput; a second invocation replaces its entries; the PNG is written."""

from __future__ import annotations

import json

from benchmarks.rehearse_sweep import SMOKE, main
from spartron.runtime.config import load_config
from spartron.runtime.memory import plan_memory


def test_smoke_sweep_rehearses_what_fits_and_reports_the_planner_for_the_rest(tmp_path):
    peaks = {w: plan_memory(load_config(cfg, sets), w).peak for cfg, w, sets in SMOKE.values()}
    assert peaks[1] > peaks[8] >= peaks[16]
    device_gib = (peaks[1] + peaks[8]) / 2 / 2**30  # world 1 does not fit, 8 and 16 do
    out = tmp_path / "sweep.json"
    argv = ["--smoke", "--steps", "1", "--gpu-memory-gib", str(device_gib), "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    by_world = {e["world_size"]: e for e in data["entries"]}
    assert sorted(by_world) == [1, 8, 16]
    one = by_world[1]
    assert one["rehearsed"] is False and one["planner_peak_bytes"] == peaks[1]
    assert one["note"].startswith("not rehearsed: the planner puts rank 0 at")
    for w in (8, 16):
        e = by_world[w]
        assert e["rehearsed"] is True and e["planner_peak_bytes"] == peaks[w]
        assert e["comm"]["fsdp"]["bytes"] > 0 and e["comm"]["ep"]["bytes"] > 0 and e["tokens_per_s_per_gpu"] > 0
        assert e["layout"].startswith(f"world {w} = dp_replicate 1 x fsdp {w} x cp 1; ep 2")
    # FSDP 16 holds half of FSDP 8's dense shard: fewer parameter bytes per rank
    assert by_world[16]["parameter_bytes"] < by_world[8]["parameter_bytes"]
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert main(argv) == 0  # entries of the same case / world / seq_len are replaced, not added
    assert len(json.loads(out.read_text())["entries"]) == 3
