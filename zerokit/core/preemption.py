"""Preemption: SIGTERM or SIGUSR1 to any rank becomes one stop that every rank agrees on at a step boundary.

[Note: agreeing to stop]
A scheduler preempts a job with SIGTERM (then SIGKILL after a grace period); torchrun's agent
forwards it to every worker, but a signal may also reach one rank only. The handler only
records it: work in progress (a forward, a collective) is never cut. `stop_requested()` is
called by every rank at the same point of every step and reduces every rank's flag with one
max over a one-element tensor (Comm.all_reduce_scalars, over the whole world under hybrid
sharding), so all ranks get the same answer at the same step boundary: the step during which
a signal arrived, or the next one when it arrived after this rank's contribution. The first
call installs the handlers (before it, the signals act as they did). A second signal restores
the previous handlers and re-delivers itself, so the process ends as it would have without
zerokit; a save it cuts short leaves the previous checkpoint current (zerokit/checkpoint/commit.py
[Note: the commit protocol]). SIGUSR1 is taken only while nothing else handles it (zerokit's own
launcher prints stacks on it).
"""
from __future__ import annotations

import signal
import threading

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """The process's stop handlers (signal handlers are per process, so there is one of these)."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first stop signal, once one arrived
        self.previous: dict[int, object] = {}  # what each handled signal did before

    @property
    def installed(self) -> bool:
        return bool(self.previous)

    def install(self) -> None:
        """Handle SIGTERM (and SIGUSR1 if nothing else does); only the main thread can install handlers."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            current = signal.getsignal(sig)
            if sig == signal.SIGUSR1 and current is not signal.SIG_DFL:
                continue  # faulthandler's stacks (zerokit/launch.py), or the user's own handler
            self.previous[sig] = current if current is not None else signal.SIG_DFL
            signal.signal(sig, self._handler)

    def release(self) -> None:
        """Put the previous handlers back (a later install takes them again)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def _handler(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            return
        self.release()  # the second signal: the process ends as it would have without zerokit
        signal.raise_signal(signum)


SIGNALS = StopSignals()


def stop_requested(comm, device: torch.device) -> bool:
    """Whether any rank has received a stop signal: a collective, the same answer on every rank."""
    SIGNALS.install()
    world = getattr(comm, "world", comm)  # hybrid sharding: every rank of every node agrees
    mine = torch.tensor([0.0 if SIGNALS.received is None else 1.0], device=device)
    return bool(world.all_reduce_scalars(mine, op="max", label="stop requested")[0].item() > 0)


def received_signal() -> str | None:
    """The name of the stop signal this rank received (None if none did)."""
    return None if SIGNALS.received is None else signal.Signals(SIGNALS.received).name
