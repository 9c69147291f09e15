"""Streaming Hugging Face safetensors import into a SparseMoEModel, and export from one (or a saved state).

Import (`import_hf`): `config.json` -> ModelConfig, then `load_into(model)` opens ONE safetensors
shard at a time and reads from it only the boxes this rank holds: for an FSDP2-sharded DTensor
its local shard, for an expert-parallel GroupedExperts its own global experts (`first_expert`),
through safetensors' lazy slices. So no rank ever holds the checkpoint, or even one whole tensor
it does not own; any EP / FSDP layout loads the same 1-rank values.

Export (`export_hf`): from a model (1 rank, or FSDP2 DTensors gathered with `full_tensor`) or any
`TensorSource` (a saved step: spartron.runtime.hf_state.SavedStateSource reads with DCP what one
output shard needs, EP entries `<fqn>/ep<r>` joined).
Output shards of at most `max_shard_bytes` each are built, checked (finite), written and freed one after
another into a temporary sibling folder; `model.safetensors.index.json` maps every tensor to its shard, and
the folder is renamed to its name at the end (nothing partial is ever left under it). MTP layers are
omitted unless asked for (transformers has no MTP module).

Reading a checkpoint never executes code: config.json is JSON, tensors come from safetensors
(`safe_open`), and shard names in the index must be plain file names inside the directory.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spartron.interop.hf import fp8_storage
from spartron.interop.hf.config_map import (
    HFConfigError,
    check_config_matches,
    hf_config_from_model_config,
    model_config_from_hf,
)
from spartron.interop.hf.folder import (
    CONFIG,
    INDEX,
    MAX_CONFIG_BYTES,
    HFCheckpointError,
    checked_headers,
    ignored_tensor,
    read_json,
    weight_files,
)
from spartron.interop.hf.fp8_storage import SCALE_SUFFIX, scaled_weights
from spartron.interop.hf.header import FLOAT_WEIGHTS
from spartron.interop.hf.names import Box, Piece, TensorMap, mtp_layer_indices, tensor_map
from spartron.interop.hf.reader import BoxReader, box_index, storage_block_of
from spartron.layers.config import ModelConfig
from spartron.optional import require
from spartron.temporaries import make_sibling, remove_stale

DEFAULT_SHARD_BYTES = 5 * 1024**3


def _safetensors():
    return require("safetensors", "Hugging Face checkpoint conversion", "pip install 'spartron[hf]'")


def hf_model_config(hf_dir: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory from its config.json (checked field by field) and its tensor
    names; no tensor is read. What a caller checks (e.g. against the machine's memory) before importing."""
    hf_dir = Path(hf_dir)
    return _config_of(hf_dir, weight_files(hf_dir))


def _config_of(hf_dir: Path, names: Iterable[str]) -> ModelConfig:
    hf = read_json(hf_dir / CONFIG, MAX_CONFIG_BYTES)
    n_layers = hf.get("num_hidden_layers")
    ok = isinstance(n_layers, int) and not isinstance(n_layers, bool) and n_layers >= 0
    mtp = mtp_layer_indices(names, n_layers) if ok else []
    if mtp and mtp != list(range(len(mtp))):
        raise HFCheckpointError(f"{hf_dir}: MTP layers {[n_layers + k for k in mtp]} are not consecutive from "
                                f"model.layers.{n_layers}")
    return model_config_from_hf(hf, mtp_layers=len(mtp))


# ---- boxes ------------------------------------------------------------------------------------------
def _intersect(piece: Piece, local: Box) -> tuple[Box, Box] | None:
    """(dst box relative to the local tensor, src box in the HF tensor) of `piece` inside `local`."""
    drop = len(piece.dst) - len(piece.src)  # 1 when one expert of a stack maps to an unstacked tensor
    dst, src = [], []
    for dim, ((a, b), (la, lb)) in enumerate(zip(piece.dst, local, strict=True)):
        lo, hi = max(a, la), min(b, lb)
        if lo >= hi:
            return None
        dst.append((lo - la, hi - la))
        if dim >= drop:
            s0 = piece.src[dim - drop][0] + (lo - a)
            src.append((s0, s0 + hi - lo))
    return tuple(dst), tuple(src)


@dataclass
class _Target:
    tensor: Tensor  # the local storage to fill (a DTensor's local shard)
    box: Box  # its place in the 1-rank global tensor


def _targets(model: nn.Module, tmap: TensorMap) -> dict[str, _Target]:
    """Every Spartron tensor of the map -> its local storage and global box on this rank."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    missing = sorted(set(tmap.shapes) - set(tensors))
    if missing:
        raise HFCheckpointError(f"the model has no {missing[:3]} ({len(missing)} missing): was it built from "
                                "the imported ModelConfig?")
    out = {}
    for name, shape in tmap.shapes.items():
        t = tensors[name]
        if isinstance(t, DTensor):
            local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            local = t.to_local()
        else:
            local_shape, offset, local = tuple(t.shape), (0,) * t.dim(), t
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        offset = list(offset)
        if getattr(owner, "is_expert_module", False):
            offset[0] += owner.first_expert
        box = tuple((o, o + n) for o, n in zip(offset, local_shape, strict=True))
        if len(shape) != len(box) or any(b > n for (_, b), n in zip(box, shape, strict=True)):
            raise HFCheckpointError(f"{name}: this rank's {list(local_shape)} at {offset} does not fit the "
                                    f"1-rank shape {list(shape)}")
        out[name] = _Target(local, box)
    return out


# ---- import -----------------------------------------------------------------------------------------
def _check_names(hf_dir: Path, names: set[str], tmap: TensorMap, optional: dict[str, str]) -> None:
    expected = {p.hf for p in tmap.pieces}
    missing = sorted(expected - names)
    known = expected | set(tmap.copies) | set(tmap.empty) | set(optional)  # empty ones may be absent: no values
    extra = sorted(n for n in names - known if not ignored_tensor(n))
    if missing or extra:
        parts = ([f"missing {len(missing)}: {', '.join(missing[:4])}"] if missing else []) + \
                ([f"unexpected {len(extra)}: {', '.join(extra[:4])}"] if extra else [])
        raise HFCheckpointError(f"{hf_dir}: tensors do not match its config.json ({'; '.join(parts)}; its "
                                "num_hidden_layers, first_k_dense_replace, n_routed_experts, "
                                "num_nextn_predict_layers and q_lora_rank decide which tensors exist)")


def _check_tensors(hf_dir: Path, files: dict[str, str], cfg: ModelConfig) -> tuple[TensorMap, dict[str, str],
                                                                                   tuple[int, int] | None]:
    """Every tensor's name, dtype and shape against the config, from the shards' headers, before any is read.
    Returns the tensor map, the FP8-stored weights' scale names and config.json's scale block (fp8_storage)."""
    first_moe = f"model.layers.{cfg.first_k_dense}.mlp.experts.gate_up_proj"
    tmap = tensor_map(cfg, stacked=first_moe in files)
    optional = {"lm_head.weight": "embed.weight"} if cfg.tie_embeddings else {}
    block = storage_block_of(hf_dir)
    scales = {n for n in files if n.endswith(SCALE_SUFFIX)} if block is not None else set()
    _check_names(hf_dir, set(files) - scales, tmap, optional)
    infos = checked_headers(hf_dir, files)
    fp8, why = scaled_weights(infos, block)
    if why is not None:
        raise HFCheckpointError(f"{hf_dir}: {why} (config.json's quantization_config stores blockwise FP8)")
    shapes = {**tmap.hf_shapes(), **{hf: tmap.shapes[ours] for hf, ours in optional.items()}}
    for name in sorted((n for n in files if not ignored_tensor(n) and n not in scales), key=_hf_order):
        info, where = infos[name], hf_dir / files[name]
        if info.dtype not in FLOAT_WEIGHTS and name not in fp8:
            raise HFCheckpointError(f"{where}: {name} is {info.dtype}; Spartron imports float32, bfloat16 or "
                                    "float16 weights (dequantize or convert it first)")
        if info.shape != shapes[name]:
            raise HFCheckpointError(f"{where}: {name} has shape {list(info.shape)}, its config.json gives "
                                    f"{list(shapes[name])}")
    return tmap, fp8, block


def _read_error(path: Path, name: str, err: Exception) -> HFCheckpointError:
    return HFCheckpointError(f"{path}: {name}: cannot be read ({str(err).splitlines()[0] if str(err) else err!r})")


@torch.no_grad()
def load_hf_weights(model: nn.Module, hf_dir: str | Path, cfg: ModelConfig | None = None,
                    check_config: bool = True) -> None:
    """Fill `model` (a SparseMoEModel of the checkpoint's config, any layout) from `hf_dir`, one shard
    at a time, each rank reading only the boxes it holds. Every tensor's name, dtype and shape is checked
    against the config (the shards' headers) before any is read. Raises HFCheckpointError on any mismatch
    or unreadable file (naming file and tensor), and (`check_config`) HFConfigError when `model.cfg` computes
    another function than the checkpoint's config (`check_config_matches`: only Spartron-only settings such
    as the dispatcher may differ)."""
    hf_dir = Path(hf_dir)
    files = weight_files(hf_dir)
    cfg = cfg or _config_of(hf_dir, files)
    if check_config and isinstance(getattr(model, "cfg", None), ModelConfig):
        check_config_matches(model.cfg, cfg)
    tmap, fp8, block = _check_tensors(hf_dir, files, cfg)
    reader = BoxReader(hf_dir, files, fp8, block, _safetensors().safe_open)
    optional = {"lm_head.weight": "embed.weight"} if cfg.tie_embeddings else {}
    targets = _targets(model, tmap)
    filled = {name: 0 for name in targets}
    copies = {k: v for k, v in {**tmap.copies, **optional}.items() if k in files}  # present: checked
    by_file: dict[str, list[Piece]] = {}
    for p in tmap.pieces:
        by_file.setdefault(files[p.hf], []).append(p)
    safe_open = _safetensors().safe_open
    for file in sorted(by_file):
        name = by_file[file][0].hf
        try:
            with safe_open(str(hf_dir / file), framework="pt") as f:
                for p in by_file[file]:
                    name = p.hf
                    target = targets[p.spartron]
                    boxes = _intersect(p, target.box)
                    if boxes is None:
                        continue
                    dst, src = boxes
                    region = target.tensor[box_index(dst)]
                    region.copy_(reader.read(f, file, p.hf, src).reshape(region.shape))
                    filled[p.spartron] += region.numel()
        except HFCheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError, OSError, ...
            raise _read_error(hf_dir / file, name, err) from None
    for hf_name, ours in copies.items():  # after every piece landed: compare the copies with the originals
        target = targets[ours]
        try:
            with safe_open(str(hf_dir / files[hf_name]), framework="pt") as f:
                theirs = reader.read(f, files[hf_name], hf_name, target.box)
        except HFCheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - as above
            raise _read_error(hf_dir / files[hf_name], hf_name, err) from None
        if not torch.equal(theirs.to(target.tensor.dtype), target.tensor):
            raise HFCheckpointError(f"{hf_dir / files[hf_name]}: {hf_name} differs from the model's {ours} "
                                    "(Spartron keeps one tensor for both: the MTP layers and a tied head share "
                                    "the model's embedding and head)")
    short = [n for n, count in filled.items() if count != targets[n].tensor.numel()]
    if short:
        raise HFCheckpointError(f"{hf_dir}: no values for {short[:3]} on this rank")


def import_hf(hf_dir: str | Path) -> tuple[ModelConfig, Callable[[nn.Module], None]]:
    """(ModelConfig, loader) of a Hugging Face DeepSeek-V3 / V3.2 checkpoint directory.

    Checked before it returns: config.json field by field, the index, and every tensor's name, dtype and shape
    (the shards' headers; no tensor data is read). `loader(model)` fills a SparseMoEModel built from that
    config (any EP / FSDP layout, each rank its own shards) by `load_hf_weights`, one shard at a time.
    """
    hf_dir = Path(hf_dir)
    files = weight_files(hf_dir)
    cfg = _config_of(hf_dir, files)
    _check_tensors(hf_dir, files, cfg)
    return cfg, lambda model, check_config=True: load_hf_weights(model, hf_dir, cfg, check_config)


# ---- export -----------------------------------------------------------------------------------------
class TensorSource:
    """Full 1-rank Spartron tensors by name: `cfg`, `dtype(name)`, `fetch(names) -> {name: cpu tensor}`."""

    cfg: ModelConfig

    def dtype(self, name: str) -> torch.dtype:
        raise NotImplementedError

    def fetch(self, names: list[str]) -> dict[str, Tensor]:
        raise NotImplementedError


class ModelSource(TensorSource):
    """A SparseMoEModel in memory: plain tensors, or FSDP2 DTensors (`full_tensor`, a collective: every
    rank calls `export_hf`, rank 0 writes). Expert-parallel models hold other ranks' experts elsewhere:
    export their saved state."""

    def __init__(self, model: nn.Module) -> None:
        self.cfg = model.cfg
        self.tensors = dict(model.named_parameters())
        self.tensors.update(dict(model.named_buffers()))
        for name, module in model.named_modules():
            if getattr(module, "is_expert_module", False) and module.n_local_experts != self.cfg.moe.n_routed_experts:
                raise HFCheckpointError(f"{name} holds {module.n_local_experts} of {self.cfg.moe.n_routed_experts} "
                                        "experts (expert parallel): export the saved state instead")

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def fetch(self, names: list[str]) -> dict[str, Tensor]:
        out = {}
        for name in names:
            t = self.tensors[name].detach()
            out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu()
        return out


def _hf_tensor(hf_name: str, shape: tuple[int, ...], pieces: list[Piece], tensors: dict[str, Tensor]) -> Tensor:
    source = tensors[pieces[0].spartron]
    out = torch.empty(shape, dtype=source.dtype)
    for p in pieces:
        region = out[box_index(p.src)]
        region.copy_(tensors[p.spartron][box_index(p.dst)].reshape(region.shape))
    return out


def _plan_shards(order: list[str], sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in order:
        if shards[-1] and size + sizes[name] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += sizes[name]
    return shards


def _check_out_dir(out_dir: Path) -> None:
    """An export writes a new folder (its missing parents too), or fills an existing empty one; never through a
    symbolic link."""
    if out_dir.is_symlink():
        raise HFCheckpointError(f"{out_dir}: is a symbolic link (an export writes a new folder, not through a link)")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise HFCheckpointError(f"{out_dir}: exists and is not an empty directory (an export writes a new one)")
    if not out_dir.parent.is_dir():  # missing parents are made, as mkdir -p: a file or a link loop there is refused
        try:
            os.makedirs(out_dir.parent, exist_ok=True)
        except OSError as err:
            raise HFCheckpointError(f"{out_dir.parent}: cannot make the export's parent folder "
                                    f"({err.strerror or err})") from None


def _temporary_sibling(out_dir: Path) -> Path:
    """A new folder beside out_dir (same filesystem: the final rename is atomic), mode 0777 less the umask,
    after removing the ones an export killed earlier left there (spartron.temporaries)."""
    for note in remove_stale(out_dir, "tmp"):
        print(note, file=sys.stderr, flush=True)
    try:
        return make_sibling(out_dir, "tmp")
    except FileExistsError:
        raise HFCheckpointError(f"{out_dir.parent}: cannot make a temporary folder for the export") from None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:  # a fresh file: never through a link, mode 0666 less the umask
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _finite(name: str, spartron: list[str], t: Tensor) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise HFCheckpointError(f"{name} (Spartron's {', '.join(sorted(set(spartron)))}) holds non-finite values: "
                                "nothing was exported")


def export_hf(source: nn.Module | TensorSource, out_dir: str | Path,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, with_mtp: bool = False,
              extra_files: dict[str, bytes] | None = None, fp8_weights: bool = False,
              token_ids: dict[str, int | None] | None = None) -> Path:
    """Write a Hugging Face checkpoint (config.json, safetensors shards, the index, `extra_files` such as
    the tokenizer) of `source`: a SparseMoEModel or a TensorSource (a saved state:
    spartron.runtime.hf_state.SavedStateSource). transformers' `from_pretrained(out_dir)` loads it.

    MTP layers are omitted by default (config.json then says num_nextn_predict_layers = 0): transformers'
    DeepseekV3ForCausalLM has no MTP module and would list them as unexpected keys. `with_mtp` writes them as
    DeepSeek-V3 lays them out (`model.layers.{n_layers + k}.*`), for Spartron or DeepSeek's own code.
    `token_ids`: config.json's eos_token_id / bos_token_id (the tokens the run's data used: transformers'
    generate() stops at that EOS; without them it falls back to id 1). `fp8_weights` stores the decoder layers'
    2-D weights as E4M3 with a float32 `weight_scale_inv` per 128 x 128 block and config.json's
    quantization_config, as DeepSeek's release does (spartron.interop.hf.fp8_storage).
    Atomic: everything is written (and fsynced) into a temporary sibling folder renamed to out_dir at the
    end; on any failure (a non-finite tensor, a full disk) it is removed and out_dir is untouched. out_dir
    may exist if empty; a symbolic link is refused. Returns out_dir.
    Collective under torch.distributed: every rank must call it (each gathers every FSDP2 tensor, rank 0
    writes, and rank 0's error is agreed by all); one rank calling it alone waits forever."""
    if isinstance(source, nn.Module):
        source = ModelSource(source)
    if max_shard_bytes < 1:
        raise HFCheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    cfg = source.cfg
    if not with_mtp and cfg.mtp.depth:
        cfg = cfg.model_copy(update={"mtp": cfg.mtp.model_copy(update={"depth": 0})})
    hf_config = {**hf_config_from_model_config(cfg), **(token_ids or {})}
    if fp8_weights:
        hf_config["quantization_config"] = dict(fp8_storage.EXPORT_QUANTIZATION)
    tmap = tensor_map(cfg)
    by_hf = tmap.by_hf()
    hf_shapes = tmap.hf_shapes()
    order = sorted(hf_shapes, key=_hf_order)
    producers = {name: [p.spartron for p in by_hf[name]] if name in by_hf else
                 [tmap.copies[name]] if name in tmap.copies else [] for name in order}  # []: an empty tensor
    dtypes = {name: source.dtype(producers[name][0] if producers[name] else tmap.empty[name][0]) for name in order}
    fp8 = {name for name in order
           if fp8_weights and producers[name] and fp8_storage.stored_in_fp8(name, hf_shapes[name])}
    sizes = {name: fp8_storage.stored_bytes(hf_shapes[name], dtypes[name], name in fp8) for name in order}
    shards = _plan_shards(order, sizes, max_shard_bytes)
    out_dir = Path(out_dir)
    # Under torch.distributed (FSDP2 DTensors) every rank gathers each tensor and rank 0 writes; rank 0's
    # error is agreed at the end, so no rank leaves the gathers early.
    writer = not dist.is_initialized() or dist.get_rank() == 0
    error, tmp = None, None
    try:  # every way out (an error, an exception, Ctrl-C, SIGTERM unwinding) removes the temporary folder
        if writer:
            try:
                _check_out_dir(out_dir)
                tmp = _temporary_sibling(out_dir)
            except HFCheckpointError as err:
                error = str(err)
            except OSError as err:
                error = f"{out_dir}: cannot be made ({err.strerror or err})"
        save = require("safetensors.torch", "Hugging Face checkpoint export", "pip install 'spartron[hf]'").save
        weight_map, total = {}, 0
        tensors: dict[str, Tensor] = {}  # what the previous shard fetched and this one still needs
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            needed = sorted({s for n in names for s in producers[n]})
            tensors = {n: t for n, t in tensors.items() if n in needed}
            missing = [n for n in needed if n not in tensors]
            if missing and (error is None or dist.is_initialized()):  # every rank joins a DTensor's gather
                try:
                    tensors.update(source.fetch(missing))
                except HFCheckpointError as err:  # a saved state's file that cannot be loaded
                    error = error or str(err)
                except OSError as err:
                    error = error or (f"reading the tensors of {file} failed: {err.strerror or err} "
                                      "(nothing was exported)")
            if not writer or error is not None:
                continue
            try:
                shard = {}
                for n in names:
                    shard[n] = (_hf_tensor(n, hf_shapes[n], by_hf[n], tensors) if n in by_hf else
                                tensors[tmap.copies[n]].clone() if n in tmap.copies else
                                torch.empty(hf_shapes[n], dtype=dtypes[n]))
                    _finite(n, producers[n], shard[n])
                    if n in fp8:  # E4M3 values and their scales
                        shard[n], shard[n + SCALE_SUFFIX] = fp8_storage.quantize(shard[n])
                        total, weight_map[n + SCALE_SUFFIX] = total + shard[n + SCALE_SUFFIX].nbytes, file
                    total += shard[n].numel() * shard[n].element_size()
                    weight_map[n] = file
                _write_file(tmp / file, save(shard, metadata={"format": "pt"}))
                del shard
            except HFCheckpointError as err:
                error = str(err)
            except OSError as err:
                error = f"writing {out_dir} failed at {file}: {err.strerror or err} (nothing was exported)"
        if writer and error is None:
            try:
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                _write_file(tmp / INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
                _write_file(tmp / CONFIG, (json.dumps(hf_config, indent=2, sort_keys=True) + "\n").encode())
                for name, data in (extra_files or {}).items():
                    _write_file(tmp / name, data)
                _fsync(tmp)
                if out_dir.is_symlink() or (out_dir.exists() and any(out_dir.iterdir())):
                    raise HFCheckpointError(f"{out_dir}: appeared or filled while exporting (nothing was exported)")
                os.rename(tmp, out_dir)  # onto an empty folder too (rename(2) replaces an empty directory)
                tmp = None
                _fsync(out_dir.parent)
            except HFCheckpointError as err:
                error = str(err)
            except OSError as err:
                error = f"writing {out_dir} failed: {err.strerror or err} (nothing was exported)"
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        agreed = [error]
        dist.broadcast_object_list(agreed, src=0)
        error = agreed[0]
    if error is not None:
        raise HFCheckpointError(error)
    return out_dir


def _hf_order(name: str) -> tuple:
    """Embedding first, then layer by layer, then norm and head. A layer's routed experts come last,
    projection by projection (every expert's gate_proj, then up_proj, then down_proj), so the shards
    written one after another need one stacked Spartron expert tensor at a time."""
    parts = name.split(".")
    if name.startswith("model.layers."):
        if len(parts) > 6 and parts[4] == "experts" and parts[5].isdigit():
            return (1, int(parts[2]), 1, parts[6], int(parts[5]))
        return (1, int(parts[2]), 0, name, 0)
    return (0 if "embed" in name else 2, 0, 0, name, 0)


__all__ = ["HFCheckpointError", "HFConfigError", "ModelSource", "TensorSource", "checked_headers", "export_hf",
           "hf_model_config", "import_hf", "load_hf_weights", "weight_files"]
