"""Stage 0: data parallelism (DDP), written by hand. Nothing is sharded.

Every rank holds the whole model, the whole gradient and the whole optimizer state, and
sees its own slice of the data. After backward the gradients are averaged over ranks
with an all-reduce, so every rank applies the same update and the replicas stay equal.

What happens, per step:
  * construction: rank 0's parameters (frozen ones too) and buffers are broadcast; the
    parameters become views into flat buckets, their `.grad`s views into flat gradient
    buckets (so gradients land in communication-ready storage);
  * backward: as soon as every gradient of a bucket has been accumulated, that bucket is
    scaled by 1/N and all-reduced asynchronously, overlapping the rest of backward;
  * end of backward: wait for every bucket;
  * step: every rank runs the optimizer over the whole flat buffers.

Collectives per step: one all-reduce of the gradients. Logical bytes per rank:
2 * Ψ * g (g = gradient bytes per element; ZeRO accounting, see core/comm.py).

Reduce dtype (core/grad_reduce.py [Note: reduce dtype]): when `policy.reduce_dtype` is not
the param dtype (e.g. bf16 params, fp32 reductions), the buckets stay in the param dtype
(autograd accumulates into them) and each ready bucket is cast into a new (padded_numel,)
reduce-dtype buffer, scaled by 1/N there and all-reduced in it (g = reduce-dtype bytes:
2x the bytes for fp32 reductions of bf16 gradients). The averaged gradient then lives in
that buffer, which the optimizer reads, until `step` (or `zero_grad`) drops it: Ψ·r extra
bytes from the bucket's hook to the step (fp32 reductions of bf16: 2Ψ + 4Ψ = 6Ψ gradient
bytes at that moment), reported as comm_buffers; `param.grad` then shows that average (a
core/user_grads.py ShardedGrad over it) while the bucket keeps this rank's local sum.

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

from zerokit.core.bucketing import InFlight
from zerokit.core.engine import Engine
from zerokit.core.flat_param import FlatParam, broadcast_module_state, build_flat_params, check_module
from zerokit.core.grad_reduce import grad_reduce_input
from zerokit.core.hooks import GradReadyTracker
from zerokit.optim.sharded import ShardedOptimizer


class DDPEngine(Engine):
    stage = 0

    # 1. construct ------------------------------------------------------------------
    def __init__(self, module: nn.Module, optimizer_cls, optimizer_kwargs: dict, *, comm, policy, scaler,
                 bucket_numel: int, param_groups=None, cast_inputs: bool = True, **_unused):
        super().__init__(module, comm, policy, scaler, cast_inputs=cast_inputs)
        infos = check_module(module, comm, self.stage, param_groups)
        broadcast_module_state(module, comm)
        self.flat_params: list[FlatParam] = build_flat_params(infos, self.world_size, self.rank, bucket_numel)
        self.flat_data: list[torch.Tensor] = []  # (padded_numel,) param dtype, one per bucket
        self.flat_grads: list[torch.Tensor | None] = []  # (padded_numel,) full gradients, trainable buckets
        fp32_values = []  # (padded_numel,) fp32 each, construction only: what the masters start from
        for fp in self.flat_params:
            data, fp32 = fp.flatten_params(policy.param_dtype)  # bf16/fp16 params (frozen too) when mixed
            self.flat_data.append(data)
            fp32_values.append(fp32)
            grad = fp.new_flat() if fp.requires_grad else None
            fp.use_as_grad_storage(grad)
            self.flat_grads.append(grad)
        trainable = [fp for fp in self.flat_params if fp.requires_grad]
        self.optimizer = ShardedOptimizer(
            optimizer_cls, optimizer_kwargs,
            param_shards=[self.flat_data[fp.index] for fp in trainable],  # the whole buffer: replicated
            grad_shards=[self.flat_grads[fp.index] for fp in trainable],
            options=[fp.options for fp in trainable], policy=policy, comm=comm, scaler=scaler,
            master_init=[fp32_values[fp.index] for fp in trainable])
        del fp32_values
        # (padded_numel,) reduce dtype: a bucket's averaged gradient from its hook until step,
        # only when the reduce dtype is not the param dtype (module docstring).
        self.reduced_grads: list[torch.Tensor | None] = [None] * len(self.flat_params)
        self._optimizer_slot = {fp.index: k for k, fp in enumerate(trainable)}  # bucket -> optimizer grad_shards[k]
        self.in_flight = InFlight()
        self.tracker = GradReadyTracker(self.flat_params, self._on_bucket_ready, self._on_backward_end,
                                        on_first_grad=self._adopt_user_grads)

    # 2. gradient hook ---------------------------------------------------------------
    def _adopt_user_grads(self, fp: FlatParam) -> None:
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

    def _on_bucket_ready(self, fp: FlatParam) -> None:
        """A bucket's gradients are all accumulated: average them over ranks, asynchronously."""
        if not self.sync_gradients:
            return  # no_sync: gradients keep accumulating in the bucket
        grad = self.flat_grads[fp.index]
        send = grad_reduce_input(grad, self.world_size, self.policy.reduce_dtype)  # pre-divided by N
        if send is not grad:  # a reduce-dtype copy: the optimizer reads the average from it
            self.reduced_grads[fp.index] = send
            self.optimizer.grad_shards[self._optimizer_slot[fp.index]] = send
        if send is not grad or self.scaler is not None:
            # `.grad` shows the average (not the bucket's local sum), and under fp16 unscaled
            # norms: a replicated ShardedGrad (core/user_grads.py), so that
            # torch.nn.utils.clip_grad_norm_ equals engine.clip_grad_norm_.
            fp.show_grads(fp.sharded_grads(send, None, lambda: self.loss_scale))
        self.in_flight.push(self.comm.all_reduce(send, async_op=True, phase="backward"))

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
        stepped = self.optimizer.step()
        self.release_reduced_grads()
        return stepped

    def adopt_assigned_grads(self, fp: FlatParam, replaced: list[int]) -> None:
        """A tensor assigned to `.grad` after backward is what a torch optimizer would read: so do we."""
        grad = self.optimizer.grad_shards[self._optimizer_slot[fp.index]]  # the bucket or its reduce-dtype copy
        for j, view in zip(replaced, fp.grad_views_of(grad, replaced)):
            view.copy_(fp.params[j].grad.reshape(-1))
        if grad is self.flat_grads[fp.index]:
            fp.use_as_grad_storage(grad)
        else:
            fp.show_grads(fp.sharded_grads(grad, None, lambda: self.loss_scale))

    def release_reduced_grads(self) -> None:
        """Drop the reduce-dtype buffers; the optimizer reads the param-dtype buckets again."""
        for fp in self.flat_params:
            if self.reduced_grads[fp.index] is not None:
                self.reduced_grads[fp.index] = None
                self.optimizer.grad_shards[self._optimizer_slot[fp.index]] = self.flat_grads[fp.index]
                fp.use_as_grad_storage(self.flat_grads[fp.index])

    # 5. zero_grad ------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.release_reduced_grads()
        for fp, grad in zip(self.flat_params, self.flat_grads):
            if grad is not None:
                grad.zero_()
                fp.use_as_grad_storage(grad)  # user code may have replaced `.grad`: show the bucket again

    # 6. state_dict ----------------------------------------------------------------------
    def state_dict(self, full: bool = True) -> dict[str, torch.Tensor]:
        """The unwrapped model's state_dict (same keys), fp32 master values where they exist."""
        sd = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        if self.policy.needs_master:
            trainable = [fp for fp in self.flat_params if fp.requires_grad]
            for fp, master in zip(trainable, self.optimizer.master_shards):
                fp.write_into_state_dict(sd, master)
        return sd

    def norm_shards(self) -> list[torch.Tensor]:
        # Every rank holds the whole gradient; each sums only its own range so that the
        # norm is computed exactly as the sharded stages compute it.
        # What the optimizer reads: the bucket, or its reduce-dtype copy (module docstring).
        slot = self._optimizer_slot
        return [fp.shard_of(self.optimizer.grad_shards[slot[fp.index]]) for fp in self.flat_params if fp.requires_grad]

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
        return [t for t in self.reduced_grads if t is not None]

    # 7. checkpoint hook ------------------------------------------------------------------
    def load_flat_params(self, flats: list[torch.Tensor]) -> None:
        """Checkpoint loading: every rank writes each full (padded_numel,) buffer into its whole bucket."""
        self.finish_backward()
        for fp, full in zip(self.flat_params, flats):
            self.flat_data[fp.index].copy_(full)  # cast to the param dtype; padding is zero in `full`
