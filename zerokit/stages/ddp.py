"""Stage 0: data parallelism (DDP), written by hand. Nothing is sharded.

Every rank holds the whole model, the whole gradient and the whole optimizer state, and
sees its own slice of the data. After backward the gradients are averaged over ranks
with an all-reduce, so every rank applies the same update and the replicas stay equal.

What happens, per step:
  * construction: rank 0's parameters (frozen ones too) and buffers are broadcast; the
    parameters become views into flat buckets, their `.grad`s views into flat gradient
    buckets (so gradients land in communication-ready storage), and consecutive gradient
    buckets lie back to back in one buffer per all-reduce group ([Note: all-reduce groups]);
  * backward: as soon as every gradient of a group's buckets has been accumulated, the group
    is scaled by 1/N and all-reduced asynchronously, overlapping the rest of backward;
  * end of backward: wait for every group;
  * step: every rank runs the optimizer over the whole flat buffers.

Collectives per step: one all-reduce of the gradients, one call per group. Logical bytes per
rank: 2 * Ψ * g (g = gradient bytes per element; ZeRO accounting, see core/comm.py).

[Note: all-reduce groups]
zerokit's buckets are cut to hold at most `bucket_numel` elements, and separately per
optimizer option set (the decay / no-decay split of `param_groups` gives the biases and
LayerNorms of every block a bucket of their own), because a bucket is also what the
optimizer steps and, at stages 1-2, what bounds the gradient memory in flight. Torch DDP's
buckets know nothing of the optimizer and close once they *reach* the cap. Issued one
all-reduce per bucket, stage 0 made more, smaller collectives than DDP with the same cap
(10 against 7 for the small GPT at 65,536 elements, 2 ranks), each paying a collective's
latency. So stage 0 applies DDP's rule one level up: walking the trainable buckets in
release order, it closes a group once the group holds `bucket_numel` elements
(core/bucketing.py `plan_all_reduce_groups`; dtypes never mix), allocates the group's
gradients as one buffer, and all-reduces it in one call when the group's last bucket is
released (buckets are released strictly in order, so its others already are). The plan is
static, the same on every rank. The buckets, and so the optimizer's flat buffers and the
norm's summation order, are unchanged; an all-reduce is elementwise (the ordered one too,
core/comm.py [Note: ordered reduction]), so grouping changes no bit of any result.
benchmarks/stage0_phases.py counts the collectives and times each phase beside DDP.

Reduce dtype (core/grad_reduce.py [Note: reduce dtype]): with bf16 params and fp32
reductions, a bucket's all-reduce runs on an fp32 copy, and the average lives in that copy
until `step` (2Ψ + 4Ψ gradient bytes at that moment, the copy reported as comm_buffers);
`param.grad` then shows the average, while the bucket keeps this rank's local sum.

`param.grad` is the user's, as under torch DDP: after backward it is the averaged gradient,
and in-place changes reach the step; `model.zero_grad()`, an optimizer's `zero_grad()` or
`p.grad = None` before the next backward are taken over by `_adopt_user_grads`.

Per-rank memory (Ψ parameters, up to padding < N elements per bucket):
  fp32 + Adam:        params 4Ψ + grads 4Ψ + optimizer_states 8Ψ                = 16Ψ
  bf16/fp16 + Adam:   params 2Ψ + grads 2Ψ + master_params 4Ψ + optimizer_states 8Ψ = 16Ψ
"""
from __future__ import annotations

import torch
from torch import nn

from zerokit.checkpoint import Checkpointing
from zerokit.core.bucketing import InFlight, plan_all_reduce_groups
from zerokit.core.config import ShardConfig
from zerokit.core.engine import Engine
from zerokit.core.flat_param import FlatParamLayout, build_flat_params, summarize_names
from zerokit.core.grad_reduce import GradReduction
from zerokit.core.hooks import GradReadyTracker
from zerokit.optim.sharded import ShardedOptimizer


class AllReduceGroup:
    """Consecutive trainable buckets whose gradients live back to back in one buffer, all-reduced in one call.

    `grad` (sum of the members' padded_numel,) is the storage; each member's flat gradient is a
    view into it at `offsets[fp.index]` (`grad_of`). `index` and `label` are what `Engine.grad_reduction` and the
    collective recorder need of a bucket ("buckets 2, 3 (blocks.1.*)"; frozen buckets, which
    have no gradient, may sit between two members' indices).
    """

    def __init__(self, index: int, members: list[FlatParamLayout]):
        self.index, self.members = index, members
        self.offsets: dict[int, int] = {}  # bucket index -> where its gradient starts in `grad`
        total = 0
        for fp in members:
            self.offsets[fp.index] = total
            total += fp.padded_numel
        self.grad = members[0].new_flat(numel=total)  # zeros, the param dtype
        self.label = members[0].label if len(members) == 1 else (  # "buckets 4, 5 (blocks.1.*)"
            f"buckets {', '.join(str(fp.index) for fp in members)} "
            f"({summarize_names([n[0] for fp in members for n in fp.names])})")

    def grad_of(self, fp: FlatParamLayout, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """`fp`'s (padded_numel,) part of `buffer` (default: the group's gradient buffer)."""
        offset = self.offsets[fp.index]
        return (self.grad if buffer is None else buffer)[offset:offset + fp.padded_numel]


class DDPEngine(Checkpointing, Engine):
    stage = 0

    # 1. construct ------------------------------------------------------------------
    def __init__(self, module: nn.Module, optimizer_cls, optimizer_kwargs: dict, *, comm, policy, scaler,
                 config: ShardConfig):
        super().__init__(module, comm, policy, scaler, config)
        infos = self.guard.params  # checked to agree across ranks, rank 0's values broadcast: core/model_guard.py
        self.flat_params: list[FlatParamLayout] = build_flat_params(infos, self.world_size, self.rank,
                                                                    config.bucket_numel)
        self.flat_data: list[torch.Tensor] = []  # (padded_numel,) param dtype, one per bucket
        fp32_values = []  # (padded_numel,) fp32 each, construction only: what the masters start from
        for fp in self.flat_params:
            data, fp32 = fp.flatten_params(policy.param_dtype)  # bf16/fp16 params (frozen too) when mixed
            self.flat_data.append(data)
            fp32_values.append(fp32)
        self.trainable = [fp for fp in self.flat_params if fp.requires_grad]
        # Consecutive trainable buckets share one gradient buffer and one all-reduce: [Note: all-reduce groups].
        self.groups = [AllReduceGroup(k, [self.trainable[i] for i in members]) for k, members in enumerate(
            plan_all_reduce_groups([fp.padded_numel for fp in self.trainable],
                                   [fp.dtype for fp in self.trainable], config.bucket_numel))]
        self.group_of: dict[int, AllReduceGroup] = {fp.index: g for g in self.groups for fp in g.members}
        self.flat_grads: list[torch.Tensor | None] = []  # (padded_numel,) full gradients, views into their group's
        for fp in self.flat_params:
            grad = self.group_of[fp.index].grad_of(fp) if fp.requires_grad else None
            fp.use_as_grad_storage(grad)
            self.flat_grads.append(grad)
        self.optimizer = ShardedOptimizer(
            optimizer_cls, optimizer_kwargs,
            param_shards=[self.flat_data[fp.index] for fp in self.trainable],  # the whole buffer: replicated
            options=[fp.options for fp in self.trainable], policy=policy, comm=comm, scaler=scaler,
            master_init=[fp32_values[fp.index] for fp in self.trainable])
        del fp32_values
        self.reductions: dict[int, GradReduction] = {}  # group -> its all-reduce, from its hook until step
        self.in_flight = InFlight()
        self.tracker = GradReadyTracker(self.flat_params, self._on_bucket_ready, self._on_backward_end,
                                        on_first_grad=self._adopt_user_grads)

    # 2. gradient hook ---------------------------------------------------------------
    def _adopt_user_grads(self, fp: FlatParamLayout) -> None:
        """Autograd is about to add this bucket's first gradient: honour what user code did to `.grad`.

        `model.zero_grad()` or an optimizer's `zero_grad()` set `.grad` to None, which would
        make autograd accumulate into a fresh tensor the all-reduce never sees (core/user_grads.py
        [Note: param.grad belongs to the user]). Cleared params are zeroed in the bucket, an
        assigned tensor is copied in (DDP accumulates into it), and `.grad` is a bucket view again.
        """
        cleared, replaced = fp.user_grad_changes()
        grad = self.flat_grads[fp.index]  # (padded_numel,)
        if len(cleared) == len(fp.params):
            grad.zero_()  # one kernel for the usual case: the whole model was cleared
        else:
            for view in fp.grad_views_of(grad, cleared):
                view.zero_()
            for j, view in zip(replaced, fp.grad_views_of(grad, replaced)):
                view.copy_(fp.params[j].grad.reshape(-1))
        fp.use_as_grad_storage(grad)

    def _on_bucket_ready(self, fp: FlatParamLayout) -> None:
        """A bucket's gradients are all accumulated; once its group's are, average them over ranks, asynchronously."""
        group = self.group_of[fp.index]
        if fp is not group.members[-1]:
            return  # buckets are released in order (core/hooks.py): the group's last one comes last
        grad, partials = group.grad, self.partials_of(group)
        if not self.sync_gradients:  # no_sync: gradients keep accumulating in the buffer, or under
            if partials is not None:  # reduction="tree" in pairwise partial sums (core/tree.py)
                partials.add(grad, reuse=True)
                grad.zero_()
            return
        # Divided by N, then summed over ranks: the average, in the buffer or its reduce-dtype copy
        # (or, under reduction="tree", in the partial sum of the step's micro-batches).
        reduction = self.reductions[group.index] = self.grad_reduction(group, grad)
        reduction.all_reduce()
        if reduction.copied or self.scaler is not None:
            # `.grad` shows the average (not the bucket's local sum), and under fp16 unscaled
            # norms: a replicated ShardedGrad (core/user_grads.py), so that
            # torch.nn.utils.clip_grad_norm_ equals engine.clip_grad_norm_.
            for member in group.members:
                member.show_grads(member.sharded_grads(group.grad_of(member, reduction.result), None,
                                                       lambda: self.loss_scale))
        self.in_flight.push(reduction)

    # 3. finish backward ---------------------------------------------------------------
    def _on_backward_end(self) -> None:
        self.in_flight.wait_all()

    def finish_backward(self) -> None:
        self.tracker.finish_if_pending()
        self.in_flight.wait_all()

    # 4. step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Update every parameter on every rank (replicated optimizer). False if fp16 skipped it."""
        self.finish_backward()
        self.check_user_grads_before_step()
        stepped = self.optimizer.step([self.averaged_grad(fp) for fp in self.trainable], self.take_clip_coef())
        self.drop_reductions()
        return stepped

    def averaged_grad(self, fp: FlatParamLayout) -> torch.Tensor:
        """What the step reads for a bucket: its gradient buffer, or its part of the reduce-dtype copy its group's
        all-reduce averaged (that copy is a new tensor; the buffer itself is returned as the same object)."""
        group = self.group_of[fp.index]
        reduction = self.reductions.get(group.index)
        if reduction is None or reduction.result is group.grad:
            return self.flat_grads[fp.index]
        return group.grad_of(fp, reduction.result)

    def adopt_assigned_grads(self, fp: FlatParamLayout, replaced: list[int]) -> None:
        """A tensor assigned to `.grad` after backward is what a torch optimizer would read: so do we."""
        grad = self.averaged_grad(fp)
        for j, view in zip(replaced, fp.grad_views_of(grad, replaced)):
            view.copy_(fp.params[j].grad.reshape(-1))
        if grad is self.flat_grads[fp.index]:
            fp.use_as_grad_storage(grad)
        else:
            fp.show_grads(fp.sharded_grads(grad, None, lambda: self.loss_scale))

    def drop_reductions(self) -> None:
        """Forget the step's reductions (and their reduce-dtype copies); `.grad` shows the buckets again."""
        for index, reduction in self.reductions.items():
            if reduction.copied:
                for fp in self.groups[index].members:
                    fp.use_as_grad_storage(self.flat_grads[fp.index])
        self.reductions.clear()

    # 5. zero_grad ------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.discard_unfinished_pass()  # a forward or backward that raised: core/engine.py
        self.clip_coef = None
        self.clear_partials()
        self.drop_reductions()
        for fp, grad in zip(self.flat_params, self.flat_grads):
            if grad is not None:
                grad.zero_()
                fp.use_as_grad_storage(grad)  # user code may have replaced `.grad`: show the bucket again

    # 6. state_dict ----------------------------------------------------------------------
    def state_dict(self, full: bool = True) -> dict[str, torch.Tensor]:
        """The unwrapped model's state_dict (same keys), fp32 master values where they exist."""
        sd = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        if self.policy.needs_master:
            for fp, master in zip(self.trainable, self.optimizer.master_shards):
                fp.write_into_state_dict(sd, master)
        return sd

    def norm_shards(self) -> list[torch.Tensor]:
        # Every rank holds the whole gradient; each sums only its own range so that the
        # norm is computed exactly as the sharded stages compute it.
        return [fp.shard_of(self.averaged_grad(fp)) for fp in self.trainable]

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {
            "params": self.flat_data,
            "grads": [g for g in self.flat_grads if g is not None],
            "master_params": self.optimizer.master_tensors(),
            "optimizer_states": self.optimizer.state_tensors(),
        }

    def comm_buffer_tensors(self) -> list[torch.Tensor]:
        """Buffers alive only to communicate: the reduce-dtype gradients, from a bucket's hook to step.

        (core/comm.py's ordered reduction allocates its receive buffers inside each call and
        drops them when the call completes; they are not listed.)
        """
        return [t for reduction in self.reductions.values() for t in reduction.transient]

    # 7. checkpoint hook ------------------------------------------------------------------
    def load_flat_params(self, flats: list[torch.Tensor]) -> None:
        """Checkpoint loading: every rank writes each full (padded_numel,) buffer into its whole bucket."""
        self.finish_backward()
        for fp, full in zip(self.flat_params, flats):
            self.flat_data[fp.index].copy_(full)  # cast to the param dtype; padding is zero in `full`
