"""Flat parameters: many module parameters stored as views into one padded 1-D buffer.

Parameters are grouped by (dtype, requires_grad, hyperparameter overrides); each group
is cut into buckets of at most `bucket_numel` elements (stage 1: closing once they reach
it), walking parameters in reverse registration order, the order gradients arrive (stage 3
cuts per unit and never splits a group), and each bucket is described by one `FlatParamLayout`:

    flat_param  (padded_numel,)   p0 | p1 | p2 | zero padding (< world_size)
    param_shard (shard_numel,)    this rank's range [rank * shard_numel, (rank + 1) * shard_numel)

A module parameter keeps its identity (the same `nn.Parameter` object, so user code,
optimizers and `state_dict` see it) while its `.data` becomes a view into the flat
buffer; its `.grad` can likewise be made a view into a flat gradient buffer, so autograd
accumulates gradients directly in communication-ready storage, never copied afterwards.

A tied parameter (one Parameter reachable under two names) is stored once, by identity;
all its names are kept for checkpoints. Frozen parameters (LoRA base weights) form
their own flat buffers: no gradient, no master copy, no optimizer state.

[Note: packed byte parameters]
A quantized weight (zerokit/quant.py) is a frozen uint8 parameter whose `zerokit_packed` says how
it is encoded (format, element count, block size): bytes that encode values, not values. It is the one non-floating parameter an engine accepts
(`is_packed`). Its flat buffers hold bytes and stay bytes under every precision (a cast would
destroy the codes), so every stage keeps, gathers and checkpoints the quantized form: stages 0-2
replicate it, stage 3 shards and all-gathers its bytes, and `engine.memory()` counts it as
"quantized_params". The dtype is part of the grouping key, so it never shares a buffer.

[Note: parameters keep their strides]
A parameter whose strides are not the contiguous ones but are non-overlapping and dense (every element
of a numel-long block once: a `channels_last` conv weight, a Parameter made from `torch.randn(8, 4).t()`)
keeps them: its range of the flat buffer holds its elements in its own storage order, and its view (and
its `.grad` view) is `as_strided` over that range with the user's strides, so the module's kernels see
the memory format DDP would give them (DDP keeps the parameters as they are), and the same bits come out.
Elementwise work on the flat buffers (reductions, sharding, the optimizer) does not care about the order
within a range; whatever maps a range to a parameter's logical elements goes through the views, or through
`to_storage_order` / `to_logical_order` (a checkpoint holds logical values: zerokit/checkpoint/). Any
other parameter (overlapping, or a view with gaps) is laid out contiguously, as before.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from zerokit.core.params.bucketing import plan_buckets
from zerokit.core.config import ParamGroupFn
from zerokit.core.params.materialize import deferred_of, is_deferred
from zerokit.core.params.partition import FlatLayout
from zerokit.core.precision import master_dtype_of
from zerokit.core.params.sharded_tensors import ShardedGrad

# The engine's own reads and writes of `.grad` skip Python-level dispatch: a stage-3 parameter whose
# unit is sharded routes every attribute through its class's __torch_function__ (core/params/unit.py [Note:
# a sharded parameter refuses reads]), a few microseconds each, and those calls read no values.
_no_subclass_dispatch = torch._C.DisableTorchFunctionSubclass



class FlatParamLayout:
    """Which parameters one padded flat buffer holds and where: a layout, no storage of its own.

    The storage is the stage's: `flat_data` (padded_numel,) params (a list indexed by
    `index`), and the gradients on its `FlatParamState` (below). This object makes module
    parameters views into them (`flatten_params`, `use_as_param_storage`,
    `use_as_grad_storage`) and remembers what it put in each `.grad` (core/grads/user_grads.py).
    `kind` is what it is called in words: a "bucket" at stages 0-2, a "flat param" at stage 3.
    """

    def __init__(self, index: int, names: list[list[str]], params: list[nn.Parameter], dtype: torch.dtype,
                 requires_grad: bool, options: dict, world_size: int, rank: int, kind: str = "bucket"):
        self.index = index  # position in the engine's list: the order collectives are issued
        self.kind = kind
        self.names = names  # names[i]: every name of params[i] (more than one when tied)
        self.params = params
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.options = options  # optimizer hyperparameter overrides shared by these params
        self.rank = rank
        self.layout = FlatLayout.build([tuple(p.shape) for p in params], world_size)
        # params[i]'s strides where they are not the contiguous ones: [Note: parameters keep their strides]
        self.strides: list[tuple[int, ...] | None] = [dense_strides(p) for p in params]
        self.device = params[0].device
        self._shown_grads: list = [p.grad for p in params]  # what the engine last put in each `.grad`
        self._grad_views: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # (flat grad, its views)

    # extents -------------------------------------------------------------
    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def padded_numel(self) -> int:
        return self.layout.padded_numel

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.layout.shard_range(self.rank)

    @functools.cached_property
    def label(self) -> str:
        """This flat param in words: "bucket 3 (blocks.2.*)" (stage 3: "flat param 3 (blocks.2.*)"). What the
        collective recorder (core/collectives/recorder.py) and debug mode's errors name a reduction by; the index is its
        collective order."""
        return f"{self.kind} {self.index} ({summarize_names([names[0] for names in self.names])})"

    # storage helpers -------------------------------------------------------
    def new_flat(self, dtype: torch.dtype | None = None, numel: int | None = None) -> torch.Tensor:
        """A zero buffer of `padded_numel` (or `numel`) elements on the params' device."""
        n = self.padded_numel if numel is None else numel
        return torch.zeros(n, dtype=dtype or self.dtype, device=self.device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view into a (padded_numel,) buffer, shaped like the parameter, with its strides
        ([Note: parameters keep their strides])."""
        assert flat.numel() == self.padded_numel, (flat.numel(), self.padded_numel)
        return [self.param_view(flat, j) for j in range(len(self.params))]

    def param_view(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        """params[j]'s view into a (padded_numel,) buffer: its shape, and its strides where it keeps them."""
        o, n, shape, stride = self.layout.offsets[j], self.layout.numels[j], self.layout.shapes[j], self.strides[j]
        return flat[o:o + n].view(shape) if stride is None else flat[o:o + n].as_strided(shape, stride)

    def write_params(self, flat: torch.Tensor, js, values, add: bool = False) -> None:
        """Copy (or add) values[k], a tensor of params[js[k]]'s shape in any layout, into that param's range
        of a (padded_numel,) buffer, in the range's own element order: a `.grad` user code assigned, or
        autograd's own gradient."""
        for j, value in zip(js, values):
            view = self.param_view(flat, j)
            view.add_(value) if add else view.copy_(value)

    def to_storage_order(self, j: int, logical: torch.Tensor) -> torch.Tensor:
        """params[j]'s elements given in logical (row-major) order, (numel,), rearranged into the order its
        range of the flat buffer holds them ([Note: parameters keep their strides]); itself if contiguous."""
        if self.strides[j] is None:
            return logical
        out = torch.empty(logical.numel(), dtype=logical.dtype, device=logical.device)
        out.as_strided(self.layout.shapes[j], self.strides[j]).copy_(logical.view(self.layout.shapes[j]))
        return out

    def to_logical_order(self, j: int, stored: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_storage_order`: params[j]'s (numel,) range in row-major logical order."""
        if self.strides[j] is None:
            return stored
        return stored.contiguous().as_strided(self.layout.shapes[j], self.strides[j]).reshape(-1)

    def flatten_params(self, param_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Move the parameters into flat storage; return (flat_param, master-dtype values).

        flat_param (padded_numel,) in `param_dtype` becomes every parameter's `.data`; the
        (padded_numel,) master-dtype copy (fp32; float64 for a float64 model: core/precision.py
        [Note: float64 models]) holds the exact original values, which the master shards are
        seeded from (not from their bf16/fp16 roundings). Under fp32 (and float64) both are one tensor.
        """
        if is_packed(self.params[0]):  # bytes stay bytes: [Note: packed byte parameters]
            flat = self.new_flat()
            self.copy_params_into(flat)
            self.use_as_param_storage(flat)
            return flat, flat
        master = self.new_flat(master_dtype_of(param_dtype))
        self.copy_params_into(master)
        flat_param = master if param_dtype == master.dtype else master.to(param_dtype)
        self.dtype = param_dtype
        self.use_as_param_storage(flat_param)
        return flat_param, master

    @property
    def values_dtype(self) -> torch.dtype:
        """The dtype this flat param's exact values are read and loaded in: its master dtype (fp32; float64 for
        a float64 model: core/precision.py [Note: float64 models]); a packed byte parameter's own (uint8)."""
        return master_dtype_of(self.dtype) if self.dtype.is_floating_point else self.dtype

    def copy_params_into(self, flat: torch.Tensor) -> None:
        """Write the parameters' current values into `flat` (padding stays zero).

        A parameter built on the meta device gets its initialized values here, this flat param's alone
        (core/params/materialize.py [Note: the same bits as an eager build]).
        """
        views = self.views(flat)
        for view, p in zip(views, self.params):
            if not is_deferred(p):
                view.copy_(p.detach())
        deferred = deferred_of(self.params)
        if deferred is not None:
            deferred.fill(self.params, views)

    def use_as_param_storage(self, flat: torch.Tensor) -> None:
        """Make every parameter's `.data` a view into `flat` (identity of the Parameter kept)."""
        for view, p in zip(self.views(flat), self.params):
            p.data = view

    def use_as_grad_storage(self, flat_grad: torch.Tensor | None) -> None:
        """Make every parameter's `.grad` a view into `flat_grad` (None: drop the gradients).

        Called at every zero_grad and backward; the views of the buffer are kept and reused while
        it is the same tensor and shown (stages 0-1 keep one gradient buffer for good), so a step
        slices nothing and reassigns only the `.grad`s user code changed. Views hold their
        buffer's storage, so showing anything else drops them (stages 2-3 free the buffer).
        """
        if flat_grad is None:
            self.show_grads([None] * len(self.params))
            return
        cached = self._grad_views
        if cached is None or cached[0] is not flat_grad:
            cached = (flat_grad, self.views(flat_grad))
        self.show_grads(cached[1])
        self._grad_views = cached

    def show_grads(self, grads: list[torch.Tensor | None]) -> None:
        """Put grads[j] in params[j].grad and remember it: see core/grads/user_grads.py [Note: param.grad belongs to
        the user]."""
        self._grad_views = None  # use_as_grad_storage keeps its views only while they are what is shown
        # stage 3's sharded parameters: core/params/unit.py [Note: a sharded parameter refuses reads]
        with _no_subclass_dispatch():
            for g, p in zip(grads, self.params):
                if p.grad is not g:  # assigning checks shape, dtype and device: skip what is already shown
                    p.grad = g
                if isinstance(g, ShardedGrad):
                    g.zeroed = False
        self._shown_grads = list(grads)  # kept alive, so `p.grad is shown` is an identity test

    def user_grad_changes(self) -> tuple[list[int], list[int]]:
        """Which params' `.grad` user code changed since `show_grads`: (cleared, replaced) indices.

        Cleared: set to None (model.zero_grad(), optimizer.zero_grad(), p.grad = None) or a
        ShardedGrad zeroed in place. Replaced: any other tensor assigned to `.grad`.
        """
        cleared, replaced = [], []
        with _no_subclass_dispatch():
            grads = [p.grad for p in self.params]
        for j, (g, shown) in enumerate(zip(grads, self._shown_grads)):
            if g is shown:
                if isinstance(g, ShardedGrad) and g.zeroed:
                    cleared.append(j)
            elif g is None:
                cleared.append(j)
            else:
                replaced.append(j)
        return cleared, replaced

    def sharded_grads(self, grad_shard: torch.Tensor, comm, scale) -> list[ShardedGrad]:
        """One ShardedGrad per param over its elements in this rank's range of `grad_shard` (shard_numel,).

        `comm=None` marks a replicated (padded_numel,) buffer (stage 0): then every element is local.
        """
        lo, hi = self.shard_range if comm is not None else (0, self.padded_numel)
        assert grad_shard.numel() == hi - lo, (grad_shard.numel(), lo, hi)
        out = []
        with _no_subclass_dispatch():
            for names, p, o, n in zip(self.names, self.params, self.layout.offsets, self.layout.numels):
                a, b = max(o, lo), min(o + n, hi)  # this param's elements in [lo, hi), flat coordinates
                local = grad_shard[a - lo:b - lo] if a < b else grad_shard[:0]
                out.append(ShardedGrad.make(p, local, comm, scale, names[0]))
        return out

    def grad_views_of(self, flat: torch.Tensor, js: list[int]) -> list[torch.Tensor]:
        """params[j]'s range of a (padded_numel,) buffer, for each j in js, as 1-D views."""
        return [flat[self.layout.offsets[j]:self.layout.offsets[j] + self.layout.numels[j]] for j in js]

    def zero_grad_parts(self, flat_grad: torch.Tensor, js: list[int]) -> None:
        """Zero params[j]'s range of a (padded_numel,) gradient for each j in js."""
        if len(js) == len(self.params):
            flat_grad.zero_()  # one kernel for the usual case: every gradient was cleared
            return
        for view in self.grad_views_of(flat_grad, js):
            view.zero_()

    def zero_shard_parts(self, grad_shard: torch.Tensor, js: list[int]) -> bool:
        """Zero params[j]'s part of a (shard_numel,) grad shard for each j in js; True when that was every
        param, so the whole shard is zero (the caller's "nothing accumulated yet" state)."""
        if len(js) == len(self.params):
            grad_shard.zero_()  # one kernel for the usual case: every gradient was cleared
            return True
        for part in self.shard_parts_of(grad_shard, js):
            part.zero_()
        return False

    def shard_parts_of(self, grad_shard: torch.Tensor, js: list[int]) -> list[torch.Tensor]:
        """params[j]'s elements within this rank's range, as views of a (shard_numel,) buffer."""
        lo, hi = self.shard_range
        out = []
        for j in js:
            o, n = self.layout.offsets[j], self.layout.numels[j]
            a, b = max(o, lo), min(o + n, hi)
            out.append(grad_shard[a - lo:b - lo] if a < b else grad_shard[:0])
        return out

    def write_into_state_dict(self, state_dict: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
        """Put each parameter's values from a (padded_numel,) buffer into `state_dict`, under every
        name it has (a tied parameter appears under each), as fresh tensors."""
        for names, view in zip(self.names, self.views(flat)):
            for name in names:
                state_dict[name] = view.detach().clone()

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's range of a (padded_numel,) buffer, as a view: (shard_numel,)."""
        lo, hi = self.shard_range
        return flat[lo:hi]

    def __repr__(self) -> str:
        return (f"FlatParamLayout(index={self.index}, params={len(self.params)}, numel={self.numel}, "
                f"padded={self.padded_numel}, dtype={self.dtype}, requires_grad={self.requires_grad})")


@dataclass(eq=False)
class FlatParamState:
    """A trainable flat param's gradient storage at a stage: what the stage keeps per flat param.

        flat_grad   (padded_numel,) param dtype: the full gradient autograd accumulates into
                    (stages 0-1 for good; stages 2-3 from its first gradient until reduced)
        grad_shard  (shard_numel,) reduce dtype: this rank's range of the average (stages 1-3;
                    at stage 1 a view into flat_grad unless the reduce dtype differs)
        grad_shard_written  a reduce-scatter wrote grad_shard since zero_grad: the next one adds
        shown_grads what `.grad` shows after a synced backward (ShardedGrads over grad_shard)
        unpacked    stage 3: autograd is making its params' own gradients ([Note: gradients
                    packed when complete] in stages/zero3.py)
    """
    fp: FlatParamLayout
    flat_grad: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    grad_shard_written: bool = False
    shown_grads: list | None = None
    unpacked: bool = False

    @property
    def index(self) -> int:
        return self.fp.index

    @property
    def label(self) -> str:
        return self.fp.label


def summarize_names(names: list[str], limit: int = 4) -> str:
    """Parameter names, compactly, by common dotted prefix: "blocks.2.*" for everything under one module.

    Names under different modules, or under different entries of a module list (a bucket that
    crosses a block boundary), are shown one group per module or entry, each summarised the same
    way: "blocks.0.mlp.proj.bias, blocks.1.*, ln_f.*" or "wte.weight, wpe.weight"; beyond `limit`
    groups, the first ones, "..", and the last. One name is shown whole.
    """
    shown = _name_groups([name.split(".") for name in names])
    if len(shown) > limit:
        shown = shown[:limit - 1] + ["..", shown[-1]]
    return ", ".join(shown)


def _name_groups(parts: list[list[str]]) -> list[str]:
    if len(parts) == 1:
        return [".".join(parts[0])]
    common = os.path.commonprefix(parts)  # the dotted components every name shares
    groups: dict[str, list[list[str]]] = {}
    for p in parts:
        groups.setdefault(p[len(common)] if len(p) > len(common) else "", []).append(p)
    if common and not all(key.isdigit() for key in groups):
        return [".".join(common) + ".*"]  # one module's parameters
    # no common module, or entries of one module list: one group each (each shares at least its key)
    return [shown for members in groups.values() for shown in _name_groups(members)]


def dense_strides(p: torch.Tensor) -> tuple[int, ...] | None:
    """p's strides when they are not the contiguous ones but non-overlapping and dense (a permutation of a
    contiguous layout, size-1 dimensions' strides kept as they are), else None: [Note: parameters keep
    their strides]. A packed byte parameter is always laid out contiguously."""
    shape, stride = tuple(p.shape), tuple(p.stride())
    if p.numel() < 2 or is_packed(p) or p.is_contiguous():
        return None
    expected = 1
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size != 1):
        if st != expected:
            return None
        expected *= size
    return stride


def is_packed(p: torch.Tensor) -> bool:
    """A frozen byte parameter holding encoded values: [Note: packed byte parameters]."""
    return p.dtype == torch.uint8 and not p.requires_grad and getattr(p, "zerokit_packed", None) is not None


@dataclass(frozen=True)
class ParamInfo:
    names: list[str]
    param: nn.Parameter
    options: dict


def unique_params(module: nn.Module, param_groups: ParamGroupFn | None = None) -> list[ParamInfo]:
    """Parameters in registration order, each once by identity, with all its names and overrides."""
    by_id: dict[int, ParamInfo] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in by_id:
            by_id[id(p)].names.append(name)  # a tie: stored once, known under every name
            continue
        options = dict(param_groups(name, p) or {}) if param_groups is not None else {}
        if "params" in options:
            raise ValueError(f"param_groups({name!r}) returned a 'params' key; return only hyperparameters")
        by_id[id(p)] = ParamInfo([name], p, options)
    return list(by_id.values())


def build_flat_params(infos: list[ParamInfo], world_size: int, rank: int, bucket_numel: int | None,
                      first_index: int = 0, close_when_full: bool = False, kind: str = "bucket") -> list[FlatParamLayout]:
    """Group parameters by (dtype, requires_grad, overrides) and cut each group into buckets.

    `bucket_numel=None`: one flat param per group, never split (stage 3's units).
    `close_when_full`: a bucket closes once it reaches `bucket_numel` (DDP's rule, stage 1)
    instead of never exceeding it (`plan_buckets`).

    The result is ordered by the earliest-registered parameter of each bucket, descending:
    roughly the order in which backward completes them (gradients arrive in about reverse
    registration order, so a bucket is complete once its earliest parameter's has arrived),
    which is the order every rank issues their collectives in (stages 0-2 release buckets
    strictly in this order). Ordering by the latest-registered parameter instead would put a
    bucket that spans the whole model first — with `param_groups`, the no-decay biases and
    LayerNorms of every block share one small bucket — and hold every other bucket's
    collective back until the end of backward: no overlap at all.
    """
    groups: dict[tuple, list[int]] = {}
    for i, info in enumerate(infos):
        key = (info.param.dtype, info.param.requires_grad, tuple(sorted(info.options.items())))
        groups.setdefault(key, []).append(i)
    planned: list[tuple[int, tuple, list[int]]] = []
    for key, members in groups.items():
        numels = [infos[i].param.numel() for i in members]
        cuts = plan_buckets(numels, bucket_numel, close_when_full) if bucket_numel is not None else [list(range(len(members)))]
        for bucket in cuts:
            indices = [members[j] for j in bucket]
            planned.append((min(indices), key, indices))
    planned.sort(key=lambda t: -t[0])
    flats = []
    for k, (_, (dtype, requires_grad, _opts), indices) in enumerate(planned):
        flats.append(FlatParamLayout(first_index + k, [infos[i].names for i in indices], [infos[i].param for i in indices],
                               dtype, requires_grad, infos[indices[0]].options, world_size, rank, kind))
    return flats
