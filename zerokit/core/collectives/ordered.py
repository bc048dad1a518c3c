"""Reductions whose bits do not depend on the buffer's layout: `Comm(ordered=True)` and the tree.

[Note: ordered reduction]
A ring all-reduce sums an element's N contributions in an order that depends on where the element sits
in the buffer and on the buffer's length, so two stages that reduce the same gradients through buffers
of different extents (stage 0's buckets, stage 3's units) disagree in the last bit at 3+ ranks. The
ordered reduce-scatter is an all-to-all (rank r receives every rank's copy of its own range: the bytes a
ring sends) followed by a local sum in rank order 0, 1, ..., N-1 (`sum_rows`); the ordered all-reduce is
that reduce-scatter followed by an all-gather. An element's result then depends only on its N
contributions, so every stage agrees bit for bit whatever its layout; with gradients pre-multiplied by
1/N, as DDP does, world size 2 is bitwise DDP (a + b == b + a). For the same reason an all-reduce at
N = 2 is the native one, and the N = 2 reduce-scatter (`exchange_halves`) sends and receives only the
peer's half (tests/distributed/test_native_pairs.py: gloo's 2-rank all-reduce is exactly a + b on both ranks,
fp32 and bf16, and stage 0 at N = 2 makes only native all-reduces). `ordered=None` picks ordered on gloo (exactness is the point there), native on NCCL.
Under the tree (`reduction="tree"`) `sum_rows` adds pairwise, (r0 + r1) + (r2 + r3): the upper levels of
core/collectives/tree.py [Note: world-size-independent bits]; it implies ordered and needs N a power of two.
Costs: benchmarks/collectives.py (benchmarks/results/reduce_scatter_cost.md), benchmarks/speed.py.

[Note: split all-reduces]
At 3+ ranks the halves of an ordered all-reduce (stage 0's buckets, issued one by one in backward) run
apart: the all-to-all is issued when the bucket is ready, its rows are summed as soon as they have
arrived (`sum_arrived_rows`, checked whenever the next one is issued: local work, which may differ
between ranks; at most ROWS_IN_FLIGHT receive buffers are left waiting, each a bucket, so that a
backward's buckets do not all hold one at once), and the all-gathers of every waiting sum are issued
together, in one round, at the first wait() on any of them or before any other kind of collective is
recorded (`issue_second_halves`). Both are points every rank reaches at the same place in its sequence
of collectives, so the sequences still match. The alternatives, an all-gather right after each
all-to-all (two rendezvous per bucket) or one all-gather of whole buckets summed locally (an (N·B,)
buffer per bucket in flight), are slower or larger.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerokit.core.collectives.gather import free_storage, lend
from zerokit.core.collectives.recorder import CollectiveRecord, check_same, in_words, report_failure
from zerokit.core.collectives.tree import pairwise_sum_


def reduce_scatter(comm, output: torch.Tensor, input: torch.Tensor, async_op: bool):
    """[Note: ordered reduction]'s reduce-scatter: `exchange_halves` at N = 2, else `rows_reduce_scatter`.
    Safe in place: the input is fully received before the sum is written."""
    if comm.world_size == 2:
        return exchange_halves(comm, output, input, async_op)
    return rows_reduce_scatter(comm, output, input, async_op)


def rows_reduce_scatter(comm, output: torch.Tensor, input: torch.Tensor, async_op: bool):
    """An all-to-all brings rank r's contribution to my range as row r of an (N·output.numel(),)
    receive buffer; `sum_rows` adds the rows in rank order (pairwise under the tree), then the
    buffer is freed (core/collectives/gather.py [Note: frees at a fixed point])."""
    n = comm.world_size
    received = torch.empty(n * output.numel(), dtype=input.dtype, device=input.device)  # (N, numel) rows

    def finish():
        sum_rows(output, received.view(n, -1), comm.tree)
        free_storage(received)

    lent = lend(input, comm.backend)
    work = dist.all_to_all_single(received, lent, group=comm.group, async_op=async_op)
    return comm._handle(work, async_op, (lent,), finish)


def exchange_halves(comm, output: torch.Tensor, input: torch.Tensor, async_op: bool):
    """The ordered reduce-scatter at N = 2: each rank sends only the peer's half of `input` and receives
    only the peer's contribution to its own half, an (output.numel(),) buffer, then adds its own half:
    one addition per element, a + b == b + a, the bits of the rank-order sum (and of the tree's, which at
    N = 2 is the same addition). An all-to-all with empty splits for this rank itself: half the N-row
    recipe's receive buffer, and no copy of the own half."""
    peer = 1 - comm.rank
    halves = input.view(2, -1)
    received = torch.empty(output.numel(), dtype=input.dtype, device=input.device)  # the peer's part of my half
    splits = [output.numel() if r == peer else 0 for r in range(2)]

    def finish():
        torch.add(halves[comm.rank], received, out=output)  # output may be halves[comm.rank] itself
        free_storage(received)

    lent = lend(halves[peer], comm.backend)
    work = dist.all_to_all_single(received, lent, output_split_sizes=splits, input_split_sizes=splits,
                                  group=comm.group, async_op=async_op)
    return comm._handle(work, async_op, (lent,), finish)


def sum_rows(output: torch.Tensor, rows: torch.Tensor, tree: bool) -> None:
    """output = the sum of rows (N, m), row r being rank r's: in rank order 0..N-1, or pairwise,
    (r0 + r1) + (r2 + r3), under the tree (core/collectives/tree.py). The one sum every ordered reduction
    makes, reduce-scatter and all-reduce alike, so they give the same bits. `rows` may be destroyed."""
    if tree:
        output.copy_(pairwise_sum_(rows))
        return
    output.copy_(rows[0])
    for r in range(1, rows.shape[0]):
        output.add_(rows[r])


@dataclass(eq=False)
class _SecondHalf:
    """An ordered all-reduce past its all-to-all, waiting for its all-gather ([Note: split all-reduces])."""

    reduced: object  # the Handle of the all-to-all and the sum into `mine`
    tensor: torch.Tensor  # (numel,) the caller's buffer
    mine: torch.Tensor  # (numel // N,) this rank's range of it: the sum, then the all-gather's input
    rec: CollectiveRecord
    gathered: object = None  # the Handle of the all-gather, once issued


def all_reduce(comm, tensor: torch.Tensor, async_op: bool, rec: CollectiveRecord):
    """All-to-all + rank-order sum + all-gather, the all-gather issued when this rank next calls a
    collective, or waits ([Note: split all-reduces]). Temporaries: the all-to-all's (numel,) receive
    buffer until the sum; the sum is written into this rank's own range of `tensor`, which the
    all-gather then sends (in place)."""
    n = comm.world_size
    assert tensor.numel() % n == 0, f"ordered all-reduce needs numel % world_size == 0, got {tensor.numel()} % {n}"
    mine = tensor.view(n, -1)[comm.rank]  # read by the all-to-all before the sum lands
    half = _SecondHalf(reduce_scatter(comm, mine, tensor, async_op=True), tensor, mine, rec)
    comm._second_halves.append(half)

    def finish():
        if half.gathered is None:
            issue_second_halves(comm)
        half.gathered.wait()

    # not local: its wait issues the all-gathers, only where every rank issues them
    return comm._handle(None, async_op, (), finish, local=False)


ROWS_IN_FLIGHT = 2  # all-to-alls whose receive buffers may wait for their sum when another is issued


def sum_arrived_rows(comm) -> None:
    """Sum the rows of every waiting all-reduce whose all-to-all has arrived, freeing its receive buffer
    now rather than at the end of backward; then wait for the oldest until at most ROWS_IN_FLIGHT
    receive buffers remain, as stage 2 bounds its reduce-scatters in flight ([Note: split all-reduces]).
    Local work only: what it does may differ between ranks, and what it waits for every rank has issued."""
    pending = []
    for half in comm._second_halves:
        if not half.reduced.done and half.reduced.completed():
            half.reduced.wait()
        elif not half.reduced.done:
            pending.append(half)
    for half in pending[:max(0, len(pending) - ROWS_IN_FLIGHT)]:
        half.reduced.wait()


def issue_second_halves(comm) -> None:
    """Every waiting ordered all-reduce gets its all-gather: rows summed (waiting for the all-to-alls still
    running), then one gather of all the sums in one round, each into its own buffer. Called from the first
    wait() on one of them, or before any other collective is recorded ([Note: split all-reduces])."""
    halves = list(comm._second_halves)
    comm._second_halves.clear()
    with report_failure(comm):
        for half in halves:
            half.reduced.wait()  # `mine` holds the sum, the receive buffer is freed
        if comm.checks_each_collective:  # collectives no public call has checked (core/collectives/recorder.py [Note: debug mode])
            for half in halves:
                check_same(comm, half.rec.fingerprint() + ("all-gather half",),
                           f"finishing (all-gather half) {in_words(half.rec)}")
        gathered = comm._gather_handle([h.tensor for h in halves], [h.mine for h in halves], coalesce=True)
    for half in halves:
        half.gathered = gathered
