"""`spartron rehearse` on CPU: the tiny preset's rank 3 of 8 (FSDP 8, EP 2) holds the planner's parameter bytes
and reports finite, modelled communication by group; a mirrored rank's forward equals a real gloo run's
(FSDP 2 and FSDP 4, 2 and 4 ranks) whose ranks hold identical shards and tokens; what a mirrored rank cannot
run is refused by key; two rehearsals in one process give what two fresh processes give."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from spartron.comm.mirror import mirrored_world
from spartron.launch.rehearse import rehearsal_config, run_rehearsal
from spartron.launch.rehearse_report import build_report, render
from spartron.layers.costs import state_bytes_per_rank
from spartron.parallel.groups import ParallelGroups
from spartron.runtime.config import ConfigError, load_config
from spartron.runtime.linktable import ClusterConfig, LinkConfig, collective_time
from spartron.runtime.rank_setup import default_model_factory
from spartron.testing import run_distributed

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
WORLD8 = ["parallel.ep=2", "train.global_batch_size=32", "train.seq_len=32", "train.peak_tflops=1.0"]


def test_tiny_rank_of_8_holds_the_planners_parameter_bytes_and_models_its_communication():
    cfg = load_config(TINY, WORLD8)
    measured = run_rehearsal(cfg, 8, 3, 2, balanced=False)
    report = build_report(measured, ClusterConfig())
    dims = cfg.parallel.dims(8)
    assert (dims.fsdp, dims.ep, dims.expert_fsdp) == (8, 2, 4)
    planned = state_bytes_per_rank(cfg.model, dims, cfg.train.optimizer, 3)["parameters"]
    assert report["planner"]["measured_parameter_bytes"] == planned == report["planner"]["parameter_bytes"]
    assert report["micro_batches"] == {"per_step": 4, "rehearsed": 2}
    assert (report["device"], report["device_name"], report["torch"]) == ("cpu", "cpu", torch.__version__)
    head = report["headline"]
    assert torch.isfinite(torch.tensor(head["loss"]))
    # FSDP all-gathers and reduce-scatters, EP all-to-alls; a CPU run's 8 ranks sit in one HGX node
    assert head["comm"]["fsdp"]["bytes"] > 0 and head["comm"]["ep"]["bytes"] > 0 and head["comm"]["cp"]["bytes"] == 0
    assert {d["link"] for d in head["comm_detail"]} == {"nvlink"}
    ep = [d for d in head["comm_detail"] if d["kind"] == "all_to_all"]
    assert [(d["group"], d["group_size"], d["category"]) for d in ep] == [("ep", 2, "ep")]
    # the experts reduce with SUM then divide: torch 2.11's PREMUL_SUM hides its factor from the mirror
    ops = {(d["kind"], d["group"]): d["reduce_ops"] for d in head["comm_detail"]}
    assert ops[("reduce_scatter", "expert_fsdp")] == ["SUM"] and ops[("reduce_scatter", "default_pg")] == ["AVG"]
    # the headline hides FSDP under compute (no intra-layer micro-batches: the all-to-alls stay exposed)
    comm = sum(c["seconds"] for c in head["comm"].values())
    assert head["no_overlap"]["seconds"] == pytest.approx(head["compute_s"] + comm)
    assert head["headline"]["seconds"] == pytest.approx(max(head["compute_s"], head["comm"]["fsdp"]["seconds"])
                                                        + comm - head["comm"]["fsdp"]["seconds"])
    assert head["compute_only"]["mfu"] == pytest.approx(head["headline"]["mfu"] * head["headline"]["seconds"]
                                                        / head["compute_s"])
    assert 0 < head["optimizer_s"] < head["compute_s"]  # the step's last stretch: clip + optimizer step
    text = render(report)
    assert "tiny rank 3 of 8" in text and "planner: predicted peak" in text and "(compute)" in text
    # a first step that ran one-time work is said to have: here its measured stretches made 10x the last step's
    first, last = report["steps"][0]["compute_s"], report["steps"][-1]["compute_s"]
    assert len([n for n in report["notes"] if "one-time work" in n]) == int(first > 2 * last)
    for seg in measured["steps"][0]["segments"]:
        seg.seconds *= 10 * max(1.0, last / first)
    slow = build_report(measured, ClusterConfig())
    first = slow["steps"][0]["compute_s"]
    assert slow["notes"][-1] == (f"step 1's compute ({first:.1f} s) is {first / last:.0f}x step 2's: it ran one-time "
                                 "work (compiles, kernels built at first use, autotuning); the headline is step 2")
    assert "note: step 1's compute" in render(slow)


def test_report_file_names_the_commit_the_config_file_and_overrides_and_the_wall_time(tmp_path, capsys):
    """What reproduces a report travels in it: a suggested layout is the preset plus --set values, and its JSON
    named only the config's name (the results filing added commit and wall time by hand)."""
    from spartron.launch.cli import main
    from spartron.runtime.metrics import git_commit

    out = tmp_path / "r.json"
    sets = [x for s in WORLD8 for x in ("--set", s)]
    assert main(["rehearse", str(TINY), "--world-size", "8", "--steps", "1", *sets, "--out", str(out)]) == 0
    assert "tiny rank 0 of 8" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["commit"] == git_commit()
    assert (report["config_path"], report["overrides"]) == (str(TINY), WORLD8)
    assert report["setup_s"] < report["wall_s"] < 600
    again = load_config(report["config_path"], report["overrides"])
    assert again.model_dump() == load_config(TINY, WORLD8).model_dump()


def test_rehearsal_runs_in_the_ranks_launch_env(tmp_path, monkeypatch):
    """launch.env is the ranks' environment (`spartron train` sets it in its process, the job script exports it);
    a rehearsal left it out, so an allocator setting it names (PYTORCH_CUDA_ALLOC_CONF, which the report's
    allocator-retry note suggests) could not be rehearsed."""
    from spartron.launch.cli import main

    monkeypatch.setenv("SPARTRON_REHEARSE_ENV_PROBE", "before")
    sets = [x for s in [*WORLD8, 'launch.env={SPARTRON_REHEARSE_ENV_PROBE = "from launch.env"}'] for x in ("--set", s)]
    assert main(["rehearse", str(TINY), "--world-size", "8", "--steps", "1", *sets]) == 0
    assert os.environ["SPARTRON_REHEARSE_ENV_PROBE"] == "from launch.env"


def test_profiled_rehearsal_lists_the_ops_of_one_more_step_and_reports_only_the_rehearsed_ones():
    cfg = load_config(TINY, WORLD8)
    measured = run_rehearsal(cfg, 8, 3, 1, balanced=True, profile=True)
    report = build_report(measured, ClusterConfig())
    assert [s["step"] for s in report["steps"]] == [1]  # the profiled step is not a reported one
    kernels = report["kernels"]
    assert kernels["what"] == "CPU ops (self time)"
    names = [r["name"] for r in kernels["top"]]
    assert len(names) == len(set(names)) > 0 and any(n in names for n in ("aten::mm", "aten::addmm", "aten::bmm"))
    ms = [r["ms"] for r in kernels["top"]]
    assert ms == sorted(ms, reverse=True) and 0 < sum(ms) <= kernels["device_ms"] + 1e-9
    assert all(r["calls"] >= 1 for r in kernels["top"])
    assert "profiled step (one more, not reported)" in render(report)
    assert build_report(run_rehearsal(cfg, 8, 3, 1, balanced=True), ClusterConfig())["kernels"] is None


def test_compiled_rehearsal_is_refused_on_a_torch_whose_dynamo_cannot_trace_the_mirror():
    from spartron.launch.rehearse import check_rehearsable

    cfg = load_config(TINY, [*WORLD8, "train.compile=true"])
    with pytest.raises(ConfigError, match=r"^train.compile = true cannot be rehearsed on torch 2.11.0\+cu130: its "
                                          r"dynamo cannot trace .* \(torch >= 2.13 can\); rehearse with --set "
                                          r"train.compile=false$"):
        check_rehearsable(cfg, "2.11.0+cu130")
    check_rehearsable(cfg, "2.13.0")  # compiled rehearsals run there (the tiny rank of 8, CP 1 and 2, on CPU)
    check_rehearsable(load_config(TINY, WORLD8), "2.11.0")  # eager rehearsals run on any supported torch


def test_link_table_classes_and_factors():
    c = ClusterConfig(nvlink=LinkConfig(busbw_gbps=100.0, latency_us=0.0),
                      network=LinkConfig(busbw_gbps=10.0, latency_us=0.0),
                      nvlink_all_to_all=LinkConfig(busbw_gbps=50.0, latency_us=0.0),
                      network_all_to_all=LinkConfig(busbw_gbps=10.0, latency_us=1.0))
    inside = collective_time(c, "all_gather", range(8), 1, 8 * 10**9, 0, 8)
    assert (inside.link, inside.seconds) == ("nvlink", pytest.approx(0.07))  # 8 GB x 7/8 at 100 GB/s
    # a ring over 2 nodes, 8 members each: 8/15 of the bus volume enters the node through 8 NICs at 10 GB/s
    # (1 GB x 2 x 15/16 x 8/15 / 80 GB/s = 0.0125 s); its NVLink hops carry it all (0.01875 s) and set the time
    across = collective_time(c, "all_reduce", range(16), 1, 10**9, 0, 8)
    assert (across.link, across.seconds) == ("nvlink+network", pytest.approx(2 * 15 / 16 / 100))
    slow = c.model_copy(update={"network": LinkConfig(busbw_gbps=1.0, latency_us=0.0)})
    ring = collective_time(slow, "all_gather", range(16), 1, 16 * 10**9, 3, 8)  # 16 GB x 15/16 x 8/15 / 8 GB/s
    assert (ring.link, ring.seconds) == ("nvlink+network", pytest.approx(1.0))
    strided = collective_time(c, "reduce_scatter", range(0, 32, 8), 1, 4 * 10**9, 8, 8)  # one member per node
    assert (strided.link, strided.seconds) == ("network", pytest.approx(3e9 / 10e9))
    a2a = collective_time(c, "all_to_all", range(16), 2, 16 * 10**9, 0, 8)  # 7/16 over NVLink, 8/16 network
    assert (a2a.link, a2a.seconds) == ("nvlink+network", pytest.approx(2e-6 + 8e9 / 10e9))
    assert collective_time(c, "all_gather", [5], 3, 100, 5, 8).seconds == 0.0


def test_cluster_section_overrides_a_link_in_part_and_refuses_unknown_links():
    cfg = load_config(TINY, ["cluster.network.busbw_gbps=25.0"])
    assert (cfg.cluster.network.busbw_gbps, cfg.cluster.network.latency_us) == (25.0, 30.0)
    assert cfg.cluster.nvlink == ClusterConfig().nvlink
    with pytest.raises(ConfigError, match=r"cluster.infiniband: unknown key"):
        load_config(TINY, ["cluster.infiniband.busbw_gbps=1.0"])
    with pytest.raises(ConfigError, match=r"cluster.nvlink_all_to_all.latency_us: Input should be greater than or"):
        load_config(TINY, ["cluster.nvlink_all_to_all.latency_us=-1.0"])


def test_what_a_mirrored_rank_cannot_run_is_refused_by_key():
    cfg = load_config(TINY, ["parallel.ep=2"])
    # built without validation: the dispatcher's own checks (DeepEP importable, CUDA) would refuse it first here
    deepep = cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"moe": cfg.model.moe.model_copy(update={"dispatcher": "deepep"})})})
    with pytest.raises(ConfigError, match=r"^model.moe.dispatcher = 'deepep' cannot be rehearsed: DeepEP's buffers"):
        rehearsal_config(deepep, 8, 1, "/tmp/unused")
    with pytest.raises(ConfigError, match=r"^--steps must be >= 1, got 0"):
        rehearsal_config(cfg, 8, 0, "/tmp/unused")


def _shard0_forward(rank: int, world: int, overrides: list[str]) -> float:
    """The loss of the tiny model on fixed tokens, every rank holding rank 0's parameter shards."""
    cfg = load_config(TINY, overrides)
    groups = ParallelGroups.build(cfg.parallel.dims(world), "cpu")
    model = default_model_factory(cfg, groups)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            rows0 = -(-p.shape[0] // world) if isinstance(p, DTensor) else local.shape[0]  # rank 0's shard rows
            buf = local.new_zeros(rows0, *local.shape[1:])
            if rank == 0:
                buf.copy_(local)
            dist.broadcast(buf, src=0)
            local.copy_(buf[: local.shape[0]])
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return float(model(tokens, tokens.roll(-1, dims=1))["loss"])


@pytest.mark.parametrize("world", [2, 4])
def test_mirrored_forward_equals_a_real_identical_data_run(world):
    overrides = ["train.seq_len=32", f"parallel.fsdp={world}"]
    real = run_distributed(_shard0_forward, world, overrides, timeout=600)
    assert real == [real[0]] * world
    with mirrored_world(0, world):
        mirrored = _shard0_forward(0, world, overrides)
    assert mirrored == pytest.approx(real[0], rel=1e-6, abs=1e-6)


WORLD16 = ["parallel.ep=2", "train.global_batch_size=16", "train.seq_len=32", "train.peak_tflops=1.0"]


def _rehearsed(world: int, rank: int) -> dict:
    """What a one-step rehearsal of the tiny preset measures that must not depend on the process's history."""
    out = run_rehearsal(load_config(TINY, WORLD16), world, rank, 1, balanced=False)
    (step,) = out["steps"]
    comm = [[s.name, [[r.kind, r.group, r.size, r.calls, r.bytes] for r in s.records]] for s in step["segments"]]
    return {"param_bytes": out["param_bytes"], "loss": step["record"]["loss"],
            "grad_norm": step["record"]["grad_norm"], "comm": comm}


def test_two_rehearsals_in_one_process_equal_fresh_processes():
    """Rank 13 then rank 0 of 16 (FSDP 16: rank 0 holds a row of the router's [8, 64] weight, rank 13 none) in this
    process; the second once picked up the first's DeviceMesh and failed ([1, 64] vs [0, 64] in materialize_)."""
    here = [_rehearsed(16, 13), _rehearsed(16, 0)]
    fresh = [json.loads(subprocess.run([sys.executable, __file__, "16", str(rank)], capture_output=True, text=True,
                                       check=True, timeout=600).stdout.splitlines()[-1]) for rank in (13, 0)]
    assert here == fresh
    assert [h["param_bytes"] for h in here] == [state_bytes_per_rank(load_config(TINY, WORLD16).model,
                                                                    load_config(TINY, WORLD16).parallel.dims(16),
                                                                    "adamw", r)["parameters"] for r in (13, 0)]


if __name__ == "__main__":  # one rehearsal in a fresh process (the test above)
    print(json.dumps(_rehearsed(int(sys.argv[1]), int(sys.argv[2]))))
