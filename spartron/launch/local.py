"""One machine, N ranks: spawn the same command once per rank with the torchrun rank variables set.

Rank 0 keeps the terminal (progress bar, summary); ranks 1.. write to `<log_dir>/rank<k>.log`, opened
before any rank starts and never through a link or into a FIFO (spartron.runtime.safe_open): a linked
`logs` folder or rank log is one line naming it, and nothing outside the run directory is truncated.
A rank writes into a pipe the launcher copies into its log, so a log that cannot be written (a full disk)
is the launcher's one line naming it (the ranks are killed), not a rank's lost traceback or a hang.
Failures are reported by root cause: the launcher watches every rank (a pidfd per rank wakes it the
moment one exits; `waitpid(WUNTRACED)` sees one stop), and the rank that failed FIRST — exited
non-zero, was killed by a signal, or stayed stopped (SIGSTOP) — is named with how it ended and the
tail of its log; the knock-on "connection closed by peer" of its peers comes later and is only
listed. Then every other rank is killed (SIGKILL: a failed job has nothing left to save, and a
saved step is atomic) and the root cause's status is returned. A refusal (status 2: a mistake in the
config or data, a loss guard's stop) is not a failure to diagnose: it is the root rank's one
`spartron: error: ...` line alone (rank 0's is on the terminal already; another rank's comes from its log),
after the other ranks got `REFUSAL_GRACE_S` to end on their own (ranks refuse together).

Ranks die with their launcher, SIGKILL of the launcher included: each rank is started with the
parent-death signal SIGKILL (Linux `prctl(PR_SET_PDEATHSIG)`), which fires when the thread that
spawned it ends; call `launch_local` from a thread that outlives the run (the CLI's main thread).

SIGTERM to the launcher (scancel, a CI timeout, `kill`) is forwarded to the ranks, which save a
complete step at the next step boundary and exit with `STOPPED_STATUS`; after `terminate_grace_s`
the launcher kills what is left.
"""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spartron.launch.process import ERROR_PREFIX, STOPPED_STATUS, USAGE_STATUS, release_sigterm
from spartron.launch.rank_env import core_slices, held_port, rank_environ
from spartron.runtime.safe_open import make_dir, open_file

_PR_SET_PDEATHSIG = 1


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass
class _Rank:
    """One spawned rank and what the launcher has observed of it (times are time.monotonic())."""

    rank: int
    proc: subprocess.Popen
    log: Path | None
    pidfd: int | None
    returncode: int | None = None  # as Popen's: -S when killed by signal S
    ended_at: float | None = None
    stop_signal: int | None = None  # set while the rank is stopped
    stopped_at: float | None = None
    killed_by_launcher: bool = False
    stopped_before_kill: int | None = None
    pipe: int | None = None  # the read end of the rank's output (ranks 1..), copied into log_fd
    log_fd: int | None = None

    def copy_output(self) -> str | None:
        """Copy what the rank has written so far into its log (without blocking); the error line when the
        log cannot be written."""
        while self.pipe is not None:
            try:
                data = os.read(self.pipe, 1 << 16)
            except BlockingIOError:
                return None
            if not data:  # every writer closed it
                os.close(self.pipe)
                self.pipe = None
                return None
            try:
                while data:
                    data = data[os.write(self.log_fd, data):]
            except OSError as err:
                return (f"{self.log}: cannot write this rank log ({err.strerror or err}): free space on its disk, "
                        "then resume the run")
        return None

    def close_output(self) -> None:
        for fd in (self.pipe, self.log_fd):
            if fd is not None:
                os.close(fd)
        self.pipe = self.log_fd = None

    @property
    def status(self) -> int:
        """Shell-style status: a rank killed (or left stopped) by signal S is 128 + S."""
        if self.returncode is None:
            return 128 + (self.stop_signal or signal.SIGKILL)
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    def describe(self) -> str:
        if self.returncode is None and self.stop_signal is not None:
            return f"stopped ({signal_name(self.stop_signal)})"
        if self.killed_by_launcher:
            before = f"stopped ({signal_name(self.stopped_before_kill)}), then " if self.stopped_before_kill else ""
            return f"{before}was killed by the launcher (SIGKILL)"
        if self.returncode is not None and self.returncode < 0:
            return f"was killed by {signal_name(-self.returncode)}"
        return f"exited with status {self.returncode}"

    def observe(self, now: float) -> None:
        """Reap an exit, or note a stop / continue, without blocking."""
        try:
            pid, wstatus = os.waitpid(self.proc.pid, os.WNOHANG | os.WUNTRACED | os.WCONTINUED)
        except ChildProcessError:  # reaped elsewhere: the exit status is lost
            self._ended(1, now)
            return
        if pid == 0:
            return
        if os.WIFSTOPPED(wstatus):
            self.stop_signal, self.stopped_at = os.WSTOPSIG(wstatus), now
        elif os.WIFCONTINUED(wstatus):
            self.stop_signal = self.stopped_at = None
        else:
            self._ended(os.waitstatus_to_exitcode(wstatus), now)

    def kill(self) -> None:
        """SIGKILL (a stopped process dies of it too) and reap."""
        if self.returncode is not None:
            return
        stopped = self.stop_signal
        os.kill(self.proc.pid, signal.SIGKILL)  # not Popen.send_signal: its poll() would reap behind our back
        try:
            _, wstatus = os.waitpid(self.proc.pid, 0)
            code = os.waitstatus_to_exitcode(wstatus)
        except ChildProcessError:
            code = -signal.SIGKILL
        self._ended(code, time.monotonic())
        self.killed_by_launcher = code == -signal.SIGKILL
        self.stopped_before_kill = stopped if self.killed_by_launcher else None

    def _ended(self, returncode: int, now: float) -> None:
        self.returncode = self.proc.returncode = returncode  # Popen must never wait for it again
        self.ended_at, self.stop_signal, self.stopped_at = now, None, None
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(text[-lines:])


def _libc_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: ranks still die with a launcher that ends normally
        return None


def _child_setup(prctl: Callable[..., int] | None, launcher_pid: int, cores: list[int] | None):
    """The preexec_fn of a rank: die with the launcher, then pin to `cores`."""
    def setup() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # as the launcher's caller had it
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != launcher_pid:  # the launcher died before the prctl took effect
                os._exit(128 + signal.SIGKILL)
        if cores:
            os.sched_setaffinity(0, cores)
    return setup


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux < 5.3: poll the ranks instead
        return None


def _wait_for_change(ranks: Sequence[_Rank], timeout_s: float) -> None:
    """Return when a live rank may have exited, or after timeout_s (stops are seen by polling)."""
    fds = [r.pidfd for r in ranks if r.returncode is None and r.pidfd is not None]
    if len(fds) < sum(r.returncode is None for r in ranks):
        time.sleep(min(timeout_s, 0.01))
        return
    poller = select.poll()
    for fd in fds + [r.pipe for r in ranks if r.pipe is not None]:  # a rank's output wakes it too
        poller.register(fd, select.POLLIN)
    poller.poll(timeout_s * 1000)


class _TermRequest:
    """SIGTERM handler of the launcher: note it, the loop forwards it (no module-level state)."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum, frame) -> None:
        self.requested = True


def _root_cause(ranks: Sequence[_Rank], now: float, stopped_limit_s: float, term_forwarded: bool) -> _Rank | None:
    """The rank that failed first, once the run has failed; None while it has not.

    Failed: exited non-zero (not STOPPED_STATUS, and not killed by the SIGTERM the launcher
    forwarded), or stopped longer than stopped_limit_s. A stopped rank also counts as soon as any
    other rank has failed (its peers' collectives time out waiting for it). Earliest observation
    wins; within one observation a stop, then a death by signal, then the lowest rank.
    """
    def failed(r: _Rank) -> bool:
        if r.returncode is None or r.returncode in (0, STOPPED_STATUS):
            return False
        return not (term_forwarded and r.returncode == -signal.SIGTERM)

    exits = [r for r in ranks if failed(r)]
    stops = [r for r in ranks if r.stopped_at is not None]
    if not exits and not any(now - r.stopped_at >= stopped_limit_s for r in stops):
        return None

    def key(r: _Rank):
        kind = 0 if r.stopped_at is not None else (1 if r.returncode < 0 else 2)
        return (r.stopped_at if r.stopped_at is not None else r.ended_at, kind, r.rank)
    return min(exits + stops, key=key)


def launch_local(command: Sequence[str], nproc: int, environ: Mapping[str, str], log_dir: Path,
                 master_addr: str = "127.0.0.1", poll_s: float = 0.1, bind_cores: bool = False,
                 stopped_limit_s: float = 300.0, terminate_grace_s: float = 120.0, root: Path | None = None) -> int:
    """Run `command` as `nproc` ranks on this machine; returns 0, STOPPED_STATUS (every rank saved and
    stopped after SIGTERM) or the status of the rank that failed first.

    bind_cores: start rank r on `core_slices(...)[r]` of the cores this launcher may use.
    stopped_limit_s: how long a rank may stay stopped (SIGSTOP) before the run is failed (the CLI
    passes parallel.timeout_s: its peers give up on it by then anyway).
    terminate_grace_s: after a forwarded SIGTERM, how long the ranks get to save and exit.
    root: the run directory log_dir lies in (default: log_dir's parent); nothing below it is followed
    through a link (UnsafeEntryError names the entry, before any rank starts).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    slices = core_slices(os.sched_getaffinity(0), nproc) if bind_cores else None
    logs = _open_logs(log_dir, root or log_dir.parent, nproc)
    with held_port(master_addr) as port:  # held until every rank has ended
        return _launch(command, nproc, environ, master_addr, port, slices, logs, log_dir, poll_s, stopped_limit_s,
                       terminate_grace_s)


def _launch(command: Sequence[str], nproc: int, environ: Mapping[str, str], master_addr: str, port: int,
            slices: list[list[int]] | None, logs: dict[int, int], log_dir: Path, poll_s: float,
            stopped_limit_s: float, terminate_grace_s: float) -> int:
    prctl = _libc_prctl()
    ranks: list[_Rank] = []
    term = _TermRequest()
    previous = signal.signal(signal.SIGTERM, term)
    # a log past RLIMIT_FSIZE is EFBIG for our write (the one line), not a SIGXFSZ that kills the launcher
    previous_fsize = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        for rank in range(nproc):
            env = rank_environ(environ, rank, nproc, master_addr, port)
            log = None if rank == 0 else log_dir / f"rank{rank}.log"
            log_fd = logs.pop(rank, None)
            pipe, out = os.pipe() if log_fd is not None else (None, None)
            try:
                # the launcher is single-threaded, so running Python between fork and exec is safe
                setup = _child_setup(prctl, os.getpid(), slices[rank] if slices else None)
                proc = subprocess.Popen(list(command), env=env, stdout=out, preexec_fn=setup,
                                        stderr=subprocess.STDOUT if out else None)
            except BaseException:
                for fd in (pipe, log_fd):
                    if fd is not None:
                        os.close(fd)
                raise
            finally:
                if out is not None:
                    os.close(out)
            if pipe is not None:
                os.set_blocking(pipe, False)
            ranks.append(_Rank(rank, proc, log, _pidfd(proc.pid), pipe=pipe, log_fd=log_fd))
        # A `spartron` launcher holds SIGTERM from its start (process.hold_sigterm) and its ranks inherit the
        # hold until their own handler is in place; the launcher's handler is, so a held SIGTERM arrives now.
        release_sigterm()
        forwarded_at = None
        while any(r.returncode is None for r in ranks):
            now, problem = _observe(ranks, poll_s)
            if problem is not None:
                return _stop_for_unwritable_log(ranks, problem)
            if term.requested and forwarded_at is None:
                forwarded_at = now
                _forward_term(ranks, terminate_grace_s)
            root = _root_cause(ranks, now, stopped_limit_s, forwarded_at is not None)
            if root is not None:
                what, status = root.describe(), root.status  # before the kill below changes them
                if status == USAGE_STATUS and root.returncode == USAGE_STATUS:
                    problem = _let_refusing_ranks_exit(ranks)
                    if problem is not None:
                        return _stop_for_unwritable_log(ranks, problem)
                failed_at = root.stopped_at if root.stopped_at is not None else root.ended_at
                early = [r for r in ranks if r.returncode in (0, STOPPED_STATUS) and r.ended_at < failed_at]
                for r in ranks:
                    r.kill()
                # reaped by kill() or on its own: its line is printed (rank 0's stderr is the terminal, unseen here:
                # one that printed its line but had not exited within the grace would read as not refused)
                zero_refused = ranks[0].returncode == USAGE_STATUS
                if status == USAGE_STATUS and root.returncode == USAGE_STATUS:
                    refusal = None if zero_refused else _refusal_line(root)
                    if zero_refused or refusal is not None:
                        if refusal is not None:
                            print(refusal, file=sys.stderr)
                        return status
                _report_failure(root, what, ranks, early)
                return status
            if forwarded_at is not None and now - forwarded_at > terminate_grace_s:
                for r in ranks:
                    r.kill()
                print(f"spartron: the ranks did not stop within {terminate_grace_s:g} s of SIGTERM; "
                      f"killed them. {_endings(ranks)}", file=sys.stderr)
                return 128 + signal.SIGTERM
        codes = {r.returncode for r in ranks}
        if codes == {0}:
            return 0
        if codes <= {0, STOPPED_STATUS}:
            return STOPPED_STATUS
        print(f"spartron: the ranks ended after SIGTERM: {_endings(ranks)}", file=sys.stderr)
        return max(r.status for r in ranks)
    except BaseException:  # Ctrl-C or an error here: never leave orphan ranks behind
        for r in ranks:
            r.kill()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGXFSZ, previous_fsize)
        for fd in logs.values():  # not handed to a rank (the launch failed first)
            os.close(fd)
        for r in ranks:
            r.close_output()
            if r.pidfd is not None:
                os.close(r.pidfd)


def launch_with_temporary_logs(command: Sequence[str], nproc: int, environ: Mapping[str, str], prefix: str,
                               **options: Any) -> int:
    """launch_local with the rank logs in a new temporary folder (for a command that reads a run directory it
    does not own): removed at the end unless the ranks failed (refused in one line counts as done); then
    its path is the last line."""
    logs = Path(tempfile.mkdtemp(prefix=prefix))
    print(f"spartron: launching {nproc} local ranks; logs of ranks 1.. in {logs}", file=sys.stderr)
    status = USAGE_STATUS
    try:
        status = launch_local(command, nproc, environ, logs, root=logs, **options)
    finally:
        if status in (0, USAGE_STATUS):
            shutil.rmtree(logs, ignore_errors=True)
        else:
            print(f"spartron: the ranks' logs are kept in {logs}", file=sys.stderr)
    return status


def _open_logs(log_dir: Path, root: Path, nproc: int) -> dict[int, int]:
    """The log file (descriptor) of each rank 1.. (truncated), opened before any rank starts, without
    following links."""
    relative = log_dir.relative_to(root) if log_dir != root else None
    opened: dict[int, int] = {}
    try:
        if relative is not None:
            make_dir(root, relative)
        else:
            root.mkdir(parents=True, exist_ok=True)
        for rank in range(1, nproc):
            name = f"rank{rank}.log" if relative is None else relative / f"rank{rank}.log"
            opened[rank] = open_file(root, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    except BaseException:
        for fd in opened.values():
            os.close(fd)
        raise
    return opened


def _forward_term(ranks: Sequence[_Rank], grace_s: float) -> None:
    print(f"spartron: got SIGTERM; forwarded it to the ranks, which save a complete step and stop "
          f"(waiting up to {grace_s:g} s)", file=sys.stderr)
    for r in ranks:
        if r.returncode is None:
            os.kill(r.proc.pid, signal.SIGTERM)
            if r.stop_signal is not None:
                os.kill(r.proc.pid, signal.SIGCONT)  # a stopped rank cannot act on it otherwise


# How long the other ranks get to end on their own after one refused (status 2) before they are killed: ranks refuse
# together (a config or data mistake, a loss guard at one step), and rank 0's line goes to the terminal, which the
# launcher cannot read, so rank 0 has refused only once it has exited with status 2. Killed a moment after its line
# and before its exit, it read as not refused and the root rank's line was printed after its own.
REFUSAL_GRACE_S = 1.0


def _let_refusing_ranks_exit(ranks: Sequence[_Rank], grace_s: float = REFUSAL_GRACE_S) -> str | None:
    """Wait up to `grace_s` for the live ranks to end (their output copied meanwhile); a log's write error."""
    deadline = time.monotonic() + grace_s
    while any(r.returncode is None for r in ranks) and (left := deadline - time.monotonic()) > 0:
        problem = _observe(ranks, min(left, 0.05))[1]
        if problem is not None:
            return problem
    return None


def _observe(ranks: Sequence[_Rank], timeout_s: float) -> tuple[float, str | None]:
    """Wait up to timeout_s for a change, note each live rank's exit or stop, copy every rank's output into its log:
    (the time observed, a log's write error or None)."""
    _wait_for_change(ranks, timeout_s)
    now = time.monotonic()
    for r in ranks:
        if r.returncode is None:
            r.observe(now)
    for r in ranks:  # after observe: a rank seen ended has all its output in the pipe
        problem = r.copy_output()
        if problem is not None:
            return now, problem
    return now, None


def _stop_for_unwritable_log(ranks: Sequence[_Rank], problem: str) -> int:
    """A rank log cannot be written: kill every rank and say so in one line."""
    for r in ranks:
        r.kill()
    print(ERROR_PREFIX + problem, file=sys.stderr)
    return USAGE_STATUS


def _endings(ranks: Sequence[_Rank]) -> str:
    return "; ".join(f"rank {r.rank} {r.describe()}" for r in ranks)


def _refusal_line(rank: _Rank) -> str | None:
    """The last `spartron: error: ...` line of a rank that exited with USAGE_STATUS (its log), or None."""
    if rank.log is None or not rank.log.is_file():
        return None
    lines = [line for line in rank.log.read_text(errors="replace").splitlines() if line.startswith(ERROR_PREFIX)]
    return lines[-1] if lines else None


def _report_failure(root: _Rank, what: str, ranks: Sequence[_Rank], early: Sequence[_Rank]) -> None:
    where = "its output is above" if root.log is None else f"last lines of {root.log}:"
    print(f"spartron: rank {root.rank} {what}, the first rank to fail; stopped the other ranks; {where}",
          file=sys.stderr)
    if root.log is not None:
        print(_tail(root.log) or "(the log is empty)", file=sys.stderr)
    print(f"spartron: how the ranks ended: {_endings(ranks)}", file=sys.stderr)
    if early:  # a rank that leaves early (status 0 or 75) strands its peers in a collective until they time out
        left = ", ".join(f"rank {r.rank} exited with status {r.returncode}" for r in early)
        print(f"spartron: note: {left} before rank {root.rank} failed; its peers may have been waiting for it",
              file=sys.stderr)
