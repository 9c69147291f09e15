"""`spartron rehearse --suggest`: every layout's peak is the planner's own number for that layout, what fits
comes first and fastest first, the modelled compute is the cost model's FLOPs at the given MFU, and a
missing device memory is one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spartron.launch.cli import main
from spartron.launch.suggest import layout_config, modelled_step, refused_layouts, replayed_flops, suggest
from spartron.layers.costs import training_flop_parts
from spartron.runtime.config import ConfigError, load_config
from spartron.runtime.linktable import ClusterConfig
from spartron.runtime.memory import plan_memory

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
SETS = ["train.global_batch_size=32", "train.seq_len=64"]


def test_suggest_rows_carry_the_planners_peak_and_sort_fitting_fastest_first():
    cfg = load_config(TINY, SETS)
    every = suggest(cfg, 8, 1 << 40, ClusterConfig(), 0.5, 10.0)
    assert {(r.ep, r.cp, r.ac_mode) for r in every} >= {(1, 1, "none"), (2, 1, "full"), (8, 8, "selective")}
    for r in every:
        assert r.peak_bytes == plan_memory(layout_config(cfg, r.ep, r.cp, r.ac_mode), 8).peak
    device = sorted(r.peak_bytes for r in every)[len(every) // 2]
    rows = suggest(cfg, 8, device, ClusterConfig(), 0.5, 10.0)
    assert [r.fits for r in rows] == sorted((r.peak_bytes <= device for r in rows), reverse=True)
    fitting = [r.tokens_per_s_per_gpu for r in rows if r.fits]
    assert fitting == sorted(fitting, reverse=True) and 0 < len(fitting) < len(rows)


def test_modelled_compute_is_the_cost_models_flops_at_the_given_mfu():
    cfg = layout_config(load_config(TINY, SETS), 2, 1, "full")
    compute, comm, step = modelled_step(cfg, 8, ClusterConfig(), 0.5, 10.0, 8)
    parts = training_flop_parts(cfg.model, 64)
    n_micro = cfg.train.micro_steps(cfg.parallel.dims(8).dp)
    assert replayed_flops(cfg, parts) == parts.total
    assert compute == pytest.approx(64 * n_micro * parts.total * 4 / 3 / (0.5 * 10e12))
    assert comm["cp"] == 0.0 and comm["ep"] > 0 and comm["fsdp"] > 0
    assert step == pytest.approx(max(compute, comm["fsdp"]) + comm["ep"])  # all-to-alls exposed, FSDP hidden
    none = layout_config(load_config(TINY, SETS), 2, 1, "none")
    assert modelled_step(none, 8, ClusterConfig(), 0.5, 10.0, 8)[0] == pytest.approx(compute * 3 / 4)


def test_suggest_command_prints_the_table_and_refuses_without_memory(capsys):
    assert main(["rehearse", str(TINY), "--world-size", "8", "--suggest", "--gpu-memory-gib", "64",
                 *(x for s in SETS for x in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert out.startswith("spartron rehearse --suggest: 8 GPUs of 64.0 GiB; compute modelled at 40% MFU")
    assert "rehearse the first: --set parallel.ep=" in out
    assert main(["rehearse", str(TINY), "--world-size", "8", "--suggest", "--gpu-memory-gib", "0.0001",
                 *(x for s in SETS for x in ("--set", s))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "no layout fits: more GPUs, offload (offload.enabled) or a shorter train.seq_len"
    assert not any(line.startswith(("rehearse the first", "the ranking models")) for line in out)
    assert main(["rehearse", str(TINY), "--world-size", "8", "--suggest", "--gpu-memory-gib", "64", "--profile"]) == 2
    assert capsys.readouterr().err == ("spartron: error: --profile profiles a rehearsed step; --suggest rehearses "
                                       "nothing\n")
    assert main(["rehearse", str(TINY), "--world-size", "8", "--suggest"]) == 2
    assert capsys.readouterr().err == ("spartron: error: --suggest needs --gpu-memory-gib in (0, 1048576] (the "
                                      "memory of one GPU), got None\n")
    assert main(["rehearse", str(TINY), "--world-size", "8", "--suggest", "--gpu-memory-gib", "inf"]) == 2
    assert "got inf" in capsys.readouterr().err


def test_fp8_dispatch_models_the_forward_dispatches_in_fp8_bytes():
    """Full AC: 6 all-to-alls a micro-batch per MoE layer, 2 of them forward dispatches; with model.fp8.dispatch
    those move dim + 4 * dim / 128 bytes a row, the other four 2 * dim (bf16). No latency: time is bytes."""
    flat = ClusterConfig.model_validate({k: {"latency_us": 0.0} for k in ("nvlink", "network", "nvlink_all_to_all",
                                                                         "network_all_to_all")})
    sets = [*SETS, 'model.dtype="bfloat16"', "model.dim=128", "model.moe.moe_inter_dim=128",
            "model.dense_inter_dim=128", "model.fp8.backend=reference", 'model.fp8.modules=["experts"]']
    bf16 = layout_config(load_config(TINY, sets), 2, 1, "full")
    fp8 = layout_config(load_config(TINY, [*sets, "model.fp8.dispatch=true", "parallel.ep=2"]), 2, 1, "full")
    ep_bf16 = modelled_step(bf16, 8, flat, 0.5, 10.0, 8)[1]["ep"]
    ep_fp8 = modelled_step(fp8, 8, flat, 0.5, 10.0, 8)[1]["ep"]
    assert ep_fp8 / ep_bf16 == pytest.approx((4 * 256 + 2 * (128 + 4)) / (6 * 256), rel=1e-6)
    # the last decoder layer kept in bf16 dispatches bf16 rows: 4 of the 5 MoE layers (3 decoder + 2 MTP) send FP8;
    # the first kept in bf16 is dense (first_k_dense 1): nothing changes
    for start, end, fp8_layers in ((0, 1, 4), (1, 0, 5)):
        kept = layout_config(load_config(TINY, [*sets, "model.fp8.dispatch=true", "parallel.ep=2",
                                                f"model.fp8.layers_at_start_in_bf16={start}",
                                                f"model.fp8.layers_at_end_in_bf16={end}"]), 2, 1, "full")
        wire = (fp8_layers * (128 + 4) + (5 - fp8_layers) * 256) / 5
        assert modelled_step(kept, 8, flat, 0.5, 10.0, 8)[1]["ep"] / ep_bf16 == pytest.approx(
            (4 * 256 + 2 * wire) / (6 * 256), rel=1e-6)


def test_every_ac_mode_is_suggested_for_a_preset_with_selective_targets_and_offload():
    """A preset's ac.targets (selective only) and offload (needs AC) must not make the other modes invalid
    and silently absent (the V3 preset listed selective layouts only before layout_config dropped them)."""
    cfg = load_config(TINY, [*SETS, 'ac.mode="selective"', 'ac.targets=["aten::mm"]', "offload.enabled=true"])
    rows = suggest(cfg, 8, 64 << 30, ClusterConfig(), 0.5, 10.0)
    assert {r.ac_mode for r in rows} == {"none", "selective", "full"}
    none = layout_config(cfg, 2, 1, "none")
    assert not none.offload.enabled and none.ac.targets is None
    full = layout_config(cfg, 2, 1, "full")
    assert full.offload.enabled and full.ac.targets is None
    assert layout_config(cfg, 2, 1, "selective").ac.targets == ["aten::mm"]


def test_the_printed_suggestion_is_a_command_that_loads_the_layout(tmp_path, capsys):
    """The line under the table must run as printed: for the V3 preset (selective targets, offload on) the top
    layout at 256 H200s is AC none, which needs offload off and ac.targets deleted. Before, it printed only the
    parallel keys and ac.mode, and the rehearsal it suggested was refused ("ac.targets is only used by ...")."""
    preset = Path(__file__).resolve().parents[2] / "configs" / "deepseek-v3-671b.toml"
    assert main(["rehearse", str(preset), "--world-size", "256", "--suggest", "--gpu-memory-gib", "141"]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if x.startswith("rehearse the first: "))
    assert line == ("rehearse the first: --set parallel.ep=256 --set parallel.cp=4 --set parallel.fsdp=-1 --set "
                    "ac.mode='none' --set offload.enabled=false (after deleting ac.targets from the config: only "
                    "ac.mode = 'selective' reads it)")
    assert lines[-1].startswith("the ranking models every layout at 40% MFU: rehearse the first few")
    sets = line.removeprefix("rehearse the first: --set ").split(" (")[0].split(" --set ")
    with pytest.raises(ConfigError, match="ac.targets is only used by ac.mode = 'selective'"):
        load_config(preset, sets)
    text = preset.read_text()
    edited = tmp_path / "v3.toml"
    edited.write_text(re.sub(r"\ntargets = \[[^\]]*\]", "", text, count=1))
    assert edited.read_text().count("targets") == text.count("targets") - 1
    cfg = load_config(edited, sets)
    assert cfg.model_dump() == layout_config(load_config(preset), 256, 4, "none").model_dump()


def test_layouts_the_config_refuses_are_counted_and_said_not_dropped(capsys):
    """seq_len 24: CP 8 needs a multiple of 16, so every CP-8 layout (4 EPs x 3 AC modes) is refused; the table
    says how many and why (the first layout's message), instead of leaving them out without a word."""
    cfg = load_config(TINY, [*SETS, "train.seq_len=24"])
    assert refused_layouts(cfg, 8) == {"train.seq_len 24 must be divisible by 2 * parallel.cp (16) for load-balanced "
                                       "causal context parallelism": 12}
    assert main(["rehearse", str(TINY), "--world-size", "8", "--suggest", "--gpu-memory-gib", "64",
                 *(x for s in [*SETS, "train.seq_len=24"] for x in ("--set", s))]) == 0
    assert capsys.readouterr().out.rstrip().endswith(
        "not suggested, 12 layouts refused like this one: train.seq_len 24 must be divisible by 2 * parallel.cp (16) "
        "for load-balanced causal context parallelism")
    assert refused_layouts(load_config(TINY, SETS), 8) == {}


def test_no_layout_at_all_names_the_first_refusal(capsys):
    assert main(["rehearse", str(TINY), "--world-size", "7", "--suggest", "--gpu-memory-gib", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["spartron: error: no layout of tiny on 7 GPUs: EP must divide model.moe.n_routed_experts and the "
                   "world, and train.global_batch_size the data ranks; the first refusal: train.global_batch_size 4 "
                   "must be divisible by dp size 7 x train.micro_batch_size 1 = 7"]
