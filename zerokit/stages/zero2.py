"""Stage 2 (ZeRO-2): shard the gradients too. Parameters stay whole.

Stage 1 keeps every full gradient until backward ends, although after its reduce-scatter
a rank needs only its own range. Stage 2 reduce-scatters each bucket from the gradient
hook the moment that bucket is complete, during backward, and releases the bucket's
full-size gradient storage as soon as that reduce-scatter has completed: only the
grad shards persist. A bucket's storage is allocated again lazily, just before autograd
accumulates its first gradient of the next backward (a gradient pre-hook, see
core/hooks.py).

What happens, per step (differences from stage 1 marked *):
  * construction: as stage 1 (broadcast, flat buckets, persistent grad shards, an
    optimizer over this rank's param_shard views), *but no full gradient buckets;
  * *backward: just before a bucket's first gradient arrives, a zeroed (padded_numel,)
    buffer is allocated and the params' `.grad`s become views into it; when the bucket is
    complete it is scaled by 1/N and reduce-scattered asynchronously into this rank's
    grad shard; when that completes the full buffer is dropped (`param.grad` then shows this
    rank's part of the average, a ShardedGrad: core/user_grads.py [Note: param.grad belongs to
    the user]; `model.zero_grad()` before the next backward clears the grad shard);
    at most `max_in_flight` (default 2) reduce-scatters are left running: the hook waits
    for the oldest ones (a CPU wait) before backward goes on;
  * end of backward: wait for every bucket;
  * step: every rank updates its own shard, then all-gathers the shards back into the full
    flat parameter buffers, in place.

Full-size gradient memory alive at once. Whenever a bucket's storage is allocated, at
most `max_in_flight` reduce-scatters are still running (the hook waited for the older
ones), so the buckets alive are those plus the ones autograd is filling. Gradients that
arrive in reverse registration order, as they do for a sequential model (buckets are
cut in that order, see core/bucketing.py), fill one bucket at a time, except that a
module whose params straddle a bucket boundary may start the next bucket before the
current one completes. The bound is therefore
    (max_in_flight + 2) buckets' worth = (max_in_flight + 2) * bucket_numel * g bytes
((max_in_flight + 1) when bucket boundaries fall between modules; a parameter larger
than `bucket_numel` is a bucket of its own), independent of Ψ, plus whatever the
autograd engine holds (the freshly computed gradient of the parameter being
accumulated). A model that uses its parameters far out of registration order keeps more
buckets waiting, since buckets are released strictly in bucket order (core/hooks.py).

Collectives per step: one reduce-scatter of the gradients (B = Ψ·g bytes) and one
all-gather of the params (B = Ψ·p bytes): 2B, the same as stage 0's all-reduce.

Reduce dtype (core/grad_reduce.py [Note: reduce dtype]): when it is not the param dtype
(e.g. bf16 params, fp32 reductions), the grad shards are (shard_numel,) reduce-dtype tensors
(grads = Ψ·r/N: 4Ψ/N for fp32) and a ready bucket is cast into a (padded_numel,)
reduce-dtype copy, scaled by 1/N there and reduce-scattered from it; the param-dtype bucket
is released right after the cast, the copy when its reduce-scatter completes. So the
`max_in_flight` buckets in the bound above are reduce-dtype copies (r bytes per element)
and the reduce-scatter counts Ψ·r bytes (2x for fp32 reductions of bf16 gradients).

Gradient accumulation (`no_sync()`), chosen by `accumulate=`:
  * "reduce_scatter" (default, low memory): every micro-step reduce-scatters anyway and
    adds its shard into the accumulating grad shard, so full-size gradient memory stays
    at the bound above; M micro-steps cost M reduce-scatters (M·B) + one all-gather (B).
    The sum is the same mathematically but not bitwise equal to stage 0's, which sums the
    micro-steps locally first: each element is rounded in a different order (a few ulps).
  * "local": inside no_sync the full buckets are kept and accumulate locally (no
    communication, Ψ·g full-size bytes alive across micro-steps, as at stages 0 and 1);
    the last micro-step reduce-scatters the sum and frees them: B + B per step, bitwise
    equal to stage 0.

Per-rank memory after backward (Ψ parameters, N ranks, up to padding < N per bucket):
  fp32 + Adam:       params 4Ψ + grads 4Ψ/N + optimizer_states 8Ψ/N
  bf16/fp16 + Adam:  params 2Ψ + grads 2Ψ/N + master_params 4Ψ/N + optimizer_states 8Ψ/N = 2Ψ + 14Ψ/N
"""
from __future__ import annotations

import torch
from torch import nn

from zerokit.checkpoint import Checkpointing
from zerokit.core.bucketing import InFlight
from zerokit.core.config import ShardConfig
from zerokit.core.engine import Engine
from zerokit.core.flat_param import FlatParamLayout, build_flat_params
from zerokit.core.grad_reduce import GradReduction
from zerokit.core.hooks import GradReadyTracker
from zerokit.optim.sharded import ShardedOptimizer


class Zero2Engine(Checkpointing, Engine):
    stage = 2

    # 1. construct ------------------------------------------------------------------
    def __init__(self, module: nn.Module, optimizer_cls, optimizer_kwargs: dict, *, comm, policy, scaler,
                 config: ShardConfig):
        super().__init__(module, comm, policy, scaler, config)
        self.accumulate = config.accumulate  # how no_sync() micro-steps accumulate (module docstring)
        self.max_in_flight = config.max_in_flight  # reduce-scatters left running before a hook waits
        infos = self.guard.params  # checked to agree across ranks, rank 0's values broadcast: core/model_guard.py
        self.flat_params: list[FlatParamLayout] = build_flat_params(infos, self.world_size, self.rank,
                                                                    config.bucket_numel)
        self.flat_data: list[torch.Tensor] = []  # (padded_numel,) param dtype, one per bucket
        # (padded_numel,) full gradients: None except while a bucket is being accumulated or
        # reduce-scattered (or kept across no_sync micro-steps under accumulate="local").
        self.flat_grads: list[torch.Tensor | None] = []
        self.grad_shards: list[torch.Tensor | None] = []  # (shard_numel,) reduce dtype: this rank's averaged range
        # False until a reduce-scatter has written the grad shard since zero_grad: the first
        # one lands directly in it, later ones (micro-steps, repeated backwards) are added.
        self.grad_shard_written: list[bool] = []
        fp32_values = []  # (padded_numel,) fp32 each, construction only: what the masters start from
        for fp in self.flat_params:
            data, fp32 = fp.flatten_params(policy.param_dtype)  # bf16/fp16 params (frozen too) when mixed
            self.flat_data.append(data)
            fp32_values.append(fp32)
            fp.use_as_grad_storage(None)  # allocated lazily, just before autograd needs it
            self.flat_grads.append(None)
            self.grad_shards.append(fp.new_flat(policy.reduce_dtype, numel=fp.shard_numel)
                                    if fp.requires_grad else None)
            self.grad_shard_written.append(False)
        self.trainable = [fp for fp in self.flat_params if fp.requires_grad]
        # What `.grad` shows between backwards: this rank's part of the grad shard, per param.
        self.shown_grads = {fp.index: fp.sharded_grads(self.grad_shards[fp.index], comm, lambda: self.loss_scale)
                            for fp in self.trainable}
        for fp in self.trainable:
            fp.show_grads(self.shown_grads[fp.index])
        self.optimizer = ShardedOptimizer(
            optimizer_cls, optimizer_kwargs,
            param_shards=[fp.shard_of(self.flat_data[fp.index]) for fp in self.trainable],  # views: updated in place
            options=[fp.options for fp in self.trainable], policy=policy, comm=comm, scaler=scaler,
            master_init=[fp.shard_of(fp32_values[fp.index]) for fp in self.trainable])
        del fp32_values
        self.in_flight = InFlight()
        self.reductions: dict[int, GradReduction] = {}  # bucket -> its reduce-scatter, until it completes
        self.tracker = GradReadyTracker(self.flat_params, self._on_bucket_ready, self._on_backward_end,
                                        on_first_grad=self._on_first_grad)

    # 2. gradient hook ---------------------------------------------------------------
    def _on_first_grad(self, fp: FlatParamLayout) -> None:
        """Autograd is about to accumulate this bucket's first gradient: give the bucket full-size storage."""
        cleared, replaced = fp.user_grad_changes()
        if self.flat_grads[fp.index] is None:  # else kept from a no_sync micro-step ("local")
            grad = fp.new_flat()  # (padded_numel,) zeros; autograd accumulates into the params' views
        else:
            grad = self.flat_grads[fp.index]
            for view in fp.grad_views_of(grad, cleared + replaced):
                view.zero_()
        self._adopt_user_grads(fp, cleared, replaced, grad)
        fp.use_as_grad_storage(grad)
        self.flat_grads[fp.index] = grad

    def _adopt_user_grads(self, fp: FlatParamLayout, cleared: list[int], replaced: list[int], grad: torch.Tensor) -> None:
        """Honour what user code did to `.grad` since the last backward (core/user_grads.py [Note: param.grad
        belongs to the user]): a cleared param's part of the grad shard starts again from zero, as after
        zero_grad(); an assigned tensor is copied into the full bucket, the gradient to accumulate onto (DDP)."""
        if fp.zero_shard_parts(self.grad_shards[fp.index], cleared + replaced):
            self.grad_shard_written[fp.index] = False  # the next reduce-scatter lands directly, as after zero_grad
        for j, view in zip(replaced, fp.grad_views_of(grad, replaced)):
            view.copy_(fp.params[j].grad.reshape(-1))

    def _on_bucket_ready(self, fp: FlatParamLayout) -> None:
        """A bucket's gradients are all accumulated: reduce-scatter now, free the full buffer when done."""
        if not self.sync_gradients and self.accumulate == "local":
            partials = self.partials_of(fp)
            if partials is not None:  # reduction="tree": into the pairwise partial sums (core/tree.py)
                partials.add(self.flat_grads[fp.index], reuse=False)
                self.release_flat_grad(fp)
            return  # keep accumulating the full gradient; the last micro-step reduce-scatters it
        self.reduce_scatter_grad(fp)
        # The CPU waits here for the oldest buckets, which bounds the full-size gradient
        # memory alive at once (module docstring) at the price of less overlap.
        self.in_flight.wait_until(self.max_in_flight)

    # 3. finish backward ---------------------------------------------------------------
    def _on_backward_end(self) -> None:
        self.in_flight.wait_all()

    def finish_backward(self) -> None:
        self.tracker.finish_if_pending()
        self.in_flight.wait_all()

    def reduce_scatter_grad(self, fp: FlatParamLayout) -> None:
        """Launch: this rank's range of the bucket's rank-averaged gradient goes into its grad shard.

        Divided by N (and cast) exactly as stage 0 does, so the sums agree bit for bit; added to
        the grad shard when an earlier backward since zero_grad wrote it (as torch's .grad accumulates).
        """
        self.in_flight.finish_arrived()  # completed ones free their buffers first (core/comm.py
        # [Note: finishing what has arrived])
        reduction = self.reductions[fp.index] = self.grad_reduction(fp, self.flat_grads[fp.index])
        reduction.reduce_scatter(self.grad_shards[fp.index], accumulate=self.grad_shard_written[fp.index])
        self.grad_shard_written[fp.index] = True
        if reduction.copied:  # the collective reads the reduce-dtype copy: the param-dtype bucket can go now
            self.release_flat_grad(fp)

        def on_done() -> None:  # the owners have this bucket's content now
            self.reductions.pop(fp.index)
            self.release_flat_grad(fp)

        self.in_flight.push(reduction, on_done)

    def release_flat_grad(self, fp: FlatParamLayout) -> None:
        """Drop the bucket's full-size gradient; `.grad` shows this rank's part of the average again."""
        fp.show_grads(self.shown_grads[fp.index])
        self.flat_grads[fp.index] = None

    # 4. step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Update this rank's shard of every buffer, then all-gather. False if fp16 skipped it."""
        self.finish_backward()
        self.check_user_grads_before_step()
        stepped = self.optimizer.step([self.grad_shards[fp.index] for fp in self.trainable], self.take_clip_coef())
        if stepped:  # a skipped step changed no shard: the full buffers are still current
            self.all_gather_params()
        return stepped

    def all_gather_params(self) -> None:
        """Bring every rank's updated param shard back into the full flat buffers, in place."""
        if self.world_size == 1:
            return  # the shard is the whole buffer and was updated in place
        # Each input is this rank's own range of its output: an in-place gather, no copy of the shard
        # (core/comm.py [Note: in-place gathers]). Issued together: one round of latency, not one per
        # bucket (on gloo packed into one staging buffer per group of at most GLOO_COALESCE_NUMEL elements,
        # whose rows are filled from every rank: [Note: gloo's all-gather temporary]).
        self.comm.all_gather_many([self.flat_data[fp.index] for fp in self.trainable],
                                  [fp.shard_of(self.flat_data[fp.index]) for fp in self.trainable], phase="step",
                                  labels=[f"updated params of {fp.label}" for fp in self.trainable]).wait()

    # 5. zero_grad ------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.discard_unfinished_pass()  # a forward or backward that raised: core/engine.py
        self.clip_coef = None
        self.clear_partials()
        for fp in self.trainable:
            self.release_flat_grad(fp)  # a bucket kept by no_sync ("local") and never sent goes too
            self.grad_shards[fp.index].zero_()
            self.grad_shard_written[fp.index] = False

    # 6. state_dict ----------------------------------------------------------------------
    def state_dict(self, full: bool = True) -> dict[str, torch.Tensor]:
        """The unwrapped model's state_dict (same keys), fp32 master values where they exist.

        Params are whole at stage 2, so `full` changes nothing. Under mixed precision the
        fp32 masters are sharded: they are all-gathered, so every rank must call this.
        """
        sd = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        if self.policy.needs_master:
            for fp, master_shard in zip(self.trainable, self.optimizer.master_shards):
                master = fp.new_flat(torch.float32)  # (padded_numel,) fp32, transient
                self.comm.all_gather(master, master_shard, phase="state_dict", label=f"fp32 master of {fp.label}")
                fp.write_into_state_dict(sd, master)
        return sd

    def norm_shards(self) -> list[torch.Tensor]:
        return [self.grad_shards[fp.index] for fp in self.trainable]

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {
            "params": self.flat_data,
            "grads": [g for g in self.flat_grads if g is not None] + [g for g in self.grad_shards if g is not None],
            "master_params": self.optimizer.master_tensors(),
            "optimizer_states": self.optimizer.state_tensors(),
        }

    def comm_buffer_tensors(self) -> list[torch.Tensor]:
        """Buffers alive only to communicate: reduce-scatter inputs and outputs in flight (the post-step gather is
        in place).

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
