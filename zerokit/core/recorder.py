"""What this rank's collectives were, in ZeRO terms: a small ring buffer per rank.

Every collective `core/comm.py` issues is recorded here first — a sequence number, the
operation, a ZeRO-level label ("bucket 3 (blocks.2.*)", "unit blocks.0", "optimizer
overflow flag"), the element count, dtype and phase — before it is launched. Three things
read the records:

* listeners (`recorder.listeners`, called with each record just before its collective is
  issued): the memory timeline (`zerokit timeline`) snapshots live bytes there;
* debug mode (`zk.shard(..., debug=True)` or ZEROKIT_DEBUG=1): every rank compares each
  collective's fingerprint with the other ranks' before issuing it, so ranks that diverge
  fail at once, naming both sides (core/comm.py [Note: debug mode]);
* a collective that fails (a timeout, a peer gone) prints this rank's last records.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class CollectiveRecord:
    seq: int  # this rank's count of collectives so far (the same on every rank while they agree)
    op: str  # all_reduce | reduce_scatter | all_gather | broadcast | all_reduce_scalars | all_gather_object
    label: str  # what it moves, in ZeRO terms
    numel: int  # elements of the collective's (full-size) input or output
    dtype: str
    phase: str  # forward | backward | step | state_dict | init | ...

    def fingerprint(self) -> tuple:
        """What every rank must agree on for this collective to be the same one."""
        return (self.seq, self.op, self.label, self.numel, self.dtype)

    def describe(self) -> str:
        return f"#{self.seq} {self.op} of {self.label} ({self.numel} x {self.dtype}, {self.phase})"


class CollectiveRecorder:
    """The last `capacity` collectives of this rank, and who wants to hear of each new one."""

    def __init__(self, capacity: int = 32):
        self.records: collections.deque[CollectiveRecord] = collections.deque(maxlen=capacity)
        self.seq = 0
        self.listeners: list[Callable[[CollectiveRecord], None]] = []

    def record(self, op: str, tensor: torch.Tensor | None, label: str | None, phase: str | None) -> CollectiveRecord:
        rec = CollectiveRecord(self.seq, op, label or "unlabelled tensor",
                               tensor.numel() if tensor is not None else 0,
                               str(tensor.dtype).removeprefix("torch.") if tensor is not None else "object",
                               phase or "other")
        self.seq += 1
        self.records.append(rec)
        for listener in self.listeners:
            listener(rec)
        return rec

    def last(self, n: int = 8) -> list[CollectiveRecord]:
        return list(self.records)[-n:]

    def report(self, rank: int, n: int = 8) -> str:
        lines = [f"zerokit rank {rank}: last {min(n, len(self.records))} collectives (oldest first):"]
        lines += [f"  {rec.describe()}" for rec in self.last(n)]
        return "\n".join(lines)
