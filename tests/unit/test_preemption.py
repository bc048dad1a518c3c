"""core/preemption.py without a process group: the first stop signal is only recorded; the second puts the
previous handlers back and re-delivers itself ([Note: agreeing to stop])."""
import os
import signal

import pytest
import torch

from zerokit.core import preemption
from zerokit.core.collectives.comm import Comm


@pytest.fixture
def fresh(monkeypatch):
    signals = preemption.StopSignals()
    monkeypatch.setattr(preemption, "SIGNALS", signals)
    yield signals
    signals.release()


def test_a_signal_is_recorded_and_a_second_one_reaches_the_previous_handler(fresh):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        comm = Comm(None)  # no process group: world size 1, collectives are identities
        assert preemption.stop_requested(comm, torch.device("cpu")) is False  # installs the handlers
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [] and preemption.received_signal() == "SIGTERM"
        assert preemption.stop_requested(comm, torch.device("cpu")) is True
        os.kill(os.getpid(), signal.SIGTERM)  # the second: handed to what handled SIGTERM before
        assert seen == [signal.SIGTERM] and not fresh.installed
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigusr1_is_left_to_a_handler_already_there(fresh):
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:
        fresh.install()
        assert signal.SIGUSR1 not in fresh.previous and signal.SIGTERM in fresh.previous
    finally:
        fresh.release()
        signal.signal(signal.SIGUSR1, previous)
