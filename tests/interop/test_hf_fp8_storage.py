"""DeepSeek's FP8 checkpoints (E4M3 linear weights with blockwise `weight_scale_inv`, config.json's
quantization_config) are imported dequantised, equal to the same checkpoint stored in float32 with the
dequantised values; what does not fit the format is one refusal naming the tensor or the key."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hf_fixtures import cli, loaded_model
from safetensors.torch import load_file, save_file

from spartron.interop.hf import HFCheckpointError, HFConfigError, import_hf
from spartron.interop.hf.fp8_storage import dequantize, scale_box

QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [16, 8]}
WQ = "model.layers.1.self_attn.q_a_proj.weight"


def stored_fp8(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 values, fp32 scale_inv per block, the dequantised float32 weight) of `w`, as DeepSeek stores it."""
    rows, cols = w.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = w
    blocks = padded.view(grid[0], block[0], grid[1], block[1])
    scales = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    full = scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scales, q.float() * full


def fp8_checkpoint(hf_dir: Path, out: Path, quant: dict = QUANT) -> dict[str, torch.Tensor]:
    """`hf_dir` re-stored as DeepSeek's FP8 release is (every 2-D weight of a decoder layer but the router's in
    E4M3 with scales); returns the dequantised float32 tensors, what the import must hold."""
    shutil.copytree(hf_dir, out)
    tensors, expected = load_file(out / "model.safetensors"), {}
    stored = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and t.dim() == 2 and not name.endswith("mlp.gate.weight"):
            q, s, deq = stored_fp8(t, quant["weight_block_size"])
            stored[name], stored[name + "_scale_inv"], expected[name] = q, s, deq
        else:
            stored[name], expected[name] = t, t
    save_file(stored, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return expected


def test_an_fp8_checkpoint_imports_as_its_dequantised_float32_twin(hf_dir, tmp_path):
    expected = fp8_checkpoint(hf_dir, tmp_path / "fp8")
    twin = tmp_path / "twin"
    shutil.copytree(hf_dir, twin)
    save_file(expected, str(twin / "model.safetensors"))
    assert not torch.equal(expected[WQ], load_file(hf_dir / "model.safetensors")[WQ])  # the rounding is real
    ours, theirs = loaded_model(tmp_path / "fp8"), loaded_model(twin)
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_box_of_a_weight_dequantises_as_the_whole_one_does():
    torch.manual_seed(0)
    w = torch.randn(40, 19)
    q, s, whole = stored_fp8(w, [16, 8])
    for src in (((0, 40), (0, 19)), ((5, 33), (3, 17)), ((16, 32), (8, 16)), ((39, 40), (18, 19))):
        scales = s[tuple(slice(a, b) for a, b in scale_box(src, (16, 8)))]
        part = dequantize(q[src[0][0]:src[0][1], src[1][0]:src[1][1]], scales, src, (16, 8))
        assert torch.equal(part, whole[src[0][0]:src[0][1], src[1][0]:src[1][1]]), src


def test_deepseeks_own_block_of_128_reads_too(hf_dir, tmp_path):
    expected = fp8_checkpoint(hf_dir, tmp_path / "fp8", {**QUANT, "weight_block_size": [128, 128]})
    model = loaded_model(tmp_path / "fp8")
    assert torch.equal(model.layers["1"].attn.wq_a.weight, expected[WQ])


def _edit(path: Path, change) -> None:  # noqa: ANN001 - a function of the tensors dict
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize(("edit", "why"), [
    (lambda t: t.pop(WQ + "_scale_inv"), f"{WQ} is F8_E4M3 without its {WQ}_scale_inv"),
    (lambda t: t.update({WQ + "_scale_inv": torch.ones(3, 3)}),
     f"{WQ}_scale_inv is F32 [3, 3]; [24, 32] in blocks of [16, 8] needs float32 or bfloat16 [2, 4]"),
    (lambda t: t.update({WQ + "_scale_inv": torch.ones(2, 4, dtype=torch.float8_e4m3fn)}),
     f"{WQ}_scale_inv is F8_E4M3 [2, 4]; [24, 32] in blocks of [16, 8] needs float32 or bfloat16 [2, 4]"),
    (lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1, 1)}),
     "model.norm.weight_scale_inv scales no F8_E4M3 tensor model.norm.weight"),
])
def test_scales_that_do_not_fit_are_refused_before_anything_is_read(hf_dir, tmp_path, edit, why):
    path = tmp_path / "fp8"
    fp8_checkpoint(hf_dir, path)
    _edit(path, edit)
    with pytest.raises(HFCheckpointError) as info:
        import_hf(path)
    assert str(info.value) == f"{path}: {why} (config.json's quantization_config stores blockwise FP8)"


def test_a_non_finite_scale_is_refused_as_the_weight_is_read(hf_dir, tmp_path):
    path = tmp_path / "fp8"
    fp8_checkpoint(hf_dir, path)
    _edit(path, lambda t: t[WQ + "_scale_inv"].__setitem__((1, 2), float("inf")))
    cfg, load = import_hf(path)
    from spartron.layers.model import build_model

    with pytest.raises(HFCheckpointError) as info:
        load(build_model(cfg))
    assert str(info.value) == (f"{path / 'model.safetensors'}: {WQ} holds non-finite values (NaN or Inf): nothing "
                               "is imported from a checkpoint with them")


def test_without_a_quantization_config_scales_are_unexpected_and_e4m3_a_refused_dtype(hf_dir, tmp_path):
    path = tmp_path / "fp8"
    fp8_checkpoint(hf_dir, path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match=r"fp8: tensors do not match its config.json \(unexpected 28: "
                                                r"model.layers.0.mlp.down_proj.weight_scale_inv, "):
        import_hf(path)
    _edit(path, lambda t: [t.pop(n) for n in [n for n in t if n.endswith("_scale_inv")]])
    with pytest.raises(HFCheckpointError) as info:
        import_hf(path)
    assert str(info.value) == (f"{path / 'model.safetensors'}: model.layers.0.mlp.down_proj.weight is F8_E4M3; "
                               "Spartron imports float32, bfloat16 or float16 weights (dequantize or convert it "
                               "first)")


@pytest.mark.parametrize(("quant", "why"), [
    ({**QUANT, "fmt": "e5m2"}, "Spartron reads DeepSeek's blockwise FP8 (quant_method 'fp8', fmt 'e4m3'); "
                               "dequantize other formats to bfloat16 first"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "unknown keys ['load_in_4bit']: Spartron reads "
                                                             "DeepSeek's blockwise FP8 only"),
    ({**QUANT, "weight_block_size": [128]}, "weight_block_size [128] must be two integers in 1..65536"),
    ({**QUANT, "activation_scheme": "static"}, "activation_scheme must be 'dynamic' (static activation scales "
                                               "are an inference format)"),
    ("fp8", "must be a JSON object (DeepSeek's blockwise FP8) or absent"),
])
def test_another_quantization_config_is_refused_naming_the_key(hf_dir, tmp_path, quant, why):
    path = tmp_path / "fp8"
    fp8_checkpoint(hf_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(HFConfigError) as info:
        import_hf(path)
    assert f"quantization_config: {quant!r}: {why}" in str(info.value)


def test_convert_from_an_fp8_checkpoint_through_the_cli(hf_dir, tmp_path):
    expected = fp8_checkpoint(hf_dir, tmp_path / "fp8")
    done = cli("convert", "--from-hf", str(tmp_path / "fp8"), "--to", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    back = cli("convert", "--to-hf", str(tmp_path / "back"), "--from", str(tmp_path / "run"), cwd=tmp_path)
    assert back.returncode == 0, back.stderr[-2000:]
    exported = {n: t for f in (tmp_path / "back").glob("*.safetensors") for n, t in load_file(f).items()}
    assert torch.equal(exported[WQ], expected[WQ]) and not any(n.endswith("_scale_inv") for n in exported)
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    _edit(tmp_path / "fp8", lambda t: t.pop(WQ + "_scale_inv"))
    refused = cli("convert", "--from-hf", str(tmp_path / "fp8"), "--to", str(tmp_path / "run2"), cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [f"spartron: error: {tmp_path / 'fp8'}: {WQ} is F8_E4M3 without its "
                                           f"{WQ}_scale_inv (config.json's quantization_config stores blockwise FP8)"]


def test_a_scale_in_another_shard_than_its_weight_is_read_from_there(hf_dir, tmp_path):
    path = tmp_path / "fp8"
    expected = fp8_checkpoint(hf_dir, path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    second = {n: tensors.pop(n) for n in list(tensors) if n.endswith("_scale_inv")}
    save_file(tensors, str(path / "model-00001-of-00002.safetensors"))
    save_file(second, str(path / "model-00002-of-00002.safetensors"))
    weight_map = {**{n: "model-00001-of-00002.safetensors" for n in tensors},
                  **{n: "model-00002-of-00002.safetensors" for n in second}}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(loaded_model(path).layers["1"].attn.wq_a.weight, expected[WQ])


def _fsdp_rank(rank, world, hf_dir: str, out: str):
    from spartron.interop.hf import export_hf
    from spartron.parallel.dims import ParallelDims
    from spartron.parallel.groups import ParallelGroups
    from spartron.runtime.config import config_from_dict
    from spartron.runtime.trainer import default_model_factory

    model_cfg, load = import_hf(hf_dir)
    cfg = config_from_dict({"device": "cpu", "model": model_cfg.model_dump(mode="json"), "train": {"seq_len": 16}})
    model = default_model_factory(cfg, ParallelGroups.build(ParallelDims(world, fsdp=world), "cpu"))
    load(model)  # each rank reads its FSDP2 rows: boxes that start inside a scale block (12 of 24 rows, blocks of 16)
    export_hf(model, out)
    return model.layers["1"].attn.wq_a.weight.to_local().shape[0]


def test_fsdp2_ranks_read_their_boxes_of_an_fp8_checkpoint(hf_dir, tmp_path):
    from spartron.testing import run_distributed

    expected = fp8_checkpoint(hf_dir, tmp_path / "fp8")
    rows = run_distributed(_fsdp_rank, 2, str(tmp_path / "fp8"), str(tmp_path / "out"), timeout=180)
    assert rows == [12, 12]
    exported = {n: t for f in (tmp_path / "out").glob("*.safetensors") for n, t in load_file(f).items()}
    assert set(exported) == set(expected)  # the weights, dequantised; no scale is exported
    for name, t in exported.items():
        assert torch.equal(t, expected[name]), name


# ---- export: `spartron convert --to-hf DIR --fp8-weights` ------------------------------------------------------
EXPORT_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def _tensors(hf: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(hf.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def test_an_fp8_export_is_deepseeks_release_format_and_imports_back_dequantised(run_dir, tmp_path):
    """The decoder layers' 2-D weights (not the router's gate) as E4M3 with a float32 scale_inv per 128 x 128
    block (partial blocks at the edges), everything else as the plain export writes it, config.json with
    DeepSeek's quantization_config; importing it gives each weight's dequantised value, in Spartron and in
    transformers' DeepseekV3ForCausalLM alike."""
    fp8, plain = tmp_path / "fp8", tmp_path / "plain"
    done = cli("convert", "--from", str(run_dir), "--to-hf", str(fp8), "--fp8-weights", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert cli("convert", "--from", str(run_dir), "--to-hf", str(plain), cwd=tmp_path).returncode == 0
    assert json.loads((fp8 / "config.json").read_text()) == {
        **json.loads((plain / "config.json").read_text()), "quantization_config": EXPORT_QUANT}
    ours, reference = _tensors(fp8), _tensors(plain)
    expected, quantized = {}, []
    for name, t in reference.items():
        if name.startswith("model.layers.") and t.dim() == 2 and not name.endswith("mlp.gate.weight"):
            q, s, expected[name] = stored_fp8(t.float(), [128, 128])
            assert ours[name].dtype == torch.float8_e4m3fn and torch.equal(ours[name].view(torch.uint8),
                                                                           q.view(torch.uint8)), name
            assert torch.equal(ours[name + "_scale_inv"], s), name
            quantized.append(name)
        else:
            assert torch.equal(ours[name], t), name
            expected[name] = t
    assert len(quantized) > 20 and sorted(ours) == sorted([*reference, *(n + "_scale_inv" for n in quantized)])
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(ours)
    twin = tmp_path / "twin"
    shutil.copytree(plain, twin)
    for shard in twin.glob("*.safetensors"):
        save_file({n: expected[n] for n in load_file(shard)}, str(shard), metadata={"format": "pt"})
    back, want = loaded_model(fp8), loaded_model(twin)
    for (name, a), (_, b) in zip(back.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # transformers reads it too (its fine-grained FP8 loader, which dequantises without a GPU): the same values
    from transformers import DeepseekV3ForCausalLM

    theirs, twins = (DeepseekV3ForCausalLM.from_pretrained(d).state_dict() for d in (fp8, twin))
    assert sorted(theirs) == sorted(twins) and all(torch.equal(theirs[k], twins[k]) for k in theirs)


def test_the_export_stores_in_fp8_what_deepseeks_release_does():
    from spartron.interop.hf.fp8_storage import stored_in_fp8

    layer = "model.layers.3."
    assert [n for n in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj",
                        "self_attn.indexer.wq_b", "self_attn.indexer.wk", "mlp.experts.7.down_proj",
                        "mlp.shared_experts.gate_proj", "mlp.gate", "self_attn.indexer.weights_proj",
                        "embed_tokens", "shared_head.head")
            if stored_in_fp8(f"{layer}{n}.weight", (256, 512))] == [
        "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj",
        "self_attn.indexer.wq_b", "self_attn.indexer.wk", "mlp.experts.7.down_proj", "mlp.shared_experts.gate_proj"]
    assert not stored_in_fp8(f"{layer}input_layernorm.weight", (512,))
    assert not stored_in_fp8("model.embed_tokens.weight", (64, 512)) and not stored_in_fp8("lm_head.weight", (64, 512))


def test_fp8_weights_is_an_export_flag(tmp_path):
    done = cli("convert", "--from-hf", "hf", "--to", "run", "--fp8-weights", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "spartron: error: --fp8-weights goes with --to-hf DIR (an import reads FP8 weights dequantised as they are "
        "stored)"]
