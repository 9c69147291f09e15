"""Saved state under a resume that changes things, and training that diverges: the guards and notes issue 34
(item 5) asks for. Extends the first audit's corrupt-step cases in state.py."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.auditing.core import TINY, Case, train

META = "runs/base/step-00000002/meta.json"


def _meta(fn) -> callable:  # noqa: ANN001
    def setup(work: Path) -> None:
        from benchmarks.auditing.state import _reseal

        path = work / META
        data = json.loads(path.read_text())
        fn(data)
        path.write_text(json.dumps(data))
        _reseal(path.parent)
    return setup


BLEND = ("train.data.kind=mmap", 'train.data.paths=["a.bin", "b.bin"]', "train.data.shuffle=true", "name=blend",
         "train.save_every=1")


def _blend_saved_in_one_order(work: Path) -> None:
    """A one-step run of two shuffled token files, its data position rewritten as an older Spartron saved it
    (both sources in one shared order; manifest resealed)."""
    import numpy as np

    from benchmarks.auditing.runner import _cli
    from benchmarks.auditing.state import _reseal

    for name in ("a.bin", "b.bin"):
        (np.arange(20 * 64 + 1) % 500).astype(np.uint16).tofile(work / name)  # 20 samples of train.seq_len 64
    _cli([a.replace("{tiny}", TINY) for a in train("train.steps=1", *BLEND)], work, work.parents[1])
    step = work / "runs" / "blend" / "step-00000001"
    for path in step.glob("rank-*.json"):
        data = json.loads(path.read_text())
        position = data["rank"]["data"]
        position["source"] = position["source"].replace(":source1", "")
        path.write_text(json.dumps(data))
    _reseal(step)


MMAP = ("train.data.kind=mmap", 'train.data.path="tokens.bin"', "name=mm", "train.save_every=1")


def _mmap_saved_at_seq_64(work: Path) -> None:
    """A one-step run on a token file at train.seq_len 64 (4 samples: tokens 0-255 of the stream read)."""
    import numpy as np

    from benchmarks.auditing.runner import _cli

    (np.arange(64 * 64 + 1) % 500).astype(np.uint16).tofile(work / "tokens.bin")
    _cli([a.replace("{tiny}", TINY) for a in train("train.steps=1", *MMAP)], work, work.parents[1])


def cases() -> list[Case]:
    out: list[Case] = []
    resume = ("train.save_every=1", "name=base")

    def add(cid, argv, names, category="values", **kw):
        out.append(Case(f"state-{cid}", "state", argv, tuple(names), category=category, base=("state",),
                        timeout=kw.pop("timeout", 150.0), **kw))

    # a resume that changes the schedule or the data says so (or is refused naming the key)
    for cid, item, key in (("steps", "train.steps=10", "train.steps"), ("lr", "train.lr=1e-2", "train.lr"),
                           ("warmup", "train.warmup_steps=5", "train.warmup_steps"),
                           ("min-lr", "train.min_lr_ratio=0.5", "train.min_lr_ratio"),
                           ("seq-len", "train.seq_len=32", "train.seq_len"), ("seed", "train.seed=9", "train.seed"),
                           ("gbs", "train.global_batch_size=8", "train.global_batch_size"),
                           ("grad-clip", "train.grad_clip=0.5", "train.grad_clip")):
        extra = () if cid == "steps" else ("train.steps=3",)
        add(f"resume-changes-{cid}", train(*resume, *extra, item), [key], accept_ok=True, expect_out=key,
            note="issue 34 item 5: a resume that changes the schedule says so")
    # divergence is not silent by default
    for lr in ("100", "1e4"):
        add(f"diverge-lr-{lr}", train("train.steps=8", "name=div", f"train.lr={lr}"),
            ["train.loss_spike_factor", "train.max_loss", "loss"], category="nonfinite")
    add("max-loss-below-first", train("train.steps=2", "name=ml", "train.max_loss=1.0"), ["train.max_loss"],
        category="nonfinite")
    add("spike-factor-tiny", train("train.steps=3", "name=sf", "train.loss_spike_factor=1.0000001",
                                   "train.lr=0.05"), ["train.loss_spike_factor"], category="nonfinite",
        accept_ok=True, note="the loss may stay below its first value")
    # counters in the step's meta.json that lie (manifest resealed)
    for cid, fn, names in (
            ("first-loss-nan", lambda d: d["counters"].__setitem__("first_loss", float("nan")), ["first_loss"]),
            ("first-loss-str", lambda d: d["counters"].__setitem__("first_loss", "x"), ["first_loss"]),
            ("tokens-negative", lambda d: d["counters"].__setitem__("tokens", -5), ["tokens"]),
            ("step-mismatch", lambda d: d.__setitem__("step", 7), ["step"]),
            ("world-size-0", lambda d: d.__setitem__("world_size", 0), ["world_size"]),
            ("config-not-dict", lambda d: d.__setitem__("config", [1]), ["config"]),
            ("run-id-huge", lambda d: d.__setitem__("run_id", "x" * 10_000_000), ["run_id"])):
        add(f"meta-{cid}", train("train.steps=3", *resume), ["meta.json", *names], category="corrupt",
            setup=_meta(fn), harmless=cid in ("run-id-huge",))
    # outside audit (data): blended sources shuffled in one shared order; each has its own now, so a position
    # saved in the shared order cannot go on: refused, saying what to do
    out.append(Case("state-blend-shuffled-in-one-order", "state", train("train.steps=2", *BLEND),
                    ("train.run_dir",), setup=_blend_saved_in_one_order, timeout=150.0))
    # outside audit (reshard): a resume with another seq_len on a token file reads the position in samples of the
    # new length; it must say which tokens of the stream that skips
    out.append(Case("state-resume-seq-len-on-a-token-file", "state", train("train.steps=2", "train.seq_len=128",
                                                                           *MMAP), ("train.seq_len",),
                    setup=_mmap_saved_at_seq_64, accept_ok=True, timeout=150.0,
                    expect_out="tokens 256-511 are skipped"))
    return out
