"""model.master_weights, train.adamw_moments_dtype and train.muon_ns_dtype (issue 38 items 1 and 3): hostile
values, contradicting keys, a layout it does not run on, and one real step on each (`spartron train` and
`spartron plan`)."""

from __future__ import annotations

from benchmarks.auditing.core import Case, plan, train

MASTERS = ("model.dtype=\"bfloat16\"", "model.master_dtype=\"float32\"")


def cases() -> list[Case]:
    out: list[Case] = []

    def add(cid, argv, names, category="values", **kw):
        out.append(Case(f"precision-{cid}", "config", argv, tuple(names), category=category,
                        timeout=kw.pop("timeout", 120.0), **kw))

    key = ("model.master_weights",)
    add("master-weights-unknown", train(*MASTERS, 'model.master_weights="megatron"'), key, quick=True)
    add("master-weights-int", train(*MASTERS, "model.master_weights=1"), key, category="dtypes")
    add("master-weights-empty", train(*MASTERS, 'model.master_weights=""'), key)
    add("master-weights-no-masters", train('model.dtype="bfloat16"', 'model.master_weights="optimizer"'), key)
    add("master-weights-muon", train(*MASTERS, 'model.master_weights="optimizer"', 'train.optimizer="muon"'), key)
    add("master-weights-two-ranks", train(*MASTERS, 'model.master_weights="optimizer"', "launch.nproc=2"), key,
        category="sizes", timeout=180.0)
    add("master-weights-plan", plan(*MASTERS, 'model.master_weights="optimizer"'), (), accept_ok=True)
    add("master-weights-plan-two-ranks", [*plan(*MASTERS, 'model.master_weights="optimizer"'), "--world-size", "2"],
        key, category="sizes", accept_ok=True, expect_out="model.master_weights = 'optimizer' runs on one rank")
    add("master-weights-step", train(*MASTERS, 'model.master_weights="optimizer"'), (), accept_ok=True)

    for kernel in ("torch", "triton"):  # Muon's AdamW part is its own loop: a chosen kernel would be ignored
        add(f"adamw-kernel-{kernel}-muon", train(f'train.adamw_kernel="{kernel}"', 'train.optimizer="muon"'),
            ("train.adamw_kernel",))

    key = ("train.adamw_moments_dtype",)
    add("moments-unknown", train(*MASTERS, 'train.adamw_moments_dtype="float8"'), key, quick=True)
    add("moments-float16", train(*MASTERS, 'train.adamw_moments_dtype="float16"'), key, category="dtypes")
    add("moments-int", train(*MASTERS, "train.adamw_moments_dtype=2"), key, category="dtypes")
    add("moments-no-masters", train('model.dtype="bfloat16"', 'train.adamw_moments_dtype="bfloat16"'), key)
    add("moments-muon", train(*MASTERS, 'train.adamw_moments_dtype="bfloat16"', 'train.optimizer="muon"'), key)
    add("moments-plan", plan(*MASTERS, 'train.adamw_moments_dtype="bfloat16"'), (), accept_ok=True,
        expect_out="AdamW moments in bfloat16")
    for holder in ("fsdp", "optimizer"):
        add(f"moments-step-{holder}", train(*MASTERS, f'model.master_weights="{holder}"',
                                            'train.adamw_moments_dtype="bfloat16"'), (), accept_ok=True)
    key = ("train.muon_ns_dtype",)
    add("muon-ns-unknown", train('train.optimizer="muon"', 'train.muon_ns_dtype="float8"'), key, quick=True)
    add("muon-ns-float16", train('train.optimizer="muon"', 'train.muon_ns_dtype="float16"'), key, category="dtypes")
    add("muon-ns-int", train('train.optimizer="muon"', "train.muon_ns_dtype=2"), key, category="dtypes")
    add("muon-ns-adamw", train('train.muon_ns_dtype="bfloat16"'), key)
    add("muon-ns-step-masters", train(*MASTERS, 'train.optimizer="muon"', 'train.muon_ns_dtype="bfloat16"'), (),
        accept_ok=True)
    return out
