"""Hugging Face DeepSeek-V3 / V3.2 checkpoints in and out of Spartron (transformers' safetensors layout).

- `import_hf(dir) -> (ModelConfig, loader)`; `loader(model)` streams the weights into a SparseMoEModel
  of any layout (`load_hf_weights`);
- `export_hf(model | TensorSource, out_dir)` writes config.json, shards and the index;
- `model_config_from_hf` / `hf_config_from_model_config`: the config mapping;
  `check_config_matches(run_model, checkpoint_model)`: before starting a run from HF weights.
Names: spartron.interop.hf.names (one table). Saved states (a step-0 state from HF, exporting a saved
step, the `[model]` TOML) are the runtime's half: spartron.runtime.hf_state. CLI: `spartron convert`.
"""

from spartron.interop.hf.config_map import (
    HFConfigError,
    check_config_matches,
    hf_config_from_model_config,
    model_config_from_hf,
    model_config_from_toml,
)
from spartron.interop.hf.convert import HFCheckpointError, TensorSource, export_hf, import_hf, load_hf_weights

__all__ = ["HFCheckpointError", "HFConfigError", "TensorSource", "check_config_matches", "export_hf",
           "hf_config_from_model_config", "import_hf", "load_hf_weights", "model_config_from_hf",
           "model_config_from_toml"]
