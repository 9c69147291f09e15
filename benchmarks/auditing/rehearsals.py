"""`spartron rehearse` (and its --suggest): hostile world sizes, ranks, steps, report paths (a missing folder,
a FIFO, a directory, a link), what a mirrored rank cannot run (DeepEP) and bad `[cluster]` link-table keys."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.auditing.core import Case, sets

W8 = ["--world-size", "8", *sets("parallel.ep=2", "train.global_batch_size=16", "train.seq_len=32")]


def _fifo(work: Path) -> None:
    os.mkfifo(work / "report.json")


def _link(work: Path) -> None:
    (work / "report.json").symlink_to(work.parent / "decoy" / "precious.txt")


def _only_report(case_dir: Path) -> str | None:
    own = ("r.json", "report.json")  # the report, and the FIFO / link a case sets up
    made = sorted(p.name for p in (case_dir / "work").iterdir() if p.name not in own)
    return f"rehearse wrote {made}" if made else None


def cases() -> list[Case]:
    out: list[Case] = []

    def add(cid, argv, names, category="values", accept_ok=False, **kw):
        out.append(Case(f"rehearse-{cid}", "rehearse", ["rehearse", "{tiny}", *argv], tuple(names),
                        category=category, accept_ok=accept_ok, harm=_only_report, timeout=kw.pop("timeout", 90.0),
                        **kw))

    add("tiny-8", [*W8, "--rank", "3", "--steps", "1", "--out", "{dir}/r.json"], (), accept_ok=True,
        expect_out="planner: predicted peak", timeout=400.0, note="rank 3 of 8 on CPU, JSON report written")
    add("world-0", ["--world-size", "0"], ["--world-size"], quick=True)
    add("world-neg", ["--world-size", "-8"], ["--world-size"])
    add("world-2-63", ["--world-size", str(2**63)], ["--world-size"], category="sizes")
    add("world-float", ["--world-size", "2.5"], ["--world-size"], category="dtypes")
    add("world-missing", [], ["--world-size"])
    add("rank-eq-world", ["--world-size", "8", "--rank", "8"], ["--rank"])
    add("rank-neg", ["--world-size", "8", "--rank", "-1"], ["--rank"])
    add("rank-nan", ["--world-size", "8", "--rank", "nan"], ["--rank"], category="nonfinite")
    add("steps-0", ["--world-size", "8", "--steps", "0"], ["--steps"])
    add("steps-huge", ["--world-size", "8", "--steps", str(2**63)], ["--steps"], category="sizes",
        accept_ok=False, timeout=60.0, note="a step count no rehearsal finishes must be refused, not started")
    add("out-missing-folder", ["--world-size", "8", "--out", "{dir}/nope/r.json"], ["--out", "nope"],
        category="paths")
    add("out-fifo", ["--world-size", "8", "--out", "{dir}/report.json"], ["--out", "report.json"],
        category="paths", setup=_fifo, timeout=60.0, note="writing a FIFO would block after the rehearsal")
    add("out-dir", ["--world-size", "8", "--out", "{dir}"], ["--out"], category="paths")
    add("out-link", ["--world-size", "8", "--out", "{dir}/report.json"], ["--out", "report.json"],
        category="paths", setup=_link, note="a link to a file elsewhere is not followed")
    add("deepep", [*W8, *sets("model.moe.dispatcher='deepep'")], ["model.moe.dispatcher"], quick=True)
    add("layout", ["--world-size", "6", *sets("parallel.ep=4")], ["parallel", "world"])
    add("cluster-unknown-link", ["--world-size", "8", *sets("cluster.infiniband.busbw_gbps=50.0")],
        ["cluster.infiniband"])
    add("cluster-zero-bw", ["--world-size", "8", *sets("cluster.nvlink.busbw_gbps=0.0")],
        ["cluster.nvlink.busbw_gbps"])
    add("cluster-nan-bw", ["--world-size", "8", *sets("cluster.network.busbw_gbps=nan")],
        ["cluster.network.busbw_gbps"], category="nonfinite")
    add("cluster-inf-latency", ["--world-size", "8", *sets("cluster.network_all_to_all.latency_us=inf")],
        ["cluster.network_all_to_all.latency_us"], category="nonfinite")
    add("cluster-str", ["--world-size", "8", *sets("cluster.nvlink='fast'")], ["cluster.nvlink"],
        category="dtypes")
    add("cluster-unknown-key", ["--world-size", "8", *sets("cluster.nvlink.bandwidth=1.0")],
        ["cluster.nvlink.bandwidth"])
    add("suggest", ["--world-size", "8", "--suggest", "--gpu-memory-gib", "80"], (), accept_ok=True,
        expect_out="rehearse the first: --set parallel.ep=")
    add("profile-tiny-8", [*W8, "--steps", "1", "--profile"], (), accept_ok=True, expect_out="profiled step",
        timeout=400.0, note="one more step under torch.profiler: its ops by time in the table")
    add("suggest-profile", ["--world-size", "8", "--suggest", "--gpu-memory-gib", "80", "--profile"],
        ["--profile", "--suggest"], note="a profile of nothing rehearsed is refused, not ignored")
    add("suggest-no-memory", ["--world-size", "8", "--suggest"], ["--gpu-memory-gib"])
    add("suggest-memory-inf", ["--world-size", "8", "--suggest", "--gpu-memory-gib", "inf"], ["--gpu-memory-gib"],
        category="nonfinite")
    add("suggest-mfu-nan", ["--world-size", "8", "--suggest", "--gpu-memory-gib", "80", "--mfu", "nan"],
        ["--mfu"], category="nonfinite")
    add("suggest-no-layout", ["--world-size", "7", "--suggest", "--gpu-memory-gib", "80"],
        ["--world-size", "train.global_batch_size", "world"], accept_ok=True,
        note="7 GPUs: EP 1 is still a layout if the batch divides")
    return out
