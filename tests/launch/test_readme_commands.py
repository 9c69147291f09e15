"""The README runs as printed: every ```sh block of README.md (the CPU commands; GPU, cluster, install and
server commands are in ```bash blocks) runs in order, each as one bash script with `set -e`, in a fresh copy
of the repository (its tracked and new files; no runs/, data/ or ../shared) with this environment's
`spartron` and `python` first on PATH. Then the outputs the README describes are checked."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.S | re.M)


def sh_blocks(text: str) -> list[str]:
    """The bodies of the ```sh fenced blocks of a markdown text, in order."""
    return BLOCK.findall(text)


def commands(block: str) -> list[str]:
    """The commands of a block, one per line after joining `\\` continuations (a `python -c "..."` is one)."""
    out, joined = [], re.sub(r"\\\n\s*", "", block)
    quoted = re.sub(r'"[^"]*"', lambda m: m.group(0).replace("\n", " "), joined)
    for line in quoted.splitlines():
        if line.strip():
            out.append(line.split("#")[0].strip())
    return out


def fresh_copy(dest: Path) -> Path:
    """The repository's tracked and new (not ignored) files, as a fresh clone of the working tree has them."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():  # a tracked file deleted in the working tree is not in a clone of it either
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def test_sh_blocks_are_found_and_split_into_commands():
    text = "a\n```sh\nspartron x \\\n    --y 1   # why\npython -c \"\nimport os\n\"\n```\n```bash\nnot run\n```\n"
    (block,) = sh_blocks(text)
    assert commands(block) == ["spartron x --y 1", 'python -c " import os "']


@pytest.mark.slow
def test_every_cpu_command_of_the_readme_runs_as_printed(tmp_path):
    blocks = sh_blocks((ROOT / "README.md").read_text())
    printed = [c.split()[:2] for b in blocks for c in commands(b)]
    assert printed == [["spartron", "--version"], ["spartron", "data"], ["spartron", "train"], ["spartron", "train"],
                       ["spartron", "eval"], ["spartron", "convert"], ["python", "-c"], ["spartron", "train"],
                       ["spartron", "regress"], ["spartron", "plan"], ["spartron", "sbatch"]]
    repo = fresh_copy(tmp_path / "spartron")
    assert not (repo / "runs").exists() and not (repo.parent / "shared").exists()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "COLUMNS": "120"}
    env.pop("PYTHONPATH", None)
    outputs, stdouts = [], []
    for block in blocks:
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"README block failed (exit {done.returncode}):\n{block}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout + done.stderr)
        stdouts.append(done.stdout)
    version, data, first, resumed, export, more = outputs

    assert re.fullmatch(r"spartron \d+\.\d+\.\d+\n", version)
    assert "of 49 documents to data/tok" in data and "(model.vocab_size >= 512)" in data
    # step lines: loss, grad norm, lr, step time, tokens/s, peak memory (and val every 2 steps)
    step_line = re.compile(r"^step (\d+)/(\d+) loss \d+\.\d{4} gnorm \d+\.\d{3} lr [0-9.e-]+ time [0-9.]+ m?s "
                           r"[0-9,]+ tok/s mem \d+\.\d\d GiB( val \d+\.\d{4} \(ppl [0-9.e+]+\))?$", re.M)
    assert [(m[0], m[1], bool(m[2])) for m in step_line.findall(first)] == [
        ("1", "5", False), ("2", "5", True), ("3", "5", False), ("4", "5", True), ("5", "5", True)]
    assert "spartron: 5 steps (steps 1-5)" in first and "│ MFU " in first and " GiB │" in first
    assert re.search(r"^spartron: total time [0-9.]+ s; last saved step: 5 \(runs/tiny-hf/step-00000005\)$", first,
                     re.M)
    assert "spartron: resumed from step 5" in resumed and "learning-rate schedule changed on resume" in resumed
    assert [m[0] for m in step_line.findall(resumed)] == ["6", "7", "8", "9", "10"]
    assert "last saved step: 10 (runs/tiny-hf/step-00000010)" in resumed
    run = repo / "runs" / "tiny-hf"
    assert sorted(p.name for p in run.glob("step-*")) == ["step-00000005", "step-00000010"]
    assert any((run / "tensorboard").iterdir())
    # eval: the newest step, on the data that step records, the value the run logged at step 10
    evaluated = json.loads(next(line for line in export.splitlines() if line.startswith("{")))
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert evaluated["step"] == 10
    assert evaluated["val_loss"] == next(r["val_loss"] for r in logged if r.get("step") == 10)
    assert "token folder 'data/tok'" in evaluated["data"]
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= {
        p.name for p in (repo / "runs" / "tiny-hf-export").iterdir()}
    assert stdouts[4].rstrip().splitlines()[-1].startswith("The run directory")  # transformers generated from it
    # more: two ranks with EP, the determinism check, the 64-GPU plan with memory, the 16-node script
    assert "ep 2" in more and "last saved step: none" in more
    assert "[PASS]" in more and "[FAIL]" not in more and (repo / "runs" / "regress.png").stat().st_size > 0
    assert "# predicted peak allocated memory per rank" in more
    assert "#SBATCH --nodes=16" in more and "#SBATCH --ntasks-per-node=8" in more
