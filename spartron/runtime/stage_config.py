"""`[[train.stages]]`: a run in stages (DeepSeek-V3.2's dense warm-up training only the indexer, then the
sparse stage training everything), as validated configuration.

Each stage names its steps, its learning-rate schedule (unset keys inherit train.lr / warmup_steps /
min_lr_ratio; the schedule restarts at the stage's first step), the parameters it trains (name globs,
matched against the model when a run starts: spartron.runtime.stages) and the DSA mode its attention runs
in. The rules of how the stages combine with the rest of the config are `check_stages`, called by
RunConfig. What a stage changes while a run trains lives in spartron.runtime.stages.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from spartron.configbase import ConfigSection

# DSA mode of a stage: "dense_warmup": full causal (dense) attention, the indexer trained by KL towards the
# head-summed dense attention over all visible keys (V3.2's warm-up); kl_dense / kl_sparse / frozen as
# model.dsa.indexer_mode (attention top-k sparse). Unset: model.dsa.indexer_mode.
StageMode = Literal["dense_warmup", "kl_dense", "kl_sparse", "frozen"]
TRAINING_MODES = ("dense_warmup", "kl_dense", "kl_sparse")


class StageConfig(ConfigSection):
    name: str
    steps: int = Field(ge=1)
    lr: float | None = Field(None, gt=0)
    warmup_steps: int | None = Field(None, ge=0)
    min_lr_ratio: float | None = Field(None, ge=0, le=1)
    trainable: list[str] = Field(default_factory=lambda: ["*"])  # fnmatch globs over parameter names
    dsa_mode: StageMode | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.strip() or len(v) > 64:
            raise ValueError(f"must be a non-empty stage name of at most 64 characters, got {v[:80]!r}")
        return v

    @field_validator("trainable")
    @classmethod
    def _trainable(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("must name at least one parameter pattern (['*']: every parameter)")
        for pattern in v:
            if not pattern.strip():
                raise ValueError("a parameter pattern must be non-empty")
        return v


def check_stages(train, model) -> None:  # noqa: ANN001 - TrainConfig, ModelConfig (no import cycle)
    """How train.stages combine with train.steps and model.dsa; a ValueError naming the key."""
    stages = train.stages
    if not stages:
        return
    total = sum(s.steps for s in stages)
    if total != train.steps:
        raise ValueError(f"train.stages: the stages' steps add up to {total} "
                         f"({' + '.join(str(s.steps) for s in stages)}), but train.steps is {train.steps}")
    seen: set[str] = set()
    for i, s in enumerate(stages):
        key = f"train.stages.{i}"
        if s.name in seen:
            raise ValueError(f"{key}.name: {s.name!r} names an earlier stage too (stage names are unique)")
        seen.add(s.name)
        warmup = train.warmup_steps if s.warmup_steps is None else s.warmup_steps
        if warmup > s.steps:
            origin = "" if s.warmup_steps is not None else " (inherited from train.warmup_steps)"
            raise ValueError(f"{key}.warmup_steps: {warmup}{origin} is more than the stage's {s.steps} steps")
        if s.dsa_mode is None:
            continue
        dsa = model.dsa
        if dsa is None:
            raise ValueError(f"{key}.dsa_mode = {s.dsa_mode!r} needs DSA layers, but the model has no [model.dsa]")
        if s.dsa_mode in TRAINING_MODES and dsa.indexer_loss_coeff == 0:
            raise ValueError(f"{key}.dsa_mode = {s.dsa_mode!r} trains the indexer by its KL loss, but "
                             "model.dsa.indexer_loss_coeff is 0: set it > 0")
        if s.dsa_mode == "kl_dense" and dsa.indexer_fp8:
            raise ValueError(f"{key}.dsa_mode = 'kl_dense' selects from its differentiable scores, but "
                             "model.dsa.indexer_fp8 = true applies to the indexer_topk selection")
