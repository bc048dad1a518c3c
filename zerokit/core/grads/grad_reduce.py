"""Averaging one bucket's gradient over ranks: the one call every stage makes for it.

    r = GradReduction(comm, grad, reduce_dtype, fp.label)   # cast to the reduce dtype if needed, divide by N
    r.all_reduce()                                # stage 0, or:
    r.reduce_scatter(grad_shard, accumulate)      # stages 1-3 (both asynchronous)
    ... later ...
    r.wait()          # the average is in r.result (stage 0) / in grad_shard (stages 1-3)

A `GradReduction` owns every temporary the reduction needs: the reduce-dtype copy of the gradient (see [Note: reduce dtype]) and,
when a grad shard accumulates a second synced backward, the reduce-scatter's own output.
`transient` lists them (the stage reports them to the measured ledger, core/accounting/ledger.py, as
comm_buffers); `wait()` finishes the reduction and lets go of what is no longer needed.

[Note: reduce dtype]
Gradients come out of backward in the param dtype, because that is what autograd
accumulates into (a flat bucket at stages 0-2, a unit's flat gradient at stage 3).
`PrecisionPolicy.reduce_dtype` says in which dtype they are summed across ranks. When it
equals the param dtype, the buffer itself is scaled by 1/N in place and handed to the
collective. When it differs (say bf16 params, fp32 reductions), the buffer is copied into a
new reduce-dtype buffer first and the 1/N pre-division happens *after* that cast, in the
reduce dtype, so no low-precision rounding sits between the local gradient and the sum. The
sum runs in the reduce dtype (communication bytes scale with its element size: 2x for fp32
reductions of bf16 gradients), and its result stays in the reduce dtype (stage 0: the copy,
`result`; stages 1-3: the grad shard, allocated in the reduce dtype), so the optimizer forms
its fp32 master gradient from it without a second rounding. `copied` tells the stage that
the param-dtype buffer is no longer read by the collective and may be released.

With `reduction="tree"` (core/collectives/tree.py [Note: world-size-independent bits]) the stage passes
the bucket's `PartialSums`: the constructor adds this last micro-batch's gradient to the
pairwise partial sums of the earlier ones and reduces their total (the bucket itself when
there were none), which is then what `copied` compares the gradient buffer against.

Every stage reduces through this class and nothing else, which is what keeps the stages
bitwise equal to each other under any reduce dtype: cast and scale are elementwise, and the
rank-ordered reduction (core/collectives/ordered.py [Note: ordered reduction]) makes the sum of an element
independent of the buffer it sits in.

[Note: all-reduce groups]
zerokit's buckets are cut to hold at most `bucket_numel` elements, and separately per
optimizer option set (the decay / no-decay split gives the biases and LayerNorms of every
block a bucket of their own), because a bucket is also what the optimizer steps and, at
stages 1-2, what bounds the gradient memory in flight. Torch DDP's buckets know nothing of
the optimizer and close once they *reach* the cap, so one all-reduce per bucket would make
more, smaller collectives than DDP, each paying a collective's latency. Stage 0 therefore
applies DDP's rule one level up: walking the trainable buckets in release order, a group
closes once it holds `bucket_numel` elements (core/params/bucketing.py `plan_all_reduce_groups`;
dtypes never mix); the group's gradients are one buffer, all-reduced in one call when its
last bucket is released (buckets are released strictly in order, so its others already are).
The plan is static, the same on every rank. The buckets, and so the optimizer's flat buffers
and the norm's summation order, are unchanged, and an all-reduce is elementwise (the ordered
one too), so grouping changes no bit of any result.

[Note: grad shards]
At stages 2 and 3 a grad shard (this rank's range of a bucket's averaged gradient) is needed from
the bucket's first reduce-scatter to the optimizer step, not between zero_grad and backward. So
zero_grad frees every grad shard (`drop_grad_shard`, as torch FSDP's zero_grad(set_to_none=True)
frees the sharded `.grad`s) and the first reduce-scatter of the next backward allocates it
(`grad_shard`): backward's peak holds the grad shards of the buckets reduced so far, not all of
them, which is what it is when the peak comes before the last bucket (GPT-2's tied embedding is
reduced last; benchmarks/results/where_peak_stage2_124m_n2.md). Meanwhile the params' `.grad` is
None, as in torch. A bucket no backward reached since zero_grad steps on zeros, as at stage 0
(`grad_shards` allocates them), so the stages stay bitwise equal. What a rank holds after
backward (the stages' formulas) is unchanged. Stage 1's grad shard is its range of the full
gradient, which it keeps.

[Note: one rank's grad shard]
With one data-parallel rank the average is the gradient itself (divided by 1, which changes no
bit) and a rank's range is the whole flat param. So where a stage frees the full gradient once
reduced (stages 2-3) and the grad shard does not exist yet, the full gradient becomes the grad
shard: no zeroed shard is allocated and nothing is copied (the reduce-scatter is then a copy of
a buffer onto itself, which `Comm.reduce_scatter` skips). A second synced backward, a reduce
dtype that differs from the param dtype and reduction="tree" take the general path.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

from zerokit.core.params.bucketing import plan_all_reduce_groups
from zerokit.core.collectives.gather import free_storage
from zerokit.core.params.flat_param import FlatParamLayout, summarize_names
from zerokit.core.collectives.tree import PartialSums

__all__ = ["GradReduction", "AllReduceGroup", "all_reduce_groups", "AllReducedGrads", "GradPath"]


def _send_buffer(grad: torch.Tensor, divisor: int, reduce_dtype: torch.dtype) -> torch.Tensor:
    """`grad` cast to `reduce_dtype` (a new buffer only when the dtype differs), then divided by `divisor` (N)."""
    if grad.dtype == reduce_dtype:
        return grad.mul_(1.0 / divisor) if divisor != 1 else grad  # pre-divide in place, as torch DDP does
    send = torch.empty(grad.shape, dtype=reduce_dtype, device=grad.device)  # transient, reduce dtype
    send.copy_(grad)
    return send.mul_(1.0 / divisor) if divisor != 1 else send


class GradReduction:
    """One gradient buffer on its way to being averaged over ranks.

    Built in two moves so that the stage can record it (and the ledger see its temporaries)
    before any collective runs: the constructor casts and pre-divides, `all_reduce` or
    `reduce_scatter` launches (asynchronously), `wait` finishes.
    """

    def __init__(self, comm, grad: torch.Tensor, reduce_dtype: torch.dtype, label: str,
                 partials: PartialSums | None = None, divide: bool = True):
        """`label`: the bucket in words ("bucket 3 (blocks.2.*)", `FlatParamLayout.label`), what the
        collective recorder and debug mode's errors call this reduction (core/collectives/recorder.py).
        `partials`: reduction="tree", the bucket's partial sums of this step's earlier micro-batches.
        `divide=False`: the 1/N is already in the gradient (fp16 under reduction="tree" puts it in
        the loss scale: core/collectives/tree.py)."""
        self.comm = comm
        self.label = label
        local = partials.total(grad) if partials is not None else grad  # this rank's sum over its micro-batches
        self.send = _send_buffer(local, comm.data_parallel_size if divide else 1, reduce_dtype)  # what the collective reads
        self.copied = self.send is not grad  # True: a reduce-dtype copy; the param-dtype buffer may go
        self.transient: list[torch.Tensor] = [self.send] if self.copied else []  # comm_buffers in the ledger
        self.result: torch.Tensor | None = None  # where the average is once wait() returns
        self._handle = None
        self._add_into: torch.Tensor | None = None

    def all_reduce(self, phase: str = "backward") -> "GradReduction":
        """Average a replicated buffer (stage 0). `result`: the gradient buffer itself, or its reduce-dtype copy."""
        self.result = self.send
        self._handle = self.comm.all_reduce(self.send, async_op=True, phase=phase, label=self.label)
        return self

    def reduce_scatter(self, grad_shard: torch.Tensor, accumulate: bool = False,
                       phase: str = "backward") -> "GradReduction":
        """This rank's range of the average into `grad_shard` (shard_numel,) (stages 1-3).

        `accumulate`: add it to what `grad_shard` holds (a second synced backward since the
        gradients were cleared, as torch's `.grad` accumulates) instead of overwriting it.
        `grad_shard` may be this rank's range of the gradient buffer itself (stage 1:
        `Comm.reduce_scatter` handles the aliasing).
        """
        self.result = grad_shard
        out = grad_shard
        if accumulate:
            out = torch.empty_like(grad_shard)  # (shard_numel,) reduce dtype, added on completion
            self.transient.append(out)
            self._add_into, self.result = grad_shard, out
        self._handle = self.comm.reduce_scatter(out, self.send, async_op=True, phase=phase, label=self.label)
        return self

    def arrived(self) -> bool:
        """wait() would neither block nor issue a collective (core/collectives/comm.py [Note: finishing what has arrived])."""
        return self._handle is not None and self._handle.arrived()

    def wait(self) -> None:
        """Block until the average is in place; release the temporaries the result does not live in."""
        self._handle.wait()
        if self._add_into is not None:
            self._add_into.add_(self.result)
            self.result, self._add_into = self._add_into, None
        for t in self.transient:
            if t is not self.result:
                free_storage(t)  # now, on this thread: core/collectives/gather.py [Note: frees at a fixed point]
        self.transient = [t for t in self.transient if t is self.result]


class AllReduceGroup:
    """Consecutive trainable buckets whose gradients live back to back in one buffer, all-reduced in one call.

    `flat_grad` (sum of the members' padded_numel,) is the storage; each member's flat gradient is a
    view into it (`grad_of`). `index` and `label` are what `Engine.grad_reduction` and the collective
    recorder need of what they reduce ("buckets 2, 3 (blocks.1.*)"; frozen buckets, which have no
    gradient, may sit between two members' indices).
    """

    def __init__(self, index: int, members: list[FlatParamLayout]):
        self.index, self.members = index, members
        self.offsets: dict[int, int] = {}  # bucket index -> where its gradient starts in `flat_grad`
        total = 0
        for fp in members:
            self.offsets[fp.index] = total
            total += fp.padded_numel
        self.flat_grad = members[0].new_flat(numel=total)  # zeros, the param dtype
        self.label = members[0].label if len(members) == 1 else (  # "buckets 4, 5 (blocks.1.*)"
            f"buckets {', '.join(str(fp.index) for fp in members)} "
            f"({summarize_names([n[0] for fp in members for n in fp.names])})")

    def grad_of(self, fp: FlatParamLayout, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """`fp`'s (padded_numel,) part of `buffer` (default: the group's gradient buffer)."""
        offset = self.offsets[fp.index]
        return (self.flat_grad if buffer is None else buffer)[offset:offset + fp.padded_numel]


def all_reduce_groups(trainable: list[FlatParamLayout], bucket_numel: int) -> list[AllReduceGroup]:
    """Stage 0's all-reduce groups of the trainable buckets, in order ([Note: all-reduce groups])."""
    plan = plan_all_reduce_groups([fp.padded_numel for fp in trainable], [fp.dtype for fp in trainable], bucket_numel)
    return [AllReduceGroup(k, [trainable[i] for i in members]) for k, members in enumerate(plan)]


class AllReducedGrads:
    """Stage 0's gradients: every trainable bucket's full gradient for good, the buckets of an all-reduce
    group back to back in its buffer ([Note: all-reduce groups]), and where a bucket's average is during a
    step: in that buffer, or from the group's all-reduce to `forget_reductions` in its reduce-dtype copy
    ([Note: reduce dtype]). `reductions` is the engine's (group index -> GradReduction); `loss_scale` reads
    its current scale, for the ShardedGrads `.grad` shows over a copy."""

    def __init__(self, flat_params: list[FlatParamLayout], states: list, bucket_numel: int,
                 reductions: dict[int, GradReduction], loss_scale: Callable[[], float]):
        self.groups = all_reduce_groups([fp for fp in flat_params if fp.requires_grad], bucket_numel)
        self.group_of = {fp.index: group for group in self.groups for fp in group.members}
        self.states, self.reductions, self.loss_scale = states, reductions, loss_scale
        for fp, state in zip(flat_params, states):  # (padded_numel,) full gradients, views of their group's
            state.flat_grad = self.group_of[fp.index].grad_of(fp) if fp.requires_grad else None
            fp.use_as_grad_storage(state.flat_grad)

    def show_average(self, group: AllReduceGroup) -> None:
        """`.grad` shows the group's average (not the buckets' local sums), and under fp16 unscaled norms: a
        replicated ShardedGrad (core/params/sharded_tensors.py), so that torch.nn.utils.clip_grad_norm_
        equals engine.clip_grad_norm_."""
        result = self.reductions[group.index].result
        for fp in group.members:
            fp.show_grads(fp.sharded_grads(group.grad_of(fp, result), None, self.loss_scale))

    def averaged(self, fp: FlatParamLayout) -> torch.Tensor:
        """What the step reads for a bucket: its gradient buffer, or its part of the reduce-dtype copy its group's
        all-reduce averaged (that copy is a new tensor; the buffer itself is returned as the same object)."""
        group = self.group_of[fp.index]
        reduction = self.reductions.get(group.index)
        if reduction is None or reduction.result is group.flat_grad:
            return self.states[fp.index].flat_grad
        return group.grad_of(fp, reduction.result)

    def adopt_assigned(self, fp: FlatParamLayout, replaced: list[int]) -> None:
        """Tensors user code assigned to `.grad` after backward go where the step reads them."""
        grad = self.averaged(fp)
        fp.write_params(grad, replaced, [fp.params[j].grad for j in replaced])
        if grad is self.states[fp.index].flat_grad:
            fp.use_as_grad_storage(grad)
        else:
            fp.show_grads(fp.sharded_grads(grad, None, self.loss_scale))

    def forget_reductions(self) -> None:
        """The step's reductions (and their reduce-dtype copies) go; `.grad` shows the buckets again."""
        for index, reduction in self.reductions.items():
            if reduction.copied:
                for fp in self.groups[index].members:
                    fp.use_as_grad_storage(self.states[fp.index].flat_grad)
        self.reductions.clear()


class GradPath:
    """The engine's gradient path, one call site for every stage (mixed into core/engine.py's `Engine`).

    The tracker (core/grads/hooks.py) calls `_on_grads_ready`; synced, the stage's `reduce_grads`
    runs (stages 1-3 through `reduce_scatter_grad`), inside no_sync the gradient stays local.
    Reads the stage's `states`, `reductions`, `in_flight`, `partials`, `keeps_flat_grads`,
    `accumulates_grad_shards` and `reduce_in_no_sync` (core/engine.py).
    """

    # -- the gradient path: one call site for every stage (core/grads/hooks.py calls these) -----------
    def _on_grads_ready(self, fp) -> None:
        """A flat param's gradients are all accumulated (stages 0-2: released in index order)."""
        self.reduce_or_hold(self.states[fp.index])

    def reduce_or_hold(self, state) -> None:
        """Synced: the stage's reduction starts now (`reduce_grads`). Inside no_sync the gradient keeps
        accumulating in the full flat gradient (stage 2's accumulate="reduce_scatter" reduces anyway),
        or, under reduction="tree", this micro-batch moves into its pairwise partial sums (core/collectives/tree.py)."""
        if self.sync_gradients or self.reduce_in_no_sync:
            self.reduce_grads(state)
            return
        partials = self.partials_of(state)
        if partials is not None:
            partials.add(state.flat_grad, reuse=self.keeps_flat_grads)
            self.release_flat_grad(state)

    def release_flat_grad(self, state) -> None:
        """Done with the full gradient: zeroed where the stage keeps it (stages 0-1); else dropped, and
        `.grad` shows this rank's part of the average (None while there is no grad shard)."""
        if self.keeps_flat_grads:
            state.flat_grad.zero_()
            return
        state.fp.show_grads(state.shown_grads or [None] * len(state.fp.params))
        state.flat_grad = None

    def reduce_scatter_grad(self, state) -> GradReduction:
        """Launch (stages 1-3): this rank's range of the flat param's rank-averaged gradient goes into its grad shard.

        Divided by N (and cast) exactly as stage 0 does, so the sums agree bit for bit; added to
        the grad shard when an earlier backward since zero_grad wrote it (as torch's .grad
        accumulates), except at stage 1, where the average overwrites this rank's range of the full
        gradient (comm handles the aliasing) and the next backward would add onto it: refused.
        Where the stage frees full gradients, the param-dtype one goes as soon as the collective
        no longer reads it, and `.grad` shows this rank's part of the average again.
        """
        if state.grad_shard_written and not self.accumulates_grad_shards:
            raise RuntimeError(
                f"stage {self.stage} (rank {self.rank}): a second synced backward since gradients were cleared, for "
                f"the bucket holding {state.fp.names[0][0]!r}; accumulate gradients inside engine.no_sync() and let "
                "only the last micro-step synchronise, or clear gradients between steps (engine.zero_grad() or "
                "model.zero_grad())")
        self.in_flight.finish_arrived()  # completed ones free their buffers first (core/collectives/comm.py
        # [Note: finishing what has arrived])
        reduction = self.reductions[state.index] = self.grad_reduction(state, state.flat_grad)
        if (state.grad_shard is None and not reduction.copied and not self.keeps_flat_grads
                and self.comm.data_parallel_size == 1):  # [Note: one rank's grad shard]
            self.new_grad_shard(state, state.flat_grad)
        reduction.reduce_scatter(self.grad_shard(state), accumulate=state.grad_shard_written)
        state.grad_shard_written = True
        frees = not self.keeps_flat_grads
        if reduction.copied and frees:  # the collective reads the reduce-dtype copy: the param-dtype one can go
            self.release_flat_grad(state)

        def on_done() -> None:  # the owners have this flat param's content now
            self.reductions.pop(state.index)
            if frees:
                self.release_flat_grad(state)

        self.in_flight.push(reduction, on_done)
        return reduction

    def grad_shard(self, state) -> torch.Tensor:
        """The flat param's (shard_numel,) grad shard, allocated (zeros) where zero_grad freed it (stages 2-3:
        [Note: grad shards])."""
        return state.grad_shard if state.grad_shard is not None else self.new_grad_shard(state)

    def grad_shards(self) -> list[torch.Tensor]:
        """Stages 1-3: this rank's range of each trainable flat param's averaged gradient, what the step reads
        (a flat param no backward reached since zero_grad steps on zeros, as at stage 0)."""
        return [self.grad_shard(self.states[fp.index]) for fp in self.trainable]

    def drop_grad_shard(self, state) -> None:
        """zero_grad at stages 2-3 ([Note: grad shards]): the grad shard goes, and a full gradient kept by
        no_sync and never sent; `.grad` is None until the next synced backward."""
        state.grad_shard, state.shown_grads, state.grad_shard_written = None, None, False
        self.release_flat_grad(state)

    def new_grad_shard(self, state, grad_shard: torch.Tensor | None = None) -> torch.Tensor:
        """Give a flat param its (shard_numel,) grad shard (zeros in the reduce dtype, or `grad_shard`) and
        the ShardedGrads `.grad` shows over it after a synced backward (core/params/sharded_tensors.py)."""
        if grad_shard is None:
            grad_shard = state.fp.new_flat(self.policy.reduce_dtype, numel=state.fp.shard_numel)
        state.grad_shard, state.grad_shard_written = grad_shard, False
        state.shown_grads = state.fp.sharded_grads(grad_shard, self.comm, _loss_scale_of(self))
        return grad_shard


    # -- reduction="tree" (core/collectives/tree.py [Note: world-size-independent bits]) -------------------
    def grad_reduction(self, fp, grad: torch.Tensor) -> GradReduction:
        """A bucket's gradient on its way to the average (core/grads/grad_reduce.py), as every stage builds it."""
        return GradReduction(self.comm, grad, self.policy.reduce_dtype, fp.label, self.partials_of(fp),
                             divide=not self._divide_in_loss)

    def partials_of(self, fp) -> PartialSums | None:
        """The bucket's pairwise partial sums under reduction="tree"; None under "linear"."""
        if self.config.reduction != "tree":
            return None
        if fp.index not in self.partials:
            self.partials[fp.index] = PartialSums(self.policy.reduce_dtype, fp.label)
        return self.partials[fp.index]

    def check_partials_sent(self) -> None:
        """Refuse to clip or step on micro-batches still held as partial sums (all of them under no_sync)."""
        for partials in self.partials.values():
            if partials.count:
                raise RuntimeError(
                    f"zerokit stage {self.stage} (rank {self.rank}): reduction='tree' holds {partials.count} "
                    f"micro-batch gradient(s) of {partials.label} not yet reduced across ranks: the step's last "
                    "backward must run outside engine.no_sync()")

    def clear_partials(self) -> None:
        """zero_grad: a new step's tree starts empty."""
        for partials in self.partials.values():
            partials.clear()


def _loss_scale_of(engine) -> Callable[[], float]:
    """The engine's current loss scale, read through a weak reference: a ShardedGrad sits in `param.grad`, on
    the C++ side where gc cannot see it, and must not keep the engine alive (core/grads/hooks.py [Note: hooks hold
    the engine weakly]). 1.0 once the engine is gone."""
    ref = weakref.ref(engine)
    return lambda: 1.0 if ref() is None else ref().loss_scale
