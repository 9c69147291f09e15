"""SIGUSR1, the preemption / time-limit warning many Slurm sites and templates send (`scancel -s USR1`), stops
a run after saving exactly as SIGTERM does; held from the process's start like SIGTERM (Slurm audit F3)."""

from __future__ import annotations

import signal
import threading

import pytest

from spartron.launch.process import hold_sigterm, release_sigterm
from spartron.runtime.preemption import StopOnSigterm


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_held_during_start_up_reaches_the_handler_and_the_default_returns_after(sig):
    before = signal.getsignal(sig)
    hold_sigterm()  # what the `spartron` process does on its first line
    try:
        # arrives while the rank still imports torch: kept pending, not fatal. To this thread, not the process: a
        # process-directed signal may go to any thread that does not block it, and pytest-xdist's worker has
        # others (its IO thread), which then died of it (a CI worker crash at fa30c36 and 90808f0)
        signal.pthread_kill(threading.get_ident(), sig)
        assert sig in signal.sigpending()
        with StopOnSigterm() as stop:
            assert stop.requested is True
            assert signal.getsignal(sig) not in (signal.SIG_DFL, before)
    finally:
        release_sigterm()
    assert signal.getsignal(sig) == before and sig not in signal.sigpending()


def test_the_launcher_holds_exactly_the_signals_the_ranks_handle():
    """process.HELD_SIGNALS is restated (the launcher's first line cannot import the runtime): one set."""
    from spartron.launch.process import HELD_SIGNALS
    from spartron.runtime.preemption import STOP_SIGNALS

    assert HELD_SIGNALS == set(STOP_SIGNALS) == {signal.SIGTERM, signal.SIGUSR1}
