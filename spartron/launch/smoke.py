"""`spartron smoke CONFIG`: cluster bring-up check without a model.

Every rank initialises distributed from the launcher's environment exactly as training does, runs
one all_reduce and one all_gather, and rank 0 writes `<run dir>/smoke.json`: world size, the sum
(which must be 1 + 2 + ... + world), each rank's host (and Slurm node name), local rank and the values of the
`launch.env` variables as the rank saw them (proof the job script's exports reached every rank).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from spartron.runtime.config import RunConfig
from spartron.runtime.rundir import check_not_in_use
from spartron.runtime.safe_open import open_file


class SmokeError(RuntimeError):
    """The collectives returned something other than what every rank contributed."""


def run_smoke(cfg: RunConfig, environ: Mapping[str, str], run_dir: Path) -> dict:
    import torch
    import torch.distributed as dist

    from spartron.parallel.env import destroy_distributed, discover, init_distributed

    env = discover(environ)
    backend = init_distributed(env, cfg.parallel.backend, cfg.parallel.timeout_s)
    try:
        device = torch.device("cuda", env.local_rank) if backend == "nccl" else torch.device("cpu")
        total = torch.tensor([float(env.rank + 1)], device=device)
        dist.all_reduce(total)
        me = {"rank": env.rank, "local_rank": env.local_rank, "host": socket.gethostname(),
              "slurm_node": environ.get("SLURMD_NODENAME"),
              "env": {key: environ.get(key) for key in cfg.launch.env}}
        ranks: list[dict] = [{} for _ in range(env.world_size)]
        dist.all_gather_object(ranks, me)
        expected = env.world_size * (env.world_size + 1) / 2
        result = {"world_size": env.world_size, "launcher": env.launcher, "backend": backend,
                  "master": f"{env.master_addr}:{env.master_port}", "all_reduce_sum": total.item(),
                  "expected_sum": expected, "ranks": ranks}
        if total.item() != expected:
            raise SmokeError(f"all_reduce returned {total.item()}, expected {expected}")
        if env.rank == 0:
            write_smoke(run_dir, result)
            print(f"spartron smoke: {env.world_size} rank(s) ok ({backend}, {env.launcher}); "
                  f"wrote {run_dir / 'smoke.json'}")
        return result
    finally:
        destroy_distributed()


def write_smoke(run_dir: Path, result: dict) -> None:
    """`<run dir>/smoke.json`, never while a run owns the directory (StateLoadError naming its lock) and never
    through a link or into a FIFO there (spartron.runtime.safe_open: UnsafeEntryError names the entry)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    check_not_in_use(run_dir)
    with open(open_file(run_dir, "smoke.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
        f.write(json.dumps(result, indent=1) + "\n")
