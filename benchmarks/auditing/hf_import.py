"""Hugging Face import: a checkpoint folder (an export of a real tiny-hf run) made hostile -- tensors of the wrong
dtype or shape, NaN/Inf, corrupt or lying safetensors headers, hostile config.json sizes and types, an index that
points outside the folder, FIFOs and links -- each given to both entry points: `spartron convert --from-hf` and a
new run with `train.init_from = "hf:..."`."""

from __future__ import annotations

import os
import pickle
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.auditing import stfile as st
from benchmarks.auditing.core import Case, decoy, train

ENTRIES = {
    "convert": ["convert", "--from-hf", "hf", "--to", "out", "--config", "{tinyhf}"],
    # the export the cases start from omits the MTP layer (transformers does not load it): depth 0 here
    "init": train('train.init_from="hf:hf"', "name=init", "model.mtp.depth=0", preset="{tinyhf}"),
}
FLOAT_OK = "float weights are cast to the model's dtype (a bf16 checkpoint is how DeepSeek-V3 ships)"


def _nothing_left(case_dir: Path) -> str | None:
    """A refused import leaves no half-written run directory behind that would block the retry."""
    out = case_dir / "work" / "out"
    if out.exists() and any(out.iterdir()) and not any(out.glob("step-*/COMPLETE")):
        return f"left a partial {out.name}/ behind: {sorted(p.name for p in out.iterdir())[:4]}"
    return None


def _config(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    return st.json_edit("config.json", fn)


def _set(key: str, value) -> Callable[[Path], None]:  # noqa: ANN001 - any JSON value
    return _config(lambda c: c.__setitem__(key, value))


def _raw_config(text: bytes) -> Callable[[Path], None]:
    return lambda w: (w / "hf" / "config.json").write_bytes(text)


def _fifo(rel: str) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        path = work / "hf" / rel
        path.unlink()
        os.mkfifo(path)
    return setup


def _link(rel: str, target: Callable[[Path], str]) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        path = work / "hf" / rel
        path.unlink()
        path.symlink_to(target(work))
    return setup


def _hf_cache(work: Path) -> None:
    """The Hugging Face hub cache layout: snapshots/<rev>/ holds links into ../../blobs."""
    hf = work / "hf"
    blobs = work / "cache" / "blobs"
    snap = work / "cache" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, path in enumerate(sorted(hf.iterdir())):
        path.rename(blobs / f"blob{i}")
        (snap / path.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    hf.rmdir()
    (work / "hf").symlink_to(snap)


def _pickle_bin(work: Path) -> None:
    """Only a pytorch_model.bin whose pickle would create the marker."""
    class Reduce:
        def __reduce__(self):
            return os.system, (f"touch {work.parent / 'pwned'}",)

    for path in (work / "hf").glob("*.safetensors*"):
        path.unlink()
    (work / "hf" / "pytorch_model.bin").write_bytes(pickle.dumps(Reduce(), protocol=4))


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def _fp8_store(damage: Callable[[dict], None] | None = None) -> Callable[[Path], None]:
    """The checkpoint with one expert weight stored as DeepSeek's FP8 release stores it (E4M3 plus a 128 x 128
    block scale_inv, config.json's quantization_config), then `damage` applied to its tensors."""
    def setup(work: Path) -> None:
        path = work / "hf" / st.SHARD
        tensors = load_file(path)
        w = tensors[st.EXPERT].float()
        scale = (w.abs().amax() / 448).clamp(min=1e-12).reshape(1, 1)
        tensors[st.EXPERT] = (w / scale).to(torch.float8_e4m3fn)
        tensors[st.EXPERT + "_scale_inv"] = scale.expand(-(-w.shape[0] // 128), -(-w.shape[1] // 128)).contiguous()
        if damage is not None:
            damage(tensors)
        save_file(tensors, str(path))
        _set("quantization_config", FP8_CONFIG)(work)
        if (work / "hf" / st.INDEX).is_file():  # the index maps what the shard now holds
            st.json_edit(st.INDEX, lambda index: index.__setitem__("weight_map", {
                **{n: f for n, f in index["weight_map"].items() if n in tensors or f != st.SHARD},
                **{n: st.SHARD for n in tensors}}))(work)
    return setup


def _hostile() -> list[tuple]:
    """(id, setup, names, options) for every hostile checkpoint."""
    out: list[tuple] = []

    def add(cid, setup, names, category, **kw):
        out.append((cid, setup, tuple(names), category, kw))

    # dtypes: integer and bool weights are refused by name; other float widths are data
    for dtype in ("I8", "I16", "I32", "I64", "U8", "BOOL"):
        for tname, tensor in (("embed", st.EMBED), ("expert", st.EXPERT), ("bias", st.BIAS)):
            add(f"dtype-{dtype.lower()}-{tname}", st.retype(tensor, dtype), [tensor], "dtypes")
    for dtype in ("F16", "BF16", "F64"):
        add(f"dtype-{dtype.lower()}-embed", st.retype(st.EMBED, dtype), [st.EMBED], "dtypes", accept_ok=True,
            note=FLOAT_OK)
    add("dtype-f8-expert", st.retype(st.EXPERT, "F8_E4M3"), [st.EXPERT], "dtypes")
    # shapes
    for cid, tensor, shape in (("embed-transposed", st.EMBED, [64, 512]), ("embed-row-short", st.EMBED, [511, 64]),
                               ("embed-3d", st.EMBED, [1, 512, 64]), ("embed-flat", st.EMBED, [512 * 64]),
                               ("norm-scalar", st.NORM, []), ("expert-wide", st.EXPERT, [32, 65]),
                               ("bias-long", st.BIAS, [9]), ("expert-empty", st.EXPERT, [0, 64])):
        add(f"shape-{cid}", st.reshape(tensor, shape), [tensor], "dtypes")
    # NaN / Inf: accepted, the first step's loss guard stops the run; refusing at import would be better
    for cid, tensor, value in (("nan-embed", st.EMBED, float("nan")), ("inf-expert", st.EXPERT, float("inf")),
                               ("neginf-norm", st.NORM, float("-inf")), ("nan-bias", st.BIAS, float("nan"))):
        add(cid, st.poison(tensor, value), [tensor], "nonfinite", harmless=True)
    # tensors missing, extra, duplicated; index hostile
    add("missing-tensor", st.drop(st.EXPERT), [st.EXPERT], "corrupt")
    add("missing-norm", st.drop(st.NORM), [st.NORM], "corrupt")
    add("extra-tensor", st.add("model.layers.1.mlp.experts.99.up_proj.weight"), ["experts.99"], "corrupt",
        harmless=True)

    def duplicate(work: Path) -> None:
        st.split_shards(work)
        items, _ = st.tensors(work / "hf" / "model-00002-of-00002.safetensors")
        first, meta = st.tensors(work / "hf" / "model-00001-of-00002.safetensors")
        st.write(work / "hf" / "model-00001-of-00002.safetensors", {**first, st.EMBED: items[st.EMBED]}, meta)

    add("two-shards", st.split_shards, (), "values", accept_ok=True, note="a sharded checkpoint is the normal case")
    add("duplicate-tensor", duplicate, [st.EMBED], "corrupt")
    add("shard-missing", lambda w: (st.split_shards(w), (w / "hf" / "model-00002-of-00002.safetensors").unlink()),
        ["model-00002-of-00002"], "partial")
    add("shard-lacks-indexed", lambda w: (st.split_shards(w), st.edit(lambda i: i.pop(st.EMBED),
                                                                     "model-00002-of-00002.safetensors")(w)),
        [st.EMBED], "partial")
    index_map = lambda value: st.json_edit(st.INDEX, lambda d: d["weight_map"].__setitem__(st.EMBED, value))  # noqa
    add("index-traversal", index_map("../decoy/precious.txt"), ["../decoy", st.INDEX], "paths")
    add("index-absolute", index_map("/etc/passwd"), ["/etc/passwd", st.INDEX], "paths")
    add("index-not-string", index_map(123), [st.INDEX, st.EMBED], "dtypes")
    add("index-garbage", lambda w: (w / "hf" / st.INDEX).write_bytes(b"{\x00\xff"), [st.INDEX], "corrupt")
    add("index-list", lambda w: (w / "hf" / st.INDEX).write_text("[]"), [st.INDEX], "corrupt")
    add("index-empty-map", st.json_edit(st.INDEX, lambda d: d.__setitem__("weight_map", {})), [st.INDEX], "corrupt")
    add("index-fifo", _fifo(st.INDEX), [st.INDEX], "paths")
    add("no-safetensors", lambda w: [p.unlink() for p in (w / "hf").glob("*.safetensors*")], ["safetensors", "hf"],
        "partial")
    add("pickle-only", _pickle_bin, ["pytorch_model.bin", "safetensors"], "corrupt")
    add("dir-missing", lambda w: __import__("shutil").rmtree(w / "hf"), ["hf"], "paths")
    add("dir-is-file", lambda w: (__import__("shutil").rmtree(w / "hf"), (w / "hf").write_text("x")), ["hf"], "paths")
    add("config-missing", lambda w: (w / "hf" / "config.json").unlink(), ["config.json"], "partial")
    add("config-fifo", _fifo("config.json"), ["config.json"], "paths")
    add("config-dev-zero", _link("config.json", lambda w: "/dev/zero"), ["config.json"], "paths")
    add("config-is-dir", lambda w: ((w / "hf" / "config.json").unlink(), (w / "hf" / "config.json").mkdir()),
        ["config.json"], "paths")
    add("shard-fifo", _fifo(st.SHARD), [st.SHARD], "paths")
    add("shard-dev-zero", _link(st.SHARD, lambda w: "/dev/zero"), [st.SHARD], "paths")
    add("shard-link-loop", _link(st.SHARD, lambda w: st.SHARD), [st.SHARD], "paths")
    add("hf-cache-layout", _hf_cache, (), "paths", accept_ok=True,
        note="links into the hub cache's blobs are how a downloaded checkpoint looks")

    def shard_outside(work: Path) -> None:
        target = decoy(work) / "shard.safetensors"
        (work / "hf" / st.SHARD).rename(target)
        (work / "hf" / st.SHARD).symlink_to(target)

    add("shard-link-outside", shard_outside, (), "paths", accept_ok=True,
        note="reading a linked shard is the user's layout; it must stay unchanged (hashed)")
    # safetensors headers that lie, and truncated or corrupt files
    header = st.header_edit
    add("st-offsets-past-end", header(lambda h: h[st.EMBED].__setitem__("data_offsets", [131072, 10**9])),
        [st.SHARD, st.EMBED], "corrupt")
    add("st-offsets-reversed", header(lambda h: h[st.EMBED].__setitem__("data_offsets", [262144, 131072])),
        [st.SHARD, st.EMBED], "corrupt")
    add("st-offsets-overlap", header(lambda h: h[st.EMBED].__setitem__("data_offsets", [0, 131072])),
        [st.SHARD, st.EMBED], "corrupt")
    add("st-offsets-size", header(lambda h: h[st.EMBED].__setitem__("data_offsets", [131072, 131072 + 100])),
        [st.SHARD, st.EMBED], "corrupt")
    add("st-shape-lies", header(lambda h: h[st.EMBED].__setitem__("shape", [1024, 64])), [st.SHARD, st.EMBED],
        "corrupt")
    add("st-shape-huge", header(lambda h: h[st.EMBED].__setitem__("shape", [2**40, 2**20])), [st.SHARD, st.EMBED],
        "sizes")
    add("st-shape-negative", header(lambda h: h[st.EMBED].__setitem__("shape", [-512, -64])), [st.SHARD, st.EMBED],
        "dtypes")
    add("st-dtype-unknown", header(lambda h: h[st.EMBED].__setitem__("dtype", "Q4_K")), [st.SHARD, st.EMBED],
        "dtypes")
    add("st-entry-not-dict", header(lambda h: h.__setitem__(st.EMBED, [1, 2])), [st.SHARD, st.EMBED], "corrupt")
    add("st-metadata-hostile", header(lambda h: h.__setitem__("__metadata__", {"format": ["x"] * 3})), [st.SHARD],
        "corrupt", harmless=True)
    raw = st.raw_edit
    add("st-header-len-huge", raw(lambda b: struct.pack("<Q", 2**63 - 1) + b[8:]), [st.SHARD], "sizes")
    add("st-header-len-past-end", raw(lambda b: struct.pack("<Q", len(b)) + b[8:]), [st.SHARD], "corrupt")
    add("st-header-len-zero", raw(lambda b: struct.pack("<Q", 0) + b[8:]), [st.SHARD], "corrupt")
    add("st-header-garbage", raw(lambda b: b[:8] + b"\x00\xff" * 8 + b[24:]), [st.SHARD], "corrupt")
    add("st-header-list", lambda w: st.write_raw(w / "hf" / st.SHARD, [1, 2, 3], b""), [st.SHARD], "corrupt")
    add("st-truncated-half", raw(lambda b: b[: len(b) // 2]), [st.SHARD], "corrupt")
    add("st-truncated-1", raw(lambda b: b[:-1]), [st.SHARD], "corrupt")
    add("st-truncated-header", raw(lambda b: b[:100]), [st.SHARD], "corrupt")
    add("st-empty", raw(lambda b: b""), [st.SHARD], "corrupt")
    add("st-garbage", raw(lambda b: os.urandom(len(b))), [st.SHARD], "corrupt")
    add("st-trailing-bytes", raw(lambda b: b + b"\x00" * 4096), [st.SHARD], "corrupt", harmless=True)
    # config.json: hostile sizes, wrong types, bad values
    for key, value in (("hidden_size", 2**40), ("num_hidden_layers", 100_000), ("vocab_size", 2**40),
                       ("n_routed_experts", 10**6), ("moe_intermediate_size", 2**40), ("num_attention_heads", 2**20),
                       ("intermediate_size", 2**50), ("max_position_embeddings", 2**62), ("kv_lora_rank", 2**40)):
        add(f"config-{key}-huge", _set(key, value), [key], "sizes", timeout=120.0)
    for key, value, cname in (("hidden_size", "64", "str"), ("hidden_size", 64.5, "float"),
                              ("hidden_size", True, "bool"), ("hidden_size", None, "null"),
                              ("num_hidden_layers", [4], "list"), ("n_routed_experts", {"n": 8}, "dict"),
                              ("rms_norm_eps", "1e-6", "str"), ("tie_word_embeddings", "no", "str"),
                              ("rope_scaling", "yarn", "str"), ("norm_topk_prob", 1.5, "float"),
                              ("architectures", "DeepseekV3ForCausalLM", "str")):
        add(f"config-{key}-{cname}", _set(key, value), [key], "dtypes")
    for key, value, cname in (("rms_norm_eps", float("nan"), "nan"), ("rope_theta", float("inf"), "inf"),
                              ("routed_scaling_factor", float("nan"), "nan"), ("initializer_range", float("-inf"),
                                                                               "neginf")):
        add(f"config-{key}-{cname}", _set(key, value), [key], "nonfinite")
    for key, value in (("hidden_size", 0), ("intermediate_size", -1), ("num_hidden_layers", 0),
                       ("max_position_embeddings", 0), ("rms_norm_eps", -1.0), ("rope_theta", 0.0),
                       ("num_experts_per_tok", 9), ("n_group", 3), ("topk_group", 5), ("kv_lora_rank", 0),
                       ("qk_rope_head_dim", 7), ("first_k_dense_replace", 99), ("num_nextn_predict_layers", 100),
                       ("num_attention_heads", 3), ("vocab_size", 1), ("routed_scaling_factor", -2.5)):
        add(f"config-{key}-{value}", _set(key, value), [key], "values")
    add("config-model-type", _set("model_type", "llama"), ["model_type", "llama"], "values")
    add("config-architecture", _set("architectures", ["LlamaForCausalLM"]), ["architectures", "Llama"], "values")
    add("config-torch-dtype-int8", _set("torch_dtype", "int8"), ["torch_dtype", "int8"], "dtypes")
    add("config-fp8-quantized", _set("quantization_config", FP8_CONFIG), (), "dtypes", accept_ok=True,
        note="DeepSeek's quantization_config over float weights (fp8_cast_bf16 leaves it in config.json): no "
             "E4M3 tensor, the floats are read as they are")
    # DeepSeek's FP8 release format (spartron.interop.hf.fp8_storage): E4M3 weights with blockwise scale_inv
    scale = st.EXPERT + "_scale_inv"
    add("fp8-stored", _fp8_store(), (), "dtypes", accept_ok=True,
        note="DeepSeek's FP8 release format: imported dequantised (fp8 x scale_inv in float32)")
    add("fp8-scale-missing", _fp8_store(lambda t: t.pop(scale)), [st.EXPERT, "_scale_inv"], "corrupt")
    add("fp8-scale-shape", _fp8_store(lambda t: t.__setitem__(scale, torch.ones(3, 3))), [scale, "[3, 3]"],
        "dtypes")
    add("fp8-scale-orphan", _fp8_store(lambda t: t.__setitem__(st.NORM + "_scale_inv", torch.ones(1, 1))),
        [st.NORM + "_scale_inv"], "corrupt")
    add("fp8-scale-nan", _fp8_store(lambda t: t[scale].__setitem__((0, 0), float("nan"))), [st.EXPERT, "non-finite"],
        "nonfinite")
    add("fp8-scale-inf", _fp8_store(lambda t: t[scale].fill_(float("inf"))), [st.EXPERT, "non-finite"], "nonfinite")
    add("fp8-e5m2-config", lambda w: (_fp8_store()(w), _set("quantization_config", {**FP8_CONFIG, "fmt": "e5m2"})(w)),
        ["quantization_config", "e5m2"], "dtypes")
    add("fp8-block-zero", _set("quantization_config", {**FP8_CONFIG, "weight_block_size": [0, 128]}),
        ["quantization_config", "weight_block_size"], "values")
    add("fp8-block-huge", _set("quantization_config", {**FP8_CONFIG, "weight_block_size": [2**40, 128]}),
        ["quantization_config", "weight_block_size"], "sizes")
    add("config-rope-scaling-bad", _set("rope_scaling", {"type": "yarn", "factor": -1.0}), ["rope_scaling", "factor"],
        "values")
    add("config-rope-scaling-kind", _set("rope_scaling", {"type": "dynamic", "factor": 2.0}),
        ["rope_scaling", "dynamic"], "values")
    add("config-missing-key", _config(lambda c: c.pop("hidden_size")), ["hidden_size"], "partial")
    add("config-extra-key", _set("my_note", "fine"), (), "values", accept_ok=True,
        note="Hugging Face configs carry keys a loader does not use")
    add("config-not-json", _raw_config(b"{hidden_size: 64"), ["config.json"], "corrupt")
    add("config-list", _raw_config(b"[]"), ["config.json"], "corrupt")
    add("config-empty", _raw_config(b""), ["config.json"], "corrupt")
    add("config-deep", _raw_config(b"[" * 100_000), ["config.json"], "sizes")
    add("config-binary", _raw_config(bytes(range(256))), ["config.json"], "corrupt")
    add("config-nan-literal", lambda w: (w / "hf" / "config.json").write_text(
        (w / "hf" / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN')),
        ["rms_norm_eps", "config.json", "NaN"], "nonfinite")
    add("config-huge-file", lambda w: (w / "hf" / "config.json").write_bytes(
        (w / "hf" / "config.json").read_bytes() + b" " * (64 << 20)), (), "sizes", accept_ok=True,
        note="valid JSON with trailing whitespace")
    return out


# train.init_from shares convert's reader: it gets the cases where its own checks (the run's [model]) also act
INIT_TOO = ("dtype-i8-embed", "dtype-i32-expert", "dtype-bool-bias", "dtype-bf16-embed", "dtype-f8-expert",
            "shape-", "nan-embed", "missing-tensor", "shard-lacks-indexed", "index-traversal", "config-fifo",
            "shard-fifo", "hf-cache-layout", "st-truncated-half", "st-offsets-past-end", "st-header-len-huge",
            "config-hidden_size", "config-num_hidden_layers", "config-vocab_size-huge", "config-rms_norm_eps",
            "config-model-type", "config-fp8-quantized", "config-not-json", "dir-missing", "pickle-only",
            "fp8-stored", "fp8-scale-missing", "fp8-scale-nan")


def cases() -> list[Case]:
    out: list[Case] = []
    for cid, setup, names, category, kw in _hostile():
        for entry, argv in ENTRIES.items():
            if entry == "init" and not cid.startswith(INIT_TOO):
                continue
            accept = kw.get("accept_ok", False)
            harm = _nothing_left if entry == "convert" and not accept else None
            out.append(Case(f"hf-import-{entry}-{cid}", "hf-import", argv, names, category=category, setup=setup,
                            base=("hf",), timeout=kw.get("timeout", 90.0), accept_ok=accept,
                            harmless=kw.get("harmless", False), note=kw.get("note", ""), harm=harm,
                            quick=cid in ("dtype-i8-embed", "config-hidden_size-huge") and entry == "convert"))
    return out

