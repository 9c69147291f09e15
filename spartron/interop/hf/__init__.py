"""Hugging Face DeepSeek-V3 / V3.2 checkpoints in and out of Spartron (transformers' safetensors layout).

- `import_hf(dir) -> (ModelConfig, loader)`; `loader(model)` streams the weights into a SparseMoEModel
  of any layout (`load_hf_weights`);
- `export_hf(model | saved step | run dir, out_dir)` writes config.json, shards and the index;
- `import_hf_to_state(dir, run_dir, run_cfg)` writes a step-0 saved state the trainer resumes from;
- `model_config_from_hf` / `hf_config_from_model_config` / `model_toml`: the config mapping;
  `check_config_matches(run_model, checkpoint_model)`: before starting a run from HF weights.
Names: spartron.interop.hf.names (one table). CLI: `spartron convert`.
"""

from spartron.interop.hf.config_map import (
    HFConfigError,
    check_config_matches,
    hf_config_from_model_config,
    model_config_from_hf,
    model_config_from_toml,
    model_toml,
)
from spartron.interop.hf.convert import HFCheckpointError, export_hf, import_hf, load_hf_weights
from spartron.interop.hf.saved_state import SavedStateSource, import_hf_to_state

__all__ = ["HFCheckpointError", "HFConfigError", "SavedStateSource", "check_config_matches", "export_hf",
           "hf_config_from_model_config", "import_hf", "import_hf_to_state", "load_hf_weights",
           "model_config_from_hf", "model_config_from_toml", "model_toml"]
