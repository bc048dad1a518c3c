"""Stage 1 (ZeRO-1): shard the optimizer states. Parameters and gradients stay whole.

Every rank still holds the whole model and, through backward, the whole gradient, but
for the update each flat buffer is cut into N shards and rank r updates only shard r:
the optimizer states (Adam's two moments; under mixed precision also the fp32 master
weights) exist only for that shard, 1/N of them per rank. An all-reduce is a
reduce-scatter followed by an all-gather; stage 1 simply puts the optimizer step in
between the two halves.

What happens, per step (differences from stage 0 marked *):
  * construction: rank 0's parameters (frozen ones too) and buffers are broadcast; the
    parameters become views into flat buckets, their `.grad`s views into flat gradient
    buckets; *a bucket closes once it holds `bucket_numel` elements, torch DDP's rule for
    `bucket_cap_mb` (stages 0 and 2 cap a bucket at `bucket_numel`; see [Note: stage 1's
    buckets]); *the optimizer is built over this rank's param_shard views only, and its
    grad_shard is a view of this rank's own range of the full gradient bucket;
  * backward: gradients accumulate in the full flat gradient buckets; *as soon as a bucket is
    complete (in bucket order, as stage 0 all-reduces it) it is scaled by 1/N and
    reduce-scattered in place, overlapping the rest of backward: the rank-average of this
    rank's range overwrites that range (the grad_shard); the other ranges keep this rank's
    local contribution, unused until zero_grad. The lecture's stage 1 reduces after backward;
    issuing each bucket's half of the all-reduce when stage 0 would issue the whole costs no
    memory (the buckets are whole anyway) and hides it behind backward;
  * step: *every rank updates its own shard, then all-gathers the updated shards back
    into the full flat buffers in place, so the module's parameters see the new values.

Collectives per step: one reduce-scatter of the gradients (B = Ψ·g bytes counted) and one
all-gather of the params (B = Ψ·p bytes); with g = p that is 2B, exactly stage 0's
all-reduce (ZeRO accounting, see core/comm.py). Gradient accumulation inside `no_sync()`
communicates nothing, as at stage 0: the full buckets keep accumulating.

[Note: stage 1's buckets]
Stage 1 keeps every bucket's whole gradient through backward, so a bucket's size sets only how
finely the reduce-scatters are cut, not how much memory they hold: fewer, larger collectives
cost less latency (each is a rendezvous of every rank). Stage 0 gets that by all-reducing
groups of buckets from one buffer (ddp.py [Note: all-reduce groups]); stage 1 cannot: a
reduce-scatter of two buckets laid end to end gives a rank a range of the concatenation, not
its shard of each. So stage 1 makes the buckets themselves larger: one closes once it holds
`bucket_numel` elements (core/bucketing.py `plan_buckets(..., close_when_full=True)`), as torch
DDP closes its buckets, where stage 2, which frees a bucket's gradient after its reduce-scatter,
keeps the cap as a bound. Small GPT, bucket_numel 65,536: 10 buckets → 8 (DDP: 7); the bits are
the stages' own either way (core/comm.py [Note: ordered reduction] sums in rank order, whatever
the buckets). benchmarks/stage1_phases.py runs the capped buckets beside these.

Per-rank memory (Ψ parameters, N ranks, up to padding < N elements per bucket):
  fp32 + Adam:       params 4Ψ + grads 4Ψ + optimizer_states 8Ψ/N
  bf16/fp16 + Adam:  params 2Ψ + grads 2Ψ + master_params 4Ψ/N + optimizer_states 8Ψ/N = 4Ψ + 12Ψ/N
(plus, transiently, the reduce-scatter's receive buffer; the all-gather after the step is in place).

Reduce dtype (core/grad_reduce.py [Note: reduce dtype]): when it is not the param dtype
(e.g. bf16 params, fp32 reductions), each bucket is cast into a (padded_numel,) reduce-dtype
copy, scaled by 1/N there and reduce-scattered from it into a grad shard of its own, a
(shard_numel,) reduce-dtype tensor (the bucket keeps this rank's local sum). A copy is
dropped as soon as its reduce-scatter completes; the CPU waits so that at most two are alive.
Then grads = Ψ·g + Ψ·r/N (bf16 with fp32 reductions: 2Ψ + 4Ψ/N) and the reduce-scatter
counts Ψ·r bytes (2x).

`param.grad` after a synced backward: only this rank's range of the average exists, so each
`.grad` becomes a ShardedGrad (core/user_grads.py [Note: param.grad belongs to the user]):
its norms are reduced over ranks (`torch.nn.utils.clip_grad_norm_(model.parameters(), c)`
equals `engine.clip_grad_norm_(c)`), in-place scaling and zeroing reach the grad shard, any
other use is refused. `model.zero_grad()` or an optimizer's `zero_grad()` before the next
backward clears the bucket (`_adopt_user_grads`). Because the grad shard lives inside the
gradient bucket, a second synced backward without clearing would mix averaged and local
values: stage 1 refuses it with a clear error (accumulate inside `no_sync()`, which
communicates nothing, as at stage 0).
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


class Zero1Engine(Checkpointing, Engine):
    stage = 1

    # 1. construct ------------------------------------------------------------------
    def __init__(self, module: nn.Module, optimizer_cls, optimizer_kwargs: dict, *, comm, policy, scaler,
                 config: ShardConfig):
        super().__init__(module, comm, policy, scaler, config)
        infos = self.guard.params  # checked to agree across ranks, rank 0's values broadcast: core/model_guard.py
        self.flat_params: list[FlatParamLayout] = build_flat_params(infos, self.world_size, self.rank,
                                                                    config.bucket_numel, close_when_full=True)
        self.flat_data: list[torch.Tensor] = []  # (padded_numel,) param dtype, one per bucket
        self.flat_grads: list[torch.Tensor | None] = []  # (padded_numel,) full gradients, trainable buckets
        # (shard_numel,) this rank's averaged range: a view into the bucket, or its own
        # reduce-dtype tensor when the reduce dtype is not the param dtype.
        self.grad_shards: list[torch.Tensor | None] = []
        # True once a reduce-scatter has overwritten the grad shard since zero_grad.
        self.grad_shard_written: list[bool] = []
        fp32_values = []  # (padded_numel,) fp32 each, construction only: what the masters start from
        for fp in self.flat_params:
            data, fp32 = fp.flatten_params(policy.param_dtype)  # bf16/fp16 params (frozen too) when mixed
            self.flat_data.append(data)
            fp32_values.append(fp32)
            grad = fp.new_flat() if fp.requires_grad else None
            fp.use_as_grad_storage(grad)
            self.flat_grads.append(grad)
            if grad is None:
                self.grad_shards.append(None)
            elif policy.reduce_dtype != policy.param_dtype:
                self.grad_shards.append(fp.new_flat(policy.reduce_dtype, numel=fp.shard_numel))
            else:
                self.grad_shards.append(fp.shard_of(grad))
            self.grad_shard_written.append(False)
        self.trainable = [fp for fp in self.flat_params if fp.requires_grad]
        self.optimizer = ShardedOptimizer(
            optimizer_cls, optimizer_kwargs,
            param_shards=[fp.shard_of(self.flat_data[fp.index]) for fp in self.trainable],  # views: updated in place
            options=[fp.options for fp in self.trainable], policy=policy, comm=comm, scaler=scaler,
            master_init=[fp.shard_of(fp32_values[fp.index]) for fp in self.trainable])
        del fp32_values
        self.in_flight = InFlight()
        self.reductions: dict[int, GradReduction] = {}  # bucket -> its reduce-scatter, until it completes
        # What `.grad` shows after a synced backward: this rank's part of the grad shard, per param.
        self.shown_grads = {fp.index: fp.sharded_grads(self.grad_shards[fp.index], comm, lambda: self.loss_scale)
                            for fp in self.trainable}
        self.tracker = GradReadyTracker(self.flat_params, self._on_bucket_ready, self._on_backward_end,
                                        on_first_grad=self._adopt_user_grads)

    # 2. gradient hook ---------------------------------------------------------------
    def _adopt_user_grads(self, fp: FlatParamLayout) -> None:
        """Autograd is about to add this bucket's first gradient: honour what user code did to `.grad`.

        Cleared `.grad`s (None, or zeroed in place) start from zero; an assigned tensor is
        the starting gradient, as under DDP. Then `.grad` is a bucket view again, for autograd.
        """
        cleared, replaced = fp.user_grad_changes()
        grad = self.flat_grads[fp.index]  # (padded_numel,)
        if self.grad_shard_written[fp.index] and (cleared or replaced):
            if len(cleared) + len(replaced) < len(fp.params):
                kept = next(names[0] for j, names in enumerate(fp.names) if j not in cleared + replaced)
                raise RuntimeError(
                    f"stage 1 (rank {self.rank}): some gradients of the bucket holding {kept!r} were cleared "
                    "since the last synced backward and others not; stage 1 cannot accumulate onto an averaged "
                    "gradient: clear all of them (model.zero_grad() or engine.zero_grad())")
            self._zero_bucket(fp)  # every param was cleared: as engine.zero_grad() for this bucket
        elif len(cleared) == len(fp.params):
            grad.zero_()
        else:
            for view in fp.grad_views_of(grad, cleared):
                view.zero_()
        for j, view in zip(replaced, fp.grad_views_of(grad, replaced)):
            view.copy_(fp.params[j].grad.reshape(-1))
        fp.use_as_grad_storage(grad)  # plain views: autograd accumulates into the bucket

    def _on_bucket_ready(self, fp: FlatParamLayout) -> None:
        """A bucket's gradients are all accumulated: reduce-scatter it now, while backward goes on (buckets are
        released in bucket order: the same collective sequence on every rank). Under no_sync the gradients
        keep accumulating in the full bucket (under reduction="tree", in its pairwise partial sums: core/tree.py)."""
        if self.sync_gradients:
            self.reduce_scatter_grad(fp)
            return
        partials = self.partials_of(fp)
        if partials is not None:
            partials.add(self.flat_grads[fp.index], reuse=True)
            self.flat_grads[fp.index].zero_()

    # 3. finish backward ---------------------------------------------------------------
    def _on_backward_end(self) -> None:
        self.in_flight.wait_all()
        if self.sync_gradients:  # `.grad` shows what exists of the average: this rank's shard
            for index, shown in self.shown_grads.items():
                self.flat_params[index].show_grads(shown)

    def finish_backward(self) -> None:
        self.tracker.finish_if_pending()
        self.in_flight.wait_all()

    def reduce_scatter_grad(self, fp: FlatParamLayout) -> None:
        """Launch: the rank-average of this rank's range overwrites that range (the grad shard)."""
        if self.grad_shard_written[fp.index]:
            raise RuntimeError(
                f"stage 1 (rank {self.rank}): a second synced backward since gradients were cleared, for the bucket "
                f"holding {fp.names[0][0]!r}; accumulate gradients inside engine.no_sync() and let only the last "
                "micro-step synchronise, or clear gradients between steps (engine.zero_grad() or model.zero_grad())")
        self.grad_shard_written[fp.index] = True
        # Divided by N (and cast) exactly as stage 0 does, so the sums agree bit for bit. Without a
        # reduce-dtype copy the output is this rank's range of the bucket itself (comm handles the aliasing).
        self.in_flight.finish_arrived()  # completed ones free their buffers first (core/comm.py
        # [Note: finishing what has arrived])
        reduction = self.reductions[fp.index] = self.grad_reduction(fp, self.flat_grads[fp.index])
        reduction.reduce_scatter(self.grad_shards[fp.index])
        self.in_flight.push(reduction, lambda index=fp.index: self.reductions.pop(index))
        if reduction.copied:
            self.in_flight.wait_until(1)  # the CPU waits: at most two reduce-dtype copies alive

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
            self._zero_bucket(fp)

    def _zero_bucket(self, fp: FlatParamLayout) -> None:
        self.flat_grads[fp.index].zero_()  # the grad shard, if a view, is zeroed with it
        if self.grad_shards[fp.index].dtype != self.flat_grads[fp.index].dtype:  # its own tensor
            self.grad_shards[fp.index].zero_()
        self.grad_shard_written[fp.index] = False

    # 6. state_dict ----------------------------------------------------------------------
    def state_dict(self, full: bool = True) -> dict[str, torch.Tensor]:
        """The unwrapped model's state_dict (same keys), fp32 master values where they exist.

        Params are whole at stage 1, so `full` changes nothing. Under mixed precision the
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
            # grad shards: views into the buckets (counted once), or reduce-dtype tensors of their own
            "grads": [g for g in self.flat_grads if g is not None] + [g for g in self.grad_shards if g is not None],
            "master_params": self.optimizer.master_tensors(),
            "optimizer_states": self.optimizer.state_tensors(),
        }

    def comm_buffer_tensors(self) -> list[torch.Tensor]:
        """Buffers alive only to communicate: reduce-dtype copies in flight (the post-step gather is in place).

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
