"""`spartron plan`: big presets and world sizes, hostile flags, and a plan that must write nothing."""

from __future__ import annotations

from pathlib import Path

from benchmarks.auditing.core import ROOT, Case, sets

V3 = str(ROOT / "configs" / "deepseek-v3-671b.toml")
V32 = str(ROOT / "configs" / "deepseek-v3.2-671b.toml")


def _wrote_nothing(case_dir: Path) -> str | None:
    made = sorted(p.name for p in (case_dir / "work").iterdir())
    return f"plan wrote {made}" if made else None


def cases() -> list[Case]:
    out: list[Case] = []

    def add(cid, argv, names, category="values", accept_ok=False, **kw):
        out.append(Case(f"plan-{cid}", "plan", ["plan", *argv], tuple(names), category=category,
                        accept_ok=accept_ok, harm=_wrote_nothing, timeout=kw.pop("timeout", 90.0), **kw))

    add("tiny", ["{tiny}"], (), accept_ok=True, quick=True)
    add("v3-2048", [V3, "--world-size", "2048"], (), accept_ok=True, category="sizes")
    add("v32-4096", [V32, "--world-size", "4096"], (), accept_ok=True, category="sizes")
    add("v3-1-rank", [V3, "--world-size", "1"], ["train.global_batch_size", "parallel", "world", "memory"],
        accept_ok=True, category="sizes")
    add("v3-max-groups-huge", [V3, "--world-size", "2048", "--max-groups", str(10**9)], (), accept_ok=True,
        category="sizes", timeout=60.0)
    add("max-groups-neg", ["{tiny}", "--max-groups", "-1"], ["--max-groups"])
    add("max-groups-str", ["{tiny}", "--max-groups", "many"], ["--max-groups"], category="dtypes")
    add("world-float", ["{tiny}", "--world-size", "2.5"], ["--world-size"], category="dtypes")
    add("world-nan", ["{tiny}", "--world-size", "nan"], ["--world-size"], category="nonfinite")
    add("world-2-63", ["{tiny}", "--world-size", str(2**63)], ["--world-size", "world size"], category="sizes")
    add("init-from-missing", ["{tiny}", *sets('train.init_from="hf:nope"')], ["train.init_from", "nope"],
        category="paths")
    add("init-from-no-prefix", ["{tiny}", *sets('train.init_from="nope"')], ["train.init_from"])
    add("data-path-missing", ["{tiny}", *sets("train.data.kind=mmap", 'train.data.path="nope.bin"')],
        ["train.data.path", "nope.bin"], category="paths", accept_ok=True,
        note="a plan may describe a run whose data is not here yet")
    add("run-dir-decoy", ["{tiny}", *sets('train.run_dir="{decoy}/run"')], (), category="paths", accept_ok=True,
        note="planning a run in an existing run directory touches nothing (hashed)")
    add("config-is-run-dir", ["{tiny}", *sets('train.run_dir="{decoy}/precious.txt"')], ["train.run_dir"],
        category="paths", accept_ok=True, note="plan does not open the run directory")
    add("fsdp-ep-mismatch", ["{tiny}", "--world-size", "6", *sets("parallel.ep=4")], ["parallel"])
    add("set-deep", ["{tiny}", *sets("model.moe.n_routed_experts=" + "9" * 400)], ["model.moe.n_routed_experts"],
        category="sizes")
    add("experts-huge", ["{tiny}", *sets("model.moe.n_routed_experts=1048576", "model.moe.n_groups=1",
                                         "model.moe.topk_groups=1")], ["model.moe.n_routed_experts"],
        category="sizes", accept_ok=True, note="a plan of a huge model is what plan is for")
    # [[train.stages]] and [train.indexer_metrics] (spartron.runtime.stage_config, stages, indexer_metrics)
    add("stages-sum", ["{tiny}", *sets("train.stages=[{name = 'a', steps = 2}]")], ["train.stages", "train.steps"])
    add("stages-unknown-key", ["{tiny}", *sets("train.stages=[{name = 'a', steps = 5, colour = 'red'}]")],
        ["train.stages.0.colour"])
    add("stages-pattern-none", ["{tiny}", *sets("train.stages=[{name = 'a', steps = 5, trainable = ['nope.*']}]")],
        ["train.stages.0.trainable.0", "nope.*"])
    add("stages-mode-no-kl", ["{tiny}", *sets("train.stages=[{name = 'a', steps = 5, dsa_mode = 'dense_warmup'}]")],
        ["train.stages.0.dsa_mode", "model.dsa.indexer_loss_coeff"])
    add("stages-steps-zero", ["{tiny}", *sets("train.stages=[{name = 'a', steps = 0}]")], ["train.stages.0.steps"],
        category="sizes")
    add("stages-lr-nan", ["{tiny}", *sets("train.stages=[{name = 'a', steps = 5, lr = nan}]")],
        ["train.stages.0.lr"], category="nonfinite")
    add("stages-not-a-list", ["{tiny}", *sets("train.stages=5")], ["train.stages"], category="dtypes")
    add("indexer-queries-zero", ["{tiny}", *sets("train.indexer_metrics.queries=0")],
        ["train.indexer_metrics.queries"], category="sizes")
    add("indexer-metrics-compiled", ["{tiny}", *sets("train.indexer_metrics.every=1", "train.compile=true")],
        ["train.indexer_metrics.every", "train.compile"])
    return out
