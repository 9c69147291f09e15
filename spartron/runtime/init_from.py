"""`train.init_from = "hf:DIR"`: a new run starts from a Hugging Face DeepSeek-V3 / V3.2 checkpoint.

The run builds its model on its own layout and each rank reads its shards of the checkpoint
(spartron.runtime.hf_state.hf_initialised). The run's `[model]` must compute the checkpoint's function
(`check_config_matches`: only Spartron-only settings such as the dispatcher may differ); that, and
the directory itself, are checked before any rank starts (`check_init_from`). A resumed run loads
its own saved step and never reads the checkpoint again.
"""

from __future__ import annotations

from pathlib import Path

from spartron.interop.hf import HFCheckpointError, HFConfigError, check_config_matches, import_hf
from spartron.runtime.config import ConfigError, RunConfig


def init_from_dir(cfg: RunConfig) -> Path | None:
    """The Hugging Face directory of train.init_from, or None."""
    return None if cfg.train.init_from is None else Path(cfg.train.init_from[len("hf:"):])


def check_init_from(cfg: RunConfig) -> None:
    """A ConfigError naming train.init_from when its checkpoint is unreadable or computes another model."""
    hf_dir = init_from_dir(cfg)
    if hf_dir is None:
        return
    try:
        checkpoint, _ = import_hf(hf_dir)
        check_config_matches(cfg.model, checkpoint)
    except (HFCheckpointError, HFConfigError) as err:
        raise ConfigError(f"train.init_from {str(hf_dir)!r}: {err}") from None


def init_from_factory(cfg: RunConfig, factory):  # noqa: ANN001, ANN201 - trainer model factories
    """`factory` followed by loading train.init_from's weights into the model it builds (checked first); what
    only the read finds (a NaN in a tensor) is a ConfigError naming train.init_from, the file and the tensor."""
    from spartron.runtime.hf_state import hf_initialised

    check_init_from(cfg)
    hf_dir = init_from_dir(cfg)
    build = hf_initialised(factory, hf_dir)

    def checked(run_cfg: RunConfig, groups):  # noqa: ANN001, ANN202 - ParallelGroups -> nn.Module
        try:
            return build(run_cfg, groups)
        except (HFCheckpointError, HFConfigError) as err:
            raise ConfigError(f"train.init_from {str(hf_dir)!r}: {err}") from None

    return checked
