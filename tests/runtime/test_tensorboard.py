"""Observability (`[observe]`, spartron.runtime.observe / tensorboard): TensorBoard event files hold the
step records' values under their tags, the startup banner, progress lines on long phases, the OOM
path, the NCCL flight-recorder environment of both launchers, and config errors naming the key."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from spartron.launch.slurm import render_job
from spartron.layers.costs import count_parameters, state_bytes_per_rank
from spartron.parallel.dims import ParallelDims
from spartron.runtime.config import ConfigError, load_config
from spartron.runtime.memory import plan_memory
from spartron.runtime.metrics import read_metrics
from spartron.runtime.observe import Heartbeat, ObserveConfig, RunObserver, banner, launch_env
from spartron.runtime.tensorboard import scalars
from spartron.runtime.trainer import train
from spartron.testing import run_distributed

SMALL = ["model.n_layers=2", "model.mtp.depth=1", "train.seq_len=16", "train.global_batch_size=2",
         "train.progress=false", "train.peak_tflops=1.0", "ac.mode='none'"]


def small_cfg(run_dir, *overrides):
    return load_config("configs/tiny.toml", [*SMALL, f"train.run_dir={json.dumps(str(run_dir))}", *overrides])


def _train(rank, world, cfg):
    train(cfg)


def _events(run_dir: Path):  # noqa: ANN202
    # imported here: the GPU image has no tensorboard, and the file's GPU test needs none
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_tensorboard_scalars_equal_the_metrics_records(tmp_path):
    run_dir = tmp_path / "r"
    cfg = small_cfg(run_dir, "train.steps=3", "train.eval_every=2", "observe.tensorboard=true")
    run_distributed(_train, 2, cfg, timeout=120)
    _, steps = read_metrics(run_dir / "metrics.jsonl")
    acc = _events(run_dir)
    tags = set(acc.Tags()["scalars"])
    n_moe = len(steps[0]["expert_load_per_layer"])
    assert n_moe == 2  # one MoE layer in the stack (first_k_dense = 1) and the MTP block's
    assert {"train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_s", "perf/mfu", "memory/peak_allocated_gb",
            "moe/load_max_violation", "moe/layer_0/load_violation", "moe/layer_1/load_violation",
            "train/mtp_loss_1", "val/loss", "val/perplexity"} <= tags
    for tag, key in (("train/loss", "loss"), ("train/grad_norm", "grad_norm"), ("perf/tokens_per_s", "tokens_per_s")):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [1, 2, 3]
        assert [e.value for e in events] == pytest.approx([s[key] for s in steps], rel=1e-6)  # stored as float32
    assert [e.step for e in acc.Scalars("val/loss")] == [2, 3]
    assert [e.value for e in acc.Scalars("val/loss")] == pytest.approx([steps[1]["val_loss"], steps[2]["val_loss"]],
                                                                       rel=1e-6)
    assert max(steps[0]["expert_load_per_layer"]) == steps[0]["expert_load_max_violation"]
    assert all(0 < s["data_time_s"] < s["step_time_s"] and s["alloc_retries"] is None for s in steps)  # CPU
    assert [e.value for e in acc.Scalars("perf/data_time_s")] == pytest.approx([s["data_time_s"] for s in steps],
                                                                              rel=1e-6)
    assert acc.Tags()["histograms"] == ["moe/load_violation_over_layers"]


def test_scalars_table():
    record = {"type": "step", "step": 4, "loss": 2.5, "grad_norm": None, "peak_memory_allocated_bytes": 3e9,
              "mtp_losses": [1.0, 0.5], "expert_load_per_layer": [0.25, 0.0]}
    assert scalars(record) == {"train/loss": 2.5, "memory/peak_allocated_gb": 3.0, "train/mtp_loss_1": 1.0,
                               "train/mtp_loss_2": 0.5, "moe/layer_0/load_violation": 0.25,
                               "moe/layer_1/load_violation": 0.0}


def test_banner_names_counts_layout_memory_and_outputs(tmp_path):
    cfg = small_cfg(tmp_path / "r", "train.save_every=2", "train.eval_every=5", "observe.tensorboard=true")
    model = torch.nn.Linear(10, 10)  # the per-rank count is the built model's own: 110
    dims = ParallelDims(world_size=2, fsdp=2)
    plan = plan_memory(cfg, 2)
    lines = banner(cfg, dims, model, tmp_path / "r", None, plan).splitlines()
    total = count_parameters(cfg.model)
    assert lines[0] == "spartron: run 'tiny': 5 steps of 2 x 16 tokens, from seed 0"
    assert lines[1].startswith(f"  parameters   {total.total / 1e3:.2f}K total, ")
    assert lines[1].endswith(", 110 on rank 0")
    assert lines[2] == f"  layout       {dims.describe()}"
    state = state_bytes_per_rank(cfg.model, dims, cfg.train.optimizer)["total"]
    assert lines[3] == (f"  memory/rank  predicted peak {plan.peak / 2**30:.3f} GiB at {plan.phase}, of which "
                        f"{state / 2**30:.3f} GiB parameters, gradients and optimizer state (cost model)")
    assert "predicted" not in banner(cfg, dims, model, tmp_path / "r", None).splitlines()[3]
    assert lines[4] == "  evaluation   every 5 steps on 2 held-out sequences"
    r = tmp_path / "r"
    assert lines[5] == (f"  outputs      metrics {r / 'metrics.jsonl'}; saved steps {r}/step-* every 2; "
                        f"rank logs {r / 'logs'}; tensorboard {r / 'tensorboard'}")
    active = total.dense + total.experts * cfg.model.moe.top_k // cfg.model.moe.n_routed_experts
    assert f", {active / 1e3:.2f}K active per token" in lines[1]


def test_heartbeat_says_how_long_a_long_phase_runs():
    lines: list[str] = []
    beat = Heartbeat(0.2, enabled=True, say=lines.append)
    try:
        with beat.phase("step 7"):
            time.sleep(0.9)
        said = len(lines)
        time.sleep(0.5)  # no phase: nothing more
        assert len(lines) == said
        with beat.phase("saving step 7"):
            time.sleep(0.05)  # shorter than every_s: nothing
    finally:
        beat.close()
    assert 1 <= said <= 4 and len(lines) == said
    assert all(line.startswith("spartron: step 7 running for ") and line.endswith(" s") for line in lines)
    quiet: list[str] = []
    off = Heartbeat(0.2, enabled=False, say=quiet.append)
    with off.phase("step 1"):
        time.sleep(0.3)
    off.close()
    assert quiet == []


def test_out_of_memory_passes_through_and_records_no_snapshot_on_cpu(tmp_path):
    observer = RunObserver(ObserveConfig(progress_every_s=0), tmp_path, 0, torch.device("cpu"), {})
    with pytest.raises(torch.OutOfMemoryError), observer.phase("step 3", 3):
        raise torch.OutOfMemoryError("out of memory")
    observer.close()
    assert observer.snapshots == [] and not (tmp_path / "memory").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator snapshot is a CUDA feature")
def test_out_of_memory_dumps_an_allocator_snapshot_on_cuda(tmp_path):
    cfg = ObserveConfig(memory_snapshot_on_oom=True, progress_every_s=0)
    observer = RunObserver(cfg, tmp_path, 0, torch.device("cuda"), {})
    keep = torch.empty(2**20, device="cuda")
    with pytest.raises(torch.OutOfMemoryError), observer.phase("step 3", 3):
        torch.empty(2**50, device="cuda")
    observer.close()
    assert observer.snapshots == [tmp_path / "memory" / "oom-rank0-step3.pickle"]
    assert observer.snapshots[0].stat().st_size > 0
    del keep


def test_nccl_flight_recorder_env_in_both_launchers(tmp_path):
    run_dir = tmp_path / "r"
    assert launch_env(ObserveConfig(), run_dir) == {}
    env = launch_env(ObserveConfig(nccl_flight_recorder=2000), run_dir)
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(run_dir / "nccl_trace" / "rank_")}
    cfg = load_config("configs/tiny.toml", ["device='cuda'", "observe.nccl_flight_recorder=2000",
                                            "launch.gpus_per_node=8", f"train.run_dir={json.dumps(str(run_dir))}"])
    RunObserver(cfg.observe, run_dir, 1, torch.device("cpu"), {}).close()  # the dump folder exists before a timeout
    assert (run_dir / "nccl_trace").is_dir()
    script = render_job(cfg, tmp_path).script
    assert "export TORCH_NCCL_TRACE_BUFFER_SIZE=2000\n" in script
    assert f"export TORCH_NCCL_DEBUG_INFO_TEMP_FILE={run_dir / 'nccl_trace' / 'rank_'}\n" in script


@pytest.mark.parametrize("overrides, message", [
    (["observe.wandb_project='p'"], "observe.wandb_project needs the Python package 'wandb', which is not installed: "
                                    "pip install wandb (or remove observe.wandb_project)"),
    (["observe.wandb_entity='me'"], "observe.wandb_entity is set but observe.wandb_project is not"),
    (["observe.memory_history_entries=10", "device='cuda'"],
     "observe.memory_history_entries is set but observe.memory_snapshot_on_oom = false"),
    (["observe.memory_snapshot_on_oom=true"], "observe.memory_snapshot_on_oom records the CUDA allocator's history, "
                                              "but device = 'cpu'"),
    (["observe.nccl_flight_recorder=100"], "observe.nccl_flight_recorder records NCCL collectives, but this run "
                                           "uses gloo"),
    (["observe.progress_every_s=-1"], "observe.progress_every_s: Input should be greater than or equal to 0"),
    (["launch.env.TORCH_NCCL_TRACE_BUFFER_SIZE='100'"], "launch.env: TORCH_NCCL_TRACE_BUFFER_SIZE is set by the "
                                                        "launchers from observe.nccl_flight_recorder"),
])
def test_observe_config_errors_name_the_key(overrides, message):
    if any("wandb_project" in o for o in overrides) and importlib.util.find_spec("wandb"):
        pytest.skip("wandb is installed here: the missing-package error cannot happen")
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.toml", overrides)
    assert message in str(info.value)


STUB_WANDB = '''
calls = []


class Run:
    def log(self, values, step):
        calls.append(("log", values, step))

    def finish(self):
        calls.append(("finish",))


def init(**kwargs):
    calls.append(("init", kwargs))
    return Run()
'''


def test_wandb_gets_the_same_scalars_when_configured(tmp_path, monkeypatch):
    """With a package named wandb importable (a stand-in written here: the real one is not a dependency),
    observe.wandb_project validates and the sink logs each step's scalars under the TensorBoard tags."""
    (tmp_path / "site" / "wandb").mkdir(parents=True)
    (tmp_path / "site" / "wandb" / "__init__.py").write_text(STUB_WANDB)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    cfg = load_config("configs/tiny.toml", ["observe.wandb_project='spartron-test'", "observe.wandb_mode='offline'"])
    from spartron.runtime.tensorboard import MetricSinks

    sinks = MetricSinks(cfg.observe, tmp_path / "run", {"name": "tiny"})
    record = {"type": "step", "step": 3, "loss": 2.0, "lr": 1e-3, "expert_load_per_layer": [0.5]}
    sinks.write(record)
    sinks.write({"type": "header"})  # not a step: nothing logged
    sinks.close()
    wandb = sys.modules.pop("wandb")  # the stand-in leaves no trace for other tests

    assert wandb.calls == [
        ("init", {"project": "spartron-test", "entity": None, "mode": "offline", "dir": str(tmp_path / "run"),
                  "name": "run", "config": {"name": "tiny"}, "resume": "allow"}),
        ("log", scalars(record), 3), ("finish",)]
    assert scalars(record) == {"train/loss": 2.0, "train/lr": 1e-3, "moe/layer_0/load_violation": 0.5}


def test_rank_0_prints_the_banner_before_the_first_step(tmp_path, capfd):
    cfg = small_cfg(tmp_path / "r", "train.steps=1", "train.progress=true")
    run_distributed(_train, 2, cfg, timeout=120)
    err = capfd.readouterr().err.splitlines()
    first = err.index("spartron: run 'tiny': 1 steps of 2 x 16 tokens, from seed 0")
    assert err[first + 2].startswith("  layout       world 2 = ")
    assert err[first + 5].startswith("  outputs      metrics ")
    (step_line,) = [i for i, line in enumerate(err) if line.startswith("step 1/1 loss ")]  # rank 0 only
    assert step_line > first + 5  # after the banner; between them at most progress lines of a slow first step
    assert all(line.startswith("spartron: step 1 running for ") for line in err[first + 6:step_line])
    assert sum(line.startswith("spartron: run 'tiny'") for line in err) == 1


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs tensorboard")
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # no writer thread's traceback
def test_a_tensorboard_write_error_names_the_folder(tmp_path, capfd):
    import resource
    import signal

    from spartron.runtime.metrics import MetricsWriteError
    from spartron.runtime.tensorboard import MetricSinks

    sinks = MetricSinks(ObserveConfig(tensorboard=True), tmp_path, {})
    sinks.write({"type": "step", "step": 1, "loss": 1.0})
    size = sum(p.stat().st_size for p in (tmp_path / "tensorboard").iterdir())
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, hard))  # the disk is full after this event file
    try:
        with pytest.raises(MetricsWriteError) as err:  # at once, on this thread: events are written synchronously
            sinks.write({"type": "step", "step": 2, "loss": 1.0})
        with pytest.raises(MetricsWriteError) as closing:  # the unwritten event: the same error, once more
            sinks.close()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert str(closing.value) == str(err.value)
    assert capfd.readouterr() == ("", "")  # no "Exception in thread ..." traceback
    assert str(err.value) == (f"{tmp_path / 'tensorboard'}: cannot write TensorBoard events (File too large): free "
                              "space on its disk, then resume the run")
