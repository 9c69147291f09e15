"""What the rehearsal report and --suggest file each collective as, and what they count (audit F1, F2, F3, F5).

The category comes from what the caller says a collective is for (spartron.comm.labelled, the collectives'
`purpose`), never from its group: with fsdp = 1 CP's group is FSDP's group object."""

from __future__ import annotations

from pathlib import Path

import pytest

from spartron.checkpointing import replays
from spartron.launch.rehearse import run_rehearsal
from spartron.launch.rehearse_report import build_report, render
from spartron.launch.suggest import layout_config, modelled_traffic
from spartron.runtime.config import load_config
from spartron.runtime.linktable import ClusterConfig

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def _rows(report: dict) -> list[tuple]:
    return [(d["category"], d["kind"], d["purpose"], d["group"], d["calls"], d["bytes"])
            for d in report["headline"]["comm_detail"]]


def test_cp_over_the_fsdp_group_files_fsdp_traffic_as_fsdp_and_every_step_all_reduce():
    """cp 2, fsdp 1 on 2 ranks: CP's group is the FSDP shard group (default_pg). FSDP2's parameter all-gathers
    and gradient reduce-scatters were filed as "cp" (exposed) while the table said fsdp was hidden; the loss
    normalisation's and the SIGTERM agreement's all-reduces (outside the phase marks) were missing. The bytes
    are what a real 2-rank gloo run of this layout moves (the audit's realrun.py: 9 all-reduces, 620 B)."""
    cfg = load_config(TINY, ["parallel.cp=2", "train.global_batch_size=2"])
    report = build_report(run_rehearsal(cfg, 2, 0, 1, balanced=True), ClusterConfig())
    assert _rows(report) == [
        ("cp", "all_gather", "cp_sequence", "default_pg", 18.0, 147456.0),
        ("cp", "reduce_scatter", "cp_sequence", "default_pg", 12.0, 122880.0),
        ("fsdp", "all_gather", "", "default_pg", 50.0, 7725824.0),
        ("fsdp", "reduce_scatter", "", "default_pg", 12.0, 1895936.0),
        ("other", "all_reduce", "expert_bias", "default_pg", 4.0, 256.0),
        ("other", "all_reduce", "grad_norm", "default_pg", 1.0, 4.0),
        ("other", "all_reduce", "loss_norm", "default_pg", 1.0, 12.0),
        ("other", "all_reduce", "step_stats", "default_pg", 2.0, 344.0),
        ("other", "all_reduce", "stop_agreement", "default_pg", 1.0, 4.0),
    ]
    head = report["headline"]
    assert {c: head["comm"][c]["bytes"] for c in head["comm"]} == {"fsdp": 9621760.0, "ep": 0.0, "cp": 270336.0,
                                                                   "other": 620.0}
    fsdp = head["comm"]["fsdp"]["seconds"]
    comm = sum(c["seconds"] for c in head["comm"].values())
    assert head["headline"]["seconds"] == pytest.approx(max(head["compute_s"], fsdp) + comm - fsdp)
    text = render(report)
    assert "hidden under compute in the headline: fsdp)" in text
    assert "cp_sequence" in text and "stop_agreement" in text


def test_hsdp_all_reduce_is_fsdp_traffic_in_the_rehearsal_and_in_suggest():
    """dp_replicate 2 x fsdp 2: FSDP2 all-reduces each reduce-scattered gradient shard over the replicas. It
    was "other" (exposed) in the rehearsal and absent from --suggest; now both file it as fsdp (hidden: FSDP2
    runs it on its own stream right after each reduce-scatter in backward), as the reduce-scatter's bytes over
    the shard group's size, one call per reduce-scatter."""
    sets = ["train.global_batch_size=8", "parallel.dp_replicate=2", "parallel.fsdp=2"]
    report = build_report(run_rehearsal(load_config(TINY, sets), 4, 0, 1, balanced=True), ClusterConfig())
    rows = _rows(report)
    assert ("fsdp", "all_reduce", "", "dp_replicate", 12.0, 947968.0) in rows
    assert ("fsdp", "reduce_scatter", "", "fsdp", 12.0, 1895936.0) in rows
    assert [r for r in rows if r[0] == "other"] == [
        ("other", "all_reduce", "expert_bias", "default_pg", 4.0, 256.0),
        ("other", "all_reduce", "loss_norm", "default_pg", 1.0, 12.0),
        ("other", "all_reduce", "step_stats", "default_pg", 2.0, 344.0),
        ("other", "all_reduce", "stop_agreement", "default_pg", 1.0, 4.0),
        ("other", "all_reduce", "grad_norm", "fsdp", 1.0, 4.0),
    ]
    cfg = layout_config(load_config(TINY, sets), 1, 1, "none")
    traffic = modelled_traffic(cfg, 4)
    scatters = [(t.calls, t.bytes) for t in traffic if t.kind == "reduce_scatter" and t.category == "fsdp"]
    hsdp = [(t.category, t.group, t.calls, t.bytes) for t in traffic if t.kind == "all_reduce"]
    # the weight-shared MTP block's layer (depth 2) counted at each depth as it runs, and only the gradients that
    # exist (the frozen indexers' stay None) reduce-scattered (outside audit F10): the rehearsal's bytes exactly
    assert scatters == [(7, 912896), (5, 983040)] and sum(b for _, b in scatters) == 1895936
    assert hsdp == [("fsdp", "dp_replicate", 7, 456448.0), ("fsdp", "dp_replicate", 5, 491520.0)]
    assert sum(t[3] for t in hsdp) == 947968
    unreplicated = layout_config(load_config(TINY, ["train.global_batch_size=8"]), 1, 1, "none")
    assert [t for t in modelled_traffic(unreplicated, 4) if t.kind == "all_reduce"] == []


def test_suggest_replays_the_collectives_that_the_checkpoint_policy_replays():
    """Selective AC's default targets keep distributed communication: its all-to-alls and CP all-gathers are
    not replayed (a rehearsal of selective AC runs as many all-to-alls as without AC). --suggest counted them
    again under any AC mode: its selective EP bytes were 1.5x what a rehearsal measures."""
    assert not replays("spartron_collectives::all_to_all", "selective")
    assert replays("spartron_collectives::all_to_all", "full")
    assert not replays("spartron_collectives::all_to_all", "none")
    assert replays("spartron_collectives::all_to_all", "selective", ["aten::mm"])
    assert not replays("spartron_deepep::dispatch", "full")  # mandatory: never replayed

    def comm(ep: int, cp: int, mode: str, kind: str) -> tuple[float, float]:
        cfg = layout_config(load_config(TINY, ["train.global_batch_size=8"]), ep, cp, mode)
        return next((t.calls, t.bytes) for t in modelled_traffic(cfg, 4) if t.kind == kind and t.category != "fsdp")

    assert comm(2, 1, "none", "all_to_all") == comm(2, 1, "selective", "all_to_all") == (40.0, 1310720.0)
    assert comm(2, 1, "full", "all_to_all") == (60.0, 1966080.0)
    assert comm(1, 2, "none", "all_gather") == comm(1, 2, "selective", "all_gather") == (16.0, 163840.0)
    assert comm(1, 2, "full", "all_gather") == (32.0, 327680.0)
