"""Suite-wide collection rules, the fixture that stops a `spartron` command at a chosen point, and the collector
given back after every test.

Tests marked `slurm` share one single-machine Slurm of 2 nodes (scripts/slurm.sh): under pytest-xdist
(`-n 2 --dist loadgroup`, as scripts/test.sh runs the suite) they all go to one worker, so their jobs never
queue behind each other's and their timings hold. The tests of a module that share one of its module-scoped
fixtures (a training run, a saved checkpoint) go to one worker too: spread over both, each worker would
compute the fixture again. (xdist 3.8 under pytest 9 ignores the groups by itself: tests/xdist_groups.py.)

`paused_cli` starts a real `spartron` command that waits, before it opens the first file whose path holds a
given text, until the test lets it go: a test signals it in a state the command cannot leave by itself, so
the outcome does not depend on how fast a loaded machine runs either process.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from xdist_groups import (  # noqa: F401 - hooks: --dist loadgroup that groups under pytest 9 (next to this file)
    pytest_configure_node,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
    write_groups,
)

# The child: `spartron ARGV`, plus a stdlib audit hook that, at the first `open` of a path holding AT, says
# "paused" on stdout and reads its stdin, which the test holds open and never writes: it waits there until
# a signal's handler raises (or the signal kills it). SIGINT as at a terminal: a test runner may start its
# children with SIGINT ignored, and a Ctrl-C test would then test nothing.
_PAUSED = """\
import os, signal, sys
from spartron.launch import cli

at, first = sys.argv.pop(1), [True]

def pause(event, args):
    if event == "open" and first[0] and isinstance(args[0], (str, os.PathLike)) and at in os.fspath(args[0]):
        first[0] = False
        os.write(1, b"paused\\n")
        os.read(0, 1)

signal.signal(signal.SIGINT, signal.default_int_handler)
sys.addaudithook(pause)
sys.argv = ["spartron", *sys.argv[1:]]
cli.run()
"""


class PausedCommand:
    """A `spartron` command waiting before it opens a file: `stop(signum)` signals it and returns how it ended."""

    def __init__(self, argv: list[str], at: str, cwd=None) -> None:  # noqa: ANN001 - a path or None
        self.proc = subprocess.Popen([sys.executable, "-c", _PAUSED, at, *argv], cwd=cwd, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._watchdog = threading.Timer(600, self.proc.kill)  # a hang fails the test, never the session
        self._watchdog.start()
        if self.proc.stdout.readline() != "paused\n":
            out, err = self.proc.communicate()
            pytest.fail(f"`spartron {' '.join(argv)}` ended (status {self.proc.returncode}) before it opened a file "
                        f"at {at!r}:\n{out}{err}")

    def stop(self, signum: int) -> subprocess.CompletedProcess:
        """Send `signum` while the command waits; its stdin stays open until it has ended, so nothing but the
        signal lets it go on."""
        got: dict[str, str] = {}
        readers = [threading.Thread(target=lambda n=n, s=s: got.__setitem__(n, s.read()))
                   for n, s in (("out", self.proc.stdout), ("err", self.proc.stderr))]
        self.proc.send_signal(signum)
        for reader in readers:  # read while it ends: a long traceback must not fill a pipe and stall it
            reader.start()
        for reader in readers:
            reader.join()
        self.proc.wait()
        self.close()
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, got["out"], got["err"])

    def close(self) -> None:
        self._watchdog.cancel()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()


@pytest.fixture
def paused_cli() -> Iterator:
    """paused_cli(argv, at, cwd=None): a PausedCommand of `spartron argv` waiting before it opens the first
    file whose path holds `at`; every one still running at the end of the test is killed."""
    started: list[PausedCommand] = []

    def start(argv: list[str], at: str, cwd=None) -> PausedCommand:  # noqa: ANN001
        started.append(PausedCommand([str(a) for a in argv], at, cwd))
        return started[-1]

    yield start
    for command in started:
        command.close()


@pytest.fixture(autouse=True)
def collector_given_back() -> Iterator[None]:
    """Python's automatic garbage collection as the test found it: a Trainer turns it off from setup() to close()
    (train.gc_every), and a test whose Trainer raised before close() would leave it off for every later test of
    its worker process and for the ranks those tests fork (tests/runtime/test_gc_schedule.py asserts the state
    its ranks start in). No test of the suite does so today; this keeps one that does from failing others."""
    import gc

    enabled = gc.isenabled()
    yield
    if enabled and not gc.isenabled():
        gc.enable()


@pytest.fixture
def master_port() -> Iterator[int]:
    """A MASTER_PORT for a rank this test starts by hand, held for the test (launch.rank_env.held_port): a port
    that was only free when picked can be taken by a concurrent test's gloo connection before the rank binds it."""
    from spartron.launch.rank_env import held_port

    with held_port() as port:
        yield port


def shared_module_fixture(item: pytest.Item) -> str | None:
    """The name of a module- or class-scoped fixture of the suite (not a plugin's) that `item` uses, if any."""
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the fixtures a test function uses
    for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
        if defs and defs[-1].scope in ("module", "class") and defs[-1].baseid:  # baseid "": a plugin's
            return name
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif shared_module_fixture(item) is not None:  # one group per module: its fixtures computed once
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    write_groups(config, items)  # on an xdist worker: the groups, for the controller (tests/xdist_groups.py)
