"""`spartron convert --from-hf` writes a step-0 state whose optimizer is fresh: a run resumed from it trains
exactly like one started with `train.init_from` on the same checkpoint, and like transformers' own model with
torch.optim.AdamW and the same settings (5 steps, fp32, CPU). A save of an optimizer that has not stepped records
no per-parameter state (torch's get_state_dict would otherwise store step 1 with zero moments: a first update
0.735x a fresh AdamW's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from spartron.interop.hf import import_hf
from spartron.runtime.config import config_from_dict
from spartron.runtime.data import build_loader
from spartron.runtime.optim import lr_at
from spartron.runtime.state import load_state, save_state
from spartron.runtime.trainer import train
from spartron.testing import run_distributed

HF = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
          num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=16,
          q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=1, topk_group=1,
          num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64, routed_scaling_factor=2.5)
STEPS = 5


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(11)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**HF))
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(HF["n_routed_experts"]))
    model.save_pretrained(path)
    return path


def _cfg(hf_dir, run_dir, **train):
    model = import_hf(hf_dir)[0].model_dump(mode="json")
    model["moe"]["bias_update_rate"] = 0.0  # transformers does not move the router's correction bias
    return config_from_dict({
        "name": "opt", "device": "cpu", "model": model, "parallel": {"timeout_s": 60.0},
        "train": {"steps": STEPS, "seq_len": 16, "global_batch_size": 2, "micro_batch_size": 1, "progress": False,
                  "peak_tflops": 1.0, "run_dir": str(run_dir), "lr": 3e-3, **train}})


def _losses(rank, world, cfg):
    result = train(cfg)
    return result.resumed_from, [r["loss"] for r in result.records]


def _transformers_losses(hf_dir, cfg) -> list[float]:
    """transformers' model + torch.optim.AdamW with the run's settings (decay on matrices, global-norm clip,
    warmup + cosine lr), on the run's batches."""
    t = cfg.train
    model = DeepseekV3ForCausalLM.from_pretrained(hf_dir).train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": t.weight_decay},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
    loader = build_loader(t.data, cfg.model.vocab_size, t.seq_len, t.seed, 0, 1)
    n_micro = t.global_batch_size // t.micro_batch_size
    losses = []
    for step in range(1, t.steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        total = 0.0
        for _ in range(n_micro):
            tokens, labels = loader.next_batch(t.micro_batch_size)
            logits = model(tokens).logits
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) / n_micro
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def test_converted_step_trains_like_init_from_and_like_transformers_adamw(hf_checkpoint, tmp_path):
    from spartron.launch.cli import main

    assert main(["convert", "--from-hf", str(hf_checkpoint), "--to", str(tmp_path / "converted")]) == 0
    (resumed, converted), = run_distributed(_losses, 1, _cfg(hf_checkpoint, tmp_path / "converted", resume=True),
                                            timeout=240)
    (_, started), = run_distributed(
        _losses, 1, _cfg(hf_checkpoint, tmp_path / "init", init_from=f"hf:{hf_checkpoint}"), timeout=240)
    reference = _transformers_losses(hf_checkpoint, _cfg(hf_checkpoint, tmp_path / "unused"))
    assert resumed == 0 and len(converted) == len(started) == STEPS
    assert converted == pytest.approx(started, abs=1e-6, rel=0)
    assert converted == pytest.approx(reference, abs=1e-6, rel=0)
    assert abs(reference[-1] - reference[0]) > 1e-2  # the steps moved the model: the comparison sees updates


def test_saving_an_optimizer_that_has_not_stepped_saves_no_state_and_leaves_it_fresh(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    path = save_state(tmp_path / "run", 0, model, opt, {"tokens": 0}, {}, torch.device("cpu"))
    assert len(opt.state) == 0  # the saver's zero-gradient initialisation is not left behind either
    twin = torch.nn.Linear(4, 3)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    load_state(path, twin, twin_opt, torch.device("cpu"))
    assert len(twin_opt.state) == 0 and torch.equal(twin.weight, model.weight)
    fresh = torch.nn.Linear(4, 3)
    fresh.load_state_dict(model.state_dict())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    for m, o in ((twin, twin_opt), (fresh, fresh_opt)):
        m.weight.sum().backward()
        o.step()
    assert torch.equal(twin.weight, fresh.weight) and torch.equal(twin.bias, fresh.bias)
    assert float(twin_opt.state[twin.weight]["step"]) == 1.0


def test_a_stepped_optimizer_still_saves_and_restores_its_moments(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.weight.sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    path = save_state(tmp_path / "run", 1, model, opt, {"tokens": 0}, {}, torch.device("cpu"))
    twin = torch.nn.Linear(4, 3)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    load_state(path, twin, twin_opt, torch.device("cpu"))
    assert float(twin_opt.state[twin.weight]["step"]) == 1.0
    assert torch.equal(twin_opt.state[twin.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])
