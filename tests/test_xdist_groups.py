"""tests/xdist_groups.py: under `pytest -n 2 --dist loadgroup` (scripts/test.sh) the tests of one xdist_group
run on one worker, whether the group is marked in the test file or added at collection (as tests/conftest.py
does for the Slurm tests and for a module's tests sharing its fixture). A pytest run of a small generated
suite, whose tests record the worker that ran them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist", reason="needs pytest-xdist")

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import pytest
from xdist_groups import pytest_configure_node, pytest_unconfigure, pytest_xdist_make_scheduler, write_groups


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "added" in item.name:
            item.add_marker(pytest.mark.xdist_group("added"))
    write_groups(config, items)
"""

SUITE = """
import os, time
import pytest


def record(tmp_path_factory, name):
    folder = tmp_path_factory.getbasetemp().parent.parent / "ran"  # above each worker's own basetemp
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(os.environ["PYTEST_XDIST_WORKER"])
    time.sleep(0.2)


@pytest.mark.parametrize("i", range(4))
def test_added(tmp_path_factory, i):
    record(tmp_path_factory, f"added{i}")


@pytest.mark.xdist_group("marked")
@pytest.mark.parametrize("i", range(4))
def test_marked(tmp_path_factory, i):
    record(tmp_path_factory, f"marked{i}")


@pytest.mark.parametrize("i", range(8))
def test_free(tmp_path_factory, i):
    record(tmp_path_factory, f"free{i}")
"""


def test_the_tests_of_a_group_run_on_one_worker(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_suite.py").write_text(SUITE)
    (tmp_path / "base").mkdir()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "--basetemp", str(tmp_path / "base" / "tmp"), "suite"], cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},  # not this run's
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = {p.name: p.read_text() for p in (tmp_path / "base" / "ran").iterdir()}
    assert len(ran) == 16
    for group in ("added", "marked"):
        assert len({ran[f"{group}{i}"] for i in range(4)}) == 1, ran
