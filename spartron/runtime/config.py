"""The run config: TOML, validated by pydantic, the one place every option lives.

`load_config(path, overrides=["parallel.ep=2", ...])` reads a TOML file, applies dotted overrides
(values parsed as TOML literals, bare words as strings) and validates. Every failure is a
`ConfigError` whose message names the dotted key and says what is allowed.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from spartron.checkpointing.config import ACConfig, OffloadConfig
from spartron.configbase import ConfigError, ConfigSection
from spartron.layers.config import ModelConfig
from spartron.layers.moe.dispatch import check_dispatcher
from spartron.layers.ops import load_ops
from spartron.parallel.dims import GROUP_DIMS, ParallelDims, check_order
from spartron.runtime.debug import DebugConfig
from spartron.runtime.observe import FLIGHT_RECORDER_ENV, ObserveConfig


class NcclCommConfig(ConfigSection):
    """NCCL communicator settings for one process group (`[parallel.nccl.<group>]`), as NCCL's own
    ncclConfig_t names them. Why per group: the EP all-to-all that overlaps expert GEMMs (intra-layer
    micro-batches) competes with them for SMs, so capping its CTAs trades some transfer speed for
    compute, without slowing the FSDP collectives. A configured group gets its own communicator even
    when its ranks equal another group's."""

    max_ctas: int | None = Field(None, ge=1)
    min_ctas: int | None = Field(None, ge=1)
    cga_cluster_size: int | None = Field(None, ge=0, le=8)

    @model_validator(mode="after")
    def _check(self) -> NcclCommConfig:
        if self.min_ctas is not None and self.max_ctas is not None and self.min_ctas > self.max_ctas:
            raise ValueError(f"min_ctas = {self.min_ctas} is above max_ctas = {self.max_ctas}")
        return self


class ParallelConfig(ConfigSection):
    """Parallel sizes. fsdp = -1 fills the ranks left after dp_replicate and cp."""

    fsdp: int = -1
    cp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    dp_replicate: int = Field(1, ge=1)
    order: str = "tp-cp-ep-dp-pp"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = Field(300.0, gt=0)
    nccl: dict[str, NcclCommConfig] = Field(default_factory=dict)  # group name -> its communicator settings

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        unknown = sorted(set(self.nccl) - set(GROUP_DIMS))
        if unknown:
            raise ValueError(f"parallel.nccl: unknown group {unknown[0]!r}; known: {', '.join(GROUP_DIMS)}")
        if self.nccl and self.backend == "gloo":
            raise ValueError("parallel.nccl configures NCCL communicators, but parallel.backend = 'gloo'")
        if self.fsdp == 0 or self.fsdp < -1:
            raise ValueError(f"parallel.fsdp must be >= 1 or -1 (fill the remaining ranks), got {self.fsdp}")
        check_order(self.order, "parallel.order")
        return self

    def nccl_settings(self) -> dict[str, dict[str, int]]:
        """Group name -> the NCCL settings that are set, by NCCL's names (ParallelGroups.build's `nccl`)."""
        return {name: comm.model_dump(exclude_none=True) for name, comm in self.nccl.items()}

    def resolve_fsdp(self, world_size: int) -> int:
        if self.fsdp != -1:
            return self.fsdp
        if world_size % (self.dp_replicate * self.cp):
            raise ConfigError(f"parallel: world size {world_size} is not divisible by dp_replicate * cp = "
                              f"{self.dp_replicate * self.cp}, so parallel.fsdp = -1 cannot fill it")
        return world_size // (self.dp_replicate * self.cp)

    def dims(self, world_size: int) -> ParallelDims:
        """THE layout of this section on `world_size` ranks (fsdp = -1 filled in)."""
        return ParallelDims(world_size=world_size, fsdp=self.resolve_fsdp(world_size), cp=self.cp, ep=self.ep,
                            dp_replicate=self.dp_replicate, order=self.order)


_NAME_MAX, _PATH_MAX = 255, 4095  # bytes of one path component and of a whole path (Linux)


def check_path_length(v: str | None) -> str | None:
    """A path the OS can open: no component over 255 bytes, at most 4095 bytes in all."""
    if v is not None:
        longest = max((len(part.encode()) for part in PurePosixPath(v).parts), default=0)
        if longest > _NAME_MAX or len(v.encode()) > _PATH_MAX:
            raise ValueError(f"too long for a path: {len(v.encode())} bytes, longest component {longest} "
                             f"(at most {_NAME_MAX} per component and {_PATH_MAX} in all)")
    return v


class DataConfig(ConfigSection):
    """`[train.data]`: what the model trains on (spartron.runtime.data builds the loaders).

    kind "synthetic": a learnable random stream, no file. "mmap": a flat uint16/uint32 token file
    (`path`), read in windows of seq_len + 1. "packed": a token folder written by `spartron data`
    (`path`): documents packed into sequences with per-document positions, a block-causal document
    mask (`doc_mask`, default true; false: plain causal attention over the packed row) and the chat
    loss mask. `val_fraction`: the held-out split (mmap: the file's last samples; packed: its last
    documents), never trained on; synthetic data always has a held-out stream of its own. `paths`
    (instead of `path`) with `weights` (default equal) blends several files or folders of the kind
    by weight (spartron.data.blend); each keeps its own held-out split.
    """

    kind: Literal["synthetic", "mmap", "packed"] = "synthetic"
    path: str | None = None
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # mmap only: packed folders record their dtype
    val_fraction: float = Field(0.0, ge=0, lt=1)
    doc_mask: bool | None = None  # packed only; None: true
    shuffle: bool = False  # mmap / packed: each epoch reads its samples in a new order (seeded by train.seed)
    paths: list[str] | None = None  # a blend, instead of `path`
    weights: list[float] | None = None  # of `paths`; default equal

    _path = field_validator("path")(check_path_length)

    @field_validator("paths")
    @classmethod
    def _paths(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            if not v:
                raise ValueError("must list at least one path (or use train.data.path)")
            for item in v:
                if not item.strip():
                    raise ValueError("must hold non-empty paths")
                check_path_length(item)
        return v

    @property
    def documents(self) -> bool:
        """Packed documents with per-document positions and the document mask."""
        return self.kind == "packed" and self.doc_mask is not False

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.kind != "synthetic" and not self.path and not self.paths:
            raise ValueError(f"train.data.path is required when train.data.kind = {self.kind!r} "
                             "(or train.data.paths for a blend)")
        if self.path and self.paths:
            raise ValueError("train.data.path and train.data.paths are both set: one file or folder, or a blend")
        if self.weights is not None:
            if self.paths is None:
                raise ValueError("train.data.weights is set without train.data.paths (the blend it weighs)")
            if len(self.weights) != len(self.paths) or any(w <= 0 for w in self.weights):
                raise ValueError(f"train.data.weights must be {len(self.paths)} positive numbers, one per "
                                 f"train.data.paths entry, got {self.weights}")
        if self.kind == "synthetic":  # an option that would be ignored is a mistake, not a no-op
            ignored = [key for key in ("path", "token_dtype", "val_fraction", "doc_mask", "shuffle", "paths")
                       if getattr(self, key) != DataConfig.model_fields[key].default]
            if ignored:
                raise ValueError(f"train.data.{ignored[0]} is set but train.data.kind = 'synthetic' reads "
                                 "no file: set train.data.kind = 'mmap' or 'packed', or remove it")
        if self.kind == "packed" and self.token_dtype != DataConfig.model_fields["token_dtype"].default:
            raise ValueError("train.data.token_dtype is set but train.data.kind = 'packed' reads the dtype from the "
                             "folder's tokens.json: remove it")
        if self.kind == "mmap" and self.doc_mask is not None:
            raise ValueError("train.data.doc_mask is set but a flat token file (train.data.kind = 'mmap') has no "
                             "documents: use train.data.kind = 'packed' with a folder from `spartron data`")
        return self


class TrainConfig(ConfigSection):
    steps: int = Field(10, ge=1)
    seq_len: int = Field(64, ge=2)
    global_batch_size: int = Field(4, ge=1)  # sequences per optimizer step, over all dp ranks
    micro_batch_size: int = Field(1, ge=1)  # sequences per forward on one rank
    intra_layer_micro_batches: int = Field(1, ge=1)
    # What runs per intra-layer micro-batch: "layer" splits the batch and interleaves whole layers (each
    # checkpoint region takes the list); "experts" runs attention, routing and shared experts once and
    # interleaves only the routed token path (dispatch, experts, combine) over chunks of tokens.
    intra_layer_micro_batch_scope: Literal["layer", "experts"] = "layer"
    seed: int = Field(0, ge=0, lt=2**63)
    optimizer: Literal["adamw", "muon"] = "adamw"
    # The AdamW update: torch's fused kernel, or one Triton pass that also applies the clip coefficient
    # (spartron.runtime.adamw_triton; CUDA + triton; the same optimizer state either way). "auto": the
    # Triton pass for CUDA parameters (an error naming this key if triton is missing), torch's on the CPU.
    adamw_kernel: Literal["auto", "torch", "triton"] = "auto"
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(2, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0)  # 0 disables clipping
    # After each optimizer step, zero the gradients in place instead of freeing them (Megatron's
    # persistent gradient buffers): no per-step allocation, but gradient memory is held through forward.
    keep_grad_buffers: bool = False
    # With several micro-batches per step, when FSDP2 reduce-scatters gradients: after the last one only
    # (less communication; every block's unsharded gradients stay live until then: the whole local model's
    # in model.master_dtype), or after every one (only sharded gradients live, as torchtitan does: what
    # large models need; communication once per micro-batch).
    grad_sync: Literal["last_micro_batch", "every_micro_batch"] = "last_micro_batch"
    compile: bool = False
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    save_every: int = Field(0, ge=0)  # 0: never
    run_dir: str | None = None  # default runs/<name>
    resume: bool = True
    # resume = false into a run directory holding saved steps or metrics is refused; true removes them first.
    overwrite: bool = False
    keep_last: int | None = Field(None, ge=0)  # keep the newest N complete saved steps; None/0: all
    # Loading checks every file's size, and its CRC-32 unless false (costs one read of the state; see state.py).
    verify_checksums: bool = True
    # Write saved tensors in the background (DCP async_save, after a copy to host memory): the next step
    # trains while they are written; the step is committed (COMPLETE written) at the end of that next step.
    async_save: bool = False
    # Stop with an error naming the step when the (finite) loss explodes, before that step's update (the state
    # stays the last good one). max_loss: an absolute cap, off (None) by default: a sensible number depends on
    # the vocabulary and the data. loss_spike_factor: the loss may not exceed this many times the run's first-step
    # loss (kept across resumes); on by default at 10, 0 turns it off. Why 10: a first loss is about ln(vocab)
    # from scratch (a model guessing uniformly), or lower from a pretrained start; 10x that is far worse than
    # guessing, which recoverable spikes never reach, while diverging runs pass it within a step or two (the tiny
    # preset at lr 100 goes 8.1 -> 73,878). Megatron-LM's --check-for-spiky-loss uses the same factor.
    max_loss: float | None = Field(None, gt=0)
    loss_spike_factor: float = Field(10.0, ge=0)
    peak_tflops: float | None = Field(None, gt=0)  # per device, for MFU; None: measured by a matmul loop
    progress: bool = True  # progress bar / per-step line and summary table on rank 0
    data: DataConfig = Field(default_factory=DataConfig)
    # Evaluation (spartron.runtime.evaluate): after every eval_every-th step (0: never) the validation loss
    # over eval_steps batches of global_batch_size held-out sequences, the same ones each time.
    eval_every: int = Field(0, ge=0)
    eval_steps: int = Field(1, ge=1)
    # A NEW run starts from these weights: "hf:DIR", a Hugging Face DeepSeek-V3 checkpoint whose config the
    # run's [model] must compute (a resumed run loads its own saved step instead).
    init_from: str | None = None

    @field_validator("init_from")
    @classmethod
    def _init_from(cls, v: str | None) -> str | None:
        if v is not None:
            if not v.startswith("hf:") or not v[3:].strip():
                raise ValueError(f"must be 'hf:DIR' (a Hugging Face checkpoint directory), got {v!r}")
            check_path_length(v[3:])
        return v

    def micro_steps(self, dp: int) -> int:
        """Micro-batches per optimizer step on each of `dp` data-parallel ranks (THE batch rule)."""
        per_step = dp * self.micro_batch_size
        if self.global_batch_size % per_step:
            raise ConfigError(f"train.global_batch_size {self.global_batch_size} must be divisible by "
                              f"dp size {dp} x train.micro_batch_size {self.micro_batch_size} = {per_step}")
        return self.global_batch_size // per_step

    @field_validator("run_dir")
    @classmethod
    def _run_dir(cls, v: str | None) -> str | None:
        """An absolute run_dir is the user's choice; a relative one stays below the working directory
        (it is resolved against it, which differs between a login node and a Slurm --chdir, so `..`
        would make where states land depend on where the command ran)."""
        if v is not None:
            if not v.strip():
                raise ValueError("must be a non-empty path (or leave it unset for runs/<name>)")
            check_path_length(v)
            if not PurePosixPath(v).is_absolute() and ".." in PurePosixPath(v).parts:
                raise ValueError(f"a relative run directory must stay below the working directory "
                                 f"(no '..'); give an absolute path to write elsewhere, got {v!r}")
        return v

    @field_validator("loss_spike_factor")
    @classmethod
    def _loss_spike_factor(cls, v: float) -> float:
        if 0 < v <= 1:  # it would stop a run whose loss merely stopped falling
            raise ValueError(f"must be 0 (off) or above 1 (times the first step's loss), got {v:g}")
        return v

    @model_validator(mode="after")
    def _async_save(self) -> TrainConfig:
        if self.async_save and not self.save_every:  # nothing would be saved asynchronously
            raise ValueError("train.async_save = true needs train.save_every > 0 (it would be ignored)")
        return self

    @model_validator(mode="after")
    def _adamw_kernel(self) -> TrainConfig:
        if self.adamw_kernel == "triton" and self.optimizer != "adamw":  # Muon's AdamW part is its own loop
            raise ValueError(f"train.adamw_kernel = {self.adamw_kernel!r} needs train.optimizer = 'adamw' "
                             f"(got {self.optimizer!r}, which would ignore it)")
        return self

    @model_validator(mode="after")
    def _overwrite(self) -> TrainConfig:
        if self.overwrite and self.resume:  # a resume keeps the saved steps: overwrite would be ignored
            raise ValueError("train.overwrite = true replaces the saved steps of an earlier run with a new run; "
                             "it needs train.resume = false")
        return self


_RUN_NAME_MAX = 128
_SLURM_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SLURM_TIME = re.compile(r"\d+(:\d{2}){0,2}|\d+-\d+(:\d{2}){0,2}|UNLIMITED|infinite")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Set per rank by srun / torchrun / the local launcher; the same value for every rank breaks discovery.
_LAUNCHER_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                           "MASTER_PORT"})
_SBATCH_ARG = re.compile(r"--[a-z][a-z0-9-]*(=[A-Za-z0-9._,:/@+=-]+)?")


class LaunchConfig(ConfigSection):
    """How ranks start: `nproc` local ranks for `spartron train`, and the Slurm job for `spartron sbatch`.

    Slurm values end up in a shell script, so they are checked against Slurm's own charsets here
    (one error naming the key) instead of being escaped into something Slurm would misread.
    Under Slurm each node runs `gpus_per_node` tasks (one per GPU), or `nproc` tasks on CPU.
    """

    nproc: int = Field(1, ge=1)  # ranks spawned on this machine by `spartron train`
    bind_cores: bool = False  # pin each spawned local rank to its own slice of cores (as srun does)
    nodes: int = Field(1, ge=1)  # default of `spartron sbatch --nodes`
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: int = Field(1, ge=1)
    partition: str | None = None  # one partition or a comma-separated list
    account: str | None = None
    qos: str | None = None
    job_name: str | None = None  # default: the run name
    time: str = "01:00:00"
    env: dict[str, str] = Field(default_factory=dict)  # exported in the job script, values shell-quoted
    venv: str | None = None  # default: the venv of the interpreter running `spartron sbatch`
    container: str | None = None  # pyxis/enroot image for `srun --container-image`
    sbatch_args: list[str] = Field(default_factory=list)  # extra `--flag=value` directives
    # Preemption: ranks save a complete step on SIGTERM and exit 75 (spartron.runtime.preemption).
    requeue: bool = False  # `#SBATCH --requeue`; a SIGTERM to the batch shell then requeues the job
    signal_before_s: int = Field(0, ge=0, le=65535)  # `--signal=B:TERM@<s>` before the time limit; 0: no
    terminate_grace_s: float = Field(120.0, gt=0)  # local launcher: time to save after a forwarded SIGTERM

    @field_validator("partition")
    @classmethod
    def _partition(cls, v: str | None) -> str | None:
        if v is not None and not all(_SLURM_WORD.fullmatch(p) for p in v.split(",")):
            raise ValueError(f"must be Slurm partition names ([A-Za-z0-9._-], comma-separated), got {v!r}")
        return v

    @field_validator("account", "qos", "job_name")
    @classmethod
    def _slurm_word(cls, v: str | None) -> str | None:
        if v is not None and not _SLURM_WORD.fullmatch(v):
            raise ValueError(f"must be letters, digits, '.', '_' or '-' (at most 128), got {v!r}")
        return v

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        if not _SLURM_TIME.fullmatch(v):
            raise ValueError(f"must be a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
                             f"D-HH:MM:SS or UNLIMITED), got {v!r}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(f"environment variable name {key!r} must match [A-Za-z_][A-Za-z0-9_]*")
            if key in _LAUNCHER_ENV or key.startswith("SLURM_"):
                raise ValueError(f"{key} is set by the launcher (srun / the local launcher) for each rank; "
                                 "setting it here would give every rank the same value")
            if key in FLIGHT_RECORDER_ENV:
                raise ValueError(f"{key} is set by the launchers from observe.nccl_flight_recorder (with the dump "
                                 "folder in the run directory): set that instead")
            if "\0" in value:
                raise ValueError(f"value of {key} contains a NUL byte")
        return v

    @field_validator("venv", "container")
    @classmethod
    def _no_nul(cls, v: str | None) -> str | None:
        if v is not None and ("\0" in v or "\n" in v or not v.strip()):
            raise ValueError(f"must be a non-empty single-line path or image name, got {v!r}")
        return v

    @field_validator("sbatch_args")
    @classmethod
    def _sbatch_args(cls, v: list[str]) -> list[str]:
        for arg in v:
            if not _SBATCH_ARG.fullmatch(arg):
                raise ValueError(f"each entry must look like --flag or --flag=value with value in "
                                 f"[A-Za-z0-9._,:/@+=-], got {arg!r}")
        return v


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
        self._check_intra_layer_micro_batches()
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
