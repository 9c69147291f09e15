"""The run config's [parallel], [train] and [train.data] sections, each validated on its own; how they
combine with the other sections is checked by RunConfig (spartron.runtime.config)."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Literal

from pydantic import Field, field_validator, model_validator

from spartron.configbase import ConfigError, ConfigSection
from spartron.parallel.dims import GROUP_DIMS, ParallelDims, check_order
from spartron.runtime.indexer_metrics import IndexerMetricsConfig
from spartron.runtime.stage_config import StageConfig


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
    # "muon": distributed Muon (spartron.runtime.muon) for hidden matrices and the routed experts (each expert
    # its own matrix), AdamW for embedding, head, norms and biases; its state reshards like AdamW's.
    optimizer: Literal["adamw", "muon"] = "adamw"
    # The dtype of Muon's Newton-Schulz iteration. "auto": the gradients' (bfloat16 with bf16-only parameters,
    # float32 with fp32 masters); "bfloat16": always, as Muon's own recipe runs it: with fp32 masters its GEMMs
    # then run on bf16 tensor cores instead of float32 ones (the momentum, the update and its application stay
    # in the parameters' dtype); "float32": always.
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # The AdamW update: torch's fused kernel, or one Triton pass that also applies the clip coefficient
    # (spartron.runtime.adamw_triton; CUDA + triton; the same optimizer state either way). "auto": the
    # Triton pass for CUDA parameters (an error naming this key if triton is missing), torch's on the CPU.
    adamw_kernel: Literal["auto", "torch", "triton"] = "auto"
    # AdamW's moments (exp_avg, exp_avg_sq) stored in bfloat16 beside fp32 masters, as DeepSeek-V3 trained
    # (Megatron's precision-aware optimizer with exp_avg_dtype = exp_avg_sq_dtype = bf16): 4 bytes a parameter
    # less. The update still runs in fp32; each moment is rounded to nearest even as it is stored. None: the
    # masters' dtype (spartron.runtime.adamw_triton). With CPU parameters or adamw_kernel = "torch" the update is
    # TritonAdamW's torch reference (torch's own AdamW keeps the moments in the parameters' dtype).
    adamw_moments_dtype: Literal["bfloat16"] | None = None
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
    # Python's garbage collection: automatic collection off while training, a full collection every gc_every steps
    # on every rank at the same step (spartron.runtime.gc_schedule); 0: Python's automatic collection.
    gc_every: int = Field(50, ge=0)
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
    # [[train.stages]]: steps, lr schedule, trainable parameters and DSA mode per stage (stage_config, stages)
    stages: list[StageConfig] = Field(default_factory=list)
    # [train.indexer_metrics]: recall of the dense attention mass by the indexer's top-k, and the KL, per
    # DSA layer on sampled queries (spartron.runtime.indexer_metrics)
    indexer_metrics: IndexerMetricsConfig = Field(default_factory=IndexerMetricsConfig)

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
        if self.adamw_kernel != "auto" and self.optimizer != "adamw":  # Muon's AdamW part is its own loop
            raise ValueError(f"train.adamw_kernel = {self.adamw_kernel!r} needs train.optimizer = 'adamw' "
                             f"(got {self.optimizer!r}, which would ignore it)")
        if self.muon_ns_dtype != "auto" and self.optimizer != "muon":
            raise ValueError(f"train.muon_ns_dtype = {self.muon_ns_dtype!r} needs train.optimizer = 'muon' "
                             f"(got {self.optimizer!r}, which would ignore it)")
        if self.adamw_moments_dtype is not None and self.optimizer != "adamw":
            raise ValueError(f"train.adamw_moments_dtype = {self.adamw_moments_dtype!r} needs train.optimizer = "
                             f"'adamw' (got {self.optimizer!r}, whose state would ignore it)")
        return self

    @model_validator(mode="after")
    def _indexer_metrics(self) -> TrainConfig:
        if self.indexer_metrics.every and self.compile:  # its forward hooks would break a compiled block's graph
            raise ValueError(f"train.indexer_metrics.every = {self.indexer_metrics.every} needs train.compile = false "
                             "(the metric hooks the DSA layers, which a compiled block cannot run); set "
                             "train.indexer_metrics.every = 0 to train compiled")
        return self

    @model_validator(mode="after")
    def _overwrite(self) -> TrainConfig:
        if self.overwrite and self.resume:  # a resume keeps the saved steps: overwrite would be ignored
            raise ValueError("train.overwrite = true replaces the saved steps of an earlier run with a new run; "
                             "it needs train.resume = false")
        return self
