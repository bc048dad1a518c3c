"""What this rank's collectives were, in ZeRO terms, and debug mode's checks that every rank agrees.

Every collective `core/collectives/comm.py` issues is recorded here first — a sequence number, the operation, a
ZeRO-level label ("bucket 3 (blocks.2.*)", "unit blocks.0", "optimizer overflow flag"), the element
count, dtype and phase — before it is launched. What reads the records:

* listeners (`recorder.listeners`, called with each record just before its collective is issued): the
  memory timeline (`zerokit timeline`) snapshots live bytes there; `recorder.recording()` lists them;
* debug mode: every rank compares each collective's fingerprint with the other ranks' before issuing it
  ([Note: debug mode]); stage 3 agrees on a digest of each step's records ([Note: rank-dependent units]);
* a collective that fails (a timeout, a peer gone) prints this rank's last records (`report_failure`).

[Note: debug mode]
A collective that one rank issues and another does not (`no_sync()` on one rank only, an extra step)
hangs until the group's timeout, or pairs with a different collective of the other rank and corrupts
both. Debug mode (`zk.shard(..., debug=True)` or ZEROKIT_DEBUG=1) makes it an immediate error on every
rank: before each collective every rank all-gathers its fingerprint, (seq, op, label, numel, dtype)
hashed into a (2 * N,) int64 all-gather, and compares them; when they differ every rank has the same
rows, so all exchange their descriptions in words and raise, naming each rank's collective. The check
cannot hang while the ranks agreed so far: checks are identical fixed-size collectives, matched by issue
order, so the first divergence shows in a check. The all-gather half of an ordered all-reduce, issued
from wait(), gets its own check, and `ShardedOptimizer.step` calls `sync_point` first so that a rank with
no collective left meets the others' check. A rank that has left fails the check when its connection
closes. Training is bitwise unchanged; cost: benchmarks/results/debug_overhead.md.

[Note: rank-dependent units]
At stages 0-2 a module that runs on some ranks only changes no collective (every bucket is reduced). At
stage 3 the ranks that run a unit gather it and the others do not, so collectives pair with different
ones across ranks: gloo aborts, hangs, or (equal sizes) computes on the wrong parameters. Stage 3 checks
at no cost per unit: every collective up to the first optimizer step gets debug mode's check
(`Comm.first_step_checks`, as DDP's static_graph learns from the first iteration), and every later step
is agreed on before the optimizer updates anything (`agree_on_step`: one fixed-size all-gather of each
rank's collective count and a digest of its collectives since the last agreement). A divergence whose
collectives still paired up fails there, naming the first differing collective; the step is not applied.
One that starts after the first step with unequal sizes still reaches gloo: `debug=True` checks every
step. After either error the engine must be rebuilt. Cost: benchmarks/results/agree_on_step_cost.md.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import sys
import zlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from zerokit.core.collectives.gather import all_gather_single


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
        self.digest = 0  # of every record since the last `agree_on_step`, in order
        self.agreed_seq = 0  # `seq` at the last `agree_on_step`

    def record(self, op: str, tensor: torch.Tensor | None, label: str | None, phase: str | None) -> CollectiveRecord:
        rec = CollectiveRecord(self.seq, op, label or "unlabelled tensor",
                               tensor.numel() if tensor is not None else 0,
                               str(tensor.dtype).removeprefix("torch.") if tensor is not None else "object",
                               phase or "other")
        self.seq += 1
        self.records.append(rec)
        self.digest = zlib.crc32(repr(rec.fingerprint()).encode(), self.digest)  # [Note: rank-dependent units]
        for listener in self.listeners:
            listener(rec)
        return rec

    def last(self, n: int = 8) -> list[CollectiveRecord]:
        return list(self.records)[-n:]

    def report(self, rank: int, n: int = 8) -> str:
        lines = [f"zerokit rank {rank}: last {min(n, len(self.records))} collectives (oldest first):"]
        lines += [f"  {rec.describe()}" for rec in self.last(n)]
        return "\n".join(lines)

    @contextlib.contextmanager
    def recording(self):
        """Every record made inside the block, in a list (the ring buffer keeps only the last few)."""
        records: list[CollectiveRecord] = []
        self.listeners.append(records.append)
        try:
            yield records
        finally:
            self.listeners.remove(records.append)


# ---------------------------------------------------------------------- debug mode
# Functions of a Comm (`comm`): its group, rank, world_size, backend, recorder and debug flags.

def sync_point(comm, what: str) -> None:
    """Debug mode: every rank must reach `what` (e.g. "optimizer step 3") at the same point of its
    collective sequence. A check with no collective after it, so that a rank with no collective left
    meets a rank waiting for one ([Note: debug mode]); nothing at all outside debug mode."""
    if comm.checks_each_collective:
        seq = comm.recorder.seq
        check_same(comm, (seq, "sync_point", what), f"starting {what}, with no collective left before it [#{seq}]")


def agree_on_step(comm, what: str) -> None:
    """Stage 3, before its optimizer updates anything: raise on every rank unless every rank issued the same
    collectives since the last call ([Note: rank-dependent units]). The first call ends the first step's
    per-collective checks (a sync point then); later ones are one fixed-size all-gather."""
    if not comm.distributed:
        return
    recorder = comm.recorder
    if comm.checks_each_collective:
        sync_point(comm, what)
    else:
        seq, since = recorder.seq, recorder.agreed_seq

        def recent():  # in words only when the ranks differ: formatting every record would cost each step
            return [(rec.seq, in_words(rec)) for rec in recorder.records if rec.seq >= since]

        check_same(comm, (seq, "agreement", recorder.digest), recent,
                   explain=lambda everyone: _explain_step_divergence(what, since, everyone, comm.rank))
    comm.first_step_checks = False
    recorder.digest, recorder.agreed_seq = 0, recorder.seq


def check_same(comm, fingerprint: tuple, doing, explain=None) -> None:
    """[Note: debug mode]: raise on every rank unless every rank's `fingerprint` equals this one's.
    `doing`: what this rank is doing (or a function giving it), exchanged only when they differ;
    `explain(every rank's doing)`: the error's text (default: debug mode's, each rank's collective side
    by side)."""
    digest = int.from_bytes(hashlib.blake2b(repr(fingerprint).encode(), digest_size=8).digest(), "little",
                            signed=True)  # repr, not hash(): str hashes differ between processes
    device = torch.device("cuda", torch.cuda.current_device()) if comm.backend == "nccl" else torch.device("cpu")
    mine = torch.tensor([fingerprint[0], digest], dtype=torch.int64, device=device)  # (2,)
    everyone = torch.empty(2 * comm.world_size, dtype=torch.int64, device=device)  # (2 * N,)
    mine_in_words = doing if isinstance(doing, str) else "agreeing on the collectives of its step"
    try:
        all_gather_single(everyone, mine, group=comm.group)
        rows = everyone.view(comm.world_size, 2).tolist()
        if all(row == rows[0] for row in rows):
            return
        # Every rank gathered the same rows, so every rank is here: this exchange pairs up too.
        doings = [None] * comm.world_size
        dist.all_gather_object(doings, doing() if callable(doing) else doing, group=comm.group)
    except RuntimeError as exc:  # gloo: the peer closed the connection, or the group's timeout
        raise _reported(RuntimeError(
            f"zerokit debug (rank {comm.rank}): rank {comm.rank} is {mine_in_words}, but the other ranks did not "
            f"answer the check before it ({_first_line(exc)}): a rank has finished (fewer steps?), died, "
            f"or is blocked outside zerokit.\n{comm.recorder.report(comm.rank)}")) from exc
    if explain is not None:
        raise _reported(RuntimeError(explain(doings)))
    ranks_of: dict[str, list[int]] = {}
    for r, d in enumerate(doings):
        ranks_of.setdefault(d, []).append(r)
    sides = "\n".join(f"  rank {rs[0]} is {d}" if len(rs) == 1 else f"  ranks {', '.join(map(str, rs))} are {d}"
                      for d, rs in ranks_of.items())
    agreed = [rec for rec in comm.recorder.records if rec.seq < fingerprint[0]]
    last = f"#{agreed[-1].seq} {in_words(agreed[-1])}" if agreed else "none"
    raise _reported(RuntimeError(
        f"zerokit {'debug' if comm.debug else 'stage 3, first step'}: collective #{fingerprint[0]} diverges "
        f"between ranks (raised on rank {comm.rank}):\n"
        f"{sides}\nthe last collective every rank agreed on: {last}.\nEvery rank must issue the same "
        "collectives in the same order: the same model and units, the same number of backwards and steps, "
        "engine.no_sync() on every rank or on none."
        + (f"\n{_RANK_DEPENDENT_UNITS}" if "gathering unit " in sides else "")))


@contextlib.contextmanager
def report_failure(comm):
    """A collective that fails (gloo: "Timed out", "Connection closed by peer") first prints this rank's
    last collectives to stderr, once per error, then the error propagates unchanged."""
    try:
        yield
    except RuntimeError as exc:
        if not getattr(exc, "_zerokit_reported", False):
            print(f"zerokit rank {comm.rank}: a collective failed ({type(exc).__name__}: {_first_line(exc)})\n"
                  f"{comm.recorder.report(comm.rank)}", file=sys.stderr, flush=True)
            _reported(exc)
        raise


_VERBS = {"all_reduce": "all-reducing", "reduce_scatter": "reduce-scattering", "all_gather": "all-gathering",
          "broadcast": "broadcasting", "all_reduce_scalars": "reducing", "all_gather_object": "exchanging",
          "barrier": "at a barrier for"}


def in_words(rec: CollectiveRecord) -> str:
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
    """`agree_on_step`'s error: each rank's collective count and the first recent collective that differs."""
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
    """Mark `exc` as already saying where this rank was: `report_failure` prints nothing more for it."""
    try:
        exc._zerokit_reported = True
    except AttributeError:  # an exception type without a __dict__: reported again, at worst
        pass
    return exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
