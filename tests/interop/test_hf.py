"""Hugging Face DeepSeek-V3 / V3.2 checkpoints in and out (spartron.interop.hf), against transformers itself.

Tiny random `DeepseekV3ForCausalLM` / `DeepseekV32ForCausalLM` models built by transformers and saved
with `save_pretrained` (fp32, CPU): Spartron's logits equal transformers' after import, transformers'
`from_pretrained` of the export gives the same logits, every tensor round-trips bitwise, and the MTP
layer (`model.layers.{num_hidden_layers}.*`, written by hand since transformers drops it) round-trips
bitwise and computes what transformers' own `MtpLayer` computes with those weights.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file
from transformers import (  # the `test` extra installs transformers, safetensors and tokenizers
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
)

from spartron.interop.hf import (
    HFCheckpointError,
    HFConfigError,
    check_config_matches,
    export_hf,
    hf_config_from_model_config,
    import_hf,
    model_config_from_hf,
    model_config_from_toml,
)
from spartron.interop.hf.convert import ModelSource
from spartron.interop.hf.names import tensor_map
from spartron.layers.config import FP8Config
from spartron.layers.decoder import run_decoder_stack
from spartron.layers.model import build_model
from spartron.layers.mtp import shift_left
from spartron.runtime.hf_state import SavedStateSource, import_hf_to_state, model_toml

ATOL = 1e-5
TOKENS = torch.Generator().manual_seed(7)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.9, "mscale_all_dim": 1.1}
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
            q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=2, topk_group=1,
            num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=128)
VARIANTS = {
    # dense only, uncompressed query (q_proj), default RoPE
    "dense": dict(first_k_dense_replace=3, q_lora_rank=None),
    # MoE: group-limited sigmoid routing with a nonzero correction bias, shared experts, YaRN (both mscales)
    "moe": dict(rope_scaling=YARN, routed_scaling_factor=2.5),
    # MoE without top-k normalisation, one group, tied embeddings, another RoPE base
    "moe_tied": dict(norm_topk_prob=False, n_group=1, topk_group=1, tie_word_embeddings=True, rope_theta=50000.0,
                     routed_scaling_factor=1.0, first_k_dense_replace=0),
}


def _randomise_(model: torch.nn.Module, seed: int) -> None:
    """Norm weights and the routers' correction bias away from their trivial init (ones / zeros)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dim() == 1 and ("norm" in name or "e_score_correction_bias" in name):
                t.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(t.shape, generator=gen))


def _save_hf(path: Path, cls, config, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = cls(config).eval()
    _randomise_(model, seed)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for i, (name, extra) in enumerate(VARIANTS.items()):
        path = tmp_path_factory.mktemp(name)
        model = _save_hf(path, DeepseekV3ForCausalLM, DeepseekV3Config(**{**BASE, **extra}), seed=i)
        out[name] = (path, model)
    return out


def _tokens(seq: int = 24) -> torch.Tensor:
    return torch.randint(0, 64, (2, seq), generator=TOKENS)


def _hf_logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def _spartron(hf_dir):
    cfg, load = import_hf(hf_dir)
    model = build_model(cfg)
    load(model)
    return cfg, model


def _logits(model, tokens) -> torch.Tensor:
    """The model's next-token logits from its public pieces (forward returns losses only)."""
    with torch.no_grad():
        stack = run_decoder_stack(list(model.layers.values()), model.embed(tokens), torch.arange(tokens.shape[1]))
        return model.norm(stack.hidden_states) @ model.head_weight.T


def _tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    differ = [n for n in a if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
              or not torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8))]
    assert differ == []


# ---- logits ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_imported_logits_equal_transformers(variant, hf_dirs):
    hf_dir, hf_model = hf_dirs[variant]
    cfg, model = _spartron(hf_dir)
    assert (cfg.first_k_dense, cfg.tie_embeddings) == (
        {"dense": 3, "moe": 1, "moe_tied": 0}[variant], variant == "moe_tied")
    tokens = _tokens()
    ref = _hf_logits(hf_model, tokens)
    diff = (_logits(model, tokens) - ref).abs().max().item()
    assert diff <= ATOL, f"{variant}: max |logits diff| {diff}"
    assert ref.abs().max() > 0.1  # not a vacuous comparison


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_loads_in_transformers_with_equal_logits_and_round_trips_bitwise(variant, hf_dirs, tmp_path):
    hf_dir, hf_model = hf_dirs[variant]
    _, model = _spartron(hf_dir)
    out = export_hf(model, tmp_path / "out")
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    reloaded = DeepseekV3ForCausalLM.from_pretrained(out).eval()
    tokens = _tokens()
    assert (_hf_logits(reloaded, tokens) - _hf_logits(hf_model, tokens)).abs().max().item() <= ATOL
    _assert_bitwise(_tensors(out), _tensors(hf_dir))


def test_checkpoint_without_shared_experts_imports_exports_and_reimports(tmp_path):
    """n_shared_experts = 0 (audit hf F4, refused before): transformers builds a shared MLP of width 0 and
    save_pretrained writes its three zero-element weights per MoE layer. Spartron builds no shared experts,
    gives transformers' logits, exports the empty weights back (transformers finds every tensor it expects),
    and the export re-imports to the same model; a checkpoint without the empty weights imports too."""
    hf_dir = tmp_path / "hf"
    hf_model = _save_hf(hf_dir, DeepseekV3ForCausalLM, DeepseekV3Config(**{**BASE, "n_shared_experts": 0}), seed=5)
    saved = _tensors(hf_dir)
    assert {n: tuple(t.shape) for n, t in saved.items() if ".shared_experts." in n} == {
        f"model.layers.{i}.mlp.shared_experts.{p}.weight": shape for i in (1, 2)
        for p, shape in (("gate_proj", (0, 32)), ("up_proj", (0, 32)), ("down_proj", (32, 0)))}
    cfg, model = _spartron(hf_dir)
    assert (cfg.moe.n_shared_experts, [layer.ffn.shared_experts for layer in model.layers.values()
                                       if layer.is_moe]) == (0, [None, None])
    assert tensor_map(cfg).shapes == {n: tuple(t.shape) for n, t in model.state_dict().items()}
    tokens = _tokens()
    ref = _hf_logits(hf_model, tokens)
    assert (_logits(model, tokens) - ref).abs().max().item() <= ATOL
    assert ref.abs().max() > 0.1

    out = export_hf(model, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["n_shared_experts"] == 0
    reloaded, info = DeepseekV3ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    assert (_hf_logits(reloaded.eval(), tokens) - ref).abs().max().item() <= ATOL
    _assert_bitwise(_tensors(out), saved)
    _, again = _spartron(out)
    _assert_bitwise(again.state_dict(), model.state_dict())

    stripped = tmp_path / "stripped"  # a writer that drops tensors of no values
    shutil.copytree(hf_dir, stripped)
    save_file({n: t for n, t in saved.items() if ".shared_experts." not in n}, str(stripped / "model.safetensors"),
              metadata={"format": "pt"})
    _, third = _spartron(stripped)
    _assert_bitwise(third.state_dict(), model.state_dict())


def test_bfloat16_checkpoint_round_trips_bitwise_with_its_fp32_correction_bias(tmp_path):
    """DeepSeek's published layout: bf16 weights, fp32 `e_score_correction_bias` (Spartron's fp32 buffer)."""
    torch.manual_seed(3)
    hf_model = DeepseekV3ForCausalLM(DeepseekV3Config(**BASE)).eval()
    _randomise_(hf_model, 3)
    hf_model.to(torch.bfloat16)
    for layer in hf_model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
    hf_model.save_pretrained(tmp_path / "bf16")
    saved = _tensors(tmp_path / "bf16")
    assert saved["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert saved["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    cfg, model = _spartron(tmp_path / "bf16")
    assert cfg.dtype == "bfloat16" and model.embed.weight.dtype == torch.bfloat16
    _assert_bitwise(_tensors(export_hf(model, tmp_path / "out")), saved)


def test_deepseek_v32_indexer_imports_with_equal_logits_and_round_trips(tmp_path):
    """transformers' DeepseekV32ForCausalLM (its indexer names are DeepSeek-V3.2's published ones):
    top-k 5 of 24 keys, so the indexer's selection decides the logits. 16 index heads: with 4, all four
    ReLU terms of a score are zero for about 1 in 16 (query, key) pairs, so exact-zero ties at the k-th
    score are common, and the two sides break them differently (torch.topk's unspecified order,
    Spartron's lower-id rule, attention/indexer_topk.topk_ids). The tokens come from their own generator,
    not the file's shared one: equal logits need a selection that rounding cannot flip; with 16 heads one
    of twelve draws of the shared generator gives logits 0.03 apart under either tie rule, most likely a
    key within rounding of the k-th score."""
    config = DeepseekV32Config(**{**BASE, "num_hidden_layers": 2}, index_topk=5, index_head_dim=16,
                               index_n_heads=16)
    hf_model = _save_hf(tmp_path / "v32", DeepseekV32ForCausalLM, config, seed=11)
    cfg, model = _spartron(tmp_path / "v32")
    assert (cfg.dsa.n_index_heads, cfg.dsa.index_head_dim, cfg.dsa.index_topk, cfg.dsa.layers) == (16, 16, 5, "all")
    assert model.layers["0"].attn.indexer is not None
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = _hf_logits(hf_model, tokens)
    dense = cfg.model_copy(update={"dsa": cfg.dsa.model_copy(update={"index_topk": 64})})
    dense_model = build_model(dense)
    with pytest.raises(HFConfigError, match=r"in 1 setting\(s\): model\.dsa\.index_topk: the run has 64, the "
                                            r"checkpoint 5$"):
        import_hf(tmp_path / "v32")[1](dense_model)
    import_hf(tmp_path / "v32")[1](dense_model, check_config=False)
    assert (_logits(dense_model, tokens) - ref).abs().max().item() > 1e-3  # the selection matters here
    assert (_logits(model, tokens) - ref).abs().max().item() <= ATOL
    out = export_hf(model, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v32"
    _assert_bitwise(_tensors(out), _tensors(tmp_path / "v32"))
    reloaded = DeepseekV32ForCausalLM.from_pretrained(out).eval()
    assert (_hf_logits(reloaded, tokens) - ref).abs().max().item() <= ATOL
    # its MTP layer (model.layers.2.*, with its own indexer) into Spartron's MTP block and back, bitwise
    written = _with_mtp(tmp_path / "v32", tmp_path / "v32-mtp", n_layers=2)
    assert "model.layers.2.self_attn.indexer.wk.weight" in written
    cfg, model = _spartron(tmp_path / "v32-mtp")
    assert cfg.mtp.depth == 1 and model.mtp.blocks[0].layer.attn.indexer is not None
    _assert_bitwise(_tensors(export_hf(model, tmp_path / "out-mtp", with_mtp=True)), written)


def test_stacked_expert_checkpoint_imports_like_unstacked(hf_dirs, tmp_path):
    """Experts stored stacked (`mlp.experts.gate_up_proj` [E, 2I, D], gate rows first, and `down_proj`)."""
    hf_dir, hf_model = hf_dirs["moe"]
    stacked_dir = tmp_path / "stacked"
    shutil.copytree(hf_dir, stacked_dir)
    tensors = _tensors(hf_dir)
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts."
        gate = [tensors.pop(f"{p}{e}.gate_proj.weight") for e in range(8)]
        up = [tensors.pop(f"{p}{e}.up_proj.weight") for e in range(8)]
        down = [tensors.pop(f"{p}{e}.down_proj.weight") for e in range(8)]
        tensors[f"{p}gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
        tensors[f"{p}down_proj"] = torch.stack(down)
    save_file(tensors, str(stacked_dir / "model.safetensors"))
    _, model = _spartron(stacked_dir)
    tokens = _tokens()
    assert (_logits(model, tokens) - _hf_logits(hf_model, tokens)).abs().max().item() <= ATOL
    _assert_bitwise(_tensors(export_hf(model, tmp_path / "out")), _tensors(hf_dir))


# ---- MTP -------------------------------------------------------------------------------------------
def _with_mtp(hf_dir: Path, out: Path, seed: int = 5, n_layers: int = 3) -> dict[str, torch.Tensor]:
    """A copy of hf_dir with a DeepSeek-V3 MTP layer (model.layers.{n_layers}.*) in a second shard; returns
    every tensor of the copy."""
    shutil.copytree(hf_dir, out)
    main = _tensors(hf_dir)
    gen = torch.Generator().manual_seed(seed)
    mtp, m = {}, f"model.layers.{n_layers}."
    for name, t in main.items():  # the MTP layer's decoder: the shapes of MoE layer 1, its own values
        if name.startswith("model.layers.1."):
            noise = 0.2 * torch.randn(t.shape, generator=gen)
            norm = t.dim() == 1 and "norm" in name
            mtp[name.replace("model.layers.1.", m)] = 1 + noise if norm else noise
    d = main["model.norm.weight"].shape[0]
    mtp[f"{m}enorm.weight"] = 1 + 0.2 * torch.randn(d, generator=gen)
    mtp[f"{m}hnorm.weight"] = 1 + 0.2 * torch.randn(d, generator=gen)
    mtp[f"{m}shared_head.norm.weight"] = 1 + 0.2 * torch.randn(d, generator=gen)
    mtp[f"{m}eh_proj.weight"] = 0.2 * torch.randn(d, 2 * d, generator=gen)
    mtp[f"{m}embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    mtp[f"{m}shared_head.head.weight"] = main["lm_head.weight"].clone()
    save_file(mtp, str(out / "mtp.safetensors"))
    index = {"metadata": {}, "weight_map": {**{n: "model.safetensors" for n in main},
                                            **{n: "mtp.safetensors" for n in mtp}}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((out / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    return {**main, **mtp}


def test_mtp_layer_imports_round_trips_bitwise_and_matches_transformers_mtp_layer(hf_dirs, tmp_path):
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
        DeepseekV3RotaryEmbedding,
    )

    hf_dir, hf_model = hf_dirs["moe"]
    written = _with_mtp(hf_dir, tmp_path / "mtp")
    cfg, model = _spartron(tmp_path / "mtp")
    assert cfg.mtp.depth == 1 and model.mtp is not None
    # transformers' own MTP layer (speculative decoding) with the same weights: an MoE decoder layer
    hf_cfg = copy.deepcopy(hf_model.config)
    hf_cfg.first_k_dense_replace = 0  # the MTP layer is an MoE layer (transformers numbers MTP layers from 0)
    hf_cfg._attn_implementation = "eager"  # a 4D causal mask from create_causal_mask
    layer = MtpLayer(hf_cfg, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, 0).eval()
    state = {}
    for name, t in written.items():
        if name.startswith("model.layers.3.") and "embed_tokens" not in name and "shared_head.head" not in name:
            state[name[len("model.layers.3."):]] = t
    state = {("post_norm." + k[len("shared_head.norm."):] if k.startswith("shared_head.norm.") else
              k if k.split(".")[0] in ("enorm", "hnorm", "eh_proj") else "mtp_block." + k): v for k, v in state.items()}
    e = "mtp_block.mlp.experts."
    state[e + "gate_up_proj"] = torch.stack([torch.cat([state.pop(f"{e}{i}.gate_proj.weight"),
                                                        state.pop(f"{e}{i}.up_proj.weight")]) for i in range(8)])
    state[e + "down_proj"] = torch.stack([state.pop(f"{e}{i}.down_proj.weight") for i in range(8)])
    layer.load_state_dict(state, strict=True)
    tokens = _tokens()
    positions = torch.arange(tokens.shape[1])
    with torch.no_grad():
        h = run_decoder_stack(list(model.layers.values()), model.embed(tokens), positions).hidden_states
        emb = model.embed(shift_left(tokens, 1, 0))
        ours = model.mtp.blocks[0].final_norm(model.mtp.blocks[0](h, emb, positions, None)["hidden_states"])
        rope = DeepseekV3RotaryEmbedding(hf_cfg)(emb, positions[None])
        mask = create_causal_mask(config=hf_cfg, inputs_embeds=emb, attention_mask=None, cache=None,
                                  position_ids=positions[None])
        theirs = layer(emb, h, rope, mask, positions[None], None)
    assert (ours - theirs).abs().max().item() <= ATOL
    out = export_hf(model, tmp_path / "out", with_mtp=True)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    _assert_bitwise(_tensors(out), written)
    reloaded = DeepseekV3ForCausalLM.from_pretrained(out).eval()  # transformers ignores layer 3, loads the rest
    assert (_hf_logits(reloaded, tokens) - _hf_logits(hf_model, tokens)).abs().max().item() <= ATOL


def test_mtp_copy_of_the_embedding_must_equal_the_model_embedding(hf_dirs, tmp_path):
    written = _with_mtp(hf_dirs["moe"][0], tmp_path / "mtp")
    tensors = load_file(tmp_path / "mtp" / "mtp.safetensors")
    tensors["model.layers.3.embed_tokens.weight"][0, 0] += 1.0
    save_file(tensors, str(tmp_path / "mtp" / "mtp.safetensors"))
    assert written  # the unmodified copy imports (previous test); this one must not
    cfg, load = import_hf(tmp_path / "mtp")
    with pytest.raises(HFCheckpointError, match=r"model\.layers\.3\.embed_tokens\.weight differs from the "
                                                r"model's embed\.weight"):
        load(build_model(cfg))


# ---- streaming -------------------------------------------------------------------------------------
def test_export_shards_and_import_streams_one_shard_at_a_time(hf_dirs, tmp_path, monkeypatch):
    hf_dir, hf_model = hf_dirs["moe"]
    _, model = _spartron(hf_dir)
    out = export_hf(model, tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4 and shards == sorted(p.name for p in out.glob("*.safetensors"))
    sizes = [(out / s).stat().st_size for s in shards]
    largest = max(t.numel() * 4 for t in _tensors(hf_dir).values())
    assert max(sizes) <= 40_000 + largest + 10_000  # a shard overflows only by its one oversized tensor
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in _tensors(out).values())
    fetched = []

    class Counting(ModelSource):
        def fetch(self, names):
            fetched.extend(names)
            return super().fetch(names)

    export_hf(Counting(model), tmp_path / "counted", max_shard_bytes=40_000)
    assert sorted(fetched) == sorted(model.state_dict())  # each tensor read once over all shards
    real_open, open_now, peak, opened = safetensors.safe_open, [0], [0], []

    class Recording:
        def __init__(self, path, framework):
            self.inner = real_open(path, framework=framework)
            opened.append(Path(path).name)

        def __enter__(self):
            open_now[0] += 1
            peak[0] = max(peak[0], open_now[0])
            return self.inner.__enter__()

        def __exit__(self, *exc):
            open_now[0] -= 1
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    _, again = _spartron(out)
    assert peak[0] == 1 and set(opened) == set(shards)
    tokens = _tokens()
    assert (_logits(again, tokens) - _hf_logits(hf_model, tokens)).abs().max().item() <= ATOL


def _ep_rank(rank, world, hf_dir: str, run_dir: str):
    """EP2 (experts split over the ranks, FSDP2 over both): load from HF, save the state by state.py."""
    from spartron.parallel.dims import ParallelDims
    from spartron.parallel.groups import ParallelGroups
    from spartron.runtime.config import config_from_dict
    from spartron.runtime.optim import build_optimizer
    from spartron.runtime.state import save_state, state_config
    from spartron.runtime.state_layout import expert_mesh
    from spartron.runtime.trainer import default_model_factory

    model_cfg, load = import_hf(hf_dir)
    cfg = config_from_dict({"device": "cpu", "model": model_cfg.model_dump(mode="json"), "parallel": {"ep": 2},
                            "train": {"seq_len": 16}})
    dims = ParallelDims(world, fsdp=cfg.parallel.resolve_fsdp(world), ep=2)
    groups = ParallelGroups.build(dims, "cpu")
    model = default_model_factory(cfg, groups)
    load(model)
    w1 = model.layers["1"].ffn.experts.w1
    local = w1.to_local() if hasattr(w1, "to_local") else w1
    experts = [n for n, _ in model.named_parameters() if "experts" in n.split(".")]
    save_state(run_dir, 3, model, build_optimizer(model, cfg.train), {"tokens": 0}, {}, torch.device("cpu"),
               ep_sharded=experts, ep_rank=groups.rank_in("ep"), ep_mesh=expert_mesh(groups), layout=dims.describe(),
               config=state_config(cfg))
    try:
        export_hf(model, Path(run_dir).parent / f"in-memory-{rank}")
        refused = None
    except HFCheckpointError as err:
        refused = str(err)
    embed = model.embed.weight
    assert embed.to_local().shape[0] < embed.shape[0]  # FSDP2 shards the dense weights over both ranks
    return model.layers["1"].ffn.experts.first_expert, local.detach().tolist(), refused  # plain data: the pipe


def test_expert_parallel_ranks_load_their_experts_and_their_saved_state_exports_bitwise(hf_dirs, tmp_path):
    from spartron.runtime.state import step_dir
    from spartron.testing import run_distributed

    hf_dir, hf_model = hf_dirs["moe"]
    results = run_distributed(_ep_rank, 2, str(hf_dir), str(tmp_path / "run"), timeout=180)
    tensors = _tensors(hf_dir)
    for first, local, refused in results:
        assert refused == ("layers.1.ffn.experts holds 4 of 8 experts (expert parallel): export the saved "
                           "state instead")
        local = torch.tensor(local)
        assert first in (0, 4) and local.shape[0] == 4
        expected = torch.stack([tensors[f"model.layers.1.mlp.experts.{first + e}.gate_proj.weight"]
                                for e in range(4)])
        assert torch.equal(local, expected[: local.shape[0]])  # (each rank's FSDP shard of its experts)
    out = export_hf(SavedStateSource(step_dir(tmp_path / "run", 3)), tmp_path / "out")
    _assert_bitwise(_tensors(out), tensors)
    tokens = _tokens()
    reloaded = DeepseekV3ForCausalLM.from_pretrained(out).eval()
    assert (_hf_logits(reloaded, tokens) - _hf_logits(hf_model, tokens)).abs().max().item() <= ATOL


def _fsdp_rank(rank, world, hf_dir: str, out: str):
    from spartron.parallel.dims import ParallelDims
    from spartron.parallel.groups import ParallelGroups
    from spartron.runtime.config import config_from_dict
    from spartron.runtime.trainer import default_model_factory

    model_cfg, load = import_hf(hf_dir)
    cfg = config_from_dict({"device": "cpu", "model": model_cfg.model_dump(mode="json"), "train": {"seq_len": 16}})
    model = default_model_factory(cfg, ParallelGroups.build(ParallelDims(world, fsdp=world), "cpu"))
    load(model)
    export_hf(model, out)  # every rank gathers, rank 0 writes
    return model.layers["1"].ffn.experts.w1.to_local().shape[0]


def test_fsdp2_model_exports_in_memory_bitwise(hf_dirs, tmp_path):
    from spartron.testing import run_distributed

    hf_dir, _ = hf_dirs["moe"]
    local_experts = run_distributed(_fsdp_rank, 2, str(hf_dir), str(tmp_path / "out"), timeout=180)
    assert local_experts == [4, 4]  # FSDP2 shards the 8 experts over the 2 ranks
    _assert_bitwise(_tensors(tmp_path / "out"), _tensors(hf_dir))


def _train_from_hf(rank, world, cfg, hf_dir: str):
    from spartron.runtime.hf_state import hf_initialised
    from spartron.runtime.trainer import default_model_factory, train

    return train(cfg, model_factory=hf_initialised(default_model_factory, hf_dir)).records[0]["loss"]


def test_the_trainer_starts_from_hf_weights_on_any_layout(hf_dirs, tmp_path):
    """One rank and EP2 x FSDP2 start from the same HF weights: the same step-1 loss (to reduction
    order), and not the seed's initial model's."""
    from spartron.runtime.config import config_from_dict
    from spartron.runtime.trainer import train
    from spartron.testing import run_distributed

    hf_dir, _ = hf_dirs["moe"]

    def cfg(name: str, ep: int):
        return config_from_dict({"device": "cpu", "model": import_hf(hf_dir)[0].model_dump(mode="json"),
                                 "parallel": {"ep": ep}, "train": {"steps": 1, "seq_len": 16, "global_batch_size": 2,
                                                                   "progress": False, "peak_tflops": 1.0,
                                                                   "run_dir": str(tmp_path / name)}})

    (one,) = run_distributed(_train_from_hf, 1, cfg("one", 1), str(hf_dir), timeout=180)
    two = run_distributed(_train_from_hf, 2, cfg("two", 2), str(hf_dir), timeout=180)
    (seed,) = run_distributed(lambda r, w, c: train(c).records[0]["loss"], 1, cfg("seed", 1), timeout=180)
    assert two[0] == two[1] == pytest.approx(one, rel=1e-6, abs=0)
    assert abs(seed - one) > 1e-3


# ---- saved state -----------------------------------------------------------------------------------
def _resume_rank(rank, world, cfg):
    from spartron.runtime.trainer import train

    result = train(cfg)
    return result.resumed_from, [r["step"] for r in result.records]


def test_import_to_saved_state_resumes_in_the_trainer_and_exports_back(hf_dirs, tmp_path):
    from spartron.runtime.config import config_from_dict
    from spartron.runtime.optim import build_optimizer
    from spartron.runtime.state import load_state
    from spartron.testing import run_distributed

    hf_dir, hf_model = hf_dirs["moe"]
    base = config_from_dict({"device": "cpu", "train": {"steps": 1, "seq_len": 16, "global_batch_size": 2,
                                                        "progress": False, "peak_tflops": 1.0,
                                                        "run_dir": str(tmp_path / "run")}})
    step, cfg = import_hf_to_state(hf_dir, tmp_path / "run", base)
    assert step.name == "step-00000000" and cfg.model == import_hf(hf_dir)[0]
    fresh = build_model(cfg.model, seed=123)
    load_state(step, fresh, build_optimizer(fresh, cfg.train), torch.device("cpu"))
    _, imported = _spartron(hf_dir)
    theirs = dict(imported.state_dict())
    assert [n for n, t in fresh.state_dict().items() if not torch.equal(t, theirs[n])] == []
    out = export_hf(SavedStateSource(tmp_path / "run"), tmp_path / "out")  # a run directory: its newest step
    _assert_bitwise(_tensors(out), _tensors(hf_dir))
    ((resumed, steps),) = run_distributed(_resume_rank, 1, cfg, timeout=180)
    assert (resumed, steps) == (0, [1])


def test_import_to_saved_state_with_the_triton_adamw_kernel_configured(hf_dirs, tmp_path):
    """The import builds a CPU model: it takes torch's AdamW (same state keys) even when the run will
    train with train.adamw_kernel = 'triton', which needs CUDA."""
    from spartron.runtime.config import config_from_dict

    base = config_from_dict({"device": "cpu", "train": {"steps": 1, "seq_len": 16, "global_batch_size": 2,
                                                        "adamw_kernel": "triton", "progress": False}})
    step, cfg = import_hf_to_state(hf_dirs["moe"][0], tmp_path / "run", base)
    assert step.name == "step-00000000" and cfg.train.adamw_kernel == "triton"


# ---- config ----------------------------------------------------------------------------------------
DEEPSEEK_V3 = {  # the published DeepSeek-V3 config.json, without its fp8 quantization_config
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def test_published_deepseek_v3_config_maps_to_spartron():
    cfg = model_config_from_hf(DEEPSEEK_V3, mtp_layers=1)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.first_k_dense, cfg.dense_inter_dim, cfg.vocab_size,
            cfg.dtype, cfg.max_seq_len, cfg.mtp.depth) == (7168, 61, 128, 3, 18432, 129280, "bfloat16", 163840, 1)
    assert cfg.mla.model_dump() == {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                                    "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 10000.0,
                                    "yarn": {"factor": 40.0, "original_max_position_embeddings": 4096,
                                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                             "mscale_all_dim": 1.0}}
    m = cfg.moe
    assert (m.n_routed_experts, m.n_shared_experts, m.top_k, m.moe_inter_dim, m.score_func, m.n_groups,
            m.topk_groups, m.route_scale, m.norm_topk_prob, m.aux_loss_coeff, m.aux_loss_type) == (
        256, 1, 8, 2048, "sigmoid", 8, 4, 2.5, True, 0.001, "seq")
    assert model_config_from_hf(DEEPSEEK_V3, mtp_layers=0).mtp.depth == 0  # the weights decide
    back = hf_config_from_model_config(cfg)
    assert model_config_from_hf(back, mtp_layers=1) == cfg
    assert model_config_from_toml(model_toml(cfg)) == cfg
    assert model_toml(cfg).startswith("[model]\n")


def test_every_setting_spartron_cannot_honour_is_in_one_error():
    bad = {**DEEPSEEK_V3, "hidden_act": "gelu", "attention_bias": True, "rope_interleave": False,
           "rms_norm_eps": 1e-5, "scoring_func": "softmax", "num_key_value_heads": 64, "sliding_window": 4096,
           "quantization_config": {"quant_method": "fp8"},
           "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0}}
    with pytest.raises(HFConfigError) as err:
        model_config_from_hf(bad)
    message = str(err.value)
    keys = ["hidden_act", "attention_bias", "rope_interleave", "rms_norm_eps", "scoring_func", "num_key_value_heads",
            "sliding_window", "quantization_config", "rope_scaling.mscale/mscale_all_dim"]
    assert message.startswith(f"Hugging Face config.json: {len(keys)} setting(s) cannot be honoured: ")
    assert [k for k in keys if f"{k}: " not in message] == []
    assert "\n" not in message
    with pytest.raises(HFConfigError, match=r"model_type: 'llama'"):
        model_config_from_hf({**DEEPSEEK_V3, "model_type": "llama"})


def test_spartron_settings_transformers_cannot_express_are_in_one_error():
    cfg = model_config_from_hf(DEEPSEEK_V3)
    bad = cfg.model_copy(update={"norm_eps": 1e-5, "moe": cfg.moe.model_copy(update={"score_func": "softmax"})})
    with pytest.raises(HFConfigError, match=r"2 setting\(s\) cannot be honoured: model\.moe\.score_func: "
                                            r"'softmax'.*; model\.norm_eps: 1e-05"):
        hf_config_from_model_config(bad)


def test_a_run_config_that_computes_another_function_than_the_checkpoint_is_named_key_by_key():
    cfg = model_config_from_hf(DEEPSEEK_V3)
    run = cfg.model_copy(update={"dtype": "float32", "loss_chunk_size": 4096,  # how Spartron runs it: allowed
                                 "moe": cfg.moe.model_copy(update={"route_scale": 1.0, "dispatcher": "deepep"}),
                                 "mla": cfg.mla.model_copy(update={"yarn": None})})
    check_config_matches(run.model_copy(update={"moe": cfg.moe.model_copy(update={"dispatcher": "deepep"}),
                                                "mla": cfg.mla}), cfg)
    # FP8 GEMMs and DSA's chunking are how the same function is computed: an FP8 run starts from bf16 HF weights
    check_config_matches(cfg.model_copy(update={"fp8": FP8Config(backend="reference"), "master_dtype": "float32"}), cfg)
    with pytest.raises(HFConfigError) as err:
        check_config_matches(run, cfg)
    assert str(err.value) == (
        "the run's [model] differs from the Hugging Face checkpoint in 2 setting(s): "
        "model.mla.yarn: the run has None, the checkpoint {'factor': 40.0, 'original_max_position_embeddings': 4096, "
        "'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': 1.0, 'mscale_all_dim': 1.0}; "
        "model.moe.route_scale: the run has 1.0, the checkpoint 2.5")


def test_name_table_covers_exactly_the_models_state_dict():
    for variant, extra in VARIANTS.items():
        hf = DeepseekV3Config(**{**BASE, **extra}).to_dict()
        for mtp in (0, 2):
            cfg = model_config_from_hf({**hf, "num_nextn_predict_layers": mtp}, mtp_layers=mtp)
            shapes = {n: tuple(t.shape) for n, t in build_model(cfg).state_dict().items()}
            assert tensor_map(cfg).shapes == shapes, (variant, mtp)


def test_checkpoint_that_does_not_match_its_config_is_refused(hf_dirs, tmp_path):
    hf_dir, _ = hf_dirs["dense"]
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    tensors = _tensors(hf_dir)
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    tensors["model.layers.1.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"tensors do not match its config.json \(missing 1: "
                                                r"model\.layers\.1\.self_attn\.o_proj\.weight; unexpected 1: "
                                                r"model\.layers\.1\.self_attn\.extra\.weight; its num_hidden_layers, "
                                                r"first_k_dense_replace, n_routed_experts, num_nextn_predict_layers "
                                                r"and q_lora_rank decide which tensors exist\)"):
        import_hf(broken)[1](build_model(import_hf(hf_dir)[0]))
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(HFCheckpointError, match=r"'a' -> '\.\./x\.safetensors' is not a \.safetensors file in"):
        import_hf(broken)


# ---- CLI -------------------------------------------------------------------------------------------
def test_cli_convert_both_ways(hf_dirs, tmp_path, capsys):
    from spartron.launch.cli import main

    hf_dir, hf_model = hf_dirs["moe"]
    assert main(["convert", "--from-hf", str(hf_dir), "--to", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "step-00000000" / "COMPLETE").is_file()
    assert model_config_from_toml((tmp_path / "run" / "model.toml").read_text()) == import_hf(hf_dir)[0]
    assert main(["convert", "--from", str(tmp_path / "run"), "--to-hf", str(tmp_path / "hf")]) == 0
    _assert_bitwise(_tensors(tmp_path / "hf"), _tensors(hf_dir))
    capsys.readouterr()
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    (bad / "config.json").write_text(json.dumps({**json.loads((hf_dir / "config.json").read_text()),
                                                  "hidden_act": "gelu"}))
    assert main(["convert", "--from-hf", str(bad), "--to", str(tmp_path / "run2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spartron: error: Hugging Face config.json: 1 setting(s) cannot be honoured: "
                          "hidden_act: 'gelu'") and err.count("\n") == 1
    assert main(["convert", "--from-hf", str(hf_dir), "--to-hf", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == ("spartron: error: --from-hf goes with --to RUN_DIR (a saved state), --from "
                                       "with --to-hf DIR\n")
    assert main(["convert", "--from-hf", str(hf_dir), "--to", str(tmp_path / "run")]) == 2  # not a new directory
    assert capsys.readouterr().err.startswith(f"spartron: error: {tmp_path / 'run'}: exists and is not an empty")
    damaged = tmp_path / "run" / "step-00000000" / "__0_0.distcp"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"x")
    assert main(["convert", "--from", str(tmp_path / "run"), "--to-hf", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert f"{damaged}: CRC-32" in err and "corrupted" in err and err.count("\n") == 1


def test_rope_scaling_beside_rope_parameters_that_say_otherwise_is_refused():
    """transformers 5 takes rope_scaling's and drops rope_parameters' when both are set: the import refused
    neither and ran rope_parameters' (plain RoPE where transformers runs YaRN)."""
    v5 = {k: v for k, v in DEEPSEEK_V3.items() if k not in ("rope_scaling", "rope_theta")}
    yarn = DEEPSEEK_V3["rope_scaling"]
    both = {**v5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_scaling": yarn}
    with pytest.raises(HFConfigError, match=r"rope_scaling: set beside rope_parameters, which says otherwise "
                                            r"\(transformers 5 takes rope_scaling's"):
        model_config_from_hf(both)
    same = {**v5, "rope_parameters": {**yarn, "rope_theta": 10000.0}, "rope_scaling": yarn}
    assert model_config_from_hf(same).mla == model_config_from_hf(DEEPSEEK_V3).mla


def test_a_run_with_fp32_masters_is_exported_as_float32():
    """The export writes the stored tensors (the fp32 masters): config.json's dtype says so, and an import
    builds a float32 model from them (it built a bf16 one and rounded every weight)."""
    cfg = model_config_from_hf(DEEPSEEK_V3).model_copy(update={"master_dtype": "float32"})
    hf = hf_config_from_model_config(cfg)
    assert (cfg.dtype, hf["torch_dtype"]) == ("bfloat16", "float32")
    assert model_config_from_hf(hf).dtype == "float32"
    assert hf_config_from_model_config(model_config_from_hf(DEEPSEEK_V3))["torch_dtype"] == "bfloat16"
