"""Stage 1 (ZeRO-1): shard the optimizer states. Parameters and gradients stay whole.

Every rank still holds the whole model and, through backward, the whole gradient, but for the
update each flat buffer is cut into N shards and rank r updates only shard r: the optimizer states
(Adam's two moments; under mixed precision also the fp32 master weights) exist only for that shard,
1/N of them per rank. An all-reduce is a reduce-scatter followed by an all-gather; stage 1 puts the
optimizer step in between the two halves.

Per step (differences from stage 0 marked *):
  * construction: rank 0's parameters and buffers are broadcast; the parameters become views into
    flat buckets, their `.grad`s views into flat gradient buckets; *buckets close once they hold
    `bucket_numel` elements ([Note: stage 1's buckets], at the constructor); *the optimizer is built
    over this rank's param_shard views only, and its grad_shard is a view of its own range of the
    full gradient bucket;
  * backward: gradients accumulate in the full buckets; *a complete bucket is scaled by 1/N and
    reduce-scattered in place, overlapping the rest of backward: the rank-average of this rank's
    range overwrites that range (the grad shard);
  * step: *every rank updates its own shard, then all-gathers the shards back into the full flat
    buffers in place, so the module's parameters see the new values.

Collectives per step: a reduce-scatter of the gradients (Ψ·g bytes) and an all-gather of the params
(Ψ·p): with g = p, stage 0's all-reduce (core/collectives/comm.py). Per-rank memory (Ψ parameters, N ranks):
  fp32 + Adam:       params 4Ψ + grads 4Ψ + optimizer_states 8Ψ/N
  bf16/fp16 + Adam:  params 2Ψ + grads 2Ψ + master_params 4Ψ/N + optimizer_states 8Ψ/N = 4Ψ + 12Ψ/N
`param.grad` after a synced backward shows this rank's range of the average, a ShardedGrad
(core/grads/user_grads.py [Note: param.grad belongs to the user]); a second synced backward without clearing
is refused (accumulate inside `no_sync()`). The reduce dtype, `.grad` and no_sync in detail:
docs/stages.md, "Stage 1".
"""
from __future__ import annotations

import torch
from torch import nn

from zerokit.checkpoint import Checkpointing
from zerokit.core.config import ShardConfig
from zerokit.core.engine import Engine
from zerokit.core.params.flat_param import FlatParamLayout, FlatParamState, build_flat_params
from zerokit.core.grads.hooks import GradReadyTracker
from zerokit.optim.sharded import ShardedOptimizer


class Zero1Engine(Checkpointing, Engine):
    stage = 1
    accumulates_grad_shards = False  # the grad shard lives in the full gradient: one synced backward per step

    # 1. construct ------------------------------------------------------------------
    def __init__(self, module: nn.Module, optimizer_cls, optimizer_kwargs: dict, *, comm, policy, scaler,
                 config: ShardConfig):
        super().__init__(module, comm, policy, scaler, config)
        self.max_in_flight = config.max_in_flight  # reduce-scatters left running before a hook waits
        # [Note: stage 1's buckets]
        # Stage 1 keeps every bucket's whole gradient through backward, so a bucket's size sets only how
        # finely the reduce-scatters are cut, not how much memory they hold: fewer, larger collectives
        # cost less latency (each is a rendezvous of every rank). Stage 0 gets that by all-reducing
        # groups of buckets from one buffer (core/grads/grad_reduce.py [Note: all-reduce groups]); stage 1 cannot: a
        # reduce-scatter of two buckets laid end to end gives a rank a range of the concatenation, not
        # its shard of each. So stage 1 makes the buckets themselves larger: one closes once it holds
        # `bucket_numel` elements (core/params/bucketing.py `plan_buckets(..., close_when_full=True)`), as torch
        # DDP closes its buckets, where stage 2, which frees a bucket's gradient after its reduce-scatter,
        # keeps the cap as a bound. The bits are the stages' own either way (core/collectives/ordered.py [Note: ordered
        # reduction] sums in rank order, whatever the buckets).
        infos = self.guard.params  # checked to agree across ranks, rank 0's values broadcast: core/params/model_guard.py
        self.flat_params: list[FlatParamLayout] = build_flat_params(infos, self.world_size, self.rank,
                                                                    config.bucket_numel, close_when_full=True)
        self.flat_data: list[torch.Tensor] = []  # (padded_numel,) param dtype, one per bucket
        self.states = [FlatParamState(fp) for fp in self.flat_params]  # each bucket's gradients, by index
        fp32_values = []  # (shard_numel,) fp32 each, construction only: what this rank's masters start from
        for fp in self.flat_params:
            data, fp32 = fp.flatten_params(policy.param_dtype)  # bf16/fp16 params (frozen too) when mixed
            self.flat_data.append(data)
            # this rank's range alone, so that no full fp32 copy of the model outlives its bucket (under fp32
            # `fp32` is the flat buffer itself: a view costs nothing)
            fp32_values.append(None if not fp.requires_grad else fp.shard_of(fp32) if fp32 is data
                               else fp.shard_of(fp32).clone())
        self.trainable = [fp for fp in self.flat_params if fp.requires_grad]
        for fp, state in zip(self.flat_params, self.states):  # (padded_numel,) full gradients, for good
            state.flat_grad = fp.new_flat() if fp.requires_grad else None
            fp.use_as_grad_storage(state.flat_grad)
        for fp in self.trainable:  # (shard_numel,) this rank's averaged range: a view into the full gradient,
            state = self.states[fp.index]  # or its own reduce-dtype tensor when that is not the param dtype
            self.new_grad_shard(state, fp.shard_of(state.flat_grad) if policy.reduce_dtype == policy.param_dtype
                                else None)
        self.optimizer = ShardedOptimizer(
            optimizer_cls, optimizer_kwargs,
            param_shards=[fp.shard_of(self.flat_data[fp.index]) for fp in self.trainable],  # views: updated in place
            options=[fp.options for fp in self.trainable], policy=policy, comm=comm, scaler=scaler,
            master_init=[fp32_values[fp.index] for fp in self.trainable], layouts=self.trainable)
        del fp32_values
        self.tracker = GradReadyTracker(self.flat_params, self._on_grads_ready, self._on_backward_end,
                                        on_first_grad=self._on_first_grad)

    # 2. gradient hook ---------------------------------------------------------------
    def reduce_grads(self, state: FlatParamState) -> None:
        """A bucket's gradients are all accumulated: reduce-scatter it now, while backward goes on (buckets are
        released in bucket order: the same collective sequence on every rank). The rank-average of this
        rank's range overwrites that range (the grad shard): core/grads/grad_reduce.py `reduce_scatter_grad`."""
        copied = self.reduce_scatter_grad(state).copied
        # The CPU waits for the oldest: at most two reduce-dtype copies alive, and at most `max_in_flight` receive
        # buffers (half a bucket each at N = 2, a bucket at 3+: core/collectives/ordered.py), which would otherwise pile up
        # for as long as the process group's thread lags behind backward.
        self.in_flight.wait_until(1 if copied else self.max_in_flight)

    # 3. finish backward ---------------------------------------------------------------
    def _on_backward_end(self) -> None:
        self.in_flight.wait_all()
        if self.sync_gradients:  # `.grad` shows what exists of the average: this rank's shard
            for fp in self.trainable:
                fp.show_grads(self.states[fp.index].shown_grads)

    # 4. step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Update this rank's shard of every buffer, then all-gather (core/engine.py). False if fp16 skipped it."""
        self.finish_backward()
        self.check_user_grads_before_step()
        stepped = self.optimizer.apply(self.grad_shards(), self.take_clip_coef())
        if stepped:  # a skipped step changed no shard: the full buffers are still current
            self.all_gather_params()
        return stepped

    # 5. zero_grad ------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.begin_zero_grad()  # a pass that raised, the clip coefficient, the tree's partial sums: core/engine.py
        for fp in self.trainable:
            state = self.states[fp.index]
            state.flat_grad.zero_()  # the grad shard, if a view, is zeroed with it
            if state.grad_shard.dtype != state.flat_grad.dtype:  # its own tensor
                state.grad_shard.zero_()
            state.grad_shard_written = False

    # 6. state_dict (the fp32 masters all-gathered), what it holds, checkpoint hook: core/engine.py ----------
