"""benchmarks/assemble_deep_gemm.sh: the DeepGEMM tree build_deep_gemm.sh compiles, from three local git repositories,
with the cutlass and fmt headers of exactly the commits DeepGEMM's submodules pin."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "assemble_deep_gemm.sh"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                          capture_output=True, text=True).stdout.strip()


def _repo(path: Path, files: dict[str, str]) -> str:
    """A repository with one commit of `files`; its commit id."""
    path.mkdir()
    _git(path, "init", "-q")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    _git(path, "add", "-A")
    _git(path, "commit", "-qm", "c")
    return _git(path, "rev-parse", "HEAD")


def _deep_gemm(path: Path, cutlass: str, fmt: str) -> None:
    _repo(path, {"setup.py": "# setup\n", "third-party/tilelang_ops/ops.py": "# kept\n"})
    for sub, sha in (("third-party/cutlass", cutlass), ("third-party/fmt", fmt)):
        _git(path, "update-index", "--add", "--cacheinfo", f"160000,{sha},{sub}")
    _git(path, "commit", "-qm", "pin")


def test_the_pinned_headers_and_nothing_else_are_assembled(tmp_path):
    cutlass = _repo(tmp_path / "cutlass", {"include/cute/a.hpp": "pinned\n", "media/big.png": "x"})
    (tmp_path / "cutlass" / "include" / "cute" / "a.hpp").write_text("later\n")
    _git(tmp_path / "cutlass", "commit", "-qam", "later")  # the mirror's HEAD moved past the pin
    fmt = _repo(tmp_path / "fmt", {"include/fmt/base.h": "fmt\n", "src/format.cc": "x"})
    _deep_gemm(tmp_path / "dg", cutlass, fmt)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("from an earlier call")
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "dg"), str(tmp_path / "cutlass"), str(tmp_path / "fmt"),
                           str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["setup.py", "third-party/cutlass/include/cute/a.hpp", "third-party/fmt/include/fmt/base.h",
                     "third-party/tilelang_ops/ops.py"]
    assert (out / "third-party/cutlass/include/cute/a.hpp").read_text() == "pinned\n"


def test_a_repository_without_the_pinned_commit_is_refused_in_one_line(tmp_path):
    cutlass = _repo(tmp_path / "cutlass", {"include/cute/a.hpp": "x\n"})
    fmt = _repo(tmp_path / "fmt", {"include/fmt/base.h": "fmt\n"})
    _deep_gemm(tmp_path / "dg", cutlass, fmt)
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "dg"), str(tmp_path / "fmt"), str(tmp_path / "fmt"),
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == f"assemble_deep_gemm: {tmp_path / 'fmt'} lacks the pinned commit {cutlass}"
    assert not (tmp_path / "out").exists()
