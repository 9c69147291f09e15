"""What the Hugging Face conversion tests build, one builder each so they agree on it: a tiny DeepSeek-V3
checkpoint saved by transformers, a run directory imported from it, the CLI as a user runs it, and a tensor
source that fails mid-export. The module-scoped fixtures over them are in conftest.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from spartron.interop.hf import TensorSource, import_hf
from spartron.interop.hf.convert import ModelSource
from spartron.launch.cli import main
from spartron.layers.model import build_model

TINY_HF = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
               kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=1,
               topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64)


def save_tiny_hf(path: Path) -> Path:
    """The tiny checkpoint (seed 0) saved by transformers' `save_pretrained` into `path`."""
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(DeepseekV3Config(**TINY_HF)).save_pretrained(path)
    return path


def import_run(hf: Path, run: Path) -> Path:
    """A step-0 run directory `run` converted from the checkpoint `hf` by `spartron convert --from-hf`."""
    assert main(["convert", "--from-hf", str(hf), "--to", str(run)]) == 0
    return run


def loaded_model(hf: Path):
    """The reference model holding the checkpoint's weights."""
    cfg, load = import_hf(hf)
    model = build_model(cfg)
    load(model)
    return model


def cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """`spartron ARGV` in a fresh process, as a user runs it (its exit status and stderr as printed)."""
    return subprocess.run([sys.executable, "-m", "spartron.launch.cli", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


class FailingSource(TensorSource):
    """A model's tensors that raise `error` at the fetch after `good` ones (a disk that fills, a reader that dies,
    Ctrl-C mid-export); `fetches` counts the fetches tried."""

    def __init__(self, model, good: int, error: BaseException) -> None:
        self.inner, self.cfg, self.good, self.error, self.fetches = ModelSource(model), model.cfg, good, error, 0

    def dtype(self, name):
        return self.inner.dtype(name)

    def fetch(self, names):
        self.fetches += 1
        if self.fetches > self.good:
            raise self.error
        return self.inner.fetch(names)
