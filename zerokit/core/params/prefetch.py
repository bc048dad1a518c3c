"""Which unit runs next: the order the last pass ran them in, followed while it holds.

[Note: recorded prefetch order]
Which stage-3 unit runs next is only known by running the model (a Python forward may loop,
branch, or call a unit twice). So the order is *recorded*: each forward remembers the units
it called, in order, and the next forward prefetches along that record (the first guess is
registration order); each backward likewise records the order it met the units in (the
first guess: the forward's, reversed, each unit once). As long as a pass follows its record,
the next `prefetch` units of the record are gathered ahead of time. As soon as it leaves the
record, prefetching stops for the rest of that pass (so the working-set bound holds: no unit
is gathered that will not run soon) and the new order is recorded for next time. Every rank
runs the same graph, so every rank records the same order and issues the same collectives.

`RecordedOrder` is that bookkeeping and nothing else: plain integers, no tensors, no
process group (tests/unit/test_prefetch.py checks it with hypothesis).
"""
from __future__ import annotations

import collections


class RecordedOrder:
    """One kind of pass (forward, or backward): its recorded order, and where the current pass is in it."""

    def __init__(self, first_guess: list[int]):
        self.recorded = list(first_guess)
        self._uses = collections.Counter(self.recorded)  # unit -> times the recorded pass called it
        self.begin()

    def begin(self) -> None:
        """A new pass starts."""
        self.seen: list[int] = []
        self.on_track = True
        self._calls: collections.Counter = collections.Counter()

    def visit(self, unit: int) -> None:
        """The pass calls `unit` now (its next position)."""
        position = len(self.seen)
        self.seen.append(unit)
        self._calls[unit] += 1
        if self.on_track and (position >= len(self.recorded) or self.recorded[position] != unit):
            self.on_track = False

    def upcoming(self, count: int) -> list[int]:
        """The `count` units the record says come next (none once the pass has left the record)."""
        if not self.on_track:
            return []
        position = len(self.seen)
        return self.recorded[position:position + count]

    def called_again(self, unit: int) -> bool:
        """True when the record says `unit` is called again later in this pass."""
        return self.on_track and self._uses[unit] > self._calls[unit]

    def end(self) -> bool:
        """The pass is over: keep its order as the record if it differed (True then); ready for the next."""
        changed = bool(self.seen) and self.seen != self.recorded
        if changed:
            self.recorded = list(self.seen)
            self._uses = collections.Counter(self.recorded)
        self.begin()
        return changed


def reverse_first_calls(order: list[int]) -> list[int]:
    """A backward's first guess from a forward order: last call first, each unit once."""
    seen: set[int] = set()
    out = []
    for unit in reversed(order):
        if unit not in seen:
            seen.add(unit)
            out.append(unit)
    return out
