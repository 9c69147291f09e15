"""Activation checkpointing: one PyTree-aware boundary, replay frames and an operator-level policy.

Public names: ``checkpoint`` (functional boundary), ``CheckpointRegion`` / ``CheckpointOptions``
(a boundary with bound options), ``reuse_during_recompute``, ``apply_activation_checkpointing``,
``apply_ac_to_blocks`` (with ``checkpointed_positions``, the one ``ac.freq`` rule), ``compile_block``
(a block's forward or its region as one compiled graph), ``ACConfig``,
``OffloadConfig``, ``build_policy``, ``replays`` (whether an AC mode runs an operator again) and the policy
table.
"""

from spartron.checkpointing.apply import (
    apply_ac_to_blocks,
    apply_activation_checkpointing,
    checkpoint_region_of,
    checkpointed_positions,
    compile_block,
    region_options,
)
from spartron.checkpointing.boundary import CheckpointOptions, CheckpointRegion, checkpoint
from spartron.checkpointing.config import ACConfig, OffloadConfig
from spartron.checkpointing.policy import (
    DEFAULT_TARGETS,
    MANDATORY,
    MANDATORY_DEVICE_TO_HOST,
    OpPolicy,
    build_policy,
    replays,
)
from spartron.checkpointing.replay import ReplayFrameError, reuse_during_recompute
from spartron.checkpointing.saved_ops import CheckpointReplayError, RegionStats

__all__ = [
    "ACConfig", "OffloadConfig", "apply_activation_checkpointing", "apply_ac_to_blocks",
    "checkpoint_region_of", "checkpointed_positions", "compile_block", "region_options", "CheckpointOptions",
    "CheckpointRegion",
    "checkpoint",
    "reuse_during_recompute", "build_policy", "replays", "OpPolicy", "MANDATORY", "MANDATORY_DEVICE_TO_HOST",
    "DEFAULT_TARGETS", "RegionStats", "CheckpointReplayError", "ReplayFrameError",
]
