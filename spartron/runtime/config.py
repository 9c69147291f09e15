"""The run config: TOML, validated by pydantic, the one place every option lives.

`load_config(path, overrides=["parallel.ep=2", ...])` reads a TOML file, applies dotted overrides
(values parsed as TOML literals, bare words as strings) and validates. Every failure is a
`ConfigError` whose message names the dotted key and says what is allowed. RunConfig checks how the
sections combine; each section checks itself in its own module (sections.py: parallel, train, data;
launch_config.py: launch; spartron.layers.config: model; spartron.checkpointing.config: ac, offload).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from spartron.checkpointing.config import ACConfig, OffloadConfig
from spartron.configbase import ConfigError, ConfigSection
from spartron.layers.config import ModelConfig, master_optimizer_refusal
from spartron.layers.fp8.apply import param_gather_refusal
from spartron.layers.fp8.wire import fp8_dispatch_refusal
from spartron.layers.moe.dispatch import check_dispatcher
from spartron.layers.ops import load_ops
from spartron.runtime.debug import DebugConfig
from spartron.runtime.launch_config import LaunchConfig
from spartron.runtime.linktable import ClusterConfig
from spartron.runtime.observe import ObserveConfig
from spartron.runtime.sections import DataConfig, NcclCommConfig, ParallelConfig, TrainConfig
from spartron.runtime.stage_config import check_stages

__all__ = ["ConfigError", "DataConfig", "LaunchConfig", "NcclCommConfig", "ParallelConfig", "RunConfig", "TrainConfig",
           "apply_overrides", "config_from_dict", "dump_config", "load_config"]

_RUN_NAME_MAX = 128


class RunConfig(ConfigSection):
    name: str = "run"  # the run folder is runs/<name>: one path component
    device: Literal["auto", "cpu", "cuda"] = "auto"
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    ac: ACConfig = Field(default_factory=ACConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    debug: DebugConfig = Field(default_factory=DebugConfig)  # test hook: fail one rank at one step
    observe: ObserveConfig = Field(default_factory=ObserveConfig)  # TensorBoard, W&B, progress, OOM snapshots
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)  # link table of `spartron rehearse`

    def run_dir(self, workdir: Path | None = None) -> Path:
        """THE run directory: train.run_dir, else runs/<name>; a relative one under `workdir` when given."""
        path = Path(self.train.run_dir) if self.train.run_dir else Path("runs") / self.name
        return path if workdir is None or path.is_absolute() else workdir / path

    @model_validator(mode="before")
    @classmethod
    def _ops_loaded(cls, data: Any) -> Any:
        """`ac.targets` name operators: their libraries are registered before the sections validate."""
        load_ops()
        return data

    @model_validator(mode="before")
    @classmethod
    def _resolve_defaults(cls, data: Any) -> Any:
        """The one default that depends on another section, chosen here, before the sections validate:
        `ac.reentrant` left unset is false when train.compile is true and there are checkpoint regions
        (compiled regions are non-reentrant). Returns new input; nothing validated is changed afterwards, so
        a section assigned later (`cfg.ac = ...`) is checked, not resolved."""
        if not isinstance(data, dict):
            return data
        train, ac = data.get("train", {}), data.get("ac", {})
        compiled = train.compile if isinstance(train, TrainConfig) else isinstance(train, dict) and train.get("compile")
        if isinstance(ac, ACConfig):
            if compiled is True and ac.mode != "none" and "reentrant" not in ac.model_fields_set:
                return {**data, "ac": ac.model_copy(update={"reentrant": False})}
        elif isinstance(ac, dict) and compiled is True and ac.get("mode", "none") != "none" and "reentrant" not in ac:
            return {**data, "ac": {**ac, "reentrant": False}}
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be a non-empty run name")
        if len(v) > _RUN_NAME_MAX:
            raise ValueError(f"must be at most {_RUN_NAME_MAX} characters, got {len(v)}")
        if "/" in v or "\\" in v or v in (".", "..") or v != v.strip():
            raise ValueError(f"must be one folder name under runs/ (no '/', '\\', '.' or '..', no leading "
                             f"or trailing spaces; set train.run_dir for another place), got {v!r}")
        return v

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.model.n_layers and self.model.moe.n_routed_experts % self.parallel.ep:
            raise ValueError(f"model.moe.n_routed_experts {self.model.moe.n_routed_experts} must be "
                             f"divisible by parallel.ep {self.parallel.ep}")
        check_dispatcher(self.model.moe.dispatcher, self.parallel.ep)
        if self.model.fp8 is not None and self.model.fp8.dispatch:
            refusal = fp8_dispatch_refusal(self.parallel.ep)
            if refusal:
                raise ValueError(refusal)
        if self.model.fp8 is not None and self.model.fp8.param_gather:
            refusal = param_gather_refusal(self.train.compile)
            if refusal:
                raise ValueError(refusal)
        if self.train.compile and self.ac.mode != "none" and self.ac.reentrant:  # set so: unset is resolved above
            raise ValueError(
                f"train.compile = true with ac.mode = {self.ac.mode!r} needs ac.reentrant = false: a compiled "
                "block checkpoints through torch's non-reentrant checkpoint, whose selective-checkpoint policy "
                "(the same operator table) the compiled graph obeys; a reentrant region's policy is a Python "
                "dispatch mode that compiled graphs bypass, so its saves could not be exact")
        if self.train.compile and self.ac.debug_summary:
            raise ValueError("ac.debug_summary is set but train.compile = true: a compiled region keeps no "
                             "per-op stats (its saves are decided in the graph); set train.compile = false to log them")
        if self.offload.what == "inputs_and_dsa_ids" and self.model.dsa is None:
            raise ValueError("offload.what = 'inputs_and_dsa_ids' offloads DSA top-k ids, but the model has no "
                             "[model.dsa]: use offload.what = 'inputs'")
        if self.offload.enabled and self.ac.mode == "none":
            raise ValueError("offload.enabled needs checkpoint regions: set ac.mode to 'full' or 'selective'")
        if self.train.seq_len % (2 * self.parallel.cp) and self.parallel.cp > 1:
            raise ValueError(f"train.seq_len {self.train.seq_len} must be divisible by 2 * parallel.cp "
                             f"({2 * self.parallel.cp}) for load-balanced causal context parallelism")
        d = self.train.data
        if d.kind == "mmap" and d.token_dtype == "uint16" and self.model.vocab_size > 2**16:
            raise ValueError(f"train.data.token_dtype = 'uint16' holds ids below 65536, but model.vocab_size is "
                             f"{self.model.vocab_size}: a file of this vocabulary is written as uint32")
        if self.train.compile_backend != "inductor" and not self.train.compile:
            raise ValueError(f"train.compile_backend = {self.train.compile_backend!r} is set but train.compile = false")
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len {self.train.seq_len} is above model.max_seq_len "
                             f"{self.model.max_seq_len} (the longest sequence the model is configured for)")
        refusal = master_optimizer_refusal(self.model.master_weights, self.train.optimizer)
        if refusal:
            raise ValueError(refusal)
        if self.train.adamw_moments_dtype is not None and self.model.master_dtype != "float32":
            raise ValueError(f"train.adamw_moments_dtype = {self.train.adamw_moments_dtype!r} keeps AdamW's moments "
                             f"below fp32 masters, but model.master_dtype is {self.model.master_dtype!r}: the state "
                             f"is already in model.dtype ({self.model.dtype!r}); set model.master_dtype = 'float32' "
                             "or leave train.adamw_moments_dtype unset")
        self._check_intra_layer_micro_batches()
        check_stages(self.train, self.model)
        if self.observe.memory_snapshot_on_oom and self.device == "cpu":
            raise ValueError("observe.memory_snapshot_on_oom records the CUDA allocator's history, but device = 'cpu'")
        if self.observe.nccl_flight_recorder and (self.device == "cpu" or self.parallel.backend == "gloo"):
            raise ValueError("observe.nccl_flight_recorder records NCCL collectives, but this run uses gloo "
                             "(device = 'cpu' or parallel.backend = 'gloo')")
        return self

    def _check_intra_layer_micro_batches(self) -> None:
        """THE rules of train.intra_layer_micro_batches and its scope (the model is built with them as
        they are; a MoE layer checks only its chunk's token count when it runs)."""
        t, moe = self.train, self.model.moe
        n = t.intra_layer_micro_batches
        if n == 1:  # the scope may stay set: a sweep over micro-batch counts keeps it at 1 too
            return
        if t.intra_layer_micro_batch_scope == "experts":
            has_moe = self.model.first_k_dense < self.model.n_layers or self.model.mtp.depth > 0
            if not has_moe:
                raise ValueError(f"train.intra_layer_micro_batches = {n} with intra_layer_micro_batch_scope "
                                 "= 'experts' needs MoE layers (model.first_k_dense = model.n_layers)")
            tokens = t.micro_batch_size * t.seq_len // self.parallel.cp
            if tokens < n:
                raise ValueError(f"train.intra_layer_micro_batches = {n} (scope 'experts') needs at least "
                                 f"{n} tokens per MoE layer call, but train.micro_batch_size x train.seq_len "
                                 f"/ parallel.cp = {tokens}")
            return
        if t.micro_batch_size % n:
            raise ValueError(f"train.intra_layer_micro_batches = {n} must divide train.micro_batch_size "
                             f"= {t.micro_batch_size} (micro-batches split the batch dimension)")
        if moe.aux_loss_coeff > 0 and moe.aux_loss_type == "batch":
            raise ValueError("train.intra_layer_micro_batches > 1 needs model.moe.aux_loss_type = 'seq': a "
                             "batch-level balance loss is not the mean of its micro-batches' losses (or use "
                             "train.intra_layer_micro_batch_scope = 'experts', which routes all tokens at once)")


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        # a key that is not a plain word (a typo'd TOML quoted key) is shown quoted: one line, visible
        key = ".".join(str(p) if _PLAIN_KEY.fullmatch(str(p)) else repr(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "value_error":
            msg = str(e["ctx"]["error"])  # our validators' messages already name their dotted keys
            if not key or msg.startswith(key + "."):
                lines.append(msg)
                continue
        elif isinstance(e.get("input"), (str, int, float, bool)):
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"{key or '<root>'}: {msg}")
    return "invalid config: " + "; ".join(lines)


def _parse_value(text: str, key: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word is a string
    except RecursionError:
        raise ConfigError(f"override {key}: value {text[:20]!r}... is nested too deeply") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like dotted.key=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(part.strip() for part in parts):
            raise ConfigError(f"override {item!r} must look like dotted.key=value "
                              f"(empty key part in {key!r})")
        parts = [part.strip() for part in parts]
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node = child
        value = _parse_value(text.strip(), key.strip())
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict) and node[parts[-1]]:
            # replacing a table would silently reset its other keys to their defaults
            raise ConfigError(f"override {'.'.join(parts)}: would replace the whole [{'.'.join(parts)}] table, "
                              f"dropping its other keys; set its keys one by one ({'.'.join(parts)}.<key>=...)")
        node[parts[-1]] = value
    return data


def config_from_dict(data: dict) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def _path_problem(path: Path) -> str | None:
    """Why `path` is not a readable regular file, told as it is: missing, a dangling or looping symbolic
    link (Path.exists() says only "does not exist" for both), or something other than a file."""
    try:
        st = os.stat(path)
    except OSError as err:
        link = os.path.islink(path)
        target = f" (to {os.readlink(path)!r})" if link else ""
        if err.errno == errno.ELOOP:
            return (f"is a symbolic link that loops{target}: point it at a TOML file" if link else
                    "cannot be reached: a folder on its path is a symbolic link that loops")
        if err.errno == errno.ENOENT:
            return f"is a dangling symbolic link{target}: its target does not exist" if link else "does not exist"
        return f"cannot be read: {err.strerror or err}"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    return None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    data: dict = {}
    if path is not None:
        path = Path(path)
        problem = _path_problem(path)
        if problem:
            raise ConfigError(f"config file {str(path)[:200]!r} {problem}")
        try:
            data = tomllib.loads(path.read_bytes().decode("utf-8-sig"))  # an editor's BOM is not an error
        except OSError as err:
            raise ConfigError(f"config file {str(path)!r} cannot be read: {err.strerror or err}") from None
        except UnicodeDecodeError as err:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {err.start}): "
                              "a TOML config is a UTF-8 text file") from None
        except (tomllib.TOMLDecodeError, RecursionError) as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return config_from_dict(apply_overrides(data, overrides or []))


def dump_config(config: RunConfig) -> str:
    """TOML text for a config (round-trips through load_config)."""
    return _to_toml(config.model_dump(exclude_none=True))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else _toml_value(key)


def _to_toml(data: dict, prefix: str = "") -> str:
    scalars = {k: v for k, v in data.items() if not (isinstance(v, dict) and k != "env")}
    tables = {k: v for k, v in data.items() if isinstance(v, dict) and k != "env"}
    out = []
    if prefix:
        out.append(f"[{prefix}]")
    out += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items()]
    text = "\n".join(out)
    for key, table in tables.items():
        text += "\n\n" + _to_toml(table, f"{prefix}.{key}" if prefix else key)
    return text.strip() + "\n"
