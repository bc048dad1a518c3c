"""Stage 2 (ZeRO-2): shard the gradients too. Parameters stay whole.

Stage 1 keeps every full gradient until backward ends, although after its reduce-scatter a rank needs
only its own range. Stage 2 reduce-scatters each bucket from the gradient hook the moment that bucket
is complete, during backward, and releases the bucket's full-size gradient storage as soon as that
reduce-scatter has completed: only the grad shards persist (from the first reduce-scatter to
zero_grad: core/grads/grad_reduce.py [Note: grad shards]). A bucket's storage is allocated again lazily,
just before autograd accumulates its first gradient of the next backward (a gradient pre-hook:
core/grads/hooks.py).

Per step (differences from stage 1 marked *):
  * construction: as stage 1 (broadcast, flat buckets, an optimizer over this rank's param_shard
    views), *but no full gradient buckets;
  * *backward: just before a bucket's first gradient arrives, a zeroed (padded_numel,) buffer is
    allocated and the params' `.grad`s become views into it; complete, it is scaled by 1/N and
    reduce-scattered asynchronously into this rank's grad shard, then dropped; at most
    `max_in_flight` (default 2) reduce-scatters are left running (the hook waits for the oldest);
  * end of backward: wait for every bucket;
  * step: every rank updates its own shard, then all-gathers the shards back, in place.

Full-size gradient memory stays within (max_in_flight + 2) buckets, independent of Ψ. Collectives per
step: a reduce-scatter of the gradients (Ψ·g) and an all-gather of the params (Ψ·p): stage 0's 2B.
`accumulate=` chooses how `no_sync()` accumulates: "reduce_scatter" (default, low memory, stage 0's
sum up to rounding) or "local" (full buckets kept, bitwise stage 0). Per-rank memory after backward:
  fp32 + Adam:       params 4Ψ + grads 4Ψ/N + optimizer_states 8Ψ/N
  bf16/fp16 + Adam:  params 2Ψ + grads 2Ψ/N + master_params 4Ψ/N + optimizer_states 8Ψ/N = 2Ψ + 14Ψ/N
Why the bound holds, the reduce dtype and accumulation in detail: docs/stages.md, "Stage 2 in detail".
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


class Zero2Engine(Checkpointing, Engine):
    stage = 2
    keeps_flat_grads = False  # a bucket's full gradient is freed once reduce-scattered

    # 1. construct ------------------------------------------------------------------
    def __init__(self, module: nn.Module, optimizer_cls, optimizer_kwargs: dict, *, comm, policy, scaler,
                 config: ShardConfig):
        super().__init__(module, comm, policy, scaler, config)
        self.reduce_in_no_sync = config.accumulate == "reduce_scatter"  # how no_sync() accumulates (docstring)
        self.max_in_flight = config.max_in_flight  # reduce-scatters left running before a hook waits
        infos = self.guard.params  # checked to agree across ranks, rank 0's values broadcast: core/params/model_guard.py
        self.flat_params: list[FlatParamLayout] = build_flat_params(infos, self.world_size, self.rank,
                                                                    config.bucket_numel)
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
        for fp in self.flat_params:  # (padded_numel,) full gradients: None except while a bucket is accumulated
            # or reduce-scattered (or kept by no_sync under accumulate="local"); made by core/grads/user_grads.py
            fp.use_as_grad_storage(None)
        # grad shards: allocated by the first reduce-scatter, freed by zero_grad: core/grads/grad_reduce.py
        # [Note: grad shards]
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
        """A bucket's gradients are all accumulated: reduce-scatter now (into the grad shard, added to what an
        earlier backward left there), free the full buffer when done: core/grads/grad_reduce.py `reduce_scatter_grad`."""
        self.reduce_scatter_grad(state)
        # The CPU waits here for the oldest buckets, which bounds the full-size gradient
        # memory alive at once (module docstring) at the price of less overlap.
        self.in_flight.wait_until(self.max_in_flight)

    # 3. finish backward: wait for every reduce-scatter (core/engine.py) -----------------

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
            self.drop_grad_shard(state)  # and a bucket kept by no_sync ("local") and never sent: core/grads/grad_reduce.py

    # 6. state_dict (the fp32 masters all-gathered), what it holds, checkpoint hook: core/engine.py ----------
