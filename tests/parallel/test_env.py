"""Launcher environment discovery (torchrun, Slurm, single process), nodelists, init and teardown."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spartron.parallel.env import (
    DistEnv,
    DistEnvError,
    destroy_distributed,
    discover,
    expand_nodelist,
    init_distributed,
    resolve_backend,
)

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "29400"}
SLURM = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123456",
         "SLURM_JOB_NODELIST": "gpu[03-04,07],cpu3"}


def _without(environ: dict, key: str) -> dict:
    return {k: v for k, v in environ.items() if k != key}


def test_torchrun():
    assert discover(TORCHRUN) == DistEnv(rank=5, local_rank=1, world_size=8, master_addr="node7",
                                         master_port=29400, launcher="torchrun")


def test_torchrun_wins_over_slurm():
    # torchrun started inside an sbatch allocation: its own variables describe this process.
    assert discover({**SLURM, **TORCHRUN}).launcher == "torchrun"


def test_slurm_master_from_nodelist_and_port_from_job_id():
    env = discover(SLURM)
    assert env == DistEnv(rank=9, local_rank=1, world_size=16, master_addr="gpu03",
                          master_port=16000 + 123456 % 16768, launcher="slurm")
    assert env.master_port == 22080
    # every job's port lies below Linux's ephemeral range (32768..), where outgoing connections take ports
    assert discover({**SLURM, "SLURM_JOB_ID": str(16767)}).master_port == 32767
    assert discover({**SLURM, "SLURM_JOB_ID": str(16768)}).master_port == 16000


def test_slurm_step_nodelist_and_explicit_master():
    env = discover({**SLURM, "SLURM_STEP_NODELIST": "gpu[07-08]"})
    assert env.master_addr == "gpu07"
    env = discover({**SLURM, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "31000"})
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 31000)


def test_single_process_without_launcher():
    assert discover({"HOME": "/root"}) == DistEnv(rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1",
                                                  master_port=29500, launcher="single")


@pytest.mark.parametrize("text,hosts", [
    ("node1", ["node1"]),
    ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("x[1-2],y[5],z", ["x1", "x2", "y5", "z"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text,message", [
    ("", "Slurm nodelist is empty"),
    ("gpu[01-04", "unclosed '['"),
    ("gpu01]", "unmatched ']'"),
    ("gpu[[1]]", "nested '['"),
    ("gpu[a-b]", "bad range 'a-b' in [a-b]"),
    ("gpu[4-2]", "range '4-2' runs backwards"),
    ("gpu[]", "bad range '' in []"),
    ("a,,b", "empty host name"),
])
def test_malformed_nodelists(text, message):
    with pytest.raises(DistEnvError) as err:
        expand_nodelist(text)
    assert message in str(err.value)


@pytest.mark.parametrize("environ,message", [
    ({**TORCHRUN, "RANK": "8"}, "rank 8 must be in [0, world size 8)"),
    ({**TORCHRUN, "RANK": "-1"}, "rank -1 must be in [0, world size 8)"),
    ({**TORCHRUN, "WORLD_SIZE": "0"}, "world size must be >= 1, got 0"),
    ({**TORCHRUN, "LOCAL_RANK": "6"}, "local rank 6 must be in [0, rank 5]"),
    (_without(TORCHRUN, "MASTER_ADDR"), "no master: set MASTER_ADDR and MASTER_PORT"),
    (_without(TORCHRUN, "WORLD_SIZE"), "torchrun environment is incomplete: missing WORLD_SIZE"),
    ({"WORLD_SIZE": "2"}, "missing RANK, LOCAL_RANK"),
    ({**TORCHRUN, "RANK": "five"}, "RANK='five' is not an integer"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "master port 70000 must be in 1..65535"),
    ({**TORCHRUN, "MASTER_ADDR": ""}, "master address is empty"),
    ({**SLURM, "SLURM_PROCID": "16"}, "rank 16 must be in [0, world size 16)"),
    (_without(SLURM, "SLURM_NTASKS"), "Slurm environment is incomplete: missing SLURM_NTASKS"),
    (_without(SLURM, "SLURM_JOB_NODELIST"), "Slurm environment has no master"),
    (_without(SLURM, "SLURM_JOB_ID"), "Slurm environment has no master port"),
    ({**SLURM, "SLURM_JOB_NODELIST": "gpu[1-"}, "malformed Slurm nodelist 'gpu[1-': unclosed '['"),
])
def test_bad_environments(environ, message):
    with pytest.raises(DistEnvError) as err:
        discover(environ)
    assert message in str(err.value)


def test_backend_choice():
    assert resolve_backend("auto", cuda_available=True) == "nccl"
    assert resolve_backend("auto", cuda_available=False) == "gloo"
    assert resolve_backend("gloo", cuda_available=True) == "gloo"
    with pytest.raises(DistEnvError, match="backend 'nccl' needs CUDA"):
        resolve_backend("nccl", cuda_available=False)
    with pytest.raises(DistEnvError, match="backend must be 'auto', 'nccl' or 'gloo', got 'mpi'"):
        resolve_backend("mpi", cuda_available=False)


def test_init_and_destroy_single_process():
    assert not dist.is_initialized()
    env = discover({})
    try:
        assert init_distributed(env, backend="gloo", timeout_s=30) == "gloo"
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        x = torch.tensor([3.0])
        dist.all_reduce(x)
        assert x.item() == 3.0
        with pytest.raises(DistEnvError, match="already initialized"):
            init_distributed(env)
    finally:
        destroy_distributed()
    assert not dist.is_initialized()
    destroy_distributed()  # a second teardown is a no-op


def _tcp_rank(rank, world, port):
    # The harness already initialised a group; tear it down and rendezvous over TCP like a launcher would.
    destroy_distributed()
    env = discover({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    init_distributed(env, backend="auto", timeout_s=30)
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    destroy_distributed()
    return x.item()


def test_init_over_tcp_on_two_ranks():
    import socket

    from spartron.testing import run_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert run_distributed(_tcp_rank, 2, port) == [3.0, 3.0]
