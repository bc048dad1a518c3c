"""Hybrid sharding: shard inside a node, replicate across nodes (`zk.shard(..., shard_group_size=S)`).

[Note: hybrid sharding]
N ranks in R = N / S nodes of S. Ranks [kS, (k+1)S) form shard group k (a node); ranks with the
same position p in their shard groups form replicate group p. For N = 4, S = 2:

    shard groups      {0, 1}  {2, 3}        parameters, gradients and optimizer states are
    replicate groups  {0, 2}  {1, 3}        sharded over S ranks and replicated R times

Stages 1-3 see only the shard group: `comm.rank` / `comm.world_size` are the position in it and
S, so flat buffers are padded to a multiple of S and a rank holds exactly what a rank of a
world of S holds (the memory formulas with N = S). Stage 3 all-gathers parameters inside the
node; nothing but gradients crosses nodes:

    1. inside the node: reduce-scatter the bucket        (Ψ·g per rank, ZeRO accounting)
    2. across nodes: all-reduce the (Ψ/S,) grad shard    (2·Ψ/S·g per rank, where a flat stage 3
                                                          sends all of its 2·Ψ·p + Ψ·g over
                                                          collectives that span the nodes:
                                                          about 2/(3S) of it, p = g)

Every rank of a replicate group then holds the same averaged shard, takes the same optimizer
step and stays a replica. The gradient is pre-divided by N (not S): the average is over every
rank's batch, as at stage 0 at world size N.

Bit for bit equal to stage 0 at the same N. Stage 0's ordered sum adds an element's N
contributions in global rank order, ((g0 + g1) + g2) + g3 (core/collectives/ordered.py [Note: ordered
reduction]); step 2 as an all-reduce of per-node sums would compute (g0 + g1) + (g2 + g3),
different bits. So the ordered recipe keeps the node's raw contributions apart and chains the
nodes: step 1 is an all-to-all (rank p of node k receives its node's S rows of range p), and
along replicate group p node 0 adds its S rows in order and sends the running sum to node 1,
which adds its own S rows in order and passes it on; the last node broadcasts the total to its
replicate group. At R = 2 (two nodes) a rank receives one (Ψ/S,) shard per hop and one total:
the bytes of an all-reduce of the shard. Each hop is a broadcast over the replicate group rather
than a send (collectives only), so at larger R a rank receives every hop's running sum: R - 1 hops
of latency and of bytes, a price of exactness; the native recipe is the one that scales. Under `reduction="tree"` the order is
(g0 + g1) + (g2 + g3) at every world size (core/collectives/tree.py), which is exactly per-node subtrees
joined pairwise: node k sums its S rows pairwise, the R node sums are all-gathered across the
replicate group and summed pairwise (S and R powers of two). With `ordered_reduction=False`
(NCCL's default) both steps are the native collectives: fast, not bitwise equal to stage 0.

What runs where: reduce-scatter and all-gather (the sharded traffic) and the small scalar
reductions (norm partials, the fp16 overflow flag: replicas hold equal shards, so the shard
group's sum is the world's) run in the shard group; the model check, the initial broadcast of
rank 0's weights and checkpoints' agreements run over the whole world (`Hybrid.world`).
Byte counters are kept per group: `stats_by_group()`.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from zerokit.core.collectives.comm import Comm, Handle, _nbytes, profiled
from zerokit.core.collectives.gather import all_gather_single, free_storage, reduce_scatter_single, shares_storage, take_back
from zerokit.core.collectives.groups import resolve_shard_group_size
from zerokit.core.collectives.tree import is_power_of_two, pairwise_sum_

__all__ = ["HybridComm", "hybrid_groups", "check_shard_group_size"]


def check_shard_group_size(shard_group_size, world_size: int) -> int:
    """S as an int dividing the world size N, or a ValueError naming the fix (core/accounting/estimate.py's check)."""
    if shard_group_size is None:
        raise ValueError("shard_group_size must be an int >= 1 (the ranks per node), got None")
    return resolve_shard_group_size(shard_group_size, world_size)


def hybrid_groups(shard_group_size: int, backend: str | None = None):
    """(shard group, replicate group) of this rank, for ranks [kS, (k+1)S) per node. A collective:
    every rank calls it, and builds every group (torch.distributed.new_group's rule).

    Build them once and pass them to every `zk.shard(..., group=groups)` that uses them: each call
    builds R + S process groups (gloo: new connections between their ranks).
    """
    n, rank = dist.get_world_size(), dist.get_rank()
    s = check_shard_group_size(shard_group_size, n)
    mine = [None, None]
    for k in range(n // s):  # shard groups: one node each
        ranks = list(range(k * s, (k + 1) * s))
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine[0] = group
    for p in range(s):  # replicate groups: position p of every node
        ranks = list(range(p, n, s))
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine[1] = group
    return tuple(mine)


def _warn_if_groups_span_nodes(shard_group_size: int, world_size: int) -> None:
    """Under torchrun, LOCAL_WORLD_SIZE is the ranks per node: a shard group of another size puts a node
    boundary inside a shard group (or keeps replicas on one node), which is correct but sends the
    parameter all-gathers over the slow link hybrid sharding exists to spare. Said once, on rank 0."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if not local or not local.isdigit() or int(local) in (shard_group_size, world_size) or dist.get_rank() != 0:
        return
    warnings.warn(f"zerokit: shard_group_size={shard_group_size} but torchrun runs {local} ranks per node "
                  f"(LOCAL_WORLD_SIZE): shard groups do not match nodes, so stage 3's all-gathers and the "
                  f"reduce-scatters cross nodes; pass shard_group_size={local} to shard within each node",
                  stacklevel=3)


class HybridComm(Comm):
    """A rank of a shard group (what stages see: `rank`, `world_size` = S), replicated across nodes."""

    def __init__(self, shard_group, replicate_group, ordered: bool | None = None, debug: bool | None = None,
                 tree: bool = False):
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("hybrid sharding needs an initialised process group (torchrun, zk.init_distributed)")
        super().__init__(shard_group, ordered=ordered, debug=debug)
        self.replicate = Comm(replicate_group, ordered=self.ordered, debug=self.debug)  # rank: which node
        self.world = Comm(None, ordered=self.ordered, debug=self.debug)  # every rank: init, checkpoints
        s, r, n = self.world_size, self.replicate.world_size, self.world.world_size
        if s * r != n:
            raise ValueError(f"the shard group ({s} ranks) times the replicate group ({r} ranks) must be the world "
                             f"({n} ranks): pass (shard_group, replicate_group) as zk.hybrid_groups builds them")
        self._check_grid(shard_group, replicate_group)
        _warn_if_groups_span_nodes(s, n)
        self.data_parallel_size = n
        self.world_rank = self.world.rank
        self.replica_rank = self.replicate.rank
        # Node k's rank at my position, as a global rank (what the chain's broadcasts take as src).
        self._replica_global = [dist.get_global_rank(replicate_group, i) for i in range(r)]  # node k -> its rank
        if tree:
            self.use_tree()

    def _check_grid(self, shard_group, replicate_group) -> None:
        """Refuse groups that do not tile the world as a grid (a replicate group that is another shard group
        would average inside the node and let the nodes drift apart, silently): every rank's two groups meet in
        that rank alone, and every member of a group names the same group. Raised on every rank."""
        mine = (dist.get_process_group_ranks(shard_group), dist.get_process_group_ranks(replicate_group))
        everyone = self.world.all_gather_object(mine, label="the hybrid groups check", phase="init")
        problems = []
        for rank, (shard, replicate) in enumerate(everyone):
            if set(shard) & set(replicate) != {rank}:
                problems.append(f"rank {rank}: its shard group {shard} and replicate group {replicate} share "
                                f"{sorted(set(shard) & set(replicate))}, not rank {rank} alone")
            for which, ranks in ((0, shard), (1, replicate)):
                other = next((m for m in ranks if sorted(everyone[m][which]) != sorted(ranks)), None)
                if other is not None:
                    problems.append(f"rank {rank} has {('shard', 'replicate')[which]} group {ranks}, but rank {other} "
                                    f"has {everyone[other][which]}")
        if problems:
            raise ValueError("hybrid sharding: the groups passed do not form a grid of shard groups x replicate "
                             f"groups (raised on rank {self.world.rank}):\n  " + "\n  ".join(problems[:8])
                             + "\nbuild them with zk.hybrid_groups(S), or pass shard_group_size=S")

    def use_tree(self) -> None:
        s, r = self.world_size, self.replicate.world_size
        if not (is_power_of_two(s) and is_power_of_two(r)):
            raise ValueError(f"reduction='tree' with hybrid sharding needs the shard group size ({s}) and the number "
                             f"of shard groups ({r}) to be powers of two: the binary tree over ranks has no other "
                             "shape")
        self.tree, self.ordered = True, True
        self.replicate.tree = self.replicate.ordered = True

    # ------------------------------------------------------------------ bookkeeping
    def stats(self) -> dict[str, int]:
        """Bytes per kind over every group (the node's, across nodes, and the world's one-time init broadcast)."""
        groups = self.stats_by_group()
        return {kind: sum(g[kind] for g in groups.values()) for kind in groups["shard_group"]}

    def stats_by_group(self) -> dict[str, dict[str, int]]:
        return {"shard_group": Comm.stats(self), "replicate_group": self.replicate.stats(),
                "world": self.world.stats()}

    def reset_stats(self) -> None:
        Comm.reset_stats(self)
        self.replicate.reset_stats()
        self.world.reset_stats()

    # ------------------------------------------------------------------ what runs over the whole world
    def all_reduce(self, tensor, op="sum", async_op=False, phase=None, label=None) -> Handle:
        return self.world.all_reduce(tensor, op=op, async_op=async_op, phase=phase, label=label)

    def broadcast(self, tensor, src=0, phase=None, label=None) -> None:
        self.world.broadcast(tensor, src=src, phase=phase, label=label)

    def all_gather_object(self, obj, label=None, phase=None) -> list:
        return self.world.all_gather_object(obj, label=label, phase=phase)

    def barrier(self, label=None) -> None:
        self.world.barrier(label=label)

    # ------------------------------------------------------------------ the gradient: node, then across nodes
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                       phase: str | None = None, label: str | None = None) -> Handle:
        """Sum `input` (padded_numel,) over all N ranks; my range of the shard group lands in `output`
        (padded_numel // S,). See [Note: hybrid sharding] for the three recipes."""
        s = self.world_size
        assert input.numel() == output.numel() * s, (input.numel(), output.numel(), s)
        self._record("reduce_scatter", input, label, phase)
        self._count("reduce_scatter", _nbytes(input), phase)
        across = f"{label} across shard groups"
        self.replicate._record("all_reduce", output, across, phase)
        self.replicate._count("all_reduce", 2 * _nbytes(output), phase)
        with profiled("zerokit::reduce_scatter"), self.report_failure():
            if not self.ordered:  # native: reduce-scatter in the node, all-reduce of the shard across nodes
                work, lent = None, ()  # lent: core/collectives/gather.py [Note: frees at a fixed point]
                if s == 1:
                    output.copy_(input)
                elif shares_storage(output, input):
                    result = torch.empty_like(output)
                    sent = self._lend(input)
                    reduce_scatter_single(result, sent, group=self.group)
                    take_back((sent,))
                    output.copy_(result)
                    free_storage(result)  # core/collectives/gather.py [Note: frees at a fixed point]
                else:
                    lent = (self._lend(output), self._lend(input))
                    work = reduce_scatter_single(lent[0], lent[1], group=self.group, async_op=True)
                handle = Handle(work, lambda: dist.all_reduce(output, group=self.replicate.group), comm=self,
                                local=False, lent=lent)  # its finish is a collective: never run early
            else:
                lent = self._lend(input)  # core/collectives/gather.py [Note: frees at a fixed point]
                rows, work = self._node_rows(lent)

                def finish():
                    (self._tree_across if self.tree else self._chain_across)(output, rows)
                    free_storage(rows)  # the receive buffer: core/collectives/gather.py [Note: frees at a fixed point]

                handle = Handle(work, finish, comm=self, local=False, lent=(lent,))  # the chain across nodes
                # is collectives
        if not async_op:
            handle.wait()
        return handle

    def _node_rows(self, input: torch.Tensor):
        """(S, shard) rows: row i = shard-group rank i's contribution to my range (an all-to-all in the node)."""
        s = self.world_size
        received = torch.empty(input.numel(), dtype=input.dtype, device=input.device)  # (S * shard,)
        if s == 1:
            received.copy_(input)  # a copy: the output may be the input itself
            return received.view(1, -1), None
        work = dist.all_to_all_single(received, input, group=self.group, async_op=True)
        return received.view(s, -1), work

    def _chain_across(self, output: torch.Tensor, rows: torch.Tensor) -> None:
        """Linear order over all N ranks: node h adds its rows to nodes 0..h-1's running sum, then the
        last node's total goes to every node ([Note: hybrid sharding]).

        Each hop is a broadcast along the replicate group from node h - 1 (every node takes part;
        only node h keeps what it receives), not a send/recv: collectives only, which torch's
        TORCH_DISTRIBUTED_DEBUG=DETAIL checks (its sequence numbers count point-to-point calls
        unevenly). At R = 2 a hop is exactly a send; at larger R each rank receives R - 1 running
        sums it mostly discards (bytes on the wire grow with R; the counters count the logical
        all-reduce).
        """
        k, r = self.replicate.rank, self.replicate.world_size
        group, peers = self.replicate.group, self._replica_global

        def add_rows(first: int) -> None:
            for i in range(first, rows.shape[0]):  # global rank order, as stage 0's ordered sum
                output.add_(rows[i])

        if k == 0:
            output.copy_(rows[0])
            add_rows(1)
        for h in range(1, r):  # hop h: nodes 0..h-1's sum (pre-divided), from node h - 1 to node h
            dist.broadcast(output, src=peers[h - 1], group=group)
            if k == h:
                add_rows(0)
        if r > 1:
            dist.broadcast(output, src=peers[r - 1], group=group)  # the total, to every node

    def _tree_across(self, output: torch.Tensor, rows: torch.Tensor) -> None:
        """Pairwise: the node's S rows, then the R node sums (all-gathered across nodes): core/collectives/tree.py."""
        r = self.replicate.world_size
        node_sum = pairwise_sum_(rows)  # (shard,) a view of rows[0]
        if r == 1:
            output.copy_(node_sum)
            return
        sums = torch.empty(r * node_sum.numel(), dtype=output.dtype, device=output.device)  # (R * shard,)
        all_gather_single(sums, node_sum.contiguous(), group=self.replicate.group)
        output.copy_(pairwise_sum_(sums.view(r, -1)))
