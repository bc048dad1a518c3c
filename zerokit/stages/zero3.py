"""Stage 3 (FSDP): parameters are sharded too. A rank keeps 1/N of everything.

The model is split into *units* by the `wrap` policy (e.g. every GPT `Block`); the root unit
holds every parameter no unit claims (embeddings, final norm, the tied head). Each unit's
parameters live in padded flat buffers (one `FlatParam` per dtype / requires_grad /
hyperparameter group within the unit), of which only this rank's range persists:

    param_shard (shard_numel,)    persistent, param dtype; the optimizer's fp32 master covers it
    grad_shard  (shard_numel,)    persistent, the gradient averaged over ranks for that range
    unsharded   (padded_numel,)   the gathered flat buffer; its *storage* is resized to 0 bytes
                                  whenever the unit is sharded (see [Note: storage, not .data])

What happens, per step:
  * forward: the root is gathered when the model is called; a forward pre-hook gathers each
    unit (already in flight when `prefetch` > 0), the unit computes, and a forward hook frees
    the unsharded storage (`reshard_after_forward=True`) or keeps it for backward (False);
  * backward: a hook on the unit's outputs gathers it again before any of its backward ops
    run (see [Note: gather again in backward]); when all its gradients are accumulated (they
    land directly in a flat unsharded gradient buffer) they are pre-scaled by 1/N and
    reduce-scattered asynchronously into `grad_shard`, and once the unit's backward is over
    (its input gradients are computed too) the unsharded params are freed;
  * step: the optimizer updates the shards. No all-gather after it: the next forward gathers.

Collectives per step, logical bytes per rank (p = param bytes/elt, g = grad bytes/elt):
  all-gather in forward      Ψ·p        (every unit, root included)
  all-gather in backward     Ψ·p        (every unit but the root, which stays gathered;
                                          none for units kept with reshard_after_forward=False)
  reduce-scatter in backward Ψ·g        (trainable parameters only)
  total 3Ψ·g when p = g: 1.5x DDP's 2Ψ·g, minus the backward gathers kept units save.

Per-rank memory (Ψ parameters, up to padding < N elements per flat buffer):
  fp32 + Adam:       params 4Ψ/N + grads 4Ψ/N + optimizer_states 8Ψ/N                    = 16Ψ/N
  bf16/fp16 + Adam:  params 2Ψ/N + grads 2Ψ/N + master_params 4Ψ/N + optimizer_states 8Ψ/N = 16Ψ/N
  plus the working set: the unsharded units alive at once. With reshard_after_forward=True at
  most root + (1 + prefetch) units of parameters (param dtype), and in backward the unsharded
  gradients of the unit being computed and of the one whose reduce-scatter is in flight.
  A unit called twice in one forward stays gathered until its last call, and units are
  kept whole while a checkpointed region is recomputed; both can add to the bound.

Reduce dtype (core/grad_reduce.py [Note: reduce dtype]): when it is not the param dtype
(e.g. bf16 params, fp32 reductions), the grad shards are (shard_numel,) reduce-dtype tensors
(grads = Ψ·r/N: 4Ψ/N for fp32), and a unit's unsharded gradient is cast into a
(padded_numel,) reduce-dtype copy, scaled by 1/N there and reduce-scattered from it; the
param-dtype gradient is released right after the cast, the copy when its reduce-scatter
completes (listed by `comm_buffer_tensors()` meanwhile). The reduce-scatter then counts
Ψ·r bytes (2x for fp32 reductions of bf16 gradients); the gathers stay in the param dtype.

Assumption, as for torch FSDP: every rank runs the same graph (same units in the same order).

[Note: storage, not .data]
Autograd saves the tensors an op needs for backward, often views of a parameter (`linear`
saves `weight.t()`). Those views keep the storage they were made from. Were the unit freed by
pointing `param.data` at a new empty tensor, each saved view would keep the old full buffer
alive (nothing freed) and a re-gathered buffer would not be the one backward reads. So each
parameter is a view into one `unsharded` flat tensor for the engine's whole life, and
gathering / freeing resizes that tensor's storage in place: every view, saved ones included,
sees the re-gathered values, and freeing really returns the bytes.

[Note: gather again in backward]
With reshard_after_forward=True the unit's parameters are gone after its forward, but its
backward needs them (the gradient w.r.t. the input of `x @ W` is `grad @ W`). A tensor hook
on the unit's outputs fires when their gradient is complete, just before the unit's own
backward ops run: the gather happens there. The unit is done when (a) every trainable
parameter's gradient has been accumulated and (b) the gradient w.r.t. its inputs has been
computed — (b) is observed by an identity autograd function applied to the inputs in the
forward pre-hook, whose backward runs after the unit's whole backward. (a) alone is not
enough: a frozen weight used before the first trainable one is still needed for the input
gradient after every parameter gradient is final.

[Note: activation checkpointing]
Non-reentrant `torch.utils.checkpoint` re-runs the unit's forward *inside* backward when its
saved tensors are first unpacked, which is after the output hook gathered the unit. That
re-run fires the unit's forward hooks again; inside backward they neither record order, nor
wrap inputs, nor reshard: the unit stays whole until its backward is done.

[Note: recorded prefetch order]
Which unit runs next is only known by running the model (a Python forward may loop, branch,
or call a unit twice). The forward order is recorded on every forward (the first guess is
registration order) and the next forward prefetches along it; backward prefetches along the
order the previous backward met the units (first guess: reverse forward order). When the
actual order leaves the recorded one, prefetching stops for that pass (so the working-set
bound holds) and the new order is used next time. Every rank records the same order, so
collectives are issued identically everywhere.
"""
from __future__ import annotations

import collections
import contextlib
import enum
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from zerokit.core.bucketing import InFlight
from zerokit.core.engine import Engine
from zerokit.core.flat_param import FlatParam, ParamInfo, broadcast_module_state, build_flat_params, check_module
from zerokit.core.grad_reduce import grad_reduce_input
from zerokit.optim.sharded import ShardedOptimizer

_ONE_UNIT = 1 << 62  # bucket_numel for build_flat_params: a unit's group is never split


class UnitState(enum.Enum):
    """Which tensors of a unit are alive (besides the persistent param_shard / grad_shard).

    SHARDED    unsharded storage is 0 bytes; parameters are views of nothing usable.
    GATHERING  unsharded storage allocated, an all-gather into it is in flight (prefetch).
    UNSHARDED  parameters usable; during backward also the unsharded flat gradients, until
               the unit's reduce-scatter completes.
    """

    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


@dataclass
class Unit:
    """A group of modules whose parameters are gathered and freed together."""

    index: int
    name: str  # qualified module name; "" for the root unit
    module: nn.Module
    flat_params: list[FlatParam]
    is_root: bool
    state: UnitState = UnitState.SHARDED
    handles: list = field(default_factory=list)  # in-flight all-gathers (GATHERING)
    event: object = None  # CUDA: recorded on the gather stream after the gathers
    # per-backward bookkeeping
    pending_grads: int = 0  # trainable params whose gradient is not accumulated yet
    pending_inputs: int = 0  # identity nodes on the inputs whose backward has not run
    reduced: bool = False  # reduce-scatter launched this backward
    backward_started: bool = False

    @property
    def num_trainable(self) -> int:
        return sum(len(fp.params) for fp in self.flat_params if fp.requires_grad)


WrapPolicy = tuple | type | Callable[[nn.Module], bool] | None


class _InputsGradDone(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's whole backward has run."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class Zero3Engine(Engine):
    """ZeRO stage 3 / FSDP over `wrap` units; built by `zk.shard(..., stage=3)`. See the module docstring."""

    stage = 3

    # 1. construct ------------------------------------------------------------------
    def __init__(self, module: nn.Module, optimizer_cls, optimizer_kwargs: dict, *, comm, policy, scaler,
                 param_groups=None, wrap: WrapPolicy = None, prefetch: int = 1, reshard_after_forward: bool = True,
                 cast_inputs: bool = True, **_unused):
        super().__init__(module, comm, policy, scaler, cast_inputs=cast_inputs)
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        matches = _wrap_matcher(wrap)
        infos = check_module(module, comm, self.stage, param_groups)
        unit_modules = _find_units(module, matches)
        infos_by_unit = _assign_params(infos, unit_modules)  # raises on a tie across units, on every rank
        broadcast_module_state(module, comm)
        self.prefetch = prefetch
        self.reshard_after_forward = bool(reshard_after_forward)

        # Flat params per unit; root first, then units in registration order.
        self.units: list[Unit] = []
        self.flat_params: list[FlatParam] = []
        for k, (name, unit_module) in enumerate([("", module)] + unit_modules):
            fps = build_flat_params(infos_by_unit[k], self.world_size, self.rank, _ONE_UNIT,
                                    first_index=len(self.flat_params))
            self.flat_params += fps
            self.units.append(Unit(k, name, unit_module, fps, is_root=(k == 0)))
        self.unit_of_flat = {fp.index: u for u in self.units for fp in u.flat_params}

        dtype = policy.param_dtype  # frozen params too are stored in the param dtype
        self.param_shards: list[torch.Tensor] = []  # (shard_numel,) param dtype, persistent
        self.unsharded: list[torch.Tensor] = []  # (padded_numel,) param dtype; storage 0 bytes when sharded
        self.grad_shards: list[torch.Tensor | None] = []  # (shard_numel,) reduce dtype, trainable flat params only
        self.unsharded_grads: list[torch.Tensor | None] = []  # (padded_numel,) alive during backward
        fp32_shards = []
        for fp in self.flat_params:
            fp32 = fp.new_flat(torch.float32)  # (padded_numel,) transient: construction only
            fp.copy_params_into(fp32)
            fp32_shards.append(fp.shard_of(fp32).clone())
            fp.dtype = dtype
            self.param_shards.append(fp.shard_of(fp32).to(dtype).clone())
            unsharded = fp.new_flat(dtype)
            fp.use_as_param_storage(unsharded)  # once, for good: see [Note: storage, not .data]
            _free_storage(unsharded)
            self.unsharded.append(unsharded)
            self.grad_shards.append(torch.zeros_like(self.param_shards[-1], dtype=policy.reduce_dtype)
                                    if fp.requires_grad else None)
            self.unsharded_grads.append(None)
        del fp32
        self._grad_shard_clean = [True] * len(self.flat_params)  # zero: reduce-scatter straight into it
        # What `.grad` shows between backwards: this rank's part of the grad shard, per param
        # (core/user_grads.py [Note: param.grad belongs to the user]).
        self.shown_grads = {fp.index: fp.sharded_grads(self.grad_shards[fp.index], comm, lambda: self.loss_scale)
                            for fp in self.flat_params if fp.requires_grad}
        for index, shown in self.shown_grads.items():
            self.flat_params[index].show_grads(shown)
        self._adopted: set[int] = set()  # flat params whose user `.grad` changes were taken over this backward
        self._assigned: dict[int, list] = {}  # flat param -> [(j, tensor user code assigned to params[j].grad)]

        trainable = [fp for fp in self.flat_params if fp.requires_grad]
        self.optimizer = ShardedOptimizer(
            optimizer_cls, optimizer_kwargs,
            param_shards=[self.param_shards[fp.index] for fp in trainable],
            grad_shards=[self.grad_shards[fp.index] for fp in trainable],
            options=[fp.options for fp in trainable], policy=policy, comm=comm, scaler=scaler,
            master_init=[fp32_shards[fp.index] for fp in trainable])  # not their rounded copies
        del fp32_shards

        # CUDA: gathers run on a side stream so they overlap compute; see _issue_gather.
        self.gather_stream = torch.cuda.Stream() if self.flat_params and self.flat_params[0].device.type == "cuda" \
            else None
        self.in_flight = InFlight()  # reduce-scatters launched in backward
        self.reduce_buffers: dict[int, list[torch.Tensor]] = {}  # flat param -> its reduce-scatter's transient tensors
        self.in_backward = False
        self._in_forward = False
        self._fwd_order: list[int] = [u.index for u in self.units[1:]]  # first guess: registration order
        self._fwd_seen: list[int] = []
        self._bwd_order: list[int] | None = None  # None: use the reverse of the forward order
        self._bwd_seen: list[int] = []
        self._fwd_on_track = self._bwd_on_track = True
        self._calls: dict[int, int] = {}  # unit -> calls in the current forward
        self._fwd_uses = collections.Counter(self._fwd_order)  # unit -> calls per recorded forward
        self._handles = []
        self._reset_backward_counts()
        self._register_hooks()

    def _register_hooks(self) -> None:
        root = self.units[0]
        self._handles.append(self.module.register_forward_pre_hook(self._root_pre_forward))
        self._handles.append(self.module.register_forward_hook(self._root_post_forward))
        for unit in self.units[1:]:
            self._handles.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit),
                                                                       with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(self._make_post_forward(unit)))
        for unit in [root] + self.units[1:]:
            for fp in unit.flat_params:
                if not fp.requires_grad:
                    continue
                for p in fp.params:
                    # Before accumulation: bind `.grad` to the flat buffer so autograd adds into it.
                    self._handles.append(p.register_hook(self._make_grad_pre_hook(fp)))
                    self._handles.append(p.register_post_accumulate_grad_hook(self._make_grad_ready_hook(unit)))

    # -- gathering and freeing ------------------------------------------------------------
    def _issue_gather(self, unit: Unit, phase: str) -> None:
        """Allocate the unit's unsharded storage and launch its all-gathers (async)."""
        assert unit.state is UnitState.SHARDED, (unit.name, unit.state)
        for fp in unit.flat_params:
            _alloc_storage(self.unsharded[fp.index])  # on the compute stream; see below
        if self.gather_stream is None:
            unit.handles = [self.comm.all_gather(self.unsharded[fp.index], self.param_shards[fp.index],
                                                 async_op=True, phase=phase) for fp in unit.flat_params]
        else:
            # The side stream first waits for the compute stream (the optimizer may just have
            # written the shards), gathers, and records an event the compute stream waits on
            # before using the params. The storage was allocated on the compute stream and
            # every free happens after that wait, so no record_stream is needed.
            self.gather_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.gather_stream):
                for fp in unit.flat_params:
                    # wait() on NCCL only makes the (side) stream wait; the CPU goes on.
                    self.comm.all_gather(self.unsharded[fp.index], self.param_shards[fp.index],
                                         async_op=True, phase=phase).wait()
                unit.event = torch.cuda.Event()
                unit.event.record(self.gather_stream)
        unit.state = UnitState.GATHERING

    def _wait_gather(self, unit: Unit) -> None:
        if unit.state is not UnitState.GATHERING:
            return
        if self.gather_stream is None:
            for handle in unit.handles:
                handle.wait()  # the CPU waits for the gather (gloo)
        else:
            torch.cuda.current_stream().wait_event(unit.event)  # the GPU waits, not the CPU
        unit.handles, unit.event = [], None
        unit.state = UnitState.UNSHARDED

    def _unshard(self, unit: Unit, phase: str) -> None:
        """Make the unit's parameters usable now (gathering them if nobody prefetched)."""
        if unit.state is UnitState.SHARDED:
            self._issue_gather(unit, phase)
        self._wait_gather(unit)

    def _reshard(self, unit: Unit) -> None:
        """Free the unit's unsharded parameters (their storage goes back to 0 bytes)."""
        if unit.state is UnitState.SHARDED:
            return
        self._wait_gather(unit)  # never free memory a gather is still writing
        for fp in unit.flat_params:
            _free_storage(self.unsharded[fp.index])
        unit.state = UnitState.SHARDED

    def _prefetch(self, order: list[int], start: int, phase: str, skip_done: bool = False) -> None:
        """Launch the gathers of the units at order[start:start + prefetch] that are sharded."""
        for k in order[start:start + self.prefetch]:
            unit = self.units[k]
            if unit.state is UnitState.SHARDED and not (skip_done and self._unit_done(unit)):
                self._issue_gather(unit, phase)

    # -- forward hooks --------------------------------------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        if self.in_backward:  # the whole model re-run inside backward (checkpointed): root is whole
            return
        self._in_forward = True
        self._fwd_seen, self._fwd_on_track, self._calls = [], True, {}
        self._unshard(self.units[0], "forward")
        self._prefetch(self._fwd_order, 0, "forward")  # root computes while unit 0's gather flies

    def _root_post_forward(self, module, args, output) -> None:
        if self.in_backward:
            return
        self._in_forward = False
        if self._fwd_seen != self._fwd_order:  # re-record: see [Note: recorded prefetch order]
            self._fwd_order = list(self._fwd_seen)
            self._fwd_uses = collections.Counter(self._fwd_order)
            self._bwd_order = None
        tensors = [t for t in _tensors_in(output) if t.requires_grad]
        if not tensors:  # no backward will follow (evaluation): free everything now
            for unit in self.units:
                self._reshard(unit)
            self._reset_backward_counts()
            return
        for t in tensors:
            t.register_hook(self._root_pre_backward)

    def _make_pre_forward(self, unit: Unit):
        def pre_forward(module, args, kwargs):
            if self.in_backward:  # checkpoint recompute: see [Note: activation checkpointing]
                self._unshard(unit, "backward")
                return None
            position = len(self._fwd_seen)
            self._fwd_seen.append(unit.index)
            self._calls[unit.index] = self._calls.get(unit.index, 0) + 1
            if self._fwd_on_track and (position >= len(self._fwd_order) or self._fwd_order[position] != unit.index):
                self._fwd_on_track = False
            self._unshard(unit, "forward")
            if self._fwd_on_track:
                self._prefetch(self._fwd_order, position + 1, "forward")
            if not torch.is_grad_enabled():
                return None
            inputs = [t for t in _tensors_in((args, kwargs)) if t.requires_grad]
            if not inputs:
                return None
            unit.pending_inputs += 1
            wrapped = _InputsGradDone.apply(lambda: self._on_inputs_grad_done(unit), *inputs)
            replace = {id(t): w for t, w in zip(inputs, wrapped)}
            return _map_tensors((args, kwargs), lambda t: replace.get(id(t), t))
        return pre_forward

    def _make_post_forward(self, unit: Unit):
        def post_forward(module, args, output) -> None:
            if self.in_backward:  # recompute: keep the unit until its backward is done
                return
            if torch.is_grad_enabled():
                for t in _tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(self._make_pre_backward(unit))
            if self.reshard_after_forward and not self._called_again(unit):
                self._reshard(unit)
        return post_forward

    def _called_again(self, unit: Unit) -> bool:
        """True when the recorded order says this unit runs again later in this forward."""
        if not self._fwd_on_track:
            return False
        return self._fwd_uses[unit.index] > self._calls.get(unit.index, 0)

    # -- backward hooks -------------------------------------------------------------------
    def _begin_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            self._bwd_seen, self._bwd_on_track = [], True
            # Runs once autograd has finished the whole graph (as torch DDP/FSDP do).
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _root_pre_backward(self, grad):
        self._begin_backward()
        return None

    def _backward_order(self) -> list[int]:
        if self._bwd_order is not None:
            return self._bwd_order
        seen, order = set(), []
        for k in reversed(self._fwd_order):  # last call first
            if k not in seen:
                seen.add(k)
                order.append(k)
        return order

    def _make_pre_backward(self, unit: Unit):
        def pre_backward(grad):
            self._begin_backward()
            if unit.backward_started:  # a second output, a second call, or a second graph
                if unit.state is not UnitState.UNSHARDED:
                    self._unshard(unit, "backward")
                return None
            unit.backward_started = True
            order = self._backward_order()
            position = len(self._bwd_seen)
            self._bwd_seen.append(unit.index)
            if self._bwd_on_track and (position >= len(order) or order[position] != unit.index):
                self._bwd_on_track = False
            self._unshard(unit, "backward")  # see [Note: gather again in backward]
            if self._bwd_on_track:
                self._prefetch(order, position + 1, "backward", skip_done=True)
            return None
        return pre_backward

    def _make_grad_pre_hook(self, fp: FlatParam):
        def grad_pre_hook(grad: torch.Tensor) -> None:
            self._begin_backward()
            if fp.index not in self._adopted:
                self._adopt_user_grads(fp)
            if self.unsharded_grads[fp.index] is None:
                # (padded_numel,) param dtype: autograd accumulates every gradient of the flat
                # param straight into it; it lives until the reduce-scatter completes.
                flat_grad = fp.new_flat()
                self._copy_assigned_grads(fp, flat_grad)
                fp.use_as_grad_storage(flat_grad)
                self.unsharded_grads[fp.index] = flat_grad
            return None
        return grad_pre_hook

    def _adopt_user_grads(self, fp: FlatParam) -> None:
        """Once per backward, before autograd adds to this flat param: honour what user code did to `.grad`.

        A cleared `.grad` (`model.zero_grad()`, an optimizer's `zero_grad()`, `p.grad = None`)
        starts from zero: its part of the grad shard, or of the unsharded gradient kept by
        `no_sync`, is zeroed. An assigned tensor is copied into the unsharded gradient, the
        gradient to accumulate onto, as DDP would (`_copy_assigned_grads`).
        """
        self._adopted.add(fp.index)
        cleared, replaced = fp.user_grad_changes()
        if not (cleared or replaced):
            return
        kept = self.unsharded_grads[fp.index]  # (padded_numel,) kept by no_sync, or None
        if kept is not None:
            for view in fp.grad_views_of(kept, cleared + replaced):
                view.zero_()
        if fp.zero_shard_parts(self.grad_shards[fp.index], cleared + replaced):
            self._grad_shard_clean[fp.index] = True  # the next reduce-scatter lands directly, as after zero_grad
        self._assigned[fp.index] = [(j, fp.params[j].grad) for j in replaced]
        if kept is not None:
            self._copy_assigned_grads(fp, kept)
            fp.use_as_grad_storage(kept)

    def _copy_assigned_grads(self, fp: FlatParam, flat_grad: torch.Tensor) -> None:
        for j, g in self._assigned.pop(fp.index, []):
            fp.grad_views_of(flat_grad, [j])[0].copy_(g.reshape(-1))

    def _make_grad_ready_hook(self, unit: Unit):
        def grad_ready_hook(param: torch.Tensor) -> None:
            if unit.pending_grads == 0:
                raise RuntimeError(
                    f"gradient hook fired twice in one backward in unit {unit.name or '<root>'!r}: use "
                    "torch.utils.checkpoint with use_reentrant=False, and engine.no_sync() for accumulation")
            unit.pending_grads -= 1
            if unit.pending_grads == 0:
                self._reduce_scatter_grads(unit)
                self._maybe_reshard_after_backward(unit)
        return grad_ready_hook

    def _on_inputs_grad_done(self, unit: Unit) -> None:
        unit.pending_inputs -= 1
        self._maybe_reshard_after_backward(unit)

    def _unit_done(self, unit: Unit) -> bool:
        return unit.pending_grads == 0 and unit.pending_inputs == 0 and unit.backward_started

    def _maybe_reshard_after_backward(self, unit: Unit) -> None:
        # The root stays whole until the end of backward: its frozen weights or its first ops
        # (the embedding) may still be ahead in the graph.
        if not unit.is_root and unit.pending_grads == 0 and unit.pending_inputs == 0:
            self._reshard(unit)

    # 2. gradient hook -------------------------------------------------------------------
    def _reduce_scatter_grads(self, unit: Unit) -> None:
        """The unit's gradients are all accumulated: average them into the grad shards, async."""
        if unit.reduced:
            return
        unit.reduced = True
        if not self.sync_gradients:
            return  # no_sync: the unsharded gradients stay bound and keep accumulating
        for fp in unit.flat_params:
            if not fp.requires_grad:
                continue
            i = fp.index
            if i not in self._adopted:  # no gradient reached it this backward: user `.grad` changes still count
                self._adopt_user_grads(fp)
            flat_grad = self.unsharded_grads[i]
            if flat_grad is None:  # no gradient reached this flat param: its contribution is zero
                flat_grad = fp.new_flat()
                self._copy_assigned_grads(fp, flat_grad)
            # Pre-divide (and cast) exactly as stage 0 does, so the sums agree bit for bit.
            send = grad_reduce_input(flat_grad, self.world_size, self.policy.reduce_dtype)
            if send is not flat_grad and self.unsharded_grads[i] is flat_grad:
                fp.show_grads(self.shown_grads[i])  # the reduce-dtype copy is the input: the gradient can go now
                self.unsharded_grads[i] = None
            clean = self._grad_shard_clean[i]
            out = self.grad_shards[i] if clean else torch.empty_like(self.grad_shards[i])  # (shard_numel,)
            # Transient tensors of this reduce-scatter (a zero or reduce-dtype input, an
            # accumulation output), listed by comm_buffer_tensors() until it completes.
            alive = [] if send is self.unsharded_grads[i] else [send]
            self.reduce_buffers[i] = alive if clean else alive + [out]
            handle = self.comm.reduce_scatter(out, send, async_op=True, phase="backward")
            self._grad_shard_clean[i] = False
            self.in_flight.push(handle, self._make_reduce_done(fp, flat_grad, None if clean else out))
            # Bound the unsharded gradients alive: at most one reduce-scatter in flight beside
            # the newest. The CPU waits here for the older one.
            self.in_flight.wait_until(1)

    def _make_reduce_done(self, fp: FlatParam, flat_grad: torch.Tensor, partial: torch.Tensor | None):
        def done() -> None:
            if partial is not None:  # a second sync backward without zero_grad: accumulate
                self.grad_shards[fp.index].add_(partial)
            self.reduce_buffers.pop(fp.index, None)
            if self.unsharded_grads[fp.index] is flat_grad:
                fp.show_grads(self.shown_grads[fp.index])  # `.grad`: this rank's part of the average
                self.unsharded_grads[fp.index] = None  # the (padded_numel,) gradient is freed
        return done

    # 3. finish backward ------------------------------------------------------------------
    def _on_backward_end(self) -> None:
        # Units some of whose gradients never came (unused parameters) reduce now, in unit
        # order, zeros for what is missing: every rank reduces every flat param every step.
        for unit in self.units:
            if unit.num_trainable and not unit.reduced:
                self._reduce_scatter_grads(unit)
        self.in_flight.wait_all()
        for unit in self.units:
            self._reshard(unit)
        if self._bwd_seen and self._bwd_seen != self._backward_order():
            self._bwd_order = list(self._bwd_seen)  # re-record: see [Note: recorded prefetch order]
        self._reset_backward_counts()
        self.in_backward = False

    def _reset_backward_counts(self) -> None:
        for unit in self.units:
            unit.pending_grads = unit.num_trainable
            unit.pending_inputs = 0
            unit.reduced = False
            unit.backward_started = False
        self._adopted.clear()

    def finish_backward(self) -> None:
        if self.in_backward:
            self._on_backward_end()
        self.in_flight.wait_all()
        if not self._in_forward:
            for unit in self.units:  # e.g. a forward whose loss was never backpropagated
                self._reshard(unit)
            self._reset_backward_counts()

    # 4. step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Update this rank's shards. No all-gather: the next forward gathers. False if fp16 skipped it."""
        self.finish_backward()
        self.check_user_grads_before_step()
        return self.optimizer.step()

    # 5. zero_grad ------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for i, grad in enumerate(self.grad_shards):
            if grad is not None:
                grad.zero_()
                self._grad_shard_clean[i] = True
        for fp in self.flat_params:  # gradients kept unsharded by no_sync
            if self.unsharded_grads[fp.index] is not None:
                fp.show_grads(self.shown_grads[fp.index])
                self.unsharded_grads[fp.index] = None

    # 6. state_dict ----------------------------------------------------------------------
    def state_dict(self, full: bool = True) -> dict[str, torch.Tensor]:
        """The unwrapped model's state_dict (same keys), whole on every rank. A collective.

        Trainable parameters come from the fp32 masters where they exist (as at stage 0),
        frozen ones in the param dtype; buffers are replicated and copied as they are.
        Only the shards and masters are read (gathered into fresh buffers), never a unit's
        unsharded storage, so it works at any point of a step: between forward and backward
        the units the step gathered stay gathered for backward.
        """
        if not full:
            raise ValueError("Zero3Engine.state_dict supports full=True only; use engine.save() for shards")
        masters = dict(zip([fp.index for fp in self.flat_params if fp.requires_grad], self.optimizer.master_shards))
        values: dict[int, torch.Tensor] = {}
        for fp in self.flat_params:
            shard = masters.get(fp.index, self.param_shards[fp.index])  # (shard_numel,)
            flat = torch.empty(fp.padded_numel, dtype=shard.dtype, device=shard.device)  # (padded_numel,)
            self.comm.all_gather(flat, shard, phase="state_dict")
            for p, view in zip(fp.params, fp.views(flat)):
                values[id(p)] = view.clone()
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            out[name] = values[id(t)] if id(t) in values else t.detach().clone()
        return out

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True) -> Iterator[None]:
        """Every parameter whole inside the block (evaluation, initialisation, inspection). A collective.

        Works at any point of a step. A unit the step has gathered (between forward and
        backward: the root, units kept by reshard_after_forward=False, a prefetched one) is
        used as it is and stays gathered afterwards, in the same storage, so the views
        autograd saved from it stay valid for backward; every other unit is gathered for
        the block and freed after it. With `writeback`, changes made inside the block are
        written back into this rank's shards on exit (and into the fp32 masters, for the
        elements whose low-precision value changed, so the untouched ones keep their full
        precision). Make the same change on every rank. `writeback=False` promises the
        block only reads.
        """
        was_gathered = [unit.state is not UnitState.SHARDED for unit in self.units]
        for unit in self.units:
            self._unshard(unit, "summon")  # a prefetch in flight completes here; it stays gathered
        try:
            yield
        finally:
            if writeback:
                masters = dict(zip([fp.index for fp in self.flat_params if fp.requires_grad],
                                   self.optimizer.master_shards))
                for fp in self.flat_params:
                    new = fp.shard_of(self.unsharded[fp.index])  # (shard_numel,) param dtype
                    old = self.param_shards[fp.index]
                    master = masters.get(fp.index)
                    if master is not None and self.policy.needs_master:
                        changed = new != old
                        master.copy_(torch.where(changed, new.to(master.dtype), master))
                    old.copy_(new)
            for unit, keep in zip(self.units, was_gathered):
                if not keep:
                    self._reshard(unit)

    def norm_shards(self) -> list[torch.Tensor]:
        return [self.grad_shards[fp.index] for fp in self.flat_params if fp.requires_grad]

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out = {
            "params": self.param_shards,
            "grads": [g for g in self.grad_shards if g is not None],
            "master_params": self.optimizer.master_tensors(),
            "optimizer_states": self.optimizer.state_tensors(),
        }
        alive = [t for t in self.unsharded if t.untyped_storage().nbytes() > 0]
        if alive:
            out["unsharded_params"] = alive
        grads = [g for g in self.unsharded_grads if g is not None]
        if grads:
            out["unsharded_grads"] = grads
        return out

    def comm_buffer_tensors(self) -> list[torch.Tensor]:
        """Buffers alive only to communicate: reduce-scatter inputs and outputs in flight (not model states).

        The gathered units are reported by `memory_tensors()` (unsharded_params / _grads);
        core/comm.py's ordered reduction allocates its receive buffers inside each call and
        drops them when the call completes, so they are not listed.
        """
        return [t for alive in self.reduce_buffers.values() for t in alive]

    def unsharded_param_bytes(self) -> int:
        """Bytes of unsharded parameter storage alive right now (the working set)."""
        return sum(t.untyped_storage().nbytes() for t in self.unsharded)

    # 7. checkpoint hook ------------------------------------------------------------------
    def load_flat_params(self, flats: list[torch.Tensor]) -> None:
        """Checkpoint loading: keep this rank's range of each full buffer; every unit stays sharded."""
        self.finish_backward()
        for unit in self.units:
            self._reshard(unit)  # the next forward gathers the loaded shards
        for fp, full in zip(self.flat_params, flats):
            self.param_shards[fp.index].copy_(fp.shard_of(full))  # (shard_numel,) cast to the param dtype


# ---------------------------------------------------------------------- helpers
def _wrap_matcher(wrap: WrapPolicy) -> Callable[[nn.Module], bool]:
    if wrap is None:
        return lambda m: False
    if isinstance(wrap, type):
        wrap = (wrap,)
    if isinstance(wrap, tuple):
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in wrap):
            raise TypeError(f"wrap must be a tuple of nn.Module classes or a callable(module) -> bool, got {wrap!r}")
        return lambda m: isinstance(m, wrap)
    if callable(wrap):
        return lambda m: bool(wrap(m))
    raise TypeError(f"wrap must be a tuple of nn.Module classes or a callable(module) -> bool, got {wrap!r}")


def _find_units(module: nn.Module, matches: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """Matching submodules in registration order; the outermost match wins (the root is never a unit)."""
    units: list[tuple[str, nn.Module]] = []
    claimed: set[int] = set()

    def visit(prefix: str, m: nn.Module) -> None:
        for child_name, child in m.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if id(child) in claimed:
                continue
            if matches(child):
                claimed.add(id(child))
                units.append((name, child))
            else:
                visit(name, child)

    visit("", module)
    return units


def _assign_params(infos: list[ParamInfo], unit_modules: list[tuple[str, nn.Module]]) -> list[list[ParamInfo]]:
    """Each parameter's unit (index 0 = root); ValueError for a parameter shared by two units."""
    prefixes = [(k, name + ".") for k, (name, _) in enumerate(unit_modules, start=1)]

    def unit_of(param_name: str) -> int:
        for k, prefix in prefixes:
            if param_name.startswith(prefix):
                return k
        return 0

    out: list[list[ParamInfo]] = [[] for _ in range(len(unit_modules) + 1)]
    for info in infos:
        owners = [unit_of(n) for n in info.names]
        for name, owner in zip(info.names[1:], owners[1:]):
            if owner != owners[0]:
                def where(k):
                    return "the root unit" if k == 0 else f"unit {unit_modules[k - 1][0]!r}"
                raise ValueError(
                    f"zerokit stage 3: parameter {info.names[0]!r} ({where(owners[0])}) is tied to {name!r} "
                    f"({where(owner)}); a parameter shared by two units cannot be gathered and freed with "
                    f"both. Wrap a module that contains both, or untie them")
        out[owners[0]].append(info)
    return out


def _alloc_storage(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


def _free_storage(t: torch.Tensor) -> None:
    if t.untyped_storage().nbytes() != 0:
        t.untyped_storage().resize_(0)


def _tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor inside nested tuples / lists / dicts (a module's inputs or outputs), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors_in(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors_in(item)]
    return []


def _map_tensors(obj, fn: Callable[[torch.Tensor], torch.Tensor]):
    """The same nesting with every tensor replaced by fn(tensor) (namedtuples keep their type)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(item, fn) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(item, fn) for item in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj
