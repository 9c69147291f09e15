"""Checks of a run that need more than its config: the world size, the data file, this machine.

`check_before_launch(cfg, world_size)` is what `spartron train` / `smoke` call after loading the
config and before any rank is spawned (and each rank of srun/torchrun calls it before it initialises
torch.distributed), so these mistakes are one line and exit status 2 instead of a traceback in
`logs/rank<N>.log`. Every failure is a ConfigError naming the dotted key or the path. The rules
themselves stay where they live (ParallelDims, TrainConfig.micro_steps, check_token_file,
offload_window); this module only runs them early.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from spartron.runtime.config import ConfigError, RunConfig


def check_before_launch(cfg: RunConfig, world_size: int, workdir: Path | None = None,
                        local_ranks: int | None = None) -> None:
    """Raise ConfigError (or ParallelDimsError) for a run that cannot start on `world_size` ranks here;
    `local_ranks`: how many this process is about to spawn on this machine (None: it is a rank itself)."""
    if local_ranks is not None:
        check_local_ranks(local_ranks)
    dims = cfg.parallel.dims(world_size)
    cfg.train.micro_steps(dims.dp)
    check_device_options(cfg)
    check_compiler(cfg)
    check_offload_window(cfg)
    check_run_dir(cfg, workdir or Path.cwd())
    if cfg.train.data.kind != "synthetic":
        from spartron.runtime.data import check_data

        check_data(cfg)


def check_before_submit(cfg: RunConfig, world_size: int) -> None:
    """What `spartron sbatch` can check on the login node before submitting a job of `world_size`
    tasks: the layout, the batch, the offload window, and CUDA-only options in a job without GPUs
    (the login node's own devices say nothing about the compute nodes')."""
    dims = cfg.parallel.dims(world_size)
    cfg.train.micro_steps(dims.dp)
    check_offload_window(cfg)
    cuda_only = _cuda_only_options(cfg) + (["device = 'cuda'"] if cfg.device == "cuda" else [])
    if cuda_only and (cfg.launch.gpus_per_node == 0 or cfg.device == "cpu"):
        why = "device = 'cpu'" if cfg.device == "cpu" else "launch.gpus_per_node = 0: a CPU job"
        raise ConfigError(f"{cuda_only[0]} needs CUDA, but the job runs on CPU ({why})")


def _cuda_only_options(cfg: RunConfig) -> list[str]:
    moe = cfg.model.moe
    out = []
    if cfg.model.n_layers > cfg.model.first_k_dense or cfg.model.mtp.depth:  # MoE layers exist
        if moe.dispatcher == "deepep":
            out.append("model.moe.dispatcher = 'deepep'")
        if moe.all_to_all_transport == "copy_engine":
            out.append("model.moe.all_to_all_transport = 'copy_engine'")
    if cfg.parallel.backend == "nccl":
        out.append("parallel.backend = 'nccl'")
    if cfg.parallel.nccl:
        out.append("parallel.nccl")
    return out


def check_device_options(cfg: RunConfig) -> None:
    """device = 'cuda' without CUDA, and CUDA-only options on a run that will be on CPU."""
    cuda_only = _cuda_only_options(cfg)
    if cfg.device == "cpu":
        cuda = False
    elif cfg.device == "cuda" or cuda_only:
        import torch

        cuda = torch.cuda.is_available()
    else:
        return  # device 'auto' and nothing that needs CUDA: either device works
    if cfg.device == "cuda" and not cuda:
        raise ConfigError("device: 'cuda' requested but torch.cuda.is_available() is False "
                          "(install a CUDA build of torch, or set device = 'cpu')")
    if cuda_only and not cuda:
        where = "device = 'cpu'" if cfg.device == "cpu" else "no CUDA device here (device = 'auto')"
        raise ConfigError(f"{cuda_only[0]} needs CUDA, but this run is on CPU ({where})")


def check_local_ranks(nproc: int, cpus: int | None = None) -> None:
    """More local ranks than 4 per core (at least 64) would only thrash the machine: a typo, not a run."""
    cpus = cpus or os.cpu_count() or 1
    limit = max(64, 4 * cpus)
    if nproc > limit:
        raise ConfigError(f"launch.nproc {nproc} is more local ranks than this machine can run ({cpus} cores; at "
                          f"most {limit} here): use spartron sbatch for many nodes")


def check_compiler(cfg: RunConfig, which=shutil.which) -> None:
    """train.compile with inductor on CPU writes and builds C++: without a compiler the first step fails."""
    if not cfg.train.compile or cfg.train.compile_backend != "inductor" or cfg.device == "cuda":
        return
    if cfg.device == "auto":
        import torch

        if torch.cuda.is_available():
            return
    names = inductor_compilers()
    if not any(which(name) for name in names):
        raise ConfigError(f"train.compile = true with compile_backend 'inductor' on CPU needs the C++ compiler torch's "
                          f"inductor builds with ({' or '.join(names)} on PATH, or another named by CXX); install it "
                          f"or set train.compile_backend = 'aot_eager'")


def inductor_compilers() -> list[str]:
    """The compilers torch's inductor tries on this machine, in order: its own setting torch._inductor.config.cpp.cxx
    (CXX when set, else g++ on Linux, clang++ on macOS; CXX is torch's, no Spartron switch). Its None entry, a gcc
    that torch downloads through conda only on its own opt-in, is left out."""
    from torch._inductor import config

    cxx = config.cpp.cxx
    return [name for name in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if name]


def n_checkpoint_regions(cfg: RunConfig) -> int:
    """Checkpoint regions of the reference model: every ac.freq-th block of the decoder stack and
    the MTP blocks (one block for weight-shared depths), by the one freq rule apply_ac uses."""
    from spartron.checkpointing.apply import checkpointed_positions

    mtp = cfg.model.mtp
    blocks = cfg.model.n_layers + ((1 if mtp.share_weights else mtp.depth) if mtp.depth else 0)
    return len(checkpointed_positions(blocks, cfg.ac))


def check_offload_window(cfg: RunConfig) -> None:
    if not cfg.offload.enabled:
        return
    from spartron.checkpointing.offload import OffloadSetupError, offload_window

    try:
        offload_window(cfg.offload, n_checkpoint_regions(cfg))
    except OffloadSetupError as err:
        raise ConfigError(str(err)) from None


def check_run_dir(cfg: RunConfig, workdir: Path) -> None:
    """The run directory must be a directory, or creatable: its nearest existing parent a writable folder."""
    run_dir = cfg.run_dir(workdir)
    key = "train.run_dir" if cfg.train.run_dir else "name"
    try:
        _check_dir(run_dir, key)
    except OSError as err:
        raise ConfigError(f"{key}: run directory {str(run_dir)[:200]!r}: {err.strerror or err}") from None


def _check_dir(run_dir: Path, key: str) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{key}: run directory {str(run_dir)!r} exists and is not a directory")
    parent = run_dir
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{key}: run directory {str(run_dir)!r} cannot be created: {str(parent)!r} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: run directory {str(run_dir)!r} is not writable ({str(parent)!r})")
