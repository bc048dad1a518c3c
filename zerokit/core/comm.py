"""The only module that calls `torch.distributed` collectives.

Every stage talks to the other ranks through one `Comm` object. It owns:

* the process group (passed explicitly; `None` means the default group, and no
  initialised group at all means world size 1, where every collective is an identity);
* the reduction recipe (see [Note: ordered reduction]);
* logical byte counters in the ZeRO paper's accounting (see [Note: byte accounting]);
* profiler labels (`zerokit::all_gather`, ...), so a trace names each collective once;
* an optional *simulated* world: one process plays rank r of N, and collectives return
  correctly shaped results computed locally, so memory can be measured for a rank of 64
  on one machine;
* the recorder (core/recorder.py): every collective is recorded, in ZeRO terms (its
  `label`: "bucket 3 (blocks.2.*)", "unit blocks.0", ...), before it is issued; debug mode
  checks that every rank is about to issue the same one (see [Note: debug mode]), and a
  collective that fails (a timeout, a peer gone) prints this rank's last records to stderr
  before the error propagates, so a hang that ends in a timeout says where each rank was.

[Note: ordered reduction]
A ring all-reduce sums an element's N contributions in an order that depends on where
the element sits in the buffer and on the buffer's length. Two stages that reduce the
same gradients through buffers of different extents (stage 0's buckets vs stage 3's
units) therefore disagree in the last bit at 3+ ranks. With `ordered=True` a
reduce-scatter is done as an all-to-all (rank r receives every rank's copy of its own
range: the same (N-1)/N bytes a ring sends) followed by a local sum in rank order
0, 1, ..., N-1; an all-reduce is that reduce-scatter followed by an all-gather. The
result for an element then depends only on its N contributions, so every stage agrees
bit for bit whatever its layout. Gradients are pre-multiplied by 1/N before the sum, as
torch's DDP does, which makes world size 2 bitwise equal to DDP (a + b == b + a).
`ordered=None` picks ordered on gloo (CPU: exactness is the point there) and the native
collective on NCCL (speed is the point there). At N = 2 an ordered all-reduce is a native
one: an element's sum is one addition, a + b == b + a, so any algorithm gives the same bits,
in one collective instead of two (the reduce-scatter stays an all-to-all on gloo, whose own
reduce-scatter is an all-reduce of the whole buffer inside: more bytes, measured slower). The
N = 2 reduce-scatter (`_exchange_halves`) sends and receives only the peer's half, into a
(B/2,) buffer, and adds it to this rank's own half: the same one addition, half the receive
buffer and none of the N-row recipe's copies of the own half (benchmarks/reduce_scatter_cost.py
times both; results/reduce_scatter_cost.md). At 3+
ranks the two halves of an ordered all-reduce (stage 0's buckets, issued one by one in backward)
run apart. A bucket's all-to-all is issued when the bucket is ready. Its rows are summed into
this rank's own range of the bucket as soon as they have arrived, which frees the (B,) receive
buffer early: checked without blocking whenever the next bucket is issued (local work, which
may happen at different moments on different ranks). The all-gathers of the sums of every
waiting bucket are issued together, in one round (on gloo one packed gather: [Note: gloo's all-gather
temporary]), at the first wait() on any of them
(the end of backward), or before any other kind of collective is recorded: points every rank
reaches at the same place in its sequence of collectives, so the sequences still match.
Two other ways were tried and are slower or larger: each bucket's all-gather right after its
all-to-all (two rendezvous of every rank per bucket), and one all-gather of every rank's whole
bucket with a local sum of the N rows (an (N·B,) receive buffer per bucket in flight);
benchmarks/speed_vs_torch.py compares the step with torch DDP's.
With `tree=True` (`zk.shard(reduction="tree")`)
the local sum adds the N contributions pairwise, (r0 + r1) + (r2 + r3), the upper levels
of the binary tree that makes the bits independent of N (core/tree.py [Note:
world-size-independent bits]); it implies ordered, on NCCL too, and needs N a power of two.

[Note: byte accounting]
Counted per call, per kind, as the ZeRO paper does: an all-reduce of B bytes counts 2B
(reduce-scatter + all-gather), a reduce-scatter its full input B, an all-gather its full
output B, a broadcast B. `ring_factor` = (N-1)/N converts these to bytes a rank actually
puts on the wire in a ring. Nothing is counted at world size 1.

[Note: frees at a fixed point]
A collective's temporaries (the ordered recipes' receive buffers, a reduce-dtype copy, an
all-gather's input clone) are referenced by the process group's Work as well as by zerokit.
The Work is released by gloo's worker thread shortly after the CPU's wait() returns, so
dropping zerokit's reference leaves the last one, and the free, to that thread at a time that
varies from run to run: the allocator's live bytes at a step boundary then sometimes include a
buffer the step no longer uses (seen in benchmarks/speed_vs_torch.py runs: stage 1's gather
clones at one boundary). Once the collective has completed, zerokit frees the
temporary's storage itself, on its own thread (`free_storage`), at the same point of every step.
The caller's own buffers are held the same way: stages 2 and 3 reduce-scatter a bucket's or
unit's full-size gradient and drop it when the owners have its content, yet gloo's worker still
held the collective's input, so its bytes were freed on that thread, late in some runs (seen: stage
3's root gradient alive at a step boundary of benchmarks/where_peak.py in one CI run). A caller's buffer cannot be freed by zerokit (user code may hold a
view of `.grad`, and reading freed storage crashes), so on gloo a collective is handed an alias of
each caller tensor (`Comm._lend`: a new tensor over the same storage) and, once it has completed,
the alias is pointed at an empty storage (`set_()`): the Work then holds no bytes of the caller's,
and the caller's last reference frees them, on its own thread. Every reduce-scatter, all-reduce
and gather zerokit issues on gloo is lent this way (a gather is broadcasts there, or at N = 2 an
all-to-all, into the caller's rows or into a staging buffer zerokit frees itself: [Note: gloo's
all-gather temporary]); only `all_reduce_scalars`' few-element gather is torch's own, whose Work
keeps views it made itself. Not on NCCL: its Work keeps its tensors alive until the CPU has seen
the collective complete on its stream, which the caching allocator relies on.

[Note: gloo's all-gather temporary]
gloo's all-gather receives into a flat buffer of its own, the size of the output, allocated when
the collective starts running on gloo's worker thread and freed when it ends, then copies the
rows out (torch's wrapper also allocates and frees one of that size on the calling thread as the
gather is issued). An asynchronous gather therefore costs a second copy of its output for as long
as it is in flight. Stage 3's prefetch of the next unit in backward is in flight across the first
ops of the current unit's backward, which is where a step peaks: benchmarks/where_peak.py found
gloo's buffer there (`gloo:all_gather > aten::empty`), putting stage 3's peak above FSDP2's. So on gloo an all-gather that is not coalesced fills the output's rows in place
(`Comm._fill_rows_from_ranks`): N broadcasts, rank r's from row r of the output, all issued at once,
or at N = 2 a single all-to-all that sends this rank's row to the peer and receives the peer's into
its row (empty splits for the rank itself, as the N = 2 reduce-scatter of [Note: ordered reduction]).
Either way nothing is allocated, the same rows move to the same ranks, the same bits (copies, no
arithmetic). benchmarks/gather_cost.py measures them beside torch's gather and beside two
broadcasts at 2 ranks (results/gather_cost.md): torch's allocates twice the output while zerokit's
way allocates nothing, and at these sizes a rendezvous, not bytes, is the cost. Not an all-to-all at 3+ ranks: it
cannot send one row to several ranks, so its send buffer would hold N - 1 copies of the row and its
receive buffer N - 1 rows, where the broadcasts hold nothing. Several outputs gathered together
(stages 1-2's buckets after the step, the all-gather halves of stage 0's ordered all-reduces) need
one round of latency, not one per output. gloo's coalesced all-gather, which zerokit used for them, paid its temporaries for
all of them at once, the concatenated inputs and one buffer of every output's size, Ψp(1 + 1/N) for
stages 1-2's gather of the updated parameters, which made that gather their step's peak
(benchmarks/sweep.py: stage 1's peak minus its model states was exactly that). On gloo such a group is now packed (`Comm._packed_gather`):
this rank's inputs are copied into its row of one (N, Σ m_i) staging buffer per dtype, the other
rows are filled from their ranks as above, then the other ranks' rows are copied out (the own row
too where an input is not its output's own row) and the staging is freed: the copies gloo's gather
made (inputs in, rows out) without its concatenated inputs, so Ψp instead of Ψp(1 + 1/N), and one
rendezvous (N = 2) or N broadcasts instead of gloo's all-gather (benchmarks/gather_cost.py,
"several outputs at once", times it beside the coalesced gather).
Outputs are still grouped in consecutive runs of at most GLOO_COALESCE_NUMEL elements, which bounds
the staging; an output that would be a group on its own is gathered into its own rows, with no
staging at all. Under TORCH_DISTRIBUTED_DEBUG=DETAIL nothing changes on gloo: broadcasts and
all-to-alls are collectives torch checks one by one. On NCCL, which receives in place, every gather stays an
all-gather.

[Note: finishing what has arrived]
An asynchronous reduce-scatter's temporaries (the ordered recipes' receive buffer, the native
in-place path's result) live until its wait(), and so, at stages 2 and 3, does the bucket's
full-size gradient, released once the owners have its content. A stage waited for a bucket only
when it had to (stage 1 at the end of backward, stage 2 with `max_in_flight` others queued, stage 3
with one), so buckets whose reduce-scatter had long completed still held those bytes. Before a
stage issues its next reduce-scatter it therefore finishes, oldest first, those that have already
completed (`Handle.arrived`, `InFlight.finish_arrived`): the same
sum into the same output, so the same bits, only sooner. Whether one has completed by then
differs between ranks, so only a finish that is local work may run there: a hybrid reduce-scatter,
whose finish crosses nodes with collectives of its own, and an ordered all-reduce's second half
(its wait issues the all-gathers) report not arrived until waited for in order. What it saves
depends on timing (benchmarks/sweep.py measures the peaks).

[Note: in-place gathers]
An all-gather's input may be this rank's own row of its output (`output.view(N, -1)[rank]`), as
stages 1 and 2 gather their updated shards after the step: the shard is already where the gather
puts it, so no copy of it is made. Every path reads the input before it writes that row: the packed
gather of [Note: gloo's all-gather temporary] copies the inputs into its staging buffer before
anything is sent and copies every row out after, its broadcasts of a single output send row r from
rank r in place, NCCL gathers in place when the input is the rank's slice of the output
(as FSDP2's gathers do), and the simulated path copies the row first. Any other overlap between
input and output is refused. The all-gather half of an ordered all-reduce is one too (the summed
range is the rank's own row of the bucket). Against a clone of every shard, the clones' Ψ·p/N
transient bytes are gone (benchmarks/stage1_phases.py times the step with it).

[Note: debug mode]
A collective that one rank issues and another does not (a `no_sync()` on one rank only,
an extra step, a unit run on one rank only) does not fail: it hangs until the process
group's timeout (600 s by default), or worse, pairs with a *different* collective of the
other rank and corrupts both. Debug mode (`zk.shard(..., debug=True)` or ZEROKIT_DEBUG=1)
turns that into an immediate error on every rank. Before issuing a collective, each rank
all-gathers its fingerprint — (seq, op, label, numel, dtype) hashed into two int64, one
fixed-size (2 * N,) all-gather — and compares every rank's. When they differ, every rank
has seen the same gathered rows, so every rank takes the same path: one all_gather_object
of each rank's description in words, then a RuntimeError on every rank naming each rank
and what it was about to do ("rank 0 is reduce-scattering bucket 3 (blocks.2.*), rank 1
is all-gathering unit blocks.0"). The divergent collective is never issued.

Why the check itself cannot hang: every collective is preceded by its check, and a check
is the same fixed-size all-gather on every rank. As long as the ranks agreed so far, their
k-th check pairs with each other's k-th check (collectives are matched by issue order), so
the first divergence is seen in the check before it, never in a real collective. The one
collective issued outside a public call (the all-gather half of an ordered all-reduce,
issued from `wait()`) gets a check of its own. What remains is a rank that has *no*
collective left to issue while another waits in a check: `ShardedOptimizer.step` (every
stage's `engine.step()`) therefore calls `sync_point("optimizer step k")` first, a check
with no collective after it, so a rank that skipped its backward's reductions meets the
other rank's reduction check at its own step and both fail. A rank that has left
altogether (fewer steps, or it died) cannot answer: the waiting rank's check fails when
the peer's connection closes (or at the group's timeout) and raises naming its own
collective and its last records. Cost: one small all-gather per collective (see
benchmarks/results/debug_overhead.md); training is bitwise unchanged.

[Note: rank-dependent units]
At stages 0-2 a module that runs on some ranks only changes no collective (every bucket is
reduced whatever ran, as DDP's find_unused_parameters=True). At stage 3 it does: the rank that
runs a unit gathers it, the others do not, and from there each rank's k-th collective pairs with
another kind of collective on the other ranks. gloo then aborts the process (a size mismatch,
no Python error), hangs, or, worst, when the sizes happen to match, pairs one unit's gather
with another's and computes on the wrong parameters. So stage 3 checks, in two ways that cost
nothing per unit:
* the first step is checked: every collective up to the first optimizer step gets debug
  mode's check (`first_step_checks`), so a unit that one rank runs and another does not fails
  there, on every rank, naming the unit each rank was gathering, before the collective is
  issued (as DDP's static_graph learns the graph from the first iteration);
* every later step is agreed on (`agree_on_step`, before the optimizer updates anything): one
  fixed-size all-gather of each rank's collective count and a digest of every collective
  since the last agreement (op, label, size, dtype). Ranks whose units diverged in that step
  and whose collectives paired up anyway (equal sizes) fail there, on every rank, naming the
  first collective that differs among the recent ones; their step is never applied.
A unit that starts running on one rank only after the first step, with collectives of unequal
sizes, still reaches gloo (an abort or a timeout): only per-collective checks prevent that, which
`debug=True` keeps for every step. After either error the ranks' collectives are out of step: the
engine must be rebuilt.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import sys
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function as _record_function

from zerokit.core.recorder import CollectiveRecord, CollectiveRecorder
from zerokit.core.tree import is_power_of_two, pairwise_sum_

if dist.is_available():
    # Imported with zerokit, so before the user's init_process_group: torch.distributed.nn binds
    # the default group into its functions' defaults at import time, which would keep the group
    # (and gloo's threads) alive past destroy_process_group. See zerokit/launch.py
    # [Note: process-group teardown].
    import torch.distributed.nn  # noqa: F401

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
GLOO_COALESCE_NUMEL = 1 << 20  # the most output elements one packed gloo gather takes: [Note: gloo's all-gather
# temporary]


class Handle:
    """An in-flight collective. `wait()` blocks the CPU until the result is usable."""

    def __init__(self, work=None, finish=None, comm: "Comm | None" = None, local: bool = True, lent=()):
        self._work = work  # torch.distributed Work, or None when already complete
        self._finish = finish  # step run after the communication (ordered sum, copy out, free)
        self._lent = lent  # aliases the Work holds, emptied once it completes: [Note: frees at a fixed point]
        self._comm = comm  # whose recorder a failure reports
        self.local = local  # False: `finish` issues collectives of its own (core/hybrid.py)
        self.done = False

    def completed(self) -> bool:
        """True once wait() would not block on communication."""
        return self.done or self._work is None or self._work.is_completed()

    def arrived(self) -> bool:
        """True when wait() would neither block nor issue a collective, so it may run at a point that
        differs between ranks: [Note: finishing what has arrived]."""
        return self.done or (self.local and self.completed())

    def wait(self) -> None:
        if self.done:
            return
        with self._comm.report_failure() if self._comm is not None else contextlib.nullcontext():
            if self._work is not None:
                self._work.wait()  # CPU waits here for the collective to complete (gloo raises on timeout)
            if self._finish is not None:
                self._finish()
            _take_back(self._lent)
        self._lent = self._finish = None  # what they referred to is the caller's to free now
        self.done = True


_DONE = Handle()
_DONE.done = True


class _SecondHalf(Handle):
    """An ordered all-reduce past its all-to-all, waiting for its all-gather (`Comm._issue_second_halves`)."""

    def __init__(self, comm: "Comm", reduced: Handle, tensor: torch.Tensor, mine: torch.Tensor,
                 rec: CollectiveRecord):
        super().__init__(None, None, comm)
        self.reduced, self.tensor, self.mine, self.rec = reduced, tensor, mine, rec
        self.issued = False

    def wait(self) -> None:
        if not self.issued:
            self._comm._issue_second_halves()
        super().wait()
        self.reduced = self.tensor = self.mine = None  # the caller's bucket is the caller's to free now

    def arrived(self) -> bool:
        return self.done  # its wait() issues the all-gathers: only where every rank issues them


def free_storage(t: torch.Tensor) -> None:
    """Give back a tensor's bytes, keeping the tensor (and every view of it) for a later re-allocation.

    Also how a collective's temporaries are freed once it has completed: [Note: frees at a fixed point]."""
    if t.untyped_storage().nbytes() != 0:
        t.untyped_storage().resize_(0)


def _take_back(lent) -> None:
    """Point each alias a completed collective was lent at an empty storage: its Work, released later on
    gloo's thread, then holds none of the caller's bytes ([Note: frees at a fixed point])."""
    for alias in lent:
        if getattr(alias, "_zerokit_lent", False):  # never a caller's own tensor (`_lend` off gloo returns it)
            alias.set_()


def profiled(name: str):
    """torch.profiler's record_function(name) while a profiler records, else nothing: entering one costs a
    dispatcher call even when no profiler is on, a few per bucket and step."""
    return _record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


class _Works:
    """Several torch.distributed Works waited for as one; `lent`: the aliases they hold (`Comm._lend`);
    `finishes`: run once every Work has completed (copying a packed gather out)."""

    def __init__(self, works: list, lent=(), finishes=()):
        self.works = works
        self.lent = lent
        self.finishes = finishes

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        for finish in self.finishes:
            finish()
        _take_back(self.lent)
        self.lent, self.finishes = (), ()


def _coalesce_groups(numels: list[int], limit: int) -> list[list[int]]:
    """Indices of consecutive outputs in groups of at most `limit` elements in all (one larger alone)."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(numels):
        if groups and total + n <= limit:
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups


def _by_dtype(group: list[int], outputs: list[torch.Tensor]) -> list[list[int]]:
    """`group`'s indices split by their output's dtype (first-seen order), so that each part packs into one buffer."""
    parts: dict[torch.dtype, list[int]] = {}
    for i in group:
        parts.setdefault(outputs[i].dtype, []).append(i)
    return list(parts.values())


def _torch_checks_each_collective() -> bool:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: torch wraps the group to check every collective before it runs."""
    return dist.is_available() and dist.get_debug_level() == dist.DebugLevel.DETAIL


@dataclass(frozen=True)
class Simulated:
    """One process playing `rank` of `world_size`; no process group is used."""

    rank: int
    world_size: int


class Comm:
    """Collectives on flat 1-D tensors for one process group, with byte counters."""

    def __init__(self, group=None, ordered: bool | None = None, simulate: Simulated | None = None,
                 debug: bool | None = None, tree: bool = False):
        """`debug`: check before each collective that every rank issues the same one ([Note: debug
        mode]); None reads the environment (ZEROKIT_DEBUG=1 turns it on). `tree`: sum ranks
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
        # Hybrid sharding (core/hybrid.py) tells these apart; in one flat group they are the group's own:
        self.data_parallel_size = self.world_size  # N: ranks whose gradients are averaged (the 1/N)
        self.world_rank = self.rank  # rank among every rank (checkpoints: who writes the shared files)
        self.replica_rank = 0  # which copy of the sharded state this rank holds (0: the one checkpoints write)
        self.tree = False
        if tree:
            self.use_tree()
        self.bytes = collections.Counter()  # kind -> logical bytes
        self.bytes_by_phase = collections.Counter()  # (phase, kind) -> logical bytes
        self.calls = collections.Counter()  # kind -> number of collectives issued
        self.trace: list[tuple[str, int, str]] | None = None  # (kind, numel, phase) when recording
        self.recorder = CollectiveRecorder()  # this rank's last collectives, in ZeRO terms (core/recorder.py)
        self._second_halves: collections.deque = collections.deque()  # ordered all-reduces awaiting their all-gather
        if debug is None:
            debug = os.environ.get("ZEROKIT_DEBUG", "").strip() not in ("", "0")
        self.debug = bool(debug)  # see [Note: debug mode]
        # Stage 3 sets it until its first step: every collective checked ([Note: rank-dependent units]).
        self.first_step_checks = False
        self._digest = 0  # of every collective since the last `agree_on_step`, in order
        self._agreed_seq = 0  # the recorder's seq at the last agreement

    @property
    def checks_each_collective(self) -> bool:
        """Whether each collective is preceded by the check of [Note: debug mode]."""
        return (self.debug or self.first_step_checks) and self.distributed

    def _lend(self, t: torch.Tensor) -> torch.Tensor:
        """What a collective is handed for the caller's tensor `t`: on gloo a new tensor over the same bytes,
        emptied by `_take_back` once the collective completes ([Note: frees at a fixed point]); else `t`."""
        if self.backend != "gloo":
            return t
        alias = t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
        alias._zerokit_lent = True
        return alias

    def use_tree(self) -> None:
        """Sum the ranks' contributions pairwise ([Note: ordered reduction]; core/tree.py). Needs N = 2^j."""
        if not is_power_of_two(self.world_size):
            raise ValueError(f"reduction='tree' needs a power-of-two world size (1, 2, 4, 8, ...), got "
                             f"{self.world_size}: the binary tree over ranks has no other shape")
        self.tree, self.ordered = True, True

    # ------------------------------------------------------------------ bookkeeping
    @property
    def distributed(self) -> bool:
        """True when collectives really cross processes."""
        return self.world_size > 1 and self.simulate is None

    @property
    def ring_factor(self) -> float:
        return (self.world_size - 1) / self.world_size

    def _count(self, kind: str, nbytes: int, numel: int, phase: str | None) -> None:
        if self.world_size == 1:
            return
        self.bytes[kind] += nbytes
        self.calls[kind] += 1
        self.bytes_by_phase[(phase or "other", kind)] += nbytes
        if self.trace is not None:
            self.trace.append((kind, numel, phase or "other"))

    def stats(self) -> dict[str, int]:
        """Cumulative logical bytes per kind (ZeRO accounting), every kind present."""
        return {kind: int(self.bytes[kind]) for kind in KINDS}

    def stats_by_group(self) -> dict[str, dict[str, int]]:
        """Bytes per kind within shard groups, across replicate groups (hybrid sharding, core/hybrid.py),
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

    @contextlib.contextmanager
    def record(self):
        """Record the sequence of collectives issued inside the block (kind, numel, phase)."""
        previous, self.trace = self.trace, []
        try:
            yield self.trace
        finally:
            self.trace = previous

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False,
                   phase: str | None = None, label: str | None = None) -> Handle:
        """In-place all-reduce of a 1-D tensor (`op` is "sum" or "max").

        An ordered sum needs the length padded to a multiple of world size; callers
        reduce flat padded buffers, and scalars go through `all_reduce_scalars`.
        `label` names what moves in ZeRO terms, for the recorder (core/recorder.py).
        """
        rec = self._record("all_reduce", tensor, label, phase)
        self._count("all_reduce", 2 * _nbytes(tensor), tensor.numel(), phase)
        if not self.distributed:
            return _DONE
        with profiled("zerokit::all_reduce"), self.report_failure():
            if op == "sum" and self.ordered and self.world_size > 2:  # N = 2: one addition, any order
                return self._ordered_all_reduce(tensor, async_op, rec)
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
        self._count("reduce_scatter", _nbytes(input), input.numel(), phase)
        if not self.distributed:
            start = self.rank * output.numel()
            output.copy_(input[start:start + output.numel()])
            return _DONE
        with profiled("zerokit::reduce_scatter"), self.report_failure():
            if self.ordered:  # safe in place: the input is fully received before the sum is written
                return self._ordered_reduce_scatter(output, input, async_op)
            lent = self._lend(input)
            if _shares_storage(output, input):  # in place (output is my range of input): go via a temporary
                result = torch.empty_like(output)
                work = dist.reduce_scatter_single(result, lent, group=self.group, async_op=async_op)

                def finish():
                    output.copy_(result)
                    free_storage(result)  # [Note: frees at a fixed point]

                return self._handle(work, async_op, (lent,), finish)
            out = self._lend(output)
            work = dist.reduce_scatter_single(out, lent, group=self.group, async_op=async_op)
            return self._handle(work, async_op, (lent, out))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   phase: str | None = None, label: str | None = None) -> Handle:
        """Concatenate every rank's `input` (shard_numel,) into `output` (shard_numel * N,)."""
        assert output.numel() == input.numel() * self.world_size, (output.numel(), input.numel(), self.world_size)
        _check_in_place(output, input, self.rank, self.world_size)
        self._record("all_gather", output, label, phase)
        self._count("all_gather", _nbytes(output), output.numel(), phase)
        if not self.distributed:
            # Simulated or single rank: every slot gets this rank's shard (correct shape,
            # and exact at world size 1).
            _fill_rows(output, input, self.world_size)
            return _DONE
        with profiled("zerokit::all_gather"), self.report_failure():
            handle = Handle(self._gather_many([output], [input], coalesce=False), comm=self)
            if not async_op:
                handle.wait()
            return handle

    def all_gather_many(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], phase: str | None = None,
                        labels: list[str] | None = None, coalesce: bool = True) -> Handle:
        """Several all-gathers (output i: (shard_numel_i * N,), input i: (shard_numel_i,)) issued together,
        waited for as one. Asynchronous; each is recorded and counted as its own all-gather, all of them
        (and their debug-mode checks) before any is issued.

        `coalesce`: in one round of latency instead of one per buffer. Its price on gloo: a staging buffer of the
        group's outputs' size while it runs (packed: [Note: gloo's all-gather temporary]), so a caller
        whose gathers come at its peak (stage 3's units in backward) passes False: then on gloo each
        output is gathered into its own rows (broadcasts, or at N = 2 one all-to-all), with no temporary. On NCCL under
        TORCH_DISTRIBUTED_DEBUG=DETAIL they are never coalesced: torch's checks of every collective (a
        barrier and a comparison before each) skip coalesced ones, so a rank issuing something else
        beside a coalesced gather would hang there instead of being reported."""
        labels = labels or [None] * len(outputs)
        for output, input, label in zip(outputs, inputs, labels):
            assert output.numel() == input.numel() * self.world_size, (output.numel(), input.numel(), self.world_size)
            _check_in_place(output, input, self.rank, self.world_size)
            self._record("all_gather", output, label, phase)
            self._count("all_gather", _nbytes(output), output.numel(), phase)
        if not self.distributed:
            for output, input in zip(outputs, inputs):
                _fill_rows(output, input, self.world_size)
            return _DONE
        with profiled("zerokit::all_gather"), self.report_failure():
            return Handle(self._gather_many(outputs, inputs, coalesce), comm=self)

    def _gather_many(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], coalesce: bool):
        """`all_gather_many`'s collectives, issued (see there for `coalesce`); a Work-like to wait on."""
        if self.backend == "gloo":  # [Note: gloo's all-gather temporary]
            numels = [output.numel() for output in outputs]
            limit = GLOO_COALESCE_NUMEL if coalesce else 0
            works, lent, finishes = [], [], []
            for group in _coalesce_groups(numels, limit):
                if len(group) == 1:
                    works += self._gather_rows(outputs[group[0]], inputs[group[0]], lent)
                else:
                    for same in _by_dtype(group, outputs):  # one staging buffer per dtype
                        issued, finish = self._packed_gather([outputs[i] for i in same], [inputs[i] for i in same])
                        works += issued
                        finishes.append(finish)
            return _Works(works, lent, finishes)
        if not coalesce or len(outputs) == 1 or _torch_checks_each_collective():
            return _Works([dist.all_gather_single(output, input, group=self.group, async_op=True)
                           for output, input in zip(outputs, inputs)])
        return self._coalesced_gather(outputs, inputs)

    def _coalesced_gather(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]):
        with dist._coalescing_manager(group=self.group, async_ops=True) as coalesced:
            for output, input in zip(outputs, inputs):
                dist.all_gather_single(output, input, group=self.group)
        return coalesced

    def _packed_gather(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]):
        """Several all-gathers in one round on gloo ([Note: gloo's all-gather temporary]): this rank's inputs
        packed into row `rank` of an (N, Σ m_i) staging buffer, the other rows filled from their ranks
        (`_fill_rows_from_ranks`), then each output's rows copied out of it. Returns (works issued, the
        copy-out to run once they have completed)."""
        n = self.world_size
        staging = torch.empty(n, sum(input.numel() for input in inputs), dtype=outputs[0].dtype,
                              device=outputs[0].device)  # transient: the group's outputs' size
        torch.cat([input.reshape(-1) for input in inputs], out=staging[self.rank])  # read before any row is written
        # zerokit's own buffer, freed below by free_storage whoever else holds it: nothing to lend
        works = self._fill_rows_from_ranks(list(staging))

        def copy_out():
            offset, me = 0, self.rank
            for output, input in zip(outputs, inputs):
                m, rows = input.numel(), output.view(n, -1)
                if rows[me].data_ptr() == input.data_ptr():  # in place: the own row holds its values already
                    rows[:me].copy_(staging[:me, offset:offset + m])
                    rows[me + 1:].copy_(staging[me + 1:, offset:offset + m])
                else:
                    rows.copy_(staging[:, offset:offset + m])  # the own row too: its input's values
                offset += m
            free_storage(staging)  # [Note: frees at a fixed point]

        return works, copy_out

    def _gather_rows(self, output: torch.Tensor, input: torch.Tensor, lent: list) -> list:
        """An all-gather in place into `output`'s rows, row r from rank r (works, issued); the rows they are
        lent go into `lent` ([Note: frees at a fixed point])."""
        assert output.dtype == input.dtype, (output.dtype, input.dtype)
        rows = output.view(self.world_size, -1)
        if rows[self.rank].data_ptr() != input.data_ptr():  # not already in place
            rows[self.rank].copy_(input.view(-1))
        rows = [self._lend(row) for row in rows]
        lent += rows
        return self._fill_rows_from_ranks(rows)

    def _fill_rows_from_ranks(self, rows: list[torch.Tensor]) -> list:
        """Row r of `rows` (N equal rows, this rank's filled) filled from rank r on every rank, in place, nothing
        allocated ([Note: gloo's all-gather temporary]): N broadcasts, row r from rank r; at N = 2 one all-to-all
        instead, this rank's row to the peer and the peer's into its row, a single rendezvous
        (benchmarks/gather_cost.py times both ways). Returns the works, issued."""
        if self.world_size == 2:
            peer = 1 - self.rank
            splits = [rows[peer].numel() if r == peer else 0 for r in range(2)]  # nothing to or from itself
            return [dist.all_to_all_single(rows[peer], rows[self.rank], output_split_sizes=splits,
                                           input_split_sizes=splits, group=self.group, async_op=True)]
        return [dist.broadcast(row, src=self._global_rank(r), group=self.group, async_op=True)
                for r, row in enumerate(rows)]

    def broadcast(self, tensor: torch.Tensor, src: int = 0, phase: str | None = None,
                  label: str | None = None) -> None:
        """Copy rank `src`'s tensor (group rank) to every rank, in place."""
        self._record("broadcast", tensor, label, phase)
        self._count("broadcast", _nbytes(tensor), tensor.numel(), phase)
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
            dist.all_gather_single(gathered, values.contiguous(), group=self.group)
        rows = gathered.view(self.world_size, -1)
        out = rows[0].clone()
        for r in range(1, self.world_size):  # fixed order 0..N-1: see [Note: ordered reduction]
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
                self._sum_arrived_rows()
            else:
                self._issue_second_halves()  # before any other collective, on every rank
        rec = self.recorder.record(op, tensor, label, phase)
        self._digest = zlib.crc32(repr(rec.fingerprint()).encode(), self._digest)  # [Note: rank-dependent units]
        if self.checks_each_collective:
            self._check_same(rec.fingerprint(), _doing(rec))
        return rec

    def sync_point(self, what: str) -> None:
        """Debug mode: every rank must reach `what` (e.g. "optimizer step 3") at the same point of its
        collective sequence. A check with no collective after it, so that a rank with no collective left
        meets a rank waiting for one ([Note: debug mode]); nothing at all outside debug mode."""
        if self.checks_each_collective:
            seq = self.recorder.seq
            self._check_same((seq, "sync_point", what), f"starting {what}, with no collective left before it [#{seq}]")

    def agree_on_step(self, what: str) -> None:
        """Stage 3, before its optimizer updates anything: raise on every rank unless every rank issued the same
        collectives since the last call ([Note: rank-dependent units]). The first call ends the first step's
        per-collective checks (a sync point then); later ones are one fixed-size all-gather."""
        if not self.distributed:
            return
        if self.checks_each_collective:
            self.sync_point(what)
        else:
            seq, since = self.recorder.seq, self._agreed_seq
            def recent():  # in words only when the ranks differ: formatting every record would cost each step
                return [(rec.seq, _doing(rec)) for rec in self.recorder.records if rec.seq >= since]
            self._check_same((seq, "agreement", self._digest), recent,
                             explain=lambda everyone: _explain_step_divergence(what, since, everyone, self.rank))
        self.first_step_checks = False
        self._digest, self._agreed_seq = 0, self.recorder.seq

    def _check_same(self, fingerprint: tuple, doing, explain=None) -> None:
        """[Note: debug mode]: raise on every rank unless every rank's `fingerprint` equals this one's.
        `doing`: what this rank is doing (or a function giving it), exchanged only when they differ;
        `explain(every rank's doing)`: the error's text (default: debug mode's, each rank's collective side
        by side)."""
        digest = int.from_bytes(hashlib.blake2b(repr(fingerprint).encode(), digest_size=8).digest(), "little",
                                signed=True)  # repr, not hash(): str hashes differ between processes
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        mine = torch.tensor([fingerprint[0], digest], dtype=torch.int64, device=device)  # (2,)
        everyone = torch.empty(2 * self.world_size, dtype=torch.int64, device=device)  # (2 * N,)
        mine_in_words = doing if isinstance(doing, str) else "agreeing on the collectives of its step"
        try:
            dist.all_gather_single(everyone, mine, group=self.group)
            rows = everyone.view(self.world_size, 2).tolist()
            if all(row == rows[0] for row in rows):
                return
            # Every rank gathered the same rows, so every rank is here: this exchange pairs up too.
            doings = [None] * self.world_size
            dist.all_gather_object(doings, doing() if callable(doing) else doing, group=self.group)
        except RuntimeError as exc:  # gloo: the peer closed the connection, or the group's timeout
            raise _reported(RuntimeError(
                f"zerokit debug (rank {self.rank}): rank {self.rank} is {mine_in_words}, but the other ranks did not "
                f"answer the check before it ({_first_line(exc)}): a rank has finished (fewer steps?), died, "
                f"or is blocked outside zerokit.\n{self.recorder.report(self.rank)}")) from exc
        if explain is not None:
            raise _reported(RuntimeError(explain(doings)))
        ranks_of: dict[str, list[int]] = {}
        for r, d in enumerate(doings):
            ranks_of.setdefault(d, []).append(r)
        sides = "\n".join(f"  rank {rs[0]} is {d}" if len(rs) == 1 else f"  ranks {', '.join(map(str, rs))} are {d}"
                          for d, rs in ranks_of.items())
        agreed = [rec for rec in self.recorder.records if rec.seq < fingerprint[0]]
        last = f"#{agreed[-1].seq} {_doing(agreed[-1])}" if agreed else "none"
        raise _reported(RuntimeError(
            f"zerokit {'debug' if self.debug else 'stage 3, first step'}: collective #{fingerprint[0]} diverges "
            f"between ranks (raised on rank {self.rank}):\n"
            f"{sides}\nthe last collective every rank agreed on: {last}.\nEvery rank must issue the same "
            "collectives in the same order: the same model and units, the same number of backwards and steps, "
            "engine.no_sync() on every rank or on none."
            + (f"\n{_RANK_DEPENDENT_UNITS}" if "gathering unit " in sides else "")))

    @contextlib.contextmanager
    def report_failure(self):
        """A collective that fails (gloo: "Timed out", "Connection closed by peer") first prints this rank's
        last collectives to stderr, once per error, then the error propagates unchanged."""
        try:
            yield
        except RuntimeError as exc:
            if not getattr(exc, "_zerokit_reported", False):
                print(f"zerokit rank {self.rank}: a collective failed ({type(exc).__name__}: {_first_line(exc)})\n"
                      f"{self.recorder.report(self.rank)}", file=sys.stderr, flush=True)
                _reported(exc)
            raise

    # ------------------------------------------------------------------ ordered recipe
    def _ordered_reduce_scatter(self, output, input, async_op) -> Handle:
        """[Note: ordered reduction]'s reduce-scatter: `_exchange_halves` at N = 2, else `_rows_reduce_scatter`."""
        if self.world_size == 2:
            return self._exchange_halves(output, input, async_op)
        return self._rows_reduce_scatter(output, input, async_op)

    def _rows_reduce_scatter(self, output, input, async_op) -> Handle:
        """An all-to-all brings rank r's contribution to my range as row r of an (N·output.numel(),)
        receive buffer; `_sum_rows` adds the rows in rank order (pairwise under the tree), then the
        buffer is freed ([Note: frees at a fixed point])."""
        n = self.world_size
        received = torch.empty(n * output.numel(), dtype=input.dtype, device=input.device)  # (N, numel) rows

        def finish():
            self._sum_rows(output, received.view(n, -1))
            free_storage(received)

        lent = self._lend(input)
        work = dist.all_to_all_single(received, lent, group=self.group, async_op=async_op)
        return self._handle(work, async_op, (lent,), finish)

    def _exchange_halves(self, output, input, async_op) -> Handle:
        """The ordered reduce-scatter at N = 2 ([Note: ordered reduction]): each rank sends only the
        peer's half of `input` and receives only the peer's contribution to its own half, an
        (output.numel(),) buffer, then adds its own half to it: one addition per element, a + b == b + a,
        the bits of the rank-order sum (and of the tree's, which at N = 2 is the same one addition).
        An all-to-all with empty splits for this rank itself: half the receive buffer, no copy of the
        own half to itself and none out of the buffer (benchmarks/reduce_scatter_cost.py)."""
        peer = 1 - self.rank
        halves = input.view(2, -1)
        received = torch.empty(output.numel(), dtype=input.dtype, device=input.device)  # the peer's part of my half
        splits = [output.numel() if r == peer else 0 for r in range(2)]

        def finish():
            torch.add(halves[self.rank], received, out=output)  # output may be halves[self.rank] itself
            free_storage(received)

        lent = self._lend(halves[peer])
        work = dist.all_to_all_single(received, lent, output_split_sizes=splits, input_split_sizes=splits,
                                      group=self.group, async_op=async_op)
        return self._handle(work, async_op, (lent,), finish)

    def _handle(self, work, async_op: bool, lent: tuple, finish=None) -> Handle:
        """The Handle of a collective just issued; waited for at once (its finish run, its aliases taken
        back) when it was synchronous. `lent`: the aliases from `_lend` it was handed."""
        handle = Handle(work if async_op else None, finish, comm=self, lent=lent)
        if not async_op:
            handle.wait()
        return handle

    def _sum_rows(self, output: torch.Tensor, rows: torch.Tensor) -> None:
        """output = the sum of rows (N, m), row r being rank r's: in rank order 0..N-1, or pairwise,
        (r0 + r1) + (r2 + r3), under the tree (core/tree.py). The one sum every ordered reduction
        makes, reduce-scatter and all-reduce alike, so they give the same bits ([Note: ordered
        reduction]). `rows` may be destroyed."""
        if self.tree:
            output.copy_(pairwise_sum_(rows))
            return
        output.copy_(rows[0])
        for r in range(1, rows.shape[0]):
            output.add_(rows[r])

    def _ordered_all_reduce(self, tensor, async_op, rec: CollectiveRecord) -> Handle:
        """All-to-all + rank-order sum + all-gather, the all-gather issued when this rank next calls a
        collective, or waits ([Note: ordered reduction]). Temporaries: the all-to-all's (numel,)
        receive buffer until the sum; the sum is written into this rank's own range of `tensor`, which
        the all-gather then sends (in place)."""
        n = self.world_size
        assert tensor.numel() % n == 0, f"ordered all-reduce needs numel % world_size == 0, got {tensor.numel()} % {n}"
        mine = tensor.view(n, -1)[self.rank]  # (numel // N,): my range, read by the all-to-all before the sum lands
        reduced = self._ordered_reduce_scatter(mine, tensor, async_op=True)
        handle = _SecondHalf(self, reduced, tensor, mine, rec)
        self._second_halves.append(handle)
        if not async_op:
            handle.wait()
        return handle

    def _sum_arrived_rows(self) -> None:
        """Sum the rows of every waiting all-reduce whose all-to-all has arrived, freeing its receive buffer
        now rather than at the end of backward. Local work only: what it does may differ between ranks."""
        for half in self._second_halves:
            if not half.reduced.done and half.reduced.completed():
                half.reduced.wait()

    def _issue_second_halves(self) -> None:
        """Every waiting ordered all-reduce gets its all-gather: rows summed (waiting for the all-to-alls
        still running), then one gather of all the sums in one round (`_gather_many`), each into its own buffer. Called
        from the first wait() on one of them, or before any other collective is recorded: points every
        rank reaches at the same place in its sequence of collectives ([Note: ordered reduction])."""
        halves = list(self._second_halves)
        self._second_halves.clear()
        with self.report_failure():
            for half in halves:
                half.reduced.wait()  # `mine` holds the sum, the receive buffer is freed
            if self.checks_each_collective:  # collectives no public call has checked ([Note: debug mode])
                for half in halves:
                    self._check_same(half.rec.fingerprint() + ("all-gather half",),
                                     f"finishing (all-gather half) {_doing(half.rec)}")
            work = self._gather_many([h.tensor for h in halves], [h.mine for h in halves], coalesce=True)
        for half in halves:
            half._work, half.issued = work, True

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX} if dist.is_available() else {}


_VERBS = {"all_reduce": "all-reducing", "reduce_scatter": "reduce-scattering", "all_gather": "all-gathering",
          "broadcast": "broadcasting", "all_reduce_scalars": "reducing", "all_gather_object": "exchanging",
          "barrier": "at a barrier for"}


def _doing(rec: CollectiveRecord) -> str:
    """A record in words, as an error names it:
    "reduce-scattering bucket 3 (blocks.2.*) [#41: 1536 x float32, backward]"."""
    return f"{_VERBS.get(rec.op, rec.op)} {rec.label} [#{rec.seq}: {rec.numel} x {rec.dtype}, {rec.phase}]"


_RANK_DEPENDENT_UNITS = (
    "At stage 3 every rank must call the same units in the same order: a unit that runs on some ranks only "
    "(rank-dependent control flow such as `if rank == 1: h = self.extra(h)`) is gathered by those ranks alone. "
    "Call it on every rank (multiply its output by 0 where it should not count), or use stage 0, 1 or 2, which "
    "reduce every gradient whatever ran (as DDP's find_unused_parameters=True). The ranks' collectives are out "
    "of step now: rebuild the engine (zk.shard) to go on.")


def _explain_step_divergence(what: str, since: int, everyone: list, rank: int) -> str:
    """`Comm.agree_on_step`'s error: each rank's collective count and the first recent collective that differs."""
    counts = ", ".join(f"rank {r}: {rows[-1][0] + 1 if rows else since}" for r, rows in enumerate(everyone))
    by_seq = [dict(rows) for rows in everyone]
    first = next((seq for seq in sorted(set().union(*by_seq))
                  if len({d.get(seq, "issuing nothing") for d in by_seq}) > 1), None)
    if first is None:
        where = "the first difference is older than the collectives each rank keeps"
    else:
        where = f"the first that differs, #{first}:\n" + "\n".join(
            f"  rank {r} was {d.get(first, 'issuing nothing (or one older than its record)')}"
            for r, d in enumerate(by_seq))
    return (f"zerokit: the ranks issued different collectives since collective #{since} (raised on rank {rank}, "
            f"at {what}, before it updated anything; collectives issued by then: {counts});\n{where}\n"
            f"Their collectives paired with each other's, so this step's gradients are wrong: it was not applied. "
            f"{_RANK_DEPENDENT_UNITS} zk.shard(..., debug=True) checks every collective as it is issued.")


def _reported(exc: BaseException) -> BaseException:
    """Mark `exc` as already saying where this rank was: `Comm.report_failure` prints nothing more for it."""
    try:
        exc._zerokit_reported = True
    except AttributeError:  # an exception type without a __dict__: reported again, at worst
        pass
    return exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_in_place(output: torch.Tensor, input: torch.Tensor, rank: int, n: int) -> None:
    """An all-gather's input overlaps its output only as this rank's own row ([Note: in-place gathers])."""
    if _shares_storage(output, input):
        row = output.view(n, -1)[rank]
        if not (input.data_ptr() == row.data_ptr() and input.is_contiguous()):
            raise ValueError("an all-gather's input shares memory with its output but is not this rank's own row of "
                             "it (output.view(world_size, -1)[rank]): pass that row, or a separate tensor")


def _fill_rows(output: torch.Tensor, input: torch.Tensor, n: int) -> None:
    """A simulated or single-rank all-gather: every one of output's N rows gets `input` (the right shape, and
    exact at world size 1). `input` may be one of those rows itself (an in-place gather)."""
    if _shares_storage(output, input):
        input = input.clone()
    output.view(n, -1).copy_(input.view(1, -1).expand(n, -1))


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
