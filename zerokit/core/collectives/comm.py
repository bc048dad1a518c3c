"""`Comm`: the collective API. Every stage talks to the other ranks through one `Comm` object, and only
through it (its recipes, in core/collectives/ordered.py, core/collectives/gather.py and core/collectives/recorder.py, are called from here).
It owns:

* the process group (passed explicitly; `None` means the default group, and no initialised group at all
  means world size 1, where every collective is an identity);
* the reduction recipe: native, or ordered / tree (core/collectives/ordered.py [Note: ordered reduction]);
* how gathers run on gloo and how storage is lent to collectives (core/collectives/gather.py);
* logical byte counters in the ZeRO paper's accounting ([Note: byte accounting]);
* profiler labels (`zerokit::all_gather`, ...), so a trace names each collective once;
* an optional *simulated* world: one process plays rank r of N, and collectives return correctly shaped
  results computed locally, so memory can be measured for a rank of 64 on one machine;
* the recorder (core/collectives/recorder.py): every collective is recorded, in ZeRO terms, before it is issued;
  debug mode checks there that every rank is about to issue the same one, and a collective that fails
  prints this rank's last records before the error propagates.

[Note: byte accounting]
Counted per call, per kind, as the ZeRO paper does: an all-reduce of B bytes counts 2B (reduce-scatter +
all-gather), a reduce-scatter its full input B, an all-gather its full output B, a broadcast B. A ring
puts (N-1)/N of these on the wire per rank. Nothing is counted at world size 1.

[Note: finishing what has arrived]
An asynchronous reduce-scatter's temporaries, and at stages 2-3 the bucket's full-size gradient, live
until its wait(). So before a stage issues its next reduce-scatter it finishes, oldest first, those that
have already completed (`Handle.arrived`, `InFlight.finish_arrived`): the same sum into the same output,
so the same bits, only sooner. Whether one has completed differs between ranks, so only a finish that is
local work may run there: a hybrid reduce-scatter (its finish crosses nodes with collectives) and an
ordered all-reduce's second half (its wait issues all-gathers) report not arrived until waited for in
order. What it saves depends on timing: benchmarks/memory.py (benchmarks/results/sweep.md).
"""
from __future__ import annotations

import collections
import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function as _record_function

from zerokit.core.collectives import ordered, recorder
from zerokit.core.collectives.gather import (all_gather_single, check_in_place, fill_rows, free_storage, gather_many, lend,
                                 reduce_scatter_single, shares_storage, take_back)
from zerokit.core.collectives.recorder import CollectiveRecord, CollectiveRecorder, in_words
from zerokit.core.collectives.tree import is_power_of_two

if dist.is_available():
    # Imported with zerokit, so before the user's init_process_group: torch.distributed.nn binds
    # the default group into its functions' defaults at import time, which would keep the group
    # (and gloo's threads) alive past destroy_process_group. See zerokit/launch.py
    # [Note: process-group teardown].
    import torch.distributed.nn  # noqa: F401

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


class Handle:
    """An in-flight collective. `wait()` blocks the CPU until the result is usable.

    `works`: the torch.distributed Works it waits for (one, a list, or None when already complete);
    `finish`: the step run after them (an ordered sum, a copy out, a free, the next collective);
    `lent`: the aliases the Works hold, emptied once they complete (core/collectives/gather.py [Note: frees at a
    fixed point]); `comm`: whose recorder a failure reports; `local=False`: `finish` issues collectives
    of its own (core/collectives/hybrid.py, core/collectives/ordered.py)."""

    def __init__(self, works=None, finish=None, comm: "Comm | None" = None, local: bool = True, lent=()):
        self._works = [] if works is None else list(works) if isinstance(works, (list, tuple)) else [works]
        self._finish = finish
        self._lent = lent
        self._comm = comm
        self.local = local
        self.done = False

    def completed(self) -> bool:
        """True once wait() would not block on communication."""
        return self.done or all(work.is_completed() for work in self._works)

    def arrived(self) -> bool:
        """True when wait() would neither block nor issue a collective, so it may run at a point that
        differs between ranks: [Note: finishing what has arrived]."""
        return self.done or (self.local and self.completed())

    def wait(self) -> None:
        if self.done:
            return
        with recorder.report_failure(self._comm) if self._comm is not None else contextlib.nullcontext():
            for work in self._works:
                work.wait()  # CPU waits here for the collective to complete (gloo raises on timeout)
            if self._finish is not None:
                self._finish()
            take_back(self._lent)
        self._lent, self._finish = (), None  # what they referred to is the caller's to free now
        self.done = True


_DONE = Handle()
_DONE.done = True


def profiled(name: str):
    """torch.profiler's record_function(name) while a profiler records, else nothing: entering one costs a
    dispatcher call even when no profiler is on, a few per bucket and step."""
    return _record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


@dataclass(frozen=True)
class Simulated:
    """One process playing `rank` of `world_size`; no process group is used."""

    rank: int
    world_size: int


class Comm:
    """Collectives on flat 1-D tensors for one process group, with byte counters."""

    def __init__(self, group=None, ordered: bool | None = None, simulate: Simulated | None = None,
                 debug: bool | None = None, tree: bool = False):
        """`debug`: check before each collective that every rank issues the same one (core/collectives/recorder.py
        [Note: debug mode]); None reads the environment (ZEROKIT_DEBUG=1 turns it on). `tree`: sum ranks
        pairwise (see `use_tree`)."""
        self.simulate = simulate
        if simulate is not None:
            if not 0 <= simulate.rank < simulate.world_size:
                raise ValueError(f"simulated rank {simulate.rank} is not in [0, {simulate.world_size})")
            self.group, self.rank, self.world_size, self.backend = None, simulate.rank, simulate.world_size, "simulated"
        elif dist.is_available() and dist.is_initialized():
            self.group = group
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group))
        else:
            if group is not None:
                raise ValueError("group= was given but torch.distributed is not initialised")
            self.group, self.rank, self.world_size, self.backend = None, 0, 1, "none"
        self.ordered = (self.backend != "nccl") if ordered is None else bool(ordered)
        # Hybrid sharding (core/collectives/hybrid.py) tells these apart; in one flat group they are the group's own:
        self.data_parallel_size = self.world_size  # N: ranks whose gradients are averaged (the 1/N)
        self.world_rank = self.rank  # rank among every rank (checkpoints: who writes the shared files)
        self.replica_rank = 0  # which copy of the sharded state this rank holds (0: the one checkpoints write)
        self.tree = False
        if tree:
            self.use_tree()
        self.bytes = collections.Counter()  # kind -> logical bytes
        self.bytes_by_phase = collections.Counter()  # (phase, kind) -> logical bytes
        self.calls = collections.Counter()  # kind -> number of collectives issued
        self.recorder = CollectiveRecorder()  # this rank's last collectives, in ZeRO terms (core/collectives/recorder.py)
        self._second_halves: collections.deque = collections.deque()  # ordered all-reduces awaiting their all-gather
        if debug is None:
            debug = os.environ.get("ZEROKIT_DEBUG", "").strip() not in ("", "0")
        self.debug = bool(debug)  # core/collectives/recorder.py [Note: debug mode]
        # Stage 3 sets it until its first step: every collective checked (core/collectives/recorder.py [Note: rank-dependent
        # units]).
        self.first_step_checks = False

    @property
    def checks_each_collective(self) -> bool:
        """Whether each collective is preceded by the check of core/collectives/recorder.py [Note: debug mode]."""
        return (self.debug or self.first_step_checks) and self.distributed

    def _lend(self, t: torch.Tensor) -> torch.Tensor:
        """core/collectives/gather.py's `lend` for this comm's backend ([Note: frees at a fixed point] there)."""
        return lend(t, self.backend)

    def use_tree(self) -> None:
        """Sum the ranks' contributions pairwise (core/collectives/ordered.py [Note: ordered reduction]). Needs N = 2^j."""
        if not is_power_of_two(self.world_size):
            raise ValueError(f"reduction='tree' needs a power-of-two world size (1, 2, 4, 8, ...), got "
                             f"{self.world_size}: the binary tree over ranks has no other shape")
        self.tree, self.ordered = True, True

    # ------------------------------------------------------------------ bookkeeping
    @property
    def distributed(self) -> bool:
        """True when collectives really cross processes."""
        return self.world_size > 1 and self.simulate is None

    def _count(self, kind: str, nbytes: int, phase: str | None) -> None:
        """[Note: byte accounting]."""
        if self.world_size == 1:
            return
        self.bytes[kind] += nbytes
        self.calls[kind] += 1
        self.bytes_by_phase[(phase or "other", kind)] += nbytes

    def stats(self) -> dict[str, int]:
        """Cumulative logical bytes per kind (ZeRO accounting), every kind present."""
        return {kind: int(self.bytes[kind]) for kind in KINDS}

    def stats_by_group(self) -> dict[str, dict[str, int]]:
        """Bytes per kind within shard groups, across replicate groups (hybrid sharding, core/collectives/hybrid.py),
        and over the whole world; one flat group is the shard group, and nothing crosses."""
        zeros = {kind: 0 for kind in KINDS}
        return {"shard_group": self.stats(), "replicate_group": zeros, "world": dict(zeros)}

    def stats_by_phase(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (phase, kind), n in sorted(self.bytes_by_phase.items()):
            out.setdefault(phase, {})[kind] = int(n)
        return out

    def reset_stats(self) -> None:
        self.bytes.clear()
        self.bytes_by_phase.clear()
        self.calls.clear()

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False,
                   phase: str | None = None, label: str | None = None) -> Handle:
        """In-place all-reduce of a 1-D tensor (`op` is "sum" or "max").

        An ordered sum needs the length padded to a multiple of world size; callers
        reduce flat padded buffers, and scalars go through `all_reduce_scalars`.
        `label` names what moves in ZeRO terms, for the recorder (core/collectives/recorder.py).
        """
        rec = self._record("all_reduce", tensor, label, phase)
        self._count("all_reduce", 2 * _nbytes(tensor), phase)
        if not self.distributed:
            return _DONE
        with profiled("zerokit::all_reduce"), self.report_failure():
            if op == "sum" and self.ordered and self.world_size > 2:  # N = 2: one addition, any order
                return ordered.all_reduce(self, tensor, async_op, rec)
            lent = self._lend(tensor)
            work = dist.all_reduce(lent, op=_OPS[op], group=self.group, async_op=async_op)
            return self._handle(work, async_op, (lent,))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                       phase: str | None = None, label: str | None = None) -> Handle:
        """Sum `input` (padded_numel,) over ranks; this rank's range lands in `output` (padded_numel // N,).

        `output` may be this rank's own range of `input` (an in-place reduce-scatter).
        """
        assert input.numel() == output.numel() * self.world_size, (input.numel(), output.numel(), self.world_size)
        self._record("reduce_scatter", input, label, phase)
        self._count("reduce_scatter", _nbytes(input), phase)
        if not self.distributed or self.world_size == 1:  # simulated, or a group of one: this rank's range
            start = self.rank * output.numel()
            if not (self.world_size == 1 and output.data_ptr() == input.data_ptr()):  # in place at one rank
                output.copy_(input[start:start + output.numel()])
            return _DONE
        with profiled("zerokit::reduce_scatter"), self.report_failure():
            if self.ordered:
                return ordered.reduce_scatter(self, output, input, async_op)
            lent = self._lend(input)
            if shares_storage(output, input):  # in place (output is my range of input): go via a temporary
                result = torch.empty_like(output)
                work = reduce_scatter_single(result, lent, group=self.group, async_op=async_op)

                def finish():
                    output.copy_(result)
                    free_storage(result)  # core/collectives/gather.py [Note: frees at a fixed point]

                return self._handle(work, async_op, (lent,), finish)
            out = self._lend(output)
            work = reduce_scatter_single(out, lent, group=self.group, async_op=async_op)
            return self._handle(work, async_op, (lent, out))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   phase: str | None = None, label: str | None = None) -> Handle:
        """Concatenate every rank's `input` (shard_numel,) into `output` (shard_numel * N,)."""
        assert output.numel() == input.numel() * self.world_size, (output.numel(), input.numel(), self.world_size)
        check_in_place(output, input, self.rank, self.world_size)
        self._record("all_gather", output, label, phase)
        self._count("all_gather", _nbytes(output), phase)
        if not self.distributed:
            # Simulated or single rank: every slot gets this rank's shard (correct shape,
            # and exact at world size 1).
            fill_rows(output, input, self.world_size)
            return _DONE
        with profiled("zerokit::all_gather"), self.report_failure():
            handle = self._gather_handle([output], [input], coalesce=False)
            if not async_op:
                handle.wait()
            return handle

    def all_gather_many(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], phase: str | None = None,
                        labels: list[str] | None = None, coalesce: bool = True) -> Handle:
        """Several all-gathers (output i: (shard_numel_i * N,), input i: (shard_numel_i,)) issued together,
        waited for as one. Asynchronous; each is recorded and counted as its own all-gather, all of them
        (and their debug-mode checks) before any is issued.

        `coalesce`: in one round of latency instead of one per buffer. Its price on gloo: a staging buffer of the
        group's outputs' size while it runs (packed: core/collectives/gather.py [Note: gloo's all-gather temporary]), so a caller
        whose gathers come at its peak (stage 3's units in backward) passes False: then on gloo each
        output is gathered into its own rows (broadcasts, or at N = 2 one all-to-all), with no temporary. On NCCL under
        TORCH_DISTRIBUTED_DEBUG=DETAIL they are never coalesced: torch's checks of every collective (a
        barrier and a comparison before each) skip coalesced ones, so a rank issuing something else
        beside a coalesced gather would hang there instead of being reported."""
        labels = labels or [None] * len(outputs)
        for output, input, label in zip(outputs, inputs, labels):
            assert output.numel() == input.numel() * self.world_size, (output.numel(), input.numel(), self.world_size)
            check_in_place(output, input, self.rank, self.world_size)
            self._record("all_gather", output, label, phase)
            self._count("all_gather", _nbytes(output), phase)
        if not self.distributed:
            for output, input in zip(outputs, inputs):
                fill_rows(output, input, self.world_size)
            return _DONE
        with profiled("zerokit::all_gather"), self.report_failure():
            return self._gather_handle(outputs, inputs, coalesce)

    def _gather_handle(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], coalesce: bool) -> Handle:
        """The all-gathers of `outputs`, issued (core/collectives/gather.py), as one Handle."""
        works, lent, finish = gather_many(self, outputs, inputs, coalesce)
        return Handle(works, finish, comm=self, lent=lent)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, phase: str | None = None,
                  label: str | None = None) -> None:
        """Copy rank `src`'s tensor (group rank) to every rank, in place."""
        self._record("broadcast", tensor, label, phase)
        self._count("broadcast", _nbytes(tensor), phase)
        if not self.distributed:
            return
        with profiled("zerokit::broadcast"), self.report_failure():
            dist.broadcast(tensor, src=self._global_rank(src), group=self.group)

    def all_reduce_scalars(self, values: torch.Tensor, op: str = "sum", label: str | None = None) -> torch.Tensor:
        """Reduce a few scalars (norm partials, overflow flags) in rank order; returns a new tensor.

        Gathers every rank's values and reduces them locally in rank order, so the
        result is identical on every rank and independent of the ring. Bytes are tiny
        and not counted: the ledgers track gradient and parameter traffic.
        """
        self._record("all_reduce_scalars", values, label, None)
        if not self.distributed:
            return values.clone()
        gathered = torch.empty(self.world_size * values.numel(), dtype=values.dtype, device=values.device)
        with self.report_failure():
            all_gather_single(gathered, values.contiguous(), group=self.group)
        rows = gathered.view(self.world_size, -1)
        out = rows[0].clone()
        for r in range(1, self.world_size):  # fixed order 0..N-1: core/collectives/ordered.py [Note: ordered reduction]
            if op == "sum":
                out.add_(rows[r])
            elif op == "max":
                torch.maximum(out, rows[r], out=out)
            else:
                raise ValueError(f"unknown op {op!r}")
        return out

    def all_gather_object(self, obj, label: str | None = None, phase: str | None = None) -> list:
        """Every rank's `obj` (used at construction to validate inputs before any tensor collective)."""
        self._record("all_gather_object", None, label, phase)
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        with self.report_failure():
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self, label: str | None = None) -> None:
        self._record("barrier", None, label, None)
        if self.distributed:
            with self.report_failure():
                dist.barrier(group=self.group)

    # ------------------------------------------------------------------ recorder, debug mode
    def _record(self, op: str, tensor: torch.Tensor | None, label: str | None, phase: str | None) -> CollectiveRecord:
        """Record the collective about to be issued; in debug mode, check every rank is about to issue it."""
        if self._second_halves:
            if op == "all_reduce":
                ordered.sum_arrived_rows(self)
            else:
                ordered.issue_second_halves(self)  # before any other collective, on every rank
        rec = self.recorder.record(op, tensor, label, phase)
        if self.checks_each_collective:
            self._check_same(rec.fingerprint(), in_words(rec))
        return rec

    # core/collectives/recorder.py: debug mode's checks, and what a failing collective prints
    sync_point = recorder.sync_point
    agree_on_step = recorder.agree_on_step
    report_failure = recorder.report_failure
    _check_same = recorder.check_same

    def _handle(self, work, async_op: bool, lent: tuple, finish=None, local: bool = True) -> Handle:
        """The Handle of a collective just issued; waited for at once (its finish run, its aliases taken
        back) when it was synchronous. `lent`: the aliases from `_lend` it was handed."""
        handle = Handle(work if async_op else None, finish, comm=self, local=local, lent=lent)
        if not async_op:
            handle.wait()
        return handle

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX} if dist.is_available() else {}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
