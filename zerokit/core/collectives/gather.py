"""All-gathers on gloo without gloo's temporaries, and lending storage to collectives.

`Comm.all_gather` / `all_gather_many` issue their collectives through `gather_many`; every recipe here
moves the same rows to the same ranks as torch's all-gather (copies, no arithmetic: the same bits).

[Note: frees at a fixed point]
A collective's temporaries (receive buffers, a reduce-dtype copy, a staging buffer) are referenced by
the process group's Work as well as by zerokit, and gloo's worker thread releases the Work at a time
that varies from run to run. So once a collective has completed, zerokit frees each temporary's storage
itself (`free_storage`), on its own thread, at the same point of every step: the live bytes at a step
boundary are then the same in every run. A caller's tensor (a `.grad` user code may still view) cannot
be freed by zerokit: on gloo a collective is handed an alias of it (`lend`: a new tensor over the same
storage), pointed at an empty storage once the collective has completed (`take_back`), so the Work holds
none of the caller's bytes and the caller's last reference frees them. Every reduce-scatter, all-reduce
and gather zerokit issues on gloo is lent this way (`all_reduce_scalars`' few elements excepted). Not on
NCCL: its Work keeps its tensors alive until the stream has used them, which the caching allocator needs.
benchmarks/investigations/cpu_frees.py and where_peak.py found the late frees
(benchmarks/results/cpu_frees.md, where_peak.md).

[Note: gloo's all-gather temporary]
gloo's all-gather receives into a buffer of its own, the size of the output, while it runs (and torch's
wrapper allocates another as it is issued), so an asynchronous gather costs a second copy of its output
while in flight: at stage 3's prefetch in backward, the step's peak. On gloo a single output is therefore
filled in place, row r from rank r (`fill_rows_from_ranks`): N broadcasts, or at N = 2 one all-to-all
that swaps the two rows; nothing is allocated. (An all-to-all at 3+ ranks would need N - 1 copies of the
row.) Several small outputs (under GLOO_PACK_BELOW elements) gathered in one round (stages 1-2's buckets
after the step, stage 0's all-reduce halves) are packed (`packed_gather`): this rank's inputs copied into its row of one (N, Σ m_i) staging
buffer per dtype, the other rows filled as above, then copied out: the output's bytes once, instead of
gloo's coalesced gather's concatenated inputs plus a buffer of every output. Groups hold consecutive
outputs of at most GLOO_COALESCE_NUMEL elements; an output alone in its group uses its own rows. NCCL
receives in place: every gather there stays an all-gather. Costs: benchmarks/collectives.py
(benchmarks/results/gather_cost.md); peaks: benchmarks/results/where_peak.md, sweep.md.

[Note: in-place gathers]
An all-gather's input may be this rank's own row of its output (`output.view(N, -1)[rank]`), as stages
1-2 gather their updated shards: no copy of the shard is made. Every path reads the input before it
writes that row: the packed gather copies inputs into its staging before anything is sent, the
broadcasts send row r from rank r in place, NCCL gathers in place when the input is the rank's slice of
the output (as FSDP2's do), and the simulated path copies the row first. Any other overlap between input
and output is refused (`check_in_place`). The all-gather half of an ordered all-reduce is one too
(core/collectives/ordered.py). Timed in benchmarks/investigations/stage1_phases.py (benchmarks/results/stage1_phases.md).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

GLOO_COALESCE_NUMEL = 1 << 20  # the most output elements one packed gloo gather takes
GLOO_PACK_BELOW = 1 << 15  # outputs this size or larger are gathered in their own rows, never packed


# [Note: the tensor collectives' names]
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
# reduce_scatter_single (the old names warn there); earlier torch has only the old ones. Looked up at
# each call, so a test that wraps torch's function sees zerokit's calls.
def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """`dist.all_gather_single`, under whichever name this torch has it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """`dist.reduce_scatter_single` (a sum), under whichever name this torch has it."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def free_storage(t: torch.Tensor) -> None:
    """Give back a tensor's bytes, keeping the tensor (and every view of it) for a later re-allocation.

    Also how a collective's temporaries are freed once it has completed: [Note: frees at a fixed point]."""
    if t.untyped_storage().nbytes() != 0:
        t.untyped_storage().resize_(0)


def lend(t: torch.Tensor, backend: str) -> torch.Tensor:
    """What a collective is handed for the caller's tensor `t`: on gloo a new tensor over the same bytes,
    emptied by `take_back` once the collective completes ([Note: frees at a fixed point]); else `t`."""
    if backend != "gloo":
        return t
    alias = t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    alias._zerokit_lent = True
    return alias


def take_back(lent) -> None:
    """Point each alias a completed collective was lent at an empty storage: its Work, released later on
    gloo's thread, then holds none of the caller's bytes ([Note: frees at a fixed point])."""
    for alias in lent:
        if getattr(alias, "_zerokit_lent", False):  # never a caller's own tensor (`lend` off gloo returns it)
            alias.set_()


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def check_in_place(output: torch.Tensor, input: torch.Tensor, rank: int, n: int) -> None:
    """An all-gather's input overlaps its output only as this rank's own row ([Note: in-place gathers])."""
    if shares_storage(output, input):
        row = output.view(n, -1)[rank]
        if not (input.data_ptr() == row.data_ptr() and input.is_contiguous()):
            raise ValueError("an all-gather's input shares memory with its output but is not this rank's own row of "
                             "it (output.view(world_size, -1)[rank]): pass that row, or a separate tensor")


def fill_rows(output: torch.Tensor, input: torch.Tensor, n: int) -> None:
    """A simulated or single-rank all-gather: every one of output's N rows gets `input` (the right shape, and
    exact at world size 1). `input` may be one of those rows itself (an in-place gather)."""
    if shares_storage(output, input):
        input = input.clone()
    output.view(n, -1).copy_(input.view(1, -1).expand(n, -1))


def coalesce_groups(numels: list[int], limit: int) -> list[list[int]]:
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


def gather_many(comm, outputs: list[torch.Tensor], inputs: list[torch.Tensor], coalesce: bool):
    """`Comm.all_gather_many`'s collectives, issued (see there for `coalesce`): (works, aliases lent, the
    step to run once every work has completed, or None)."""
    if comm.backend == "gloo":  # [Note: gloo's all-gather temporary]
        limit = GLOO_COALESCE_NUMEL if coalesce else 0
        works, lent, finishes = [], [], []
        # only small outputs are packed: a large one costs no more collectives alone, and its staging would
        # be live beside every other group's until the last finishes
        numels = [output.numel() if output.numel() < GLOO_PACK_BELOW else limit + 1 for output in outputs]
        for group in coalesce_groups(numels, limit):
            if len(group) == 1:
                works += _gather_rows(comm, outputs[group[0]], inputs[group[0]], lent)
            else:
                for same in _by_dtype(group, outputs):  # one staging buffer per dtype
                    issued, finish = _packed_gather(comm, [outputs[i] for i in same], [inputs[i] for i in same])
                    works += issued
                    finishes.append(finish)

        def finish_all():
            for finish in finishes:
                finish()

        return works, lent, finish_all if finishes else None
    if not coalesce or len(outputs) == 1 or _torch_checks_each_collective():
        return [all_gather_single(output, input, group=comm.group, async_op=True)
                for output, input in zip(outputs, inputs)], (), None
    return coalesced_gather(comm, outputs, inputs).works, (), None


def coalesced_gather(comm, outputs: list[torch.Tensor], inputs: list[torch.Tensor]):
    """torch's coalesced all-gathers (NCCL's way: it receives in place); something with `works` and `wait()`."""
    with dist._coalescing_manager(group=comm.group, async_ops=True) as coalesced:
        for output, input in zip(outputs, inputs):
            all_gather_single(output, input, group=comm.group)
    return coalesced


def _packed_gather(comm, outputs: list[torch.Tensor], inputs: list[torch.Tensor]):
    """Several all-gathers in one round on gloo ([Note: gloo's all-gather temporary]): this rank's inputs
    packed into row `rank` of an (N, Σ m_i) staging buffer, the other rows filled from their ranks
    (`fill_rows_from_ranks`), then each output's rows copied out of it. Returns (works issued, the
    copy-out to run once they have completed)."""
    n, me = comm.world_size, comm.rank
    staging = torch.empty(n, sum(input.numel() for input in inputs), dtype=outputs[0].dtype,
                          device=outputs[0].device)  # (N, Σ m_i), transient
    torch.cat([input.reshape(-1) for input in inputs], out=staging[me])  # read before any row is written
    # zerokit's own buffer, freed below by free_storage whoever else holds it: nothing to lend
    works = fill_rows_from_ranks(comm, list(staging))

    def copy_out():
        offset = 0
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


def _gather_rows(comm, output: torch.Tensor, input: torch.Tensor, lent: list) -> list:
    """An all-gather in place into `output`'s rows, row r from rank r (works, issued); the rows they are
    lent go into `lent` ([Note: frees at a fixed point])."""
    assert output.dtype == input.dtype, (output.dtype, input.dtype)
    rows = output.view(comm.world_size, -1)
    if rows[comm.rank].data_ptr() != input.data_ptr():  # not already in place
        rows[comm.rank].copy_(input.view(-1))
    rows = [lend(row, comm.backend) for row in rows]
    lent += rows
    return fill_rows_from_ranks(comm, rows)


def fill_rows_from_ranks(comm, rows: list[torch.Tensor]) -> list:
    """Row r of `rows` (N equal rows, this rank's filled) filled from rank r on every rank, in place, nothing
    allocated ([Note: gloo's all-gather temporary]): N broadcasts, row r from rank r; at N = 2 one all-to-all
    instead, this rank's row to the peer and the peer's into its row, a single rendezvous. Returns the works,
    issued."""
    if comm.world_size == 2:
        peer = 1 - comm.rank
        splits = [rows[peer].numel() if r == peer else 0 for r in range(2)]  # nothing to or from itself
        return [dist.all_to_all_single(rows[peer], rows[comm.rank], output_split_sizes=splits,
                                       input_split_sizes=splits, group=comm.group, async_op=True)]
    return [dist.broadcast(row, src=comm._global_rank(r), group=comm.group, async_op=True)
            for r, row in enumerate(rows)]
