"""Optimizers that need whole parameters: each one stepped by one owner rank, in the module's shape.

[Note: elementwise or whole parameters]
The sharded optimizer (optim/sharded.py) runs the wrapped optimizer over 1-D shards of flat buffers.
That is exact only for an *elementwise* optimizer, one whose update of an element reads nothing but
that element's gradient, value and state (SGD, Adam, AdamW, ...): then a shard is as good as the
parameter. An optimizer whose update reads a parameter's shape or a reduction over it — Adafactor's
row and column statistics, Muon's orthogonalized 2-D update, LAMB's and LARS's per-parameter trust
ratio ||w|| / ||update||, Shampoo's preconditioners, a user's `step` reading `p.shape` or `p.norm()` —
computes something else on a flat shard, silently. So zerokit decides by class (`is_elementwise`):

- torch's elementwise optimizers (ELEMENTWISE below; a subclass that does not override `step`), and a
  class that declares `elementwise = True`, take the flat path;
- every other class takes this whole-parameter path (`elementwise = False` forces it for any class);
- LBFGS (one closure-driven group over every parameter) and SparseAdam (sparse gradients only) are
  refused at zk.shard, naming the fix.

The whole-parameter path keeps the flat layout, the master shards and every collective of the stage,
and changes only who steps what. Each parameter is stepped by one *owner*: the rank whose shard holds
its first element, so ownership follows the layout (about 1/N of the parameters each) and is the same
on every rank without a message. The wrapped optimizer is built over the owned parameters in their
module shapes:

- a parameter that lies inside its owner's shard is a view of the master shard (and its gradient a
  view of the grad shard): nothing moves, and at stage 0 (or one rank), where the shard is the whole
  buffer, every parameter is such a view: the optimizer sees exactly DDP's parameters;
- a parameter that crosses a shard boundary (a *straddler*) is gathered for the step: every rank
  all-gathers the buffer's fp32 gradient and master shards (two (padded_numel,) transients, one
  buffer at a time), the owner copies its straddlers out of them into tensors of its own (whose
  storage is freed between steps), steps, and broadcasts each straddler's new value over the shard
  group to the ranks whose shards hold a part of it.

Only buffers that hold a straddler communicate; each is stepped by its own `optimizer.step()` call
(the others in one call), so the transients are one buffer's. Every parameter's update is computed
from its whole gradient, value and state, as DDP computes it, so the bits are DDP's at every stage
(tests/distributed/test_optimizer_classes.py). What it costs over the flat path, per step and
buffer with a straddler: all-gathers of 2 x 4 bytes x padded_numel and broadcasts of 4 bytes per
straddler element (`zerokit explain --optimizer` counts them), and the owner's state for a whole
parameter instead of a shard's (the same total over ranks, less evenly spread).

One limit: the update of a parameter may read that parameter and its own state only. An optimizer
that reads *other* parameters in its step (a global norm over every parameter) cannot be split
across owners and calls; at stage 0 it is exact (one call over every parameter), at stages 1-3 it
is not, and no class-based rule can tell: such an optimizer belongs before zk.shard's step (use
engine.clip_grad_norm_ for a global norm).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zerokit.core.collectives.comm import Comm
from zerokit.core.collectives.gather import free_storage

# torch's elementwise optimizers: each element's update reads only that element (and 0-dim per-parameter
# counters): a 1-D shard of a flat buffer steps exactly like the parameters it holds.
ELEMENTWISE: tuple[type, ...] = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "ASGD", "Rprop")
    if hasattr(torch.optim, name))

REFUSED = {
    "LBFGS": "LBFGS steps one group over every parameter with a closure that re-evaluates the whole model; "
             "it has no sharded form: use it without zk.shard, or a first-order optimizer",
    "SparseAdam": "SparseAdam accepts only sparse gradients, and zerokit's flat gradients are dense: use "
                  "torch.optim.Adam (or AdamW), which zerokit steps exactly like DDP",
}


def is_elementwise(optimizer_cls: type) -> bool:
    """Whether a shard steps like the parameters it holds ([Note: elementwise or whole parameters]).

    A class attribute `elementwise` (True or False) decides; otherwise torch's elementwise optimizers, and
    subclasses of them that keep their `step`, are elementwise, and every other class is not."""
    if optimizer_cls.__name__ in REFUSED and optimizer_cls.__module__.startswith("torch.optim"):
        raise TypeError(f"zk.shard: {REFUSED[optimizer_cls.__name__]}")
    declared = getattr(optimizer_cls, "elementwise", None)
    if declared is not None:
        return bool(declared)
    return any(issubclass(optimizer_cls, base) and optimizer_cls.step is base.step for base in ELEMENTWISE)


def _shaped(flat: torch.Tensor, shape, stride) -> torch.Tensor:
    """A parameter's (numel,) range as the module sees it: its shape, and its strides where it keeps them
    (core/params/flat_param.py [Note: parameters keep their strides])."""
    return flat.view(shape) if stride is None else flat.as_strided(shape, stride)


def owner_of(offset: int, shard_numel: int, world_size: int) -> int:
    """The rank that steps the parameter whose first element is at `offset`: the one whose shard holds it."""
    return 0 if shard_numel == 0 else min(offset // shard_numel, world_size - 1)


def crosses(offset: int, numel: int, shard_numel: int) -> bool:
    """Whether elements [offset, offset + numel) lie in more than one shard (a straddler)."""
    return numel > 0 and shard_numel > 0 and offset // shard_numel != (offset + numel - 1) // shard_numel


def step_cost(layouts, world_size: int, master_bytes: int = 4) -> dict[str, int]:
    """What the whole-parameter path adds to each step over the flat path, per rank, for these layouts
    (core/params/partition.py FlatLayout: `offsets`, `numels`, `padded_numel`, `shard_numel`): counted the way
    core/collectives/comm.py counts (an all-gather's output bytes, a broadcast's tensor bytes), and how unevenly it
    spreads the parameters whose state a rank holds. Nothing at one rank or where the shard is the buffer."""
    out = {"buffers": len(layouts), "buffers_gathered": 0, "all_gather_bytes": 0, "broadcast_bytes": 0,
           "transient_bytes": 0, "straddlers": 0, "max_owned_elements": 0, "shard_elements": 0}
    owned = [0] * world_size
    for layout in layouts:
        shard = layout.shard_numel
        out["shard_elements"] += shard
        spans = [(o, n) for o, n in zip(layout.offsets, layout.numels)]
        for o, n in spans:
            owned[owner_of(o, shard, world_size)] += n
        if world_size == 1:
            continue
        cross = [n for o, n in spans if crosses(o, n, shard)]
        if cross:
            out["buffers_gathered"] += 1
            out["straddlers"] += len(cross)
            out["all_gather_bytes"] += 2 * layout.padded_numel * master_bytes
            out["broadcast_bytes"] += sum(cross) * master_bytes
            out["transient_bytes"] = max(out["transient_bytes"], 2 * layout.padded_numel * master_bytes)
    out["max_owned_elements"] = max(owned)
    return out


@dataclass(eq=False)
class Owned:
    """A parameter this rank steps: `tensor` is what the wrapped optimizer holds, in the module's shape."""

    buffer: int  # which master shard (index into the optimizer's shards)
    index: int  # which parameter of that buffer's layout
    offset: int  # its first element in the flat buffer
    numel: int
    tensor: torch.Tensor  # a view of the master shard, or (a straddler) a tensor of its own, freed between steps
    local: bool  # inside this rank's shard: no communication


@dataclass(eq=False)
class Straddler:
    """A parameter crossing a shard boundary of its buffer (every rank knows every one)."""

    index: int
    offset: int
    numel: int
    owner: int


class WholeParams:
    """Which parameters this rank steps, and the gathers and broadcasts around their step.

    `layouts[k]` is the FlatParamLayout of `masters[k]` (a (shard_numel,) master shard, or at stage 0 the
    whole (padded_numel,) buffer)."""

    def __init__(self, layouts: list, masters: list[torch.Tensor], comm):
        self.comm = comm
        self.layouts = layouts
        self.masters = masters
        self.owned: list[list[Owned]] = []  # per buffer, in flat order
        self.straddlers: list[list[Straddler]] = []  # per buffer: gathered and broadcast at each step
        self.lo: list[int] = []  # where each master begins in its buffer
        for k, (fp, master) in enumerate(zip(layouts, masters)):
            whole = master.numel() == fp.padded_numel
            lo = 0 if whole else fp.shard_range[0]
            self.lo.append(lo)
            shard = fp.shard_numel
            owned, straddlers = [], []
            for j, (o, n, shape) in enumerate(zip(fp.layout.offsets, fp.layout.numels, fp.layout.shapes)):
                owner = comm.rank if whole else owner_of(o, shard, comm.world_size)
                straddles = not whole and crosses(o, n, shard)
                if straddles:
                    straddlers.append(Straddler(j, o, n, owner))
                if owner != comm.rank:
                    continue
                stride = fp.strides[j]  # the module's strides (channels_last...), or None: contiguous
                if straddles:
                    tensor = (torch.empty(shape, dtype=master.dtype, device=master.device) if stride is None else
                              torch.empty_strided(shape, stride, dtype=master.dtype, device=master.device))
                    free_storage(tensor)
                else:
                    tensor = _shaped(master[o - lo:o - lo + n], shape, stride)
                owned.append(Owned(k, j, o, n, tensor, not straddles))
            self.owned.append(owned)
            self.straddlers.append(straddlers)

    def gathers(self, k: int) -> bool:
        """Whether buffer k's step communicates (the same answer on every rank)."""
        return bool(self.straddlers[k])

    def params(self, k: int) -> list[torch.Tensor]:
        return [own.tensor for own in self.owned[k]]

    def prepare(self, ks: list[int]) -> list:
        """Before `optimizer.step()` over buffers `ks` (their masters' `.grad` set): give every owned parameter
        its whole value and gradient. Returns what `finish` needs (the gathered masters)."""
        held = []
        for k in ks:
            master, lo = self.masters[k], self.lo[k]
            grad = master.grad
            full_m = full_g = None
            if self.gathers(k):
                fp = self.layouts[k]
                full_g = torch.empty(fp.padded_numel, dtype=grad.dtype, device=grad.device)
                full_m = torch.empty(fp.padded_numel, dtype=master.dtype, device=master.device)
                self.comm.all_gather(full_g, grad, label=f"{fp.label}: gradient for whole-parameter steps",
                                     phase="step")
                self.comm.all_gather(full_m, master.detach(), label=f"{fp.label}: masters for whole-parameter "
                                     "steps", phase="step")
            strides = self.layouts[k].strides
            for own in self.owned[k]:
                a, b = own.offset, own.offset + own.numel
                shape, stride = own.tensor.shape, strides[own.index]
                if own.local:
                    own.tensor.grad = _shaped(grad[a - lo:b - lo], shape, stride)
                else:
                    own.tensor.untyped_storage().resize_(own.numel * own.tensor.element_size())
                    with torch.no_grad():
                        own.tensor.copy_(_shaped(full_m[a:b], shape, stride))
                    own.tensor.grad = _shaped(full_g[a:b], shape, stride)
            held.append(full_m)
            del full_g
        return held

    def finish(self, ks: list[int], held: list) -> None:
        """After the step: each straddler's owner broadcasts its new value over the shard group; every rank
        copies the part its master holds. Frees the straddlers' storage and lets go of the gradients."""
        for k, full_m in zip(ks, held):
            master, lo = self.masters[k], self.lo[k]
            hi = lo + master.numel()
            mine = {own.index: own for own in self.owned[k]}
            fp = self.layouts[k]
            for s in self.straddlers[k]:
                value = full_m[s.offset:s.offset + s.numel]
                if s.owner == self.comm.rank:
                    tensor = mine[s.index].tensor.detach()
                    _shaped(value, tensor.shape, fp.strides[s.index]).copy_(tensor)
                # the shard group's broadcast, also under hybrid sharding (whose own broadcast spans the world)
                Comm.broadcast(self.comm, value, src=s.owner, phase="step",
                               label=f"{fp.label}: parameter {s.index} stepped whole by rank {s.owner}")
                a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < b:
                    with torch.no_grad():
                        master[a - lo:b - lo].copy_(full_m[a:b])
            for own in self.owned[k]:
                own.tensor.grad = None
                if not own.local:
                    free_storage(own.tensor)
