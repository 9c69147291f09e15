"""`train.init_from = "hf:DIR"`: a new run starts from a Hugging Face DeepSeek-V3 checkpoint saved by
transformers itself; its first step's loss is the loss transformers computes on the same batch, on one
rank and on two FSDP x EP ranks; a mismatching [model] or a missing directory is one error naming the key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from spartron.interop.hf import import_hf
from spartron.runtime.config import ConfigError, config_from_dict
from spartron.runtime.data import build_loader
from spartron.runtime.init_from import check_init_from
from spartron.runtime.trainer import train
from spartron.testing import run_distributed

HF = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
          num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=16,
          q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=1, topk_group=1,
          num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64, routed_scaling_factor=2.5)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(3)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**HF)).eval()
    with torch.no_grad():  # the router bias away from zero, so a wrong bias would change the routing
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(HF["n_routed_experts"]))
    model.save_pretrained(path)
    return path, model


def run_cfg(hf_dir, run_dir, **extra):
    model_cfg, _ = import_hf(hf_dir)
    data = {"name": "hf", "device": "cpu", "model": {**model_cfg.model_dump(mode="json"), **extra.pop("model", {})},
            "parallel": {"timeout_s": 30.0, **extra.pop("parallel", {})},
            "train": {"steps": 1, "seq_len": 16, "global_batch_size": 2, "micro_batch_size": 1, "progress": False,
                      "peak_tflops": 1.0, "run_dir": str(run_dir), "init_from": f"hf:{hf_dir}"}}
    return config_from_dict(data)


def _first_loss(rank, world, cfg):
    return train(cfg).records[0]["loss"]


def _hf_loss(model, cfg) -> float:
    """transformers' mean next-token loss on the run's first global batch (each micro-batch's mean, averaged)."""
    t = cfg.train
    loader = build_loader(t.data, cfg.model.vocab_size, t.seq_len, t.seed, 0, 1)
    losses = []
    with torch.no_grad():
        for _ in range(t.global_batch_size // t.micro_batch_size):
            tokens, labels = loader.next_batch(t.micro_batch_size)
            logits = model(tokens).logits
            losses.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    return float(torch.stack(losses).mean())


def test_first_loss_equals_transformers(hf_checkpoint, tmp_path):
    hf_dir, hf_model = hf_checkpoint
    cfg = run_cfg(hf_dir, tmp_path / "one")
    expected = _hf_loss(hf_model, cfg)
    (loss,) = run_distributed(_first_loss, 1, cfg, timeout=120)
    assert loss == pytest.approx(expected, abs=1e-5)
    assert abs(loss - 4.1589) > 1e-3  # not the loss of a fresh init (log 64 = 4.1589 for uniform logits)
    two = run_distributed(_first_loss, 2, run_cfg(hf_dir, tmp_path / "two", parallel={"ep": 2}), timeout=120)
    assert two[0] == two[1] and two[0] == pytest.approx(expected, abs=1e-5)


def test_a_resumed_run_loads_its_own_step_not_the_checkpoint(hf_checkpoint, tmp_path):
    hf_dir, _ = hf_checkpoint
    cfg = run_cfg(hf_dir, tmp_path / "r")
    cfg.train.save_every = 1
    run_distributed(_first_loss, 1, cfg, timeout=120)
    cfg2 = cfg.model_copy(deep=True)
    cfg2.train.init_from = f"hf:{tmp_path / 'gone'}"  # the checkpoint is not read again: any path will do
    cfg2.train.steps = 2
    assert run_distributed(_resumed_from, 1, cfg2, timeout=120) == [1]


def _resumed_from(rank, world, cfg):
    return train(cfg).resumed_from


def test_mismatching_model_and_missing_directory_name_the_key(hf_checkpoint, tmp_path):
    hf_dir, _ = hf_checkpoint
    with pytest.raises(ConfigError, match=r"^train.init_from '.*': the run's \[model\] differs from the Hugging "
                                          r"Face checkpoint in 1 setting\(s\): model.dim"):
        check_init_from(run_cfg(hf_dir, tmp_path / "r", model={"dim": 48}))
    cfg = run_cfg(hf_dir, tmp_path / "r")
    missing = tmp_path / "nothing"
    cfg.train.init_from = f"hf:{missing}"
    with pytest.raises(ConfigError) as info:
        check_init_from(cfg)
    assert str(info.value) == (f"train.init_from {str(missing)!r}: {missing}: does not exist (a Hugging Face "
                               "checkpoint folder is expected)")
