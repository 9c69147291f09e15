"""GPU: the reference model in bf16 on CUDA gives finite, matching gradients under every AC mode.

Runs on the lent H200 (benchmarks/run_gpu.sh pytest step); skipped on CPU.
"""

from __future__ import annotations

import pytest
import torch

from spartron.layers.model import build_model
from spartron.layers.parallelize import parallelize
from spartron.runtime.config import load_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: bf16 model on the GPU")]

SMALL = ["model.n_layers=3", "model.dim=512", "model.n_heads=4", "model.vocab_size=4096",
         "model.dense_inter_dim=1024", "model.moe.n_routed_experts=16", "model.moe.top_k=4",
         "model.moe.moe_inter_dim=256", "model.max_seq_len=1024", "train.seq_len=1024"]


def _grads(preset: str, ac_mode: str, extra: list[str]) -> tuple[float, dict[str, torch.Tensor]]:
    cfg = load_config(preset, [*SMALL, f"ac.mode={ac_mode}", *extra])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(cfg.model, micro_batches=cfg.train.intra_layer_micro_batches,
                            micro_batch_scope=cfg.train.intra_layer_micro_batch_scope)
    parallelize(model, None, cfg.ac)
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 1024), device="cuda", generator=g)
    labels = torch.randint(0, cfg.model.vocab_size, (2, 1024), device="cuda", generator=g)
    out = model(tokens, labels)
    out["loss"].backward()
    return out["loss"].item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset,extra", [("configs/dsv3-12l.toml", []),
                                          ("configs/dsa-12l.toml", ["model.dsa.index_topk=256"])])
@pytest.mark.parametrize("ac_mode", ["full", "selective"])
def test_bf16_model_gradients_under_ac_match_no_ac(preset, extra, ac_mode):
    ref_loss, ref = _grads(preset, "none", extra)
    loss, got = _grads(preset, ac_mode, extra)
    bad = [n for n, g in got.items() if not torch.isfinite(g).all()]
    assert bad == [], f"non-finite grads under ac {ac_mode}: {bad[:8]}"
    assert loss == ref_loss
    assert set(got) == set(ref)
    for name, g in got.items():
        err = (g - ref[name]).norm() / ref[name].norm().clamp(min=1e-12)
        assert err < 1e-2, f"{name}: relative error {err:.3g} vs no AC"


@pytest.mark.parametrize("scope", ["layer", "experts"])
def test_bf16_two_intra_layer_micro_batches_match_one(scope):
    """Comm steps on side streams, events, record_stream (and scope 'experts': the chunked routed path
    with one count exchange for both chunks) on CUDA: the same loss and gradients as one micro-batch."""
    ref_loss, ref = _grads("configs/dsv3-12l.toml", "selective", [])
    loss, got = _grads("configs/dsv3-12l.toml", "selective", ["train.micro_batch_size=2",
                                                               "train.intra_layer_micro_batches=2",
                                                               f"train.intra_layer_micro_batch_scope={scope}"])
    assert abs(loss - ref_loss) <= 1e-2 * abs(ref_loss)
    assert set(got) == set(ref)
    for name, g in got.items():
        err = (g - ref[name]).norm() / ref[name].norm().clamp(min=1e-12)
        assert err < 2e-2, f"{name}: relative error {err:.3g} vs one micro-batch"
