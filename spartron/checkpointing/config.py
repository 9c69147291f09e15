"""Activation checkpointing and offload configs: the `[ac]` and `[offload]` sections of the run config."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from spartron.configbase import ConfigSection


class ACConfig(ConfigSection):
    """Which blocks are checkpoint regions and what each region keeps for backward.

    mode: "none" (no regions), "full" (keep only the mandatory operations) or "selective" (also keep
    `targets`). targets: exact operator names ("aten::mm") or namespaces ("spartron_collectives");
    None means the defaults, a list REPLACES them, [] keeps only the mandatory set.
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
            import spartron.runtime.ops  # noqa: F401  (registers Spartron's op namespaces)
            from spartron.checkpointing.policy import validate_targets

            validate_targets(targets)
        return targets

    @model_validator(mode="after")
    def _check(self) -> ACConfig:
        if self.targets is not None and self.mode != "selective":
            raise ValueError(f"ac.targets is only used by ac.mode = 'selective' (mode is {self.mode!r})")
        return self


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
    pool_max_bytes: int = Field(64 * 2**30, ge=0)

    @model_validator(mode="after")
    def _check(self) -> OffloadConfig:
        if self.enabled and self.prefetch_depth == 0:
            raise ValueError("offload.prefetch_depth must be >= 1 when offload.enabled is true "
                             "(0 would copy nothing back ahead of backward)")
        return self
