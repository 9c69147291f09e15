"""Activation checkpointing and offload configs: the `[ac]` and `[offload]` sections of the run config."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from spartron.configbase import ConfigSection


class ACConfig(ConfigSection):
    """Which blocks are checkpoint regions and what each region keeps for backward.

    mode: "none" (no regions), "full" (keep only the mandatory operations) or "selective" (also keep
    `targets`). targets: exact operator names ("aten::mm") or namespaces ("spartron_collectives");
    None means the defaults, a list REPLACES them, [] keeps only the mandatory set. reentrant: the
    region's boundary; left unset with train.compile = true it becomes false (compiled regions are
    non-reentrant; setting it true there is an error, spartron.runtime.config). Targets are checked
    against the operators torch has registered when the config is validated: the run config
    (spartron.runtime.config) calls spartron.layers.ops.load_ops() first, so their namespaces are there.
    """

    mode: Literal["none", "full", "selective"] = "none"
    freq: int = Field(1, ge=1)
    targets: list[str] | None = None
    reentrant: bool = True
    preserve_rng_state: bool = True
    debug_summary: bool = False

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, targets: list[str] | None) -> list[str] | None:
        """Every entry must name a registered operator or namespace: a typo is not a silent no-op."""
        if targets:
            from spartron.checkpointing.policy import validate_targets

            validate_targets(targets)
            _check_overloads(targets)
        return targets

    @model_validator(mode="after")
    def _check(self) -> ACConfig:
        if self.targets is not None and self.mode != "selective":
            raise ValueError(f"ac.targets is only used by ac.mode = 'selective' (mode is {self.mode!r})")
        if self.mode == "none":
            ignored = _non_default(self, ("freq", "debug_summary"))
            if ignored:
                raise ValueError(f"ac.{ignored[0]} is set but ac.mode = 'none' makes no checkpoint regions")
        return self


def _check_overloads(targets: list[str]) -> None:
    """An 'ns::op.overload' target must name an overload the operator has (the policy matches by
    'ns::op', so a bogus suffix would otherwise be dropped silently)."""
    import torch

    for entry in targets:
        if "::" not in entry or "." not in entry.split("::", 1)[1]:
            continue
        name, overload = entry.split(".", 1)
        namespace, op = name.split("::", 1)
        overloads = getattr(getattr(torch.ops, namespace), op).overloads()
        if overload not in overloads:
            raise ValueError(f"target {entry!r}: {name} has no overload {overload!r} "
                             f"(it has {', '.join(sorted(overloads))})")


def _non_default(section: ConfigSection, keys: tuple[str, ...]) -> list[str]:
    """The keys among `keys` whose value differs from the field's default (so a dumped config, which
    writes every default, still loads)."""
    return [k for k in keys if getattr(section, k) != type(section).model_fields[k].get_default(
        call_default_factory=True)]


class OffloadConfig(ConfigSection):
    """Offload window: saved inputs of the regions in the window go to host memory during forward.

    window: "all_but_last" keeps the last `keep_last` regions on device, or an explicit list of region
    indices. prefetch_depth: how many regions ahead backward copies back. what: "inputs" or
    "inputs_and_dsa_ids".
    """

    enabled: bool = False
    window: Literal["all_but_last"] | list[int] = "all_but_last"
    keep_last: int = Field(1, ge=0)
    prefetch_depth: int = Field(1, ge=0)
    what: Literal["inputs", "inputs_and_dsa_ids"] = "inputs"
    min_bytes: int = Field(0, ge=0)
    pool_max_bytes: int = Field(64 * 2**30, ge=1)  # host buffers; 0 would offload nothing

    @model_validator(mode="after")
    def _check(self) -> OffloadConfig:
        if not self.enabled:
            ignored = _non_default(self, ("window", "keep_last", "prefetch_depth", "what", "min_bytes",
                                          "pool_max_bytes"))
            if ignored:
                raise ValueError(f"offload.{ignored[0]} is set but offload.enabled = false: set "
                                 "offload.enabled = true or remove it")
        if isinstance(self.window, list) and self.keep_last != 1:
            raise ValueError(f"offload.keep_last = {self.keep_last} applies to offload.window = 'all_but_last', "
                             f"not to the explicit window {self.window}")
        if self.enabled and self.prefetch_depth == 0:
            raise ValueError("offload.prefetch_depth must be >= 1 when offload.enabled is true "
                             "(0 would copy nothing back ahead of backward)")
        if self.min_bytes > self.pool_max_bytes:
            raise ValueError(f"offload.min_bytes {self.min_bytes} is above offload.pool_max_bytes "
                             f"{self.pool_max_bytes}: no tensor could be offloaded")
        return self
