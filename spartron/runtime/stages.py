"""Which training stage a step is in, and what the stage changes: THE rule of `[[train.stages]]`.

A stage sets (1) the learning rate: its own warmup + cosine schedule over its own steps, restarted at its first
step (lr / warmup_steps / min_lr_ratio unset: train's); (2) the trainable parameters: those of the model's
trainable ones whose names match one of its globs; the others get requires_grad False, so they get no
gradient, no optimizer state and no gradient communication (FSDP2 reduce-scatters only parameters that have a
gradient; a unit mixing both is fine); (3) the DSA mode of every DSA layer (`mla.set_indexer_mode`); (4) whether
the MoE expert bias moves: only while some router weight trains (a frozen backbone stays bitwise frozen).

The optimizer holds exactly the trainable parameters. At a boundary it is rebuilt: the states of parameters
that go on training are carried over, a newly trainable parameter starts without state (created at its first
step), a newly frozen one's state is dropped. A saved step holds the optimizer of the stage it was taken in:
a resume builds that stage's optimizer, loads it, then crosses into the next stage as the uninterrupted run
did, so a resume at or just after a boundary continues bitwise. The data position is the loader's, untouched.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from spartron.configbase import ConfigError
from spartron.layers.attention.mla import MLA, set_indexer_mode
from spartron.layers.moe.layer import MoELayer
from spartron.runtime.optim import lr_at
from spartron.runtime.sections import TrainConfig
from spartron.runtime.stage_config import StageConfig

_WRAPPERS = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)(?=\.)")


@dataclass(frozen=True)
class Stage:
    index: int
    first_step: int  # 1-based optimizer steps, inclusive
    last_step: int
    config: StageConfig
    schedule: TrainConfig  # train with the stage's lr keys and steps: lr_at of the step within the stage

    @property
    def name(self) -> str:
        return self.config.name


def stages_of(t: TrainConfig) -> list[Stage]:
    """The run's stages in order (an empty list: the run has none, train's own schedule applies)."""
    out, first = [], 1
    for i, s in enumerate(t.stages):
        keys = {k: getattr(s, k) for k in ("lr", "warmup_steps", "min_lr_ratio") if getattr(s, k) is not None}
        out.append(Stage(i, first, first + s.steps - 1, s, t.model_copy(update={**keys, "steps": s.steps,
                                                                                  "stages": []})))
        first += s.steps
    return out


def stage_at(step: int, t: TrainConfig) -> Stage | None:
    """The stage optimizer step `step` (1-based) trains in; None without stages."""
    for stage in stages_of(t):
        if stage.first_step <= step <= stage.last_step:
            return stage
    return None if not t.stages else stages_of(t)[-1]  # beyond train.steps (a plan's look ahead): the last


def lr_for_step(step: int, t: TrainConfig) -> float:
    """The learning rate of optimizer step `step`: its stage's schedule, or train's when there are no stages."""
    stage = stage_at(step, t)
    return lr_at(step, t) if stage is None else lr_at(step - stage.first_step + 1, stage.schedule)


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers compile / activation checkpointing may add."""
    return _WRAPPERS.sub(r"\1", name).replace("..", ".").lstrip(".")


def trainable_names(names: list[str], stage: Stage) -> set[str]:
    """The names of `names` the stage trains; a pattern matching none of them is a ConfigError naming it."""
    chosen: set[str] = set()
    for j, pattern in enumerate(stage.config.trainable):
        hits = {n for n in names if fnmatch.fnmatchcase(plain_name(n), pattern)}
        if not hits:
            sample = ", ".join(plain_name(n) for n in names[:3])
            raise ConfigError(f"train.stages.{stage.index}.trainable.{j}: {pattern!r} matches no trainable "
                              f"parameter of the model (names look like {sample}, ...)")
        chosen |= hits
    return chosen


def check_stages_against(model: nn.Module, t: TrainConfig) -> None:
    """Every stage's patterns against the model's trainable parameters (ConfigError naming the first miss)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for stage in stages_of(t):
        trainable_names(names, stage)


class StageRunner:
    """Applies the stages to one model as the steps advance; `current` is the stage in force (None: no stages)."""

    def __init__(self, model: nn.Module, t: TrainConfig, default_mode: str | None) -> None:
        self.model, self.train, self.default_mode = model, t, default_mode
        # The parameters a stage may train: those the model itself trains (an always-frozen one stays so).
        self.base = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        check_stages_against(model, t)
        if len(t.stages) > 1:
            fsdp_dtype_refresher()  # a torch without it fails now, not at the first boundary
        self.current: Stage | None = None

    def enter(self, step: int, optimizer: torch.optim.Optimizer | None,
              build: Callable[[nn.Module], torch.optim.Optimizer]) -> torch.optim.Optimizer | None:
        """Put the model in the stage of optimizer step `step` if it is not there yet; returns the optimizer
        for it (`optimizer` itself when nothing changes; a rebuilt one carrying the states on at a boundary)."""
        stage = stage_at(step, self.train)
        if stage is None or (self.current is not None and stage.index == self.current.index):
            return optimizer
        keep = trainable_names([n for n, _ in self.base], stage)
        for name, p in self.base:
            p.requires_grad_(name in keep)
        mode = stage.config.dsa_mode or self.default_mode
        if mode is not None:
            set_indexer_mode(self.model, mode)
        refresh_fsdp_reduce_dtypes(self.model)
        self.current = stage
        new = build(self.model)
        if optimizer is not None:
            carry_optimizer_state(optimizer, new)
        return new

    def updates_expert_bias(self) -> bool:
        """Whether the MoE expert bias moves this stage: while some router weight trains."""
        if self.current is None:
            return True
        routers = [p for n, p in self.base if plain_name(n).endswith(".router.weight")]
        return not routers or any(p.requires_grad for p in routers)

    def update_expert_bias(self, model, group) -> None:  # noqa: ANN001 - an ExpertBiasModel, the dp x cp group
        """The step's expert-bias update, or, while the routers are frozen, only its counts dropped (a later stage's
        first update sees its own step's counts, as after a resume, whose counts start at zero)."""
        if self.updates_expert_bias():
            model.update_expert_bias(group)
            return
        for module in self.model.modules():
            if isinstance(module, MoELayer):
                module.reset_buffers()

    def table(self) -> list[str]:
        """`stage_table` of this model (the banner's lines)."""
        if self.current is None:
            return []
        nbytes = self.base[0][1].element_size()
        return stage_table(self.train, [(n, p.numel()) for n, p in self.base], nbytes, self.default_mode)

    def describe(self) -> str | None:
        """One line naming the stage in force (rank 0 prints it when a stage begins)."""
        s = self.current
        if s is None:
            return None
        count, nbytes = trainable_count(self.model)
        return (f"spartron: stage {s.index + 1}/{len(self.train.stages)} {s.name!r}: steps {s.first_step}-"
                f"{s.last_step}, {_mode_text(s, self.default_mode)}, lr {_lr_text(s)}, {count:,} parameters train "
                f"({nbytes / 2**20:.2f} MiB on this rank)")


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(parameters, bytes of them on this rank) with requires_grad: the global count, this rank's bytes."""
    params = [p for p in model.parameters() if p.requires_grad]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return sum(p.numel() for p in params), sum(q.numel() * q.element_size() for q in local)


def stage_table(t: TrainConfig, params: list[tuple[str, int]], dtype_bytes: int, default_mode: str | None
                ) -> list[str]:
    """What `spartron plan` and the run banner say of the stages: per stage its steps, lr, DSA mode and how many of
    the model's trainable `params` (name, global count) train, with their bytes in the stored dtype."""
    total = sum(k for _, k in params)
    lines = []
    for s in stages_of(t):
        chosen = trainable_names([n for n, _ in params], s)
        count = sum(k for n, k in params if n in chosen)
        lines.append(f"  stage {s.index + 1} {s.name!r}: steps {s.first_step}-{s.last_step}, "
                     f"{_mode_text(s, default_mode)}, lr {_lr_text(s)}; trains {count:,} of {total:,} parameters "
                     f"({count * dtype_bytes / 2**20:,.2f} MiB)")
    return lines


def planned_stage_table(cfg) -> list[str]:  # noqa: ANN001 - a RunConfig
    """`stage_table` of the reference model, built on the meta device (no memory); [] without stages."""
    if not cfg.train.stages:
        return []
    from spartron.layers.model import build_model

    model = build_model(cfg.model, device="meta")
    params = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    dtype_bytes = getattr(torch, cfg.model.stored_dtype).itemsize
    return stage_table(cfg.train, params, dtype_bytes, cfg.model.dsa.indexer_mode if cfg.model.dsa else None)


def _mode_text(stage: Stage, default_mode: str | None) -> str:
    mode = stage.config.dsa_mode or default_mode
    return "no DSA" if mode is None else f"DSA {mode}"


def _lr_text(stage: Stage) -> str:
    s = stage.schedule
    return f"{s.lr:g} (warmup {s.warmup_steps}, cosine to {s.lr * s.min_lr_ratio:g})"


def carry_optimizer_state(old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """The per-parameter states of `old` for the parameters `new` holds (same tensors): carried over as they are."""
    for group in new.param_groups:
        for p in group["params"]:
            if p in old.state:
                new.state[p] = old.state[p]


def fsdp_dtype_refresher() -> Callable[[object], None]:
    """torch's private FSDP2 `FSDPParamGroup._init_mp_dtypes` (no public hook re-derives a unit's gradient dtypes);
    its behaviour pinned by tests/runtime/test_stage_fsdp_dtypes.py on the torch that runs the tests. A torch
    without it is a ConfigError naming train.stages (one line, every rank), raised when a staged run starts
    (StageRunner), not at a boundary."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup  # noqa: PLC2701
    except ImportError:
        FSDPParamGroup = None  # noqa: N806 - the class, when this torch has it
    refresh = getattr(FSDPParamGroup, "_init_mp_dtypes", None)
    if refresh is None:
        raise ConfigError(f"train.stages: torch {torch.__version__}'s FSDP2 FSDPParamGroup has no _init_mp_dtypes, "
                          "which the stages need to re-derive gradient dtypes at a stage change; run them on a torch "
                          "that has it (2.13 is tested) or drop train.stages")
    return refresh


def refresh_fsdp_reduce_dtypes(model: nn.Module) -> None:
    """FSDP2 fixes a unit's gradient dtypes (model.master_dtype / reduce_dtype) at its first forward from the
    parameters trainable THEN; a unit wholly frozen at that time would reduce a later stage's gradients in the
    compute dtype. Re-derived here at every stage change (torch's own initialiser, a no-op before lazy init)."""
    from torch.distributed.fsdp import FSDPModule

    refresh = fsdp_dtype_refresher()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group  # noqa: SLF001 - torch's, no public hook
            if group is not None and getattr(group, "_orig_dtype", "unset") != "unset":
                refresh(group)


def default_indexer_mode(model: nn.Module) -> str | None:
    """model.dsa.indexer_mode as the model's DSA layers were built with it (None: no DSA layer)."""
    for m in model.modules():
        if isinstance(m, MLA) and m.dsa_role is not None:
            return m.cfg.dsa.indexer_mode
    return None
