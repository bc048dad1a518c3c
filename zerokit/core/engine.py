"""What every stage's engine shares, and the interface every stage implements.

Shared here: calling the wrapped model (with mixed precision's input cast), scaling the
loss for fp16, the `no_sync` switch, `summon_full_params` (stage 3 overrides it; params are
whole below), global gradient-norm clipping over shards, what user code did to `param.grad`
(core/grads/user_grads.py `UserGrads`), refusing an fp16 step on gradients no loss scale
multiplied, recovery after a forward or backward that raised, and the ledgers
(`comm_stats`, `memory`).

The gradient path has one call site for every stage: the tracker (core/grads/hooks.py) calls
`_on_first_grad` (core/grads/user_grads.py) and `_on_grads_ready`, which either hands the flat
param's state to the stage's `reduce_grads` or, inside `no_sync`, keeps the gradient local
(under reduction="tree" in its pairwise partial sums). Per flat param the stage keeps a
`FlatParamState` (core/params/flat_param.py) in `states`, indexed by `FlatParamLayout.index`.

Each stage file subclasses `Engine` directly (no stage inherits from another) and
implements the methods of "the stage interface" below, in this order in every file:
construction (partition), the gradient hook (`reduce_grads`), the end of backward, `step`,
`zero_grad`, then whatever of `state_dict` (`full_flat_source`), what it holds
(`memory_tensors`, `norm_shards`) and the checkpoint hooks (`kept_range`, `load_flat_params`)
differs from the defaults here (written for stages 0-2, whose parameters are whole). Saving
and loading themselves are generic (zerokit/checkpoint/, mixed into each stage's engine),
driven by `flat_params` and the optimizer's master shards; core depends on no feature module.

[Note: the full state, one flat param at a time]
`full_state_items` is what `state_dict(full=True)` and a checkpoint's model file are made of.
It walks the flat params in order and, where a rank holds only a shard of one (stage 3's
params and masters, stages 1-2's fp32 masters), all-gathers that flat param alone into a
(padded_numel,) buffer, yields its parameters' values as views of it and drops it before the
next gather. A consumer that writes each value and lets it go (checkpoint/commit.py streams
the model file so) holds the rank's own shards plus one gathered flat param, never the whole
model; `state_dict(full=True)` clones every value, and its dict is the whole model. The order
is the flat params', not state_dict's (a bucket's parameters are not contiguous among the
state_dict keys, and following those keys would gather a flat param more than once);
`state_dict` restores the key order.

[Note: recovery after an exception]
An exception inside a forward or backward (a user hook, an op, out of memory) leaves a pass
cut short: autograd never runs the end of a backward that raised (core/grads/hooks.py [Note: a
backward that raised]), stage 3 leaves units gathered, and collectives the pass issued are
still in flight. Every stage's `zero_grad` starts with `discard_unfinished_pass`, which
forgets the hooks' bookkeeping, waits for every collective already issued and discards its
result with the gradients, and frees stage 3's units, so training continues as if the step
had never started (torch DDP refuses the next forward instead). This is exact when every rank
raised at the same point, so that every rank issued the same collectives; when only some did,
the ranks' collectives no longer pair up and nothing local can repair that. Under debug=True
(core/collectives/recorder.py [Note: debug mode]) the recovering ranks' zero_grad is a checked sync point, so
every rank raises at its next collective, saying to rebuild the engine; without it gloo may
abort, a rank may wait until the group's timeout, or values could mix where sizes match.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Iterable, Iterator

import torch
from torch import nn

from zerokit.core.params.bucketing import InFlight
from zerokit.core.config import ShardConfig
from zerokit.core.params.flat_param import FlatParamState
from zerokit.core.grads.grad_reduce import GradPath, GradReduction
from zerokit.core import preemption
from zerokit.core.params.model_guard import ModelGuard
from zerokit.core.precision import GradScaler, LossScaler, PrecisionPolicy, cast_floating_tensors, refuse_scaled
from zerokit.core.collectives.tree import PartialSums, exact_square_sum, norm_from_square_sum
from zerokit.core.params.unit import wrap_forward_method
from zerokit.core.grads.user_grads import UserGrads


_NORM_CHUNK_NUMEL = 1 << 20  # elements converted to fp64 at a time when summing squares


class Engine(GradPath, UserGrads):
    stage: int = -1
    units: list = []  # stage 3's units (core/params/unit.py), freed by discard_unfinished_pass; none below it
    keeps_flat_grads = True  # stages 0-1 keep each full gradient for good; stages 2-3 free it once reduced
    accumulates_grad_shards = True  # False at stage 1, whose grad shard lives in the full gradient
    reduce_in_no_sync = False  # stage 2's accumulate="reduce_scatter": no_sync micro-steps reduce too

    def __init__(self, module: nn.Module, comm, policy: PrecisionPolicy, scaler: LossScaler | None,
                 config: ShardConfig):
        self.module = module
        self.comm = comm
        self.policy = policy
        self.loss_scaler = scaler  # fp16's LossScaler (None under fp32/bf16), the one optim/sharded.py updates
        # torch GradScaler's shape over it, at every precision (disabled under fp32/bf16): core/precision.py
        self.scaler = GradScaler(self, scaler)
        self._warned_unscaled = False  # the static-scale-1 warning: GradScaler [Note: a static scale of 1]
        self.config = config
        self.rank, self.world_size = comm.rank, comm.world_size
        self.sync_gradients = True  # False inside no_sync(): accumulate locally, no communication
        # Ranks agree on the model and hold rank 0's values, or every rank raises; then buffers are kept as
        # DDP keeps them and a model changed under the engine is refused (core/params/model_guard.py).
        # A model built on the meta device gets its values as each stage lays it out, one flat param at a time
        # (core/params/materialize.py), after the guard has checked that every rank built it so.
        self.guard = ModelGuard(module, comm, self.stage, config)
        # bf16/fp16: floating-point forward inputs are cast to the param dtype (None: no cast).
        self.input_dtype = policy.param_dtype if config.cast_inputs and policy.needs_master else None
        # Set by clip_grad_norm_, handed to the next optimizer step, forgotten by zero_grad.
        self.clip_coef: torch.Tensor | None = None
        # reduction="tree": each trainable bucket's pairwise partial sums of the step's micro-batches.
        self.partials: dict[int, PartialSums] = {}
        if config.reduction == "tree":
            if policy.param_dtype == torch.float64:  # core/collectives/tree.py's exact bins read values as float32
                raise ValueError("reduction='tree' is not available for a float64 model (its exact norm reads "
                                 "float32 values): use reduction='linear', or model.float()")
            comm.use_tree()  # the cross-rank sum pairwise too; raises unless N is a power of two
        # fp16 + tree: the gradient's 1/N rides in the loss scale (`backward`), not in the reduction.
        self._divide_in_loss = config.reduction == "tree" and scaler is not None
        self._backward_error: BaseException | None = None  # the last engine.backward's exception, until zero_grad
        self.states: list[FlatParamState] = []  # per flat param, by index: its gradient storage
        self.reductions: dict[int, GradReduction] = {}  # index -> its reduction, until done with
        self.in_flight = InFlight()  # reductions launched, oldest first

    # -- running the model ------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Run the wrapped model (every stage's forward, stage 3's root hooks included, starts here).

        First the model is checked to be the one the engine was built with (dtype, device,
        storage) and, with `broadcast_buffers` (the default), rank 0's buffers are broadcast
        when torch DDP would (core/params/model_guard.py [Note: buffers as DDP keeps them]): only
        here, as DDP only in `ddp(x)`, never in `model(x)`.
        Under bf16/fp16 (unless `cast_inputs=False`) floating-point tensors among the
        arguments, however nested, are cast to the param dtype first; integer and bool
        tensors are left alone; the output is not cast back (core/precision.py, item 5).
        """
        self.guard.before_forward(self)
        if self.input_dtype is not None:
            args, kwargs = cast_floating_tensors((args, kwargs), self.input_dtype)
        output = self.module(*args, **kwargs)
        self.guard.after_forward(self)
        return output

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), with the loss multiplied by the fp16 loss scale first: the same bits as torch's
        idiom `engine.scaler.scale(loss).backward()` (core/precision.py GradScaler).

        fp16 under reduction="tree": by scale / N, and the reductions do not divide by N, so
        that every fp16 leaf of the tree holds the same bits at every world size (core/collectives/tree.py).
        """
        if self.loss_scaler is not None:
            loss = refuse_scaled(loss, "engine.backward") * self.loss_factor
        self.tracker.engine_backward = True  # this backward is scaled: core/grads/hooks.py [Note: which backward was scaled]
        try:
            loss.backward()
        except BaseException as exc:
            self._backward_error = exc  # named by discard_unfinished_pass: [Note: recovery after an exception]
            raise
        finally:
            self.tracker.engine_backward = False

    def check_last_backward(self) -> None:
        """Refuse to clip or step on gradients of an `engine.backward` that raised (partial), or, under fp16,
        of a backward the loss scale never multiplied.

        The step divides by the loss scale (core/grads/hooks.py [Note: which backward was scaled]); a
        plain `loss.backward()` would leave every gradient that many times too small. Every rank
        runs the same code, so every rank raises here.
        """
        if self._backward_error is not None:
            raise RuntimeError(
                f"zerokit stage {self.stage} (rank {self.rank}): the last engine.backward raised "
                f"({type(self._backward_error).__name__}: {self._backward_error}), so its gradients are partial: "
                "after catching it call engine.zero_grad() on every rank, then run the step again "
                "([Note: recovery after an exception] in zerokit/core/engine.py)")
        if self.loss_scaler is not None and self.tracker.plain_backwards:
            if self.scaler.plain_backward_ok:  # GradScaler [Note: a static scale of 1]
                self._warn_unscaled_fp16()
                return
            raise RuntimeError(
                f"zerokit (fp16): this backward ran through loss.backward(), so the loss was not multiplied by "
                f"the loss scale ({self.loss_scale:g}) that the step divides the gradients by, and every gradient "
                f"would be that many times too small ({self.tracker.plain_backwards} backward(s) since the last "
                "engine.zero_grad() was not scaled): call engine.backward(loss) under precision='fp16' (or torch's "
                "GradScaler idiom, engine.scaler.scale(loss).backward()), then engine.zero_grad() and run the "
                "step again")

    def register_forward_method(self, name: str) -> None:
        """Let `module.<name>(...)` (say `generate`) run the model as a call of the module does.

        Stages 0-2 need nothing: every parameter is whole. Stage 3 gathers the root unit when the
        module is called; a method that runs the model without calling the module itself (a
        PEFT `PeftModel.generate` calls the inner model) needs registering there, as torch's
        FSDP2 `register_fsdp_forward_method` (core/params/unit.py [Note: forward methods]). Accepted at
        every stage, so code runs unchanged.
        """
        if not callable(getattr(self.module, name, None)):
            raise AttributeError(f"{type(self.module).__name__} has no method {name!r} to register")
        if self.units:
            wrap_forward_method(self, name)

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True) -> Iterator[None]:
        """Every parameter whole inside the block: already so at stages 0-2 (stage 3 gathers).

        So code written for stage 3 (evaluation, inspection, initialisation) runs unchanged
        at every stage, at any point of a step. With `writeback` under bf16/fp16, an element
        of this rank's range whose low-precision value changed inside the block is copied
        into the fp32 master, which the next step would otherwise write over it (a
        (shard_numel,) param-dtype snapshot per flat buffer is held meanwhile); under fp32
        the master is the param itself. Make the same change on every rank.
        `writeback=False` promises the block only reads.
        """
        shards = self.optimizer.param_shards
        track = writeback and self.policy.needs_master
        before = [p.clone() for p in shards] if track else []  # (shard_numel,) param dtype each
        try:
            yield
        finally:
            self.write_back(self.trainable if track else [], before, shards)

    def write_back(self, flat_params: list, olds: list[torch.Tensor], news: list[torch.Tensor]) -> None:
        """summon_full_params's write-back into the fp32 masters: where news[i], this rank's range of
        flat_params[i] after the block, differs from olds[i] (its param-dtype values before), the
        master takes the new value; the elements the block left alone keep their full precision."""
        masters = dict(zip([fp.index for fp in self.trainable], self.optimizer.master_shards))
        if self.policy.needs_master:
            for fp, old, new in zip(flat_params, olds, news):
                if fp.index in masters:
                    master = masters[fp.index]
                    master.copy_(torch.where(new != old, new.to(master.dtype), master))

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backwards inside the block communicate nothing (stage-specific)."""
        previous, self.sync_gradients = self.sync_gradients, False
        try:
            yield
        finally:
            self.sync_gradients = previous

    def stop_requested(self) -> bool:
        """Whether any rank was sent SIGTERM or SIGUSR1 (a preemption): the same answer on every rank.

        A collective: every rank calls it at the same point of each step, then saves and stops when
        it is True (core/preemption.py [Note: agreeing to stop]). The first call installs the handlers.
        """
        device = next(iter(self.module.parameters()), torch.empty(0)).device
        return preemption.stop_requested(self.comm, device)

    @property
    def data_parallel_rank(self) -> int:
        """Which part of the global batch this rank trains on: its rank among all data-parallel ranks.
        Equal to `rank` in one flat group; under hybrid sharding `rank` is the position in the shard
        group (core/collectives/hybrid.py), shared by one rank of every node, so pick data with this instead."""
        return self.comm.world_rank

    @property
    def data_parallel_size(self) -> int:
        """N: the ranks whose gradients are averaged (`world_size` is the shard group's S under hybrid sharding)."""
        return self.comm.data_parallel_size

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scaler.scale) if self.loss_scaler is not None else 1.0

    @property
    def loss_factor(self) -> float:
        """What `engine.backward` and `engine.scaler.scale` multiply the loss by: the fp16 loss scale
        (divided by N under reduction="tree", whose reductions then do not divide); 1.0 without a scaler."""
        if self.loss_scaler is None:
            return 1.0
        scale = self.loss_scaler.scale
        return scale / self.comm.data_parallel_size if self._divide_in_loss else scale

    def mark_scaled_backward(self) -> None:
        """The running backward is a scaled one (GradScaler [Note: which backward `scale` marks]): set the
        tracker's `engine_backward` until autograd finishes this backward."""
        if not self.tracker.engine_backward:
            self.tracker.engine_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_scaled_backward)

    def _end_scaled_backward(self) -> None:
        self.tracker.engine_backward = False

    def _warn_unscaled_fp16(self) -> None:
        if not self._warned_unscaled:
            self._warned_unscaled = True
            warnings.warn(
                "zerokit (fp16): plain loss.backward() under a static loss scale of 1: fp16 gradients below "
                "2**-24 (~6e-8) flush to zero and those below 2**-14 (~6e-5) lose precision, silently; if the "
                "loss stops improving, use the dynamic scaler (drop loss_scaler=) with "
                "engine.scaler.scale(loss).backward(), or bf16", stacklevel=3)

    # -- clipping -----------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global L2 norm of the (unscaled) averaged gradient; return that norm (fp32; float64 for a
        float64 model).

        Every rank sums squares over *its own range* of each flat gradient (padding is
        zero, a tied parameter is stored once), then one rank-ordered reduction of those
        scalars gives every rank the same total. The squares are summed in fp64, where the
        square of an fp32 (or bf16/fp16) value is exact and the sum's rounding error
        (~1e-16 relative) is far below fp32's resolution: the fp32 norm therefore does not
        depend on how a stage groups elements into buffers and ranks, so clipped runs stay
        bitwise equal across stages. The coefficient is applied while the optimizer forms
        its master gradients, as torch's clip_grad_norm_ would have scaled the gradients:
        coef = max_norm / (norm + 1e-6), capped at 1. With reduction="tree" the sum of squares
        is exact (integer bins, core/collectives/tree.py), so the norm is equal at every world size too.
        """
        self.finish_backward()
        self.check_last_backward()
        self.check_partials_sent()
        shards = self.norm_shards()
        if self.config.reduction == "tree":  # exact, so equal at every world size: core/collectives/tree.py
            bins = self.comm.all_reduce_scalars(exact_square_sum(shards), label="gradient norm bins (clip_grad_norm_)")
            return self._set_clip_coef(norm_from_square_sum(bins).to(bins.device), max_norm)
        device = shards[0].device if shards else torch.device("cpu")
        partial = torch.zeros((), dtype=torch.float64, device=device)
        for g in shards:  # per flat buffer, in chunks: the fp64 copy stays small
            for chunk in g.split(_NORM_CHUNK_NUMEL):
                c64 = chunk.double()
                partial += torch.dot(c64, c64)
        total_sq = self.comm.all_reduce_scalars(partial.reshape(1), label="gradient norm partials (clip_grad_norm_)")[0]
        # fp32; float64 for a float64 model, as torch's clip_grad_norm_ returns (core/precision.py [Note: float64
        # models])
        return self._set_clip_coef(total_sq.sqrt().to(self.policy.master_dtype), max_norm)

    def _set_clip_coef(self, norm: torch.Tensor, max_norm: float) -> torch.Tensor:
        if self.loss_scaler is not None:
            norm = norm / self.loss_scaler.scale
        # Spelled as torch.nn.utils.clip_grad_norm_ spells it (a Python float over a tensor is a
        # reciprocal and a multiply), so both give the same coefficient bit for bit.
        self.clip_coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
        return norm

    def take_clip_coef(self) -> torch.Tensor | None:
        """The coefficient the last clip_grad_norm_ computed (None if none since the last step), once."""
        coef, self.clip_coef = self.clip_coef, None
        return coef

    # -- ledgers -------------------------------------------------------------------
    def comm_stats(self, by_group: bool = False) -> dict:
        """Cumulative logical bytes per collective kind (ZeRO-paper accounting, see core/collectives/comm.py).

        `by_group=True`: {"shard_group": ..., "replicate_group": ..., "world": ...}, each per kind:
        within this rank's shard group (a node), across its replicate group (between nodes) and over
        every rank (the initial broadcast) under hybrid sharding (core/collectives/hybrid.py); a flat group counts
        everything as its shard group's.
        """
        return self.comm.stats_by_group() if by_group else self.comm.stats()

    def memory(self) -> dict[str, int]:
        """This rank's live bytes by category, each storage counted once.

        The stage's model states (params, grads, master_params, optimizer_states, and stage
        3's unsharded buffers while alive; "quantized_params", a quantized base's bytes, apart
        from "params": core/params/flat_param.py [Note: packed byte parameters]) plus "comm_buffers": storage held only to
        communicate (reduce-dtype copies, all-gather inputs) — 0 between steps. Activations
        are measured around a forward/backward with core/accounting/ledger.py's ActivationMeter.
        """
        seen: set = set()
        out = {}
        categories = dict(self.memory_tensors())
        packed = [t for t in categories.get("params", []) if not t.is_floating_point()]
        if packed:  # a quantized base: core/params/flat_param.py [Note: packed byte parameters]
            categories["params"] = [t for t in categories["params"] if t.is_floating_point()]
            categories["quantized_params"] = packed
        if self.config.reduction == "tree":  # log2(k) partial sums per bucket while accumulating
            categories["tree_partials"] = [t for partials in self.partials.values() for t in partials.tensors()]
        categories["comm_buffers"] = self.comm_buffer_tensors()
        for category, tensors in categories.items():
            total = 0
            for t in tensors:
                if t is None:
                    continue
                key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                if key in seen or t.untyped_storage().nbytes() == 0:
                    continue
                seen.add(key)
                total += t.untyped_storage().nbytes()
            out[category] = total
        return out

    # -- a pass that raised ([Note: recovery after an exception]) ------------------------------------
    def discard_unfinished_pass(self, forward_cut_short: bool = False) -> None:
        """Every stage's `zero_grad` starts here: forget a forward or backward that raised.

        The hooks' per-backward bookkeeping is reset, every collective already issued is waited
        for (its result goes with the gradients zero_grad clears), and stage 3's units are freed
        (`forward_cut_short`: its root forward began and did not end). After a pass that completed
        this only waits for nothing: between a forward and its backward (`optimizer.zero_grad()`
        placed there) the units the backward needs stay gathered.
        """
        cut_short = self.tracker.discard() or forward_cut_short
        self.in_flight.wait_all()
        error, self._backward_error = self._backward_error, None
        if not cut_short:
            return
        if self.comm.debug and self.comm.distributed:  # the other ranks must have raised at the same point
            exc = sys.exc_info()[1] or error
            what = f"{type(exc).__name__}: {exc}" if exc is not None else "an exception"
            self.comm._check_same(
                (self.comm.recorder.seq, "sync_point", "engine.zero_grad() after a pass that raised"),
                f"in engine.zero_grad() after a forward or backward that raised on this rank ({what}); unless "
                "every rank raised at the same point, the ranks' collectives no longer pair up: rebuild the "
                "engine (zk.shard) and load the last checkpoint")
        for unit in self.units:
            unit.abandon_pass()

    def begin_zero_grad(self, forward_cut_short: bool = False) -> None:
        """Every stage's `zero_grad` starts here: a pass that raised is discarded, the clip coefficient and
        the tree's partial sums are forgotten."""
        self.discard_unfinished_pass(forward_cut_short)  # [Note: recovery after an exception]
        # a scaled backward that raised: core/precision.py [Note: which backward `scale` marks]
        self.tracker.engine_backward = False
        self.clip_coef = None
        self.clear_partials()

    @property
    def flat_grads(self) -> list[torch.Tensor | None]:
        """Each flat param's (padded_numel,) full gradient, by index (None where none exists now)."""
        return [state.flat_grad for state in self.states]

    # -- the stage interface: implemented by each stage file, in this order ------------------
    # 1. construction (the partition) and 2. the gradient hook (`reduce_grads`) are each stage's own.

    def reduce_grads(self, state) -> None:
        """2. Start averaging a flat param's (or stage 0's all-reduce group's) gradient over ranks."""
        raise NotImplementedError

    def _on_backward_end(self) -> None:
        """3. Autograd finished a backward (core/grads/hooks.py): wait for every reduction."""
        self.in_flight.wait_all()

    def finish_backward(self) -> None:
        """3. Complete a backward: every gradient reduction waited for (idempotent; step calls it)."""
        self.tracker.finish_if_pending()
        self.in_flight.wait_all()

    def step(self) -> bool:
        """4. One optimizer step on this rank's shards, then whatever makes params whole again.

        Returns False when fp16 skipped it (an inf/nan gradient on any rank).
        """
        raise NotImplementedError

    def zero_grad(self) -> None:
        """5. Clear every gradient (and a clip coefficient not yet used), ready for the next backward."""
        raise NotImplementedError

    def all_gather_params(self) -> None:
        """4. Stages 1-2, after the step: every rank's updated param shard back into the full flat buffers."""
        if self.world_size == 1:
            return  # the shard is the whole buffer and was updated in place
        # Each input is this rank's own range of its output: an in-place gather, no copy of the shard
        # (core/collectives/gather.py [Note: in-place gathers]). Issued together: one round of latency, not one per
        # bucket (on gloo packed into one staging buffer per group of at most GLOO_COALESCE_NUMEL elements,
        # whose rows are filled from every rank: [Note: gloo's all-gather temporary]).
        self.comm.all_gather_many([self.flat_data[fp.index] for fp in self.trainable],
                                  [fp.shard_of(self.flat_data[fp.index]) for fp in self.trainable], phase="step",
                                  labels=[f"updated params of {fp.label}" for fp in self.trainable]).wait()

    def state_dict(self, full: bool = True) -> dict[str, torch.Tensor]:
        """6. The unwrapped model's state_dict (same keys, same order), fp32 master values where they exist.

        Every value a fresh tensor (a tied parameter's names each get their own). Params are whole at
        stages 0-2, so `full` changes nothing. Built from `full_state_items`, so it is a collective
        wherever that is (masters sharded at stages 1-2, everything at stage 3): every rank calls it.
        """
        values = {name: t.clone() for name, t in self.full_state_items()}
        return {name: values[name] for name in self.module.state_dict(keep_vars=True)}

    def full_state_items(self, rank0_only: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
        """6. (name, tensor) for every state_dict key, one flat param gathered at a time: [Note: the full
        state, one flat param at a time]. A collective: every rank iterates it to the end.

        Each flat param's parameters come in layout order (a tied parameter under each of its
        names), then the buffers in state_dict order. A value is a view, of a (padded_numel,)
        buffer gathered for this flat param alone or of the engine's own storage (stage 0's
        params, the buffers): read it, or clone it to keep it, and drop it before asking for the
        next (a value still held keeps its gathered buffer alive beside the next one). With
        `rank0_only` every other rank gets None for each value (it still takes part in every gather).
        """
        keep = not rank0_only or self.comm.world_rank == 0
        masters = self._masters_by_index()
        in_flat: set[int] = set()
        for fp in self.flat_params:
            source, sharded = self.full_flat_source(fp, masters)
            flat = source
            if sharded:  # (shard_numel,) -> a transient (padded_numel,) buffer of its own
                what = "fp32 master" if source is masters.get(fp.index) else "params"
                flat = torch.empty(fp.padded_numel, dtype=source.dtype, device=source.device)
                self.comm.all_gather(flat, source, phase="state_dict", label=f"{what} of {fp.label}")
            for names, view, p in zip(fp.names, fp.views(flat), fp.params):
                in_flat.add(id(p))
                for name in names:
                    yield name, view.detach() if keep else None
            flat = view = None  # the gathered buffer goes before the next flat param's gather
        for name, t in self.module.state_dict(keep_vars=True).items():
            if id(t) not in in_flat:
                yield name, t.detach() if keep else None

    def full_state_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """6. name -> (dtype, shape) of every value `full_state_items` yields, known without a collective."""
        masters = self._masters_by_index()
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        in_flat: set[int] = set()
        for fp in self.flat_params:
            dtype = self.full_flat_source(fp, masters)[0].dtype
            for names, shape, p in zip(fp.names, fp.layout.shapes, fp.params):
                in_flat.add(id(p))
                specs.update((name, (dtype, tuple(shape))) for name in names)
        for name, t in self.module.state_dict(keep_vars=True).items():
            if id(t) not in in_flat:
                specs[name] = (t.dtype, tuple(t.shape))
        return specs

    def _masters_by_index(self) -> dict[int, torch.Tensor]:
        """Each trainable flat param's master (a shard at stages 1-3; under fp32 the param shard), by index."""
        return dict(zip([fp.index for fp in self.trainable], self.optimizer.master_shards))

    def full_flat_source(self, fp, masters: dict[int, torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """6. Where flat param `fp`'s full values come from, and whether it is this rank's shard to all-gather.
        Stages 0-2: the fp32 master under mixed precision (a shard at stages 1-2), else the whole flat buffer."""
        if self.policy.needs_master and fp.index in masters:
            return masters[fp.index], self.stage > 0
        return self.flat_data[fp.index], False

    def norm_shards(self) -> list[torch.Tensor]:
        """The averaged gradient this rank sums squares over for the global norm (disjoint across ranks)."""
        return self.grad_shards()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What the stage holds, by ledger category (params, grads, master_params, optimizer_states, ...)."""
        states = [self.states[fp.index] for fp in self.trainable]
        return {
            "params": self.flat_data,
            # grad shards: views into the full gradients (counted once), or tensors of their own
            "grads": [s.flat_grad for s in states if s.flat_grad is not None]
            + [s.grad_shard for s in states if s.grad_shard is not None],
            "master_params": self.optimizer.master_tensors(),
            "optimizer_states": self.optimizer.state_tensors(),
        }

    def comm_buffer_tensors(self) -> list[torch.Tensor]:
        """Storage alive only to communicate right now (none between steps): the reductions' reduce-dtype
        copies and outputs (the post-step gathers are in place; core/collectives/ordered.py's ordered reduction
        allocates its receive buffers inside each call and drops them when the call completes)."""
        return [t for reduction in self.reductions.values() for t in reduction.transient]

    def kept_range(self, fp) -> tuple[int, int]:
        """7. The elements [lo, hi) of flat param `fp`'s (padded_numel,) buffer this rank keeps, all that a
        checkpoint load reads of it: the whole buffer at stages 0-2."""
        return 0, fp.padded_numel

    def load_flat_params(self, flats: Iterable[torch.Tensor]) -> None:
        """7. Write loaded values into the stage's storage: the i-th of `flats` is flat param i's range
        `kept_range`, fp32 (hi - lo,), each written before the next is taken (a loader streams them: one
        flat param's range alive at a time). Stages 0-2: every rank writes each into its whole flat buffer."""
        self.finish_backward()
        for fp, full in zip(self.flat_params, flats):
            self.flat_data[fp.index].copy_(full)  # cast to the param dtype; padding is zero in `full`
