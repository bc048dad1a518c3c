"""Stage 0: data parallelism (DDP), written by hand. Nothing is sharded.

Every rank holds the whole model, the whole gradient and the whole optimizer state, and
sees its own slice of the data. After backward the gradients are averaged over ranks
with an all-reduce, so every rank applies the same update and the replicas stay equal.

What happens, per step:
  * construction: rank 0's parameters (frozen ones too) and buffers are broadcast; the
    parameters become views into flat buckets, their `.grad`s views into flat gradient
    buckets (so gradients land in communication-ready storage), and consecutive gradient
    buckets lie back to back in one buffer per all-reduce group (core/grads/grad_reduce.py
    [Note: all-reduce groups]: DDP's bucket-closing rule, one call per group);
  * backward: as soon as every gradient of a group's buckets has been accumulated, the group
    is scaled by 1/N and all-reduced asynchronously, overlapping the rest of backward;
  * end of backward: wait for every group;
  * step: every rank runs the optimizer over the whole flat buffers.

Collectives per step: one all-reduce of the gradients, one call per group. Logical bytes per
rank: 2 * Ψ * g (g = gradient bytes per element; ZeRO accounting, see core/collectives/comm.py).

Reduce dtype (core/grads/grad_reduce.py [Note: reduce dtype]): with bf16 params and fp32
reductions, a group's all-reduce runs on an fp32 copy, and the average lives in that copy
until `step` (2Ψ + 4Ψ gradient bytes at that moment, the copy reported as comm_buffers);
`param.grad` then shows the average, while the bucket keeps this rank's local sum.

`param.grad` is the user's, as under torch DDP: after backward it is the averaged gradient,
and in-place changes reach the step; `model.zero_grad()`, an optimizer's `zero_grad()` or
`p.grad = None` before the next backward are taken over (core/grads/user_grads.py).

Per-rank memory (Ψ parameters, up to padding < N elements per bucket):
  fp32 + Adam:        params 4Ψ + grads 4Ψ + optimizer_states 8Ψ                = 16Ψ
  bf16/fp16 + Adam:   params 2Ψ + grads 2Ψ + master_params 4Ψ + optimizer_states 8Ψ = 16Ψ
"""
from __future__ import annotations

import torch
from torch import nn

from zerokit.checkpoint import Checkpointing
from zerokit.core.config import ShardConfig
from zerokit.core.engine import Engine
from zerokit.core.params.flat_param import FlatParamLayout, FlatParamState, build_flat_params
from zerokit.core.grads.grad_reduce import AllReduceGroup, AllReducedGrads
from zerokit.core.grads.hooks import GradReadyTracker
from zerokit.optim.sharded import ShardedOptimizer


class DDPEngine(Checkpointing, Engine):
    stage = 0

    # 1. construct ------------------------------------------------------------------
    def __init__(self, module: nn.Module, optimizer_cls, optimizer_kwargs: dict, *, comm, policy, scaler,
                 config: ShardConfig):
        super().__init__(module, comm, policy, scaler, config)
        infos = self.guard.params  # checked to agree across ranks, rank 0's values broadcast: core/params/model_guard.py
        self.flat_params: list[FlatParamLayout] = build_flat_params(infos, self.world_size, self.rank,
                                                                    config.bucket_numel)
        self.flat_data: list[torch.Tensor] = []  # (padded_numel,) param dtype, one per bucket
        self.states = [FlatParamState(fp) for fp in self.flat_params]  # each bucket's gradients, by index
        fp32_values = []  # (padded_numel,) fp32 each, construction only: what the masters start from
        for fp in self.flat_params:
            data, fp32 = fp.flatten_params(policy.param_dtype)  # bf16/fp16 params (frozen too) when mixed
            self.flat_data.append(data)
            fp32_values.append(fp32)
        self.trainable = [fp for fp in self.flat_params if fp.requires_grad]
        # (padded_numel,) full gradients, for good; consecutive trainable buckets share one gradient buffer and one
        # all-reduce: core/grads/grad_reduce.py [Note: all-reduce groups]
        self.full_grads = AllReducedGrads(self.flat_params, self.states, config.bucket_numel, self.reductions,
                                          lambda: self.loss_scale)
        self.groups = self.full_grads.groups
        self.optimizer = ShardedOptimizer(
            optimizer_cls, optimizer_kwargs,
            param_shards=[self.flat_data[fp.index] for fp in self.trainable],  # the whole buffer: replicated
            options=[fp.options for fp in self.trainable], policy=policy, comm=comm, scaler=scaler,
            master_init=[fp32_values[fp.index] for fp in self.trainable], layouts=self.trainable)
        del fp32_values
        self.tracker = GradReadyTracker(self.flat_params, self._on_grads_ready, self._on_backward_end,
                                        on_first_grad=self._on_first_grad)

    # 2. gradient hook ---------------------------------------------------------------
    def _on_grads_ready(self, fp: FlatParamLayout) -> None:
        """A bucket's gradients are all accumulated; once its group's are, the group is reduced (core/engine.py)."""
        group = self.full_grads.group_of[fp.index]
        if fp is group.members[-1]:  # buckets are released in order (core/grads/hooks.py): the group's last one comes last
            self.reduce_or_hold(group)

    def reduce_grads(self, group: AllReduceGroup) -> None:
        """Average the group's gradients over ranks, asynchronously: divided by N, then summed, in the buffer or
        its reduce-dtype copy (or, under reduction="tree", in the partial sum of the step's micro-batches)."""
        reduction = self.reductions[group.index] = self.grad_reduction(group, group.flat_grad)
        reduction.all_reduce()
        if reduction.copied or self.loss_scaler is not None:  # the average is not what the buckets hold
            self.full_grads.show_average(group)
        self.in_flight.push(reduction)

    # 3. finish backward: wait for every all-reduce (core/engine.py) ---------------------

    # 4. step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Update every parameter on every rank (replicated optimizer). False if fp16 skipped it."""
        self.finish_backward()
        self.check_user_grads_before_step()
        stepped = self.optimizer.apply([self.full_grads.averaged(fp) for fp in self.trainable],
                                       self.take_clip_coef())
        self.full_grads.forget_reductions()  # and `.grad` shows the buckets again
        return stepped

    def adopt_assigned_grads(self, fp: FlatParamLayout, replaced: list[int]) -> None:
        """A tensor assigned to `.grad` after backward is what a torch optimizer would read: so do we."""
        self.full_grads.adopt_assigned(fp, replaced)

    # 5. zero_grad ------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.begin_zero_grad()  # a pass that raised, the clip coefficient, the tree's partial sums: core/engine.py
        self.full_grads.forget_reductions()
        for fp in self.trainable:
            state = self.states[fp.index]
            state.flat_grad.zero_()
            fp.use_as_grad_storage(state.flat_grad)  # user code may have replaced `.grad`: show the bucket again

    # 6. state_dict, what it holds, checkpoint hook: the whole-parameter defaults (core/engine.py) ----------
    def norm_shards(self) -> list[torch.Tensor]:
        # Every rank holds the whole gradient; each sums only its own range so that the
        # norm is computed exactly as the sharded stages compute it.
        return [fp.shard_of(self.full_grads.averaged(fp)) for fp in self.trainable]
