"""`spartron eval` with launch.nproc > 1 reads a run directory it does not own (maybe a live one): its rank
logs go to a temporary folder, removed at the end; nothing is written into the evaluated run directory
(issue 34)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from spartron.runtime.config import load_config
from spartron.runtime.trainer import train
from spartron.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _cli(args: list[str], cwd: Path, tmp: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    return subprocess.run([sys.executable, "-m", "spartron.launch.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=env)


def _sets(run: Path, *more: str) -> list[str]:
    return [f"train.run_dir={json.dumps(str(run))}", "train.progress=false", "train.peak_tflops=1.0",
            "train.seq_len=32", "train.steps=1", "train.save_every=1", *more]


def _args(run: Path, *more: str) -> list[str]:
    return [str(ROOT / "configs" / "tiny.toml"), *[x for s in _sets(run, *more) for x in ("--set", s)]]


def _train(rank, world, run: str) -> list[int]:
    return [r["step"] for r in train(load_config(ROOT / "configs" / "tiny.toml", _sets(Path(run)))).records]


def test_eval_on_two_ranks_writes_nothing_into_the_run_directory(tmp_path):
    run, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    assert run_distributed(_train, 1, str(run), timeout=120) == [[1]]  # the step to evaluate (set-up, not the CLI)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    done = _cli(["eval", *_args(run, "launch.nproc=2"), "--step", str(run)], tmp_path, tmp)
    assert done.returncode == 0, done.stderr
    (logs,) = [line for line in done.stderr.splitlines() if line.startswith("spartron: launching 2 local ranks")]
    assert logs.startswith(f"spartron: launching 2 local ranks; logs of ranks 1.. in {tmp}/spartron-eval-logs-")
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before  # no logs/eval, nothing else
    assert list(tmp.glob("spartron-eval-logs-*")) == []  # the temporary folder is removed

