"""Buckets: which parameters' gradients travel together, and the queue of collectives in flight.

A bucket is one `FlatParamLayout` (see flat_param.py): its gradient buffer is the unit a
stage hands to one collective. Small buckets start communicating early in backward
(more overlap) but pay a per-collective latency; large ones amortise latency but start
late. `bucket_numel` caps a bucket's elements (DDP's `bucket_cap_mb`, in elements).

`plan_buckets` and `plan_all_reduce_groups` are pure index math (tested with hypothesis);
`InFlight` keeps launched collectives in launch order so that a stage can bound how many
full-size buffers are alive (stage 2 frees a bucket's gradient as soon as its reduce-scatter
completes).
"""
from __future__ import annotations

from collections import deque
from typing import Callable


def plan_buckets(numels: list[int] | tuple[int, ...], bucket_numel: int, close_when_full: bool = False) -> list[list[int]]:
    """Group parameter indices into buckets, walking them in reverse registration order.

    Gradients arrive roughly in reverse registration order during backward, so the
    first bucket to fill holds the last parameters. Each bucket is a contiguous run of
    indices (returned ascending, so a bucket's flat buffer keeps registration order)
    whose numels sum to at most `bucket_numel`; a parameter larger than the cap gets a
    bucket of its own. Every index appears in exactly one bucket.

    `close_when_full`: torch DDP's rule instead (stage 1: stages/zero1.py [Note: stage 1's
    buckets]): a bucket closes once it holds `bucket_numel` elements or more, so every bucket
    but the last reaches the cap and none exceeds it by more than its last parameter.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(numels))):
        n = numels[i]
        if current and filled + n > bucket_numel and not close_when_full:
            buckets.append(sorted(current))
            current, filled = [], 0
        current.append(i)
        filled += n
        if close_when_full and filled >= bucket_numel:
            buckets.append(sorted(current))
            current, filled = [], 0
    if current:
        buckets.append(sorted(current))
    return buckets


def plan_all_reduce_groups(numels: list[int] | tuple[int, ...], keys: list | tuple, threshold: int) -> list[list[int]]:
    """Group consecutive buckets into collectives: a group closes once it holds `threshold` elements.

    That is torch DDP's rule for closing a bucket (`bucket_cap_mb`), applied to whole zerokit
    buckets rather than to parameters: stage 0 all-reduces each group in one call (core/grads/grad_reduce.py
    [Note: all-reduce groups]). Buckets with different `keys` (their dtype) never share a group.
    Groups are contiguous runs of indices in order; every one but the last of its key run holds
    at least `threshold` elements, and dropping its last bucket would leave it below that (so no
    group is larger than `threshold` plus one bucket). Every index appears in exactly one group.
    """
    if threshold < 1:
        raise ValueError(f"threshold must be >= 1, got {threshold}")
    if len(keys) != len(numels):
        raise ValueError(f"{len(numels)} numels but {len(keys)} keys")
    groups: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, n in enumerate(numels):
        if current and keys[i] != keys[current[-1]]:
            groups.append(current)
            current, filled = [], 0
        current.append(i)
        filled += n
        if filled >= threshold:
            groups.append(current)
            current, filled = [], 0
    if current:
        groups.append(current)
    return groups


class InFlight:
    """Launched collectives, oldest first; each with a callback run after it completes."""

    def __init__(self):
        self._queue: deque = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, handle, on_done: Callable[[], None] | None = None) -> None:
        self._queue.append((handle, on_done))

    def wait_oldest(self) -> None:
        handle, on_done = self._queue.popleft()
        handle.wait()  # CPU waits for this bucket's collective
        if on_done is not None:
            on_done()

    def wait_until(self, max_in_flight: int) -> None:
        """Wait for the oldest collectives until at most `max_in_flight` remain."""
        while len(self._queue) > max_in_flight:
            self.wait_oldest()

    def wait_all(self) -> None:
        self.wait_until(0)

    def finish_arrived(self) -> None:
        """Finish, oldest first, the collectives that have completed, up to the first that has not, so
        that their temporaries go now (core/collectives/comm.py [Note: finishing what has arrived]). Local work
        only: where it happens may differ between ranks."""
        while self._queue and self._queue[0][0].arrived():
            self.wait_oldest()
