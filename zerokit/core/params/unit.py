"""Stage 3's unit: a group of modules whose parameters are gathered and freed together.

A `Unit` owns its lifecycle, as FSDP2's parameter group does: `unshard` (all-gather the
param shards into whole flat buffers), `reshard` (free them again), and the four moments
that drive them — `pre_forward`, `post_forward`, `pre_backward`, `post_backward`. The stage
(stages/zero3.py) decides *when* to prefetch (core/params/prefetch.py) and reduces the gradients;
the unit knows what it holds and when its own backward is over.

Its state (`UnitState`) says which of its tensors are alive.

[Note: storage, not .data]
Autograd saves the tensors an op needs for backward, often views of a parameter (`linear`
saves `weight.t()`). Those views keep the storage they were made from. Were the unit freed
by pointing `param.data` at a new empty tensor, each saved view would keep the old full
buffer alive (nothing freed) and a re-gathered buffer would not be the one backward reads.
So each parameter is a view into one `flat_data` tensor for the engine's whole life, and
gathering / freeing resizes that tensor's *storage* in place: every view, saved ones
included, sees the re-gathered values, and freeing really returns the bytes.

[Note: one rank]
On one rank a flat param's shard is the whole flat param (padding < N elements is none), so the
stage keeps its flat buffer as the param shard (`in_place`): gathering would copy a buffer onto
itself and freeing would free the shard. Such a unit goes through the same states and hooks
(its parameters refuse reads while it is "sharded", so code written at one rank runs at N),
but allocates, gathers and frees nothing: no working set beside the shards and no copy in
forward or backward, as FSDP1 runs unsharded at world size 1.

[Note: a sharded parameter refuses reads]
While its unit is sharded a parameter keeps its shape, dtype and device over a storage of 0
bytes ([Note: storage, not .data]), and torch's kernels do not check a tensor's bytes against
its shape: `p.sum()` there would read freed memory and crash the process (a segmentation
fault), and so would `print(p)`, `p.norm()` or `torch.save(model.state_dict())` outside forward.
So while its unit is not gathered each parameter's Python class is switched to a subclass of
its own class (`sharded_class`: `isinstance(p, nn.Parameter)` still holds) whose
`__torch_function__` lets metadata through (shape, dtype, device, numel, requires_grad,
`.grad` read and written, hooks) and refuses anything that reads or writes the values with a
RuntimeError naming the ways to the whole parameter: `engine.summon_full_params()`,
`engine.state_dict(full=True)`, `engine.save()`. Gathering switches the class back before the
unit computes, so forward and backward run on plain parameters and pay nothing; a switch is
one attribute store. The shape stays the logical one, as FSDP2's sharded
DTensor parameters keep theirs (FSDP1 shows a 1-D view of the local shard instead): counting
`p.numel()` over `model.parameters()` still gives the model's size, and `.grad` (a
`ShardedGrad` of the parameter's shape, core/params/sharded_tensors.py) stays assignable. The class and its
refusals live in core/params/sharded_tensors.py, beside `ShardedGrad`.

[Note: gather again in backward]
With reshard_after_forward=True a unit's parameters are gone after its forward, but its
backward needs them (the gradient w.r.t. the input of `x @ W` is `grad @ W`). A tensor hook
on the unit's outputs fires when their gradient is complete, just before the unit's own
backward ops run: `pre_backward` gathers there. The unit's backward is over when (a) every
trainable flat param's gradient has been reduced and (b) the gradient w.r.t. its inputs has
been computed — (b) is observed by an identity autograd function applied to the inputs in
`pre_forward`, whose backward runs after the unit's whole backward. (a) alone is not enough:
a frozen weight used before the first trainable one is still needed for the input gradient
after every parameter gradient is final. Then `post_backward` frees the unit (the root stays
whole until the end of backward: its first ops, the embedding, may still be ahead) and hands the
gradients it held to the stage to reduce (stages/zero3.py [Note: reduce once the unit's backward is
over]).

[Note: activation checkpointing]
Non-reentrant `torch.utils.checkpoint` re-runs a unit's forward *inside* backward when its
saved tensors are first unpacked, which is after `pre_backward` gathered the unit. That re-run
fires the unit's forward hooks again; inside backward they only make sure the unit is whole:
they neither record order, nor watch inputs, nor reshard. The unit stays whole until its
backward is done.

[Note: torch.compile]
Compiling each wrapped block (`block.compile()`) or the whole model (`model.compile()`, after
`zk.shard`) traces modules whose forward hooks gather and free units: they swap parameter
classes, resize storages and issue collectives, nothing a graph can hold. So every stage-3
forward hook is wrapped by `eager` (`torch._dynamo.disable`), as torch FSDP2's hooks are skipped
by dynamo: the trace breaks at each hook, the hook runs as plain Python, and tracing resumes on
a gathered unit, whose parameters are plain ones again. Before its root hook has run, dynamo
reads the sharded parameters' metadata (`is_conj()`, `is_neg()`, ...), which
`_SHARDED_PARAM_METHODS` lets through. Gradient hooks run in autograd's engine, outside any
trace. Compiled or not, the same ops run on the same values: tests/distributed/test_compile.py
checks bitwise equality with eager at every stage, whole model and per block.

[Note: forward methods]
The root unit (embeddings, final norm, head) is gathered by a forward pre-hook on the model, so
it runs when the model is *called*. Some methods run the model's parts without calling it: a
PEFT `PeftModel.generate` calls the inner model's `generate`, whose forwards call the inner
model, not the PeftModel the engine wraps, and their first read of a root parameter would be
refused ([Note: a sharded parameter refuses reads]). `engine.register_forward_method(name)`
wraps the method as FSDP2's `register_fsdp_forward_method` does (`wrap_forward_method`): the
root is gathered before it runs and the model freed after it (or, if its output requires grad,
kept for backward as after a call). Units still gather and free themselves around each of their
forwards. The method's pass is recorded apart from training's (core/params/prefetch.py [Note: recorded
prefetch order]): a generate calls each unit once per new token, and were that the record, the
next training forward would keep units gathered for calls that never come.
"""
from __future__ import annotations

import contextlib
import enum
import functools
from typing import Callable, Iterator

import torch
from torch import nn

from zerokit.core.config import WrapPolicy, wrap_matcher
from zerokit.core.params.flat_param import FlatParamLayout, ParamInfo, summarize_names
from zerokit.core.collectives.gather import free_storage
from zerokit.core.nest import map_tensors, tensors_in
from zerokit.core.params.prefetch import RecordedOrder
from zerokit.core.params.sharded_tensors import sharded_class


class UnitState(enum.Enum):
    """Which tensors of a unit are alive (besides the persistent param shards, alive in every state).

    SHARDED    flat_data storage is 0 bytes; the parameters are views of nothing usable.
    GATHERING  flat_data storage allocated, an all-gather into it in flight (a prefetch).
    UNSHARDED  parameters usable; during backward also autograd's gradients of the unit's
               parameters, which the unit holds (`held`) until its backward is over and it is freed;
               then they are packed and reduce-scattered (the stage holds those).
    """

    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


class Unit:
    """One unit's flat params, their storage, and where they are in their lifecycle."""

    def __init__(self, index: int, name: str, module: nn.Module, flat_params: list[FlatParamLayout],
                 param_shards: list[torch.Tensor], flat_data: list[torch.Tensor], comm, gather_stream=None,
                 reduce: Callable[[list], None] | None = None):
        """`reduce`: the stage's call for the gradients the unit held until its backward was over
        ([Note: reduce once the unit's backward is over])."""
        self.index = index
        self.name = name  # qualified module name; "" for the root unit
        self.module = module
        self.is_root = index == 0
        self.flat_params = flat_params
        self.param_shards = param_shards  # (shard_numel,) each, persistent
        self.flat_data = flat_data  # (padded_numel,) each; storage 0 bytes while sharded
        self.comm = comm
        self.gather_stream = gather_stream  # CUDA: gathers run on this side stream
        self.reduce = reduce
        # One rank: each flat buffer is its param shard, never freed nor gathered ([Note: one rank])
        self.in_place = all(flat is shard for flat, shard in zip(flat_data, param_shards))
        self.held: list = []  # complete gradients (the stage's flat param states) not yet handed to `reduce`
        self.state = UnitState.SHARDED
        self._handles: list = []  # in-flight all-gathers (GATHERING, no side stream)
        self._event = None  # CUDA: recorded on the gather stream after the gathers
        self.num_trainable = sum(1 for fp in flat_params if fp.requires_grad)
        # Each parameter's own class and its sharded twin: [Note: a sharded parameter refuses reads]
        self._classes = []
        for fp in flat_params:
            for p, names in zip(fp.params, fp.names):
                own, sharded = type(p), sharded_class(type(p))
                try:
                    p.__class__ = sharded
                except TypeError:  # a parameter class with a layout of its own: Python cannot switch it
                    continue
                p._zerokit_name = names[0]
                self._classes.append((p, own, sharded))
        # What the collective recorder calls each gather (core/collectives/recorder.py): "unit blocks.0", and
        # with several flat params (frozen ones apart, say) which one: "unit blocks.0 (blocks.0.fc1.*)".
        what = f"unit {name or '<root>'}"
        self.gather_labels = [what] if len(flat_params) == 1 else [
            f"{what} ({summarize_names([names[0] for names in fp.names])})" for fp in flat_params]
        self.reset_backward()
        self._show_params(sharded=True)  # the stage built the unit sharded

    def gathered_buffers(self) -> list[torch.Tensor]:
        """The flat buffers alive beside the shards now (the working set): none while sharded, nor ever at
        one rank, where each buffer is its shard ([Note: one rank])."""
        return [] if self.in_place else [t for t in self.flat_data if t.untyped_storage().nbytes() > 0]

    def _show_params(self, sharded: bool) -> None:
        """Switch the parameters' class: refusing reads while sharded, their own when gathered."""
        for p, own, guarded in self._classes:
            p.__class__ = guarded if sharded else own

    # -- unshard / reshard ----------------------------------------------------------------
    def start_unshard(self, phase: str) -> None:
        """Allocate the flat buffers and launch their all-gathers (async): SHARDED -> GATHERING."""
        assert self.state is UnitState.SHARDED, (self.name, self.state)
        if self.in_place:  # nothing to allocate or gather: [Note: one rank]
            self.state = UnitState.GATHERING
            return
        for flat in self.flat_data:
            _alloc_storage(flat)  # on the compute stream; see below
        if self.gather_stream is None:  # a unit's flat params (trainable, frozen, per group), issued together
            # Not coalesced: a coalesced gather costs a temporary of the whole unit at backward's peak; on gloo each
            # gather is broadcasts into the flat buffer, with no temporary at all (Comm.all_gather_many).
            self._handles = [self.comm.all_gather_many(self.flat_data, self.param_shards, phase=phase,
                                                       labels=self.gather_labels, coalesce=False)]
        else:
            # The side stream first waits for the compute stream (the optimizer may just have
            # written the shards), gathers, and records an event the compute stream waits on
            # before using the params. The storage was allocated on the compute stream and
            # every free happens after that wait, so no record_stream is needed.
            self.gather_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.gather_stream):
                for flat, shard, label in zip(self.flat_data, self.param_shards, self.gather_labels):
                    # wait() on NCCL only makes the (side) stream wait; the CPU goes on.
                    self.comm.all_gather(flat, shard, async_op=True, phase=phase, label=label).wait()
                self._event = torch.cuda.Event()
                self._event.record(self.gather_stream)
        self.state = UnitState.GATHERING

    def wait_unshard(self) -> None:
        """GATHERING -> UNSHARDED: the CPU waits for the gathers (gloo), or the GPU does (a CUDA event)."""
        if self.state is not UnitState.GATHERING:
            return
        for handle in self._handles:
            handle.wait()
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        self._handles, self._event = [], None
        self.state = UnitState.UNSHARDED
        self._show_params(sharded=False)

    def unshard(self, phase: str) -> None:
        """Make the parameters usable now, gathering them unless a prefetch already started."""
        if self.state is UnitState.SHARDED:
            self.start_unshard(phase)
        self.wait_unshard()

    def reshard(self) -> None:
        """Free the flat buffers (storage back to 0 bytes): -> SHARDED."""
        if self.state is UnitState.SHARDED:
            return
        self.wait_unshard()  # never free memory a gather is still writing
        for flat in self.flat_data if not self.in_place else ():
            free_storage(flat)
        self.state = UnitState.SHARDED
        self._show_params(sharded=True)

    # -- forward ----------------------------------------------------------------------------
    def pre_forward(self, args: tuple, kwargs: dict):
        """Unshard; under grad mode, watch the inputs' gradients (see [Note: gather again in backward]).

        Returns (args, kwargs) with the watched tensors replaced, or None when nothing changed.
        """
        self.unshard("forward")
        if not torch.is_grad_enabled():
            return None
        inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if not inputs:
            return None
        self.pending_inputs += 1
        watched = _InputsGradDone.apply(self._inputs_grad_done, *inputs)
        replace = {id(t): w for t, w in zip(inputs, watched)}
        return map_tensors((args, kwargs), lambda t: replace.get(id(t), t))

    def post_forward(self, output, pre_backward: Callable[[], None], reshard: bool) -> None:
        """Arrange for `pre_backward` to run before this call's backward; free the params if `reshard`."""
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(lambda grad: pre_backward())
        if reshard:
            self.reshard()

    # -- backward ---------------------------------------------------------------------------
    def pre_backward(self) -> bool:
        """The unit's backward is about to run: unshard. True the first time in this backward."""
        first = not self.backward_started
        self.backward_started = True
        if first or self.state is not UnitState.UNSHARDED:
            self.unshard("backward")
        return first

    def grad_ready(self, state) -> None:
        """One of the unit's trainable flat params has its whole gradient (`state`, the stage's): the root's is
        reduced now, every other unit's once its backward is over (stages/zero3.py [Note: reduce once the
        unit's backward is over])."""
        self.pending_grads -= 1
        self.held.append(state)
        if self.is_root:
            self.hand_over()
        self.post_backward()

    def hand_over(self) -> None:
        """The held gradients go to the stage's `reduce`, in the order they became complete."""
        held, self.held = self.held, []
        if held:
            self.reduce(held)

    def _inputs_grad_done(self) -> None:
        self.pending_inputs -= 1
        self.post_backward()

    @property
    def backward_done(self) -> bool:
        return self.backward_started and self.pending_grads == 0 and self.pending_inputs == 0

    def post_backward(self) -> None:
        """Once the unit's backward is over: free the params, then reduce its gradients. The root stays whole
        until the end of backward."""
        if not self.is_root and self.pending_grads == 0 and self.pending_inputs == 0:
            self.reshard()
            self.hand_over()

    def abandon_pass(self) -> None:
        """A forward or backward that raised left this unit gathered, or gathering, or counting: wait for its
        gathers, free it, reset its counters (core/engine.py [Note: recovery after an exception])."""
        self.reshard()
        self.reset_backward()

    def reset_backward(self) -> None:
        self.pending_grads = self.num_trainable  # trainable flat params whose gradient is not complete yet
        self.pending_inputs = 0  # watched forward calls whose input gradient is not computed yet
        self.backward_started = False
        self.held = []


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


# ---------------------------------------------------------------------- which params go where
def split_into_units(module: nn.Module, wrap: WrapPolicy,
                     infos: list[ParamInfo]) -> list[tuple[str, nn.Module, list[ParamInfo]]]:
    """(name, module, params) per unit: the root first ("", the whole model, every param no unit
    claims), then the matching submodules in registration order, the outermost match winning.

    ValueError for a parameter tied across two units (it could not be gathered and freed with both).
    """
    matches = wrap_matcher(wrap)
    found: list[tuple[str, nn.Module]] = []
    claimed: set[int] = set()

    def visit(prefix: str, m: nn.Module) -> None:
        for child_name, child in m.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if id(child) in claimed:
                continue
            if matches(child):
                claimed.add(id(child))
                found.append((name, child))
            else:
                visit(name, child)

    visit("", module)
    prefixes = [(k, name + ".") for k, (name, _) in enumerate(found, start=1)]

    def unit_of(param_name: str) -> int:
        return next((k for k, prefix in prefixes if param_name.startswith(prefix)), 0)

    def where(k: int) -> str:
        return "the root unit" if k == 0 else f"unit {found[k - 1][0]!r}"

    members: list[list[ParamInfo]] = [[] for _ in range(len(found) + 1)]
    for info in infos:
        owners = [unit_of(n) for n in info.names]
        for name, owner in zip(info.names[1:], owners[1:]):
            if owner != owners[0]:
                raise ValueError(
                    f"zerokit stage 3: parameter {info.names[0]!r} ({where(owners[0])}) is tied to {name!r} "
                    f"({where(owner)}); a parameter shared by two units cannot be gathered and freed with "
                    f"both. Wrap a module that contains both, or untie them")
        members[owners[0]].append(info)
    return [(name, m, params) for (name, m), params in zip([("", module)] + found, members)]


# ---------------------------------------------------------------------- stage 3's helpers
def keep_shard(fp: FlatParamLayout, data: torch.Tensor) -> torch.Tensor:
    """Stage 3's construction: this rank's (shard_numel,) range of flat buffer `data`, a persistent copy, and
    `data`'s storage freed (the unit starts sharded); at one rank `data` itself ([Note: one rank])."""
    if fp.layout.world_size == 1:
        return data
    shard = fp.shard_of(data).clone()
    free_storage(data)
    return shard


@contextlib.contextmanager
def gathered(units: list[Unit], snapshot: bool = False) -> Iterator[list[torch.Tensor]]:
    """Every unit whole inside the block (summon_full_params). A unit already gathered (between forward and
    backward: the root, units kept by reshard_after_forward=False, a prefetched one) is used as it is and
    stays gathered, in the same storage, so the views autograd saved from it stay valid for backward;
    every other unit is freed after the block.

    Yields every unit's param shards in order, as they were before the block: the shards themselves,
    which the block does not change, except at one rank, where the block changes them in place
    ([Note: one rank]) and, with `snapshot`, a copy is yielded instead."""
    was_gathered = [unit.state is not UnitState.SHARDED for unit in units]
    before = [s.clone() if snapshot and unit.in_place else s for unit in units for s in unit.param_shards]
    for unit in units:
        unit.unshard("summon")  # a prefetch in flight completes here; it stays gathered
    try:
        yield before
    finally:
        for unit, keep in zip(units, was_gathered):
            if not keep:
                unit.reshard()


def hand_over_all(units: list[Unit]) -> None:
    """End of backward: every unit's held gradients go to be reduced, in unit order (the same on every rank), e.g. a
    unit whose inputs' gradient was never computed (its output reached the loss, its inputs did not)."""
    for unit in units:
        unit.hand_over()


def reshard_all(units: list[Unit]) -> None:
    """Free every unit and forget its backward bookkeeping (end of backward, a forward nothing backpropagates)."""
    for unit in units:
        unit.reshard()
        unit.reset_backward()


def prefetch(units: list[Unit], upcoming: list[int], phase: str) -> None:
    """Start gathering the units a recorded order predicts next (core/params/prefetch.py), those still sharded."""
    for k in upcoming:
        unit = units[k]
        if unit.state is UnitState.SHARDED and not unit.backward_done:
            unit.start_unshard(phase)


def packed_grads(fp: FlatParamLayout) -> torch.Tensor:
    """The params' own gradients written as 0 + g into a new (padded_numel,) full gradient (zeros where no gradient
    reached, and in the padding); `.grad` becomes its views and autograd's tensors go (stages/zero3.py [Note:
    gradients packed when complete])."""
    grad = torch.empty(fp.padded_numel, dtype=fp.dtype, device=fp.device)  # (padded_numel,)
    for j, p in enumerate(fp.params):  # the ranges lie back to back from 0 to numel
        view = fp.param_view(grad, j)
        if p.grad is None or p.grad.layout != torch.strided:
            view.zero_()  # a param no gradient reached has zeros
            if p.grad is not None:  # a sparse gradient (nn.Embedding(sparse=True)) adds onto them
                view.add_(p.grad)
        else:  # 0 + g, written in one pass: the bits of autograd's accumulation into a zeroed view (-0 becomes 0)
            torch.add(p.grad, 0.0, out=view)
    grad[fp.layout.numel:].zero_()  # the padding
    fp.use_as_grad_storage(grad)
    return grad


def wrap_forward_method(engine, name: str) -> None:
    """`module.<name>(...)` gathers the root unit and frees the model after, as a call of the module does
    ([Note: forward methods]); drives the stage-3 engine's root hooks (stages/zero3.py)."""
    method = getattr(engine.module, name)
    if getattr(method, "_zerokit_forward_method", False):
        return

    @functools.wraps(method)
    def call(*args, **kwargs):
        if engine._in_forward or engine.tracker.in_backward:  # already inside a pass: the root is whole
            return method(*args, **kwargs)
        saved, engine.forward_order = engine.forward_order, RecordedOrder(engine.forward_order.recorded)
        try:
            engine._root_pre_forward(engine.module, args)
            output = method(*args, **kwargs)
        except BaseException:
            engine._in_forward = False
            reshard_all(engine.units)
            raise
        finally:
            engine.forward_order = saved
        engine._in_forward = False
        if any(t.requires_grad for t in tensors_in(output)):
            engine.units[0].post_forward(output, engine.tracker.begin_backward, reshard=False)
        else:
            reshard_all(engine.units)
        return output

    call._zerokit_forward_method = True
    setattr(engine.module, name, call)  # an instance attribute: it shadows the class's method


def eager(hook: Callable) -> Callable:
    """`hook` run as plain Python under torch.compile: [Note: torch.compile]."""
    return torch._dynamo.disable(hook, recursive=True)


def _alloc_storage(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


