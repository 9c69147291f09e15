"""`spartron eval`: the step it evaluates, the data it evaluates on (the step's, issue 34 item 4), and bad steps."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from benchmarks.auditing.core import Case, decoy
from benchmarks.auditing.hf_export import poison_state
from benchmarks.auditing.state import _hostile_pickle, _reseal

STEP = "runs/base/step-00000002"


def ev(*overrides: str, step: str = "runs/base", preset: str = "{tiny}") -> list[str]:
    out = ["eval", preset, "--step", step]
    for item in ("train.progress=false", *overrides):
        out += ["--set", item]
    return out


def cases() -> list[Case]:
    out: list[Case] = []

    def add(cid, argv, names, category="values", setup=None, **kw):
        out.append(Case(f"eval-{cid}", "eval", argv, tuple(names), category=category, setup=setup,
                        base=kw.pop("base", ("state",)), timeout=kw.pop("timeout", 120.0), **kw))

    add("plain", ev(), (), accept_ok=True, expect_out="loss", quick=True)
    # a config whose data differs from the step's: evaluated on the step's data, or the difference said
    for cid, item, key in (("seq-len", "train.seq_len=32", "train.seq_len"), ("seed", "train.seed=7", "train.seed"),
                           ("gbs", "train.global_batch_size=8", "train.global_batch_size"),
                           ("eval-steps", "train.eval_steps=2", None),
                           ("val-fraction", "train.data.val_fraction=0.5", "train.data.val_fraction")):
        add(f"data-differs-{cid}", ev(item), [key] if key else (), accept_ok=True, expect_out=key,
            note="issue 34 item 4: prints what differs from the step, as resume does")
    add("data-differs-kind", ev("train.data.kind=mmap", 'train.data.path="t.bin"'), ["train.data"],
        setup=lambda w: (w / "t.bin").write_bytes(bytes(range(200)) * 100), accept_ok=True,
        expect_out="train.data")
    add("model-differs", ev("model.dim=32"), ["model.dim"])
    # numerics other than the step's: tensors that fit are evaluated as the config says, and said (outside
    # audit: eval changed the precision without a note); another dtype is another shape of tensors: refused
    add("precision-differs-indexer-fp8", ev("model.dsa.indexer_fp8=true"), ["model.dsa.indexer_fp8"],
        accept_ok=True, expect_out="model.dsa.indexer_fp8")
    add("precision-differs-dtype", ev('model.dtype="bfloat16"'), ["model.dtype"], category="dtypes")
    add("other-model-step", ev(step="runs/hfbase", preset="{tiny}"), ["model"], base=("state", "hfrun"))
    add("step-missing", ev(step="nope"), ["nope"], category="paths")
    add("step-file", ev(step="f"), ["'f'", "f:"], category="paths", setup=lambda w: (w / "f").write_text("x"))
    add("step-empty-dir", ev(step="e"), ["'e'", "e:"], category="paths", setup=lambda w: (w / "e").mkdir())
    add("step-fifo", ev(step="p"), ["'p'", "p:", " p "], category="paths", setup=lambda w: os.mkfifo(w / "p"),
        timeout=60.0)
    add("step-incomplete", ev(step=STEP), ["step-00000002", "COMPLETE"], category="partial",
        setup=lambda w: (w / STEP / "COMPLETE").unlink())
    add("run-newest-incomplete", ev(), (), category="partial", setup=lambda w: (w / STEP / "COMPLETE").unlink(),
        accept_ok=True, expect_out="step-00000001")
    add("step-link-outside", ev(step="linked"), (), category="paths", accept_ok=True,
        setup=lambda w: (shutil.move(str(w / STEP), str(decoy(w) / "step")), (w / "linked").symlink_to(
            decoy(w) / "step")), note="reading a linked step; it stays unchanged (hashed)")
    for pattern in ("*.distcp", ".metadata", "meta.json", "rank-00000.json"):
        def garbage(work: Path, pattern=pattern) -> None:
            for path in (work / STEP).glob(pattern):
                path.write_bytes(os.urandom(max(64, path.stat().st_size)))
            _reseal(work / STEP)
        add(f"step-{pattern.strip('*.')}-garbage", ev(step=STEP), ["step-00000002", pattern.strip("*")],
            category="corrupt", setup=garbage)
    add("step-hostile-pickle", ev(step=STEP), ["step-00000002", ".metadata"], category="corrupt",
        setup=_hostile_pickle(".metadata", "reduce-system"))
    add("step-nan-weight", ev(step=STEP), ["non-finite", "nan", "NaN", "embed"], category="nonfinite",
        setup=poison_state(STEP, "embed.weight", float("nan")), harmless=True)
    add("two-ranks", ev("launch.nproc=2"), (), accept_ok=True, expect_out="loss",
        note="saved steps are layout-free")
    add("lr-nan", ev("train.lr=nan"), ["train.lr"], category="nonfinite")
    add("eval-steps-0", ev("train.eval_steps=0"), ["train.eval_steps"])
    add("config-missing", ["eval", "nope.toml", "--step", "runs/base"], ["nope.toml"], category="paths")
    add("no-step-flag", ["eval", "{tiny}"], ["--step"])
    return out
