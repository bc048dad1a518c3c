"""What `param.grad` shows user code, and noticing what user code did to it.

[Note: param.grad belongs to the user]
Training loops touch `param.grad` behind the engine's back: `model.zero_grad()` (which sets
every `.grad` to None), a torch optimizer built over `model.parameters()` whose
`zero_grad()` the loop calls, `p.grad = None`, `torch.nn.utils.clip_grad_norm_(
model.parameters(), c)`. Each stage keeps its gradients in flat storage of its own, so it
must notice those actions and give them the meaning they have under torch's DDP (stages 0-1)
or FSDP2 (stages 2-3), or refuse them with an error — never let them silently detach
`param.grad` from the storage the reduction reads.

Two pieces do that:

* `FlatParamLayout` remembers which tensor it last put in each parameter's `.grad`
  (`FlatParamLayout.use_as_grad_storage` / `show_grads`), and `FlatParamLayout.user_grad_changes()`
  compares: a `.grad` that is now None (or a `ShardedGrad` zeroed in place) was *cleared*
  by the user, any other tensor was *replaced*. The engine asks at the start of each flat
  param's backward (the gradient pre-hook, before autograd accumulates: `UserGrads._on_first_grad`,
  the same for every stage) and at `step` (`UserGrads.check_user_grads_before_step`).

* `ShardedGrad` is what `param.grad` holds at stages 1-3 after a synchronised backward,
  when only this rank's range of the averaged gradient exists (the grad shard). Like an
  FSDP2 gradient (a sharded DTensor) it has the parameter's shape, dtype and device, but
  its values are this rank's part `local` of the averaged gradient (a view into the grad
  shard, possibly empty). It supports what gradient code does with a `.grad` and nothing
  else: norms (reduced over ranks, so `torch.nn.utils.clip_grad_norm_` returns the global
  norm), in-place scaling, clamping and zeroing (applied to the shard, so they reach the
  step). Any other operation raises a RuntimeError that says so. Its own storage is one
  element, expanded: it costs no memory.

Norms are computed lazily, as DTensor does: `torch.linalg.vector_norm(g)` returns a
`PartialNorm` that carries this rank's sum of |x|^p in fp64; `torch.stack` of partial
norms stays partial, and the norm of that stack performs one rank-ordered reduction. So
`clip_grad_norm_` costs one tiny collective in all, and its total equals
`engine.clip_grad_norm_`'s (the same fp64 sums of squares, reduced in the same order, up to
the fp64 rounding of a different summation grouping). Any other use of a partial norm (for
example `.item()`) reduces it on the spot: a collective, so every rank must do it, as with
DTensor's `full_tensor()`.

Under fp16 the grad shards hold loss-scaled gradients; norms are divided by the current
loss scale and clamps multiplied by it, so user code sees unscaled values. (At stage 0,
`param.grad` is the plain averaged gradient; under fp16 it is loss-scaled, as it is with
torch.amp before `GradScaler.unscale_`: clip with `engine.clip_grad_norm_` there.)
"""
from __future__ import annotations

from typing import Callable

import torch

from zerokit.core.precision import master_dtype_of

__all__ = ["ShardedGrad", "PartialNorm", "UserGrads"]

# Flags about a tensor's kind, no values: what torch.compile's dynamo asks of every tensor it meets, the
# sharded parameters and their `.grad`s included (core/unit.py [Note: torch.compile]).
KIND_QUERIES = {"is_conj", "is_neg", "_is_view", "is_inference", "_is_zerotensor", "is_sparse", "is_quantized",
                "is_nested", "is_mkldnn", "is_meta"}
_METADATA_METHODS = {"size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
                     "requires_grad_", "detach_", "__repr__", "__format__", "__hash__", "get_device", "type",
                     "stride", "storage_offset", "is_contiguous", "untyped_storage", "data_ptr"} | KIND_QUERIES
_REFUSED_PROPERTIES = {"data"}


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


class ShardedGrad(torch.Tensor):
    """`param.grad` after a synchronised backward at stages 1-3: this rank's part of the averaged gradient.

    Attributes: `local` (k,) a view into the grad shard (the elements of this parameter
    that fall in this rank's range; k may be 0), `zeroed` (set by `zero_()`: the user
    cleared this gradient in place).
    """

    local: torch.Tensor
    comm: object
    scale: Callable[[], float]
    param_name: str
    zeroed: bool

    @staticmethod
    def make(param: torch.Tensor, local: torch.Tensor, comm, scale: Callable[[], float], name: str) -> "ShardedGrad":
        # One element expanded to the parameter's shape: `param.grad = ` accepts it, it holds no bytes.
        g = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape).as_subclass(ShardedGrad)
        g.local, g.comm, g.scale, g.param_name, g.zeroed = local, comm, scale, name, False
        return g

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"ShardedGrad(param={self.param_name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"this rank's {self.local.numel()} elements of the averaged gradient)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name == "__get__":  # property reads: shape, dtype, device, grad_fn, requires_grad, ...
            prop = getattr(func, "__self__", None)
            if getattr(prop, "__name__", None) in _REFUSED_PROPERTIES:
                _refuse(args[0], ".data")
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name in _METADATA_METHODS:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return args[0] if name in ("requires_grad_", "detach_") else out
        handler = _HANDLERS.get(name)
        if handler is None:
            grads = [a for a in _flat_args(args, kwargs) if isinstance(a, ShardedGrad)]
            _refuse(grads[0], f"{name}()")
        return handler(*args, **kwargs)


def _refuse(g: ShardedGrad, what: str):
    from zerokit.core.model_guard import move_hint  # imported here: core/model_guard.py imports flat_param, which imports this
    # RuntimeError, not TypeError: torch turns a TypeError inside `+`, `*`, ... into NotImplemented.
    held = (f"only its shard of the averaged gradient ({g.local.numel()} of {g.numel()} elements), as with FSDP2"
            if g.comm is not None else
            "the averaged gradient in a buffer of another dtype or loss-scaled (stage 0 under fp16 or a distinct "
            "reduce dtype)")
    raise RuntimeError(
        f"param.grad of {g.param_name!r} is a ShardedGrad: after backward at this ZeRO stage this rank holds "
        f"{held}. "
        f"{what} is not supported on it. Supported: norms (torch.nn.utils.clip_grad_norm_, .norm(), "
        "torch.linalg.vector_norm), mul_/div_/clamp_/zero_ and their torch._foreach_ forms. Read gradients "
        "before they are sharded with stage=0, or use engine.clip_grad_norm_()." + move_hint(what))


def _flat_args(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


# -- norms ------------------------------------------------------------------------------
class PartialNorm(torch.Tensor):
    """A norm not yet reduced over ranks: this rank's sum of |x|^ord (fp64) per entry."""

    sums: torch.Tensor
    ord: float
    comm: object
    scale: Callable[[], float]

    @staticmethod
    def make(sums: torch.Tensor, ord: float, comm, scale, dtype: torch.dtype) -> "PartialNorm":
        n = torch.zeros(sums.shape, dtype=dtype, device=sums.device).as_subclass(PartialNorm)
        n.sums, n.ord, n.comm, n.scale = sums, ord, comm, scale
        return n

    def reduced(self) -> torch.Tensor:
        """The global norm of every entry (a collective): a plain tensor of this shape."""
        return _finish(_reduce(self.comm, self.sums, self.ord), self.ord, self.scale(), self.dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name == "__repr__":
            return "PartialNorm(this rank's part of a norm; .item() or any other use reduces it over ranks)"
        if name == "__get__" or name in _METADATA_METHODS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name == "to" and isinstance(args[0], PartialNorm):
            target = torch.empty(0).to(*args[1:], **kwargs)  # what .to() would produce, for its device
            if target.device == args[0].device:
                return args[0]
        if name == "stack":
            parts = list(args[0])
            if all(isinstance(p, PartialNorm) for p in parts) and len({(p.ord, id(p.comm)) for p in parts}) == 1:
                first = parts[0]
                return PartialNorm.make(torch.stack([p.sums for p in parts]), first.ord, first.comm, first.scale,
                                        first.dtype)
        if name in ("linalg_vector_norm", "norm") and isinstance(args[0], PartialNorm):
            ord = _ord(args, kwargs, 1)
            first = args[0]
            if ord == first.ord and not kwargs.get("dim") and not kwargs.get("keepdim"):
                total = first.sums.max() if ord == float("inf") else first.sums.sum()
                # fp32, or float64 for float64 gradients (torch returns the gradients' dtype): core/precision.py
                return _finish(_reduce(first.comm, total.reshape(1), ord)[0], ord, first.scale(),
                               master_dtype_of(first.dtype))
        # Anything else: reduce every partial norm involved, then run the op on plain tensors.
        args, kwargs = _materialize(args), {k: _materialize(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _materialize(obj):
    if isinstance(obj, PartialNorm):
        return obj.reduced()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_materialize(o) for o in obj)
    return obj


def _ord(args, kwargs, position: int) -> float:
    ord = kwargs.get("ord", kwargs.get("p", args[position] if len(args) > position else 2.0))
    ord = 2.0 if ord is None or ord == "fro" else float(ord)
    if ord <= 0:
        raise RuntimeError(f"zerokit ShardedGrad: norm order {ord} is not supported (use ord > 0 or inf)")
    return ord


def _local_sum(local: torch.Tensor, ord: float) -> torch.Tensor:
    """This rank's sum of |x|^ord (max |x| for inf) over its elements, in fp64: a 0-dim tensor."""
    x = local.detach().double()
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=local.device)
    if ord == float("inf"):
        return x.abs().max()
    if ord == 2.0:
        return torch.dot(x, x)  # squares of fp32/bf16/fp16 values are exact in fp64
    return x.abs().pow(ord).sum()


def _reduce(comm, sums: torch.Tensor, ord: float) -> torch.Tensor:
    flat = sums.reshape(-1)
    if comm is None:  # replicated (stage 0): every rank already holds every element
        return sums.clone()
    return comm.all_reduce_scalars(flat, op="max" if ord == float("inf") else "sum",
                                   label=f"param.grad norm partials (ShardedGrad, ord {ord:g})").reshape(sums.shape)


def _finish(total: torch.Tensor, ord: float, scale: float, dtype: torch.dtype) -> torch.Tensor:
    if ord == float("inf"):
        norm = total
    else:
        norm = total.sqrt() if ord == 2.0 else total.pow(1.0 / ord)
    return (norm.float() / scale).to(dtype) if scale != 1.0 else norm.to(dtype)


def _norm(g, *args, **kwargs):
    if kwargs.get("dim") is not None or kwargs.get("keepdim"):
        _refuse(g, "a norm over some dims")
    ord = _ord((g,) + args, kwargs, 1)
    return PartialNorm.make(_local_sum(g.local, ord), ord, g.comm, g.scale, g.dtype)


def _foreach_norm(tensors, *args, **kwargs):
    ord = _ord((tensors,) + args, kwargs, 1)
    return [_norm(g, ord=ord) for g in tensors]


# -- in-place elementwise ops, applied to the shard ----------------------------------------
def _scalar(x, g: ShardedGrad):
    return x.to(g.local.device) if torch.is_tensor(x) else x


def _mul_(g, other):
    g.local.mul_(_scalar(other, g))
    return g


def _div_(g, other):
    g.local.div_(_scalar(other, g))
    return g


def _zero_(g):
    g.local.zero_()
    g.zeroed = True
    return g


def _clamp_(g, min=None, max=None):
    s = g.scale()  # the shard holds loss-scaled values under fp16
    g.local.clamp_(None if min is None else min * s, None if max is None else max * s)
    return g


def _each(fn):
    def run(tensors, *args, **kwargs):
        others = args[0] if args and isinstance(args[0], (list, tuple)) else None
        for i, g in enumerate(tensors):
            if others is not None:
                fn(g, others[i], *args[1:], **kwargs)
            else:
                fn(g, *args, **kwargs)
    return run


_HANDLERS = {
    "linalg_vector_norm": _norm,
    "norm": _norm,
    "_foreach_norm": _foreach_norm,
    "mul_": _mul_,
    "div_": _div_,
    "zero_": _zero_,
    "clamp_": _clamp_,
    "clamp_min_": lambda g, v: _clamp_(g, min=v),
    "clamp_max_": lambda g, v: _clamp_(g, max=v),
    "_foreach_mul_": _each(_mul_),
    "_foreach_div_": _each(_div_),
    "_foreach_zero_": _each(_zero_),
    "_foreach_clamp_min_": _each(lambda g, v: _clamp_(g, min=v)),
    "_foreach_clamp_max_": _each(lambda g, v: _clamp_(g, max=v)),
}


class UserGrads:
    """The engine's side of [Note: param.grad belongs to the user], one implementation for every stage.

    Mixed into core/engine.py's `Engine`; reads the stage's `states` (core/flat_param.py
    `FlatParamState`), `flat_params`, `packs_grads` and `adopt_assigned_grads`.
    """

    packs_grads = False  # stage 3: autograd makes each param's own gradient, packed once all are there

    def _on_first_grad(self, fp) -> None:
        """Autograd is about to add this flat param's first gradient of a backward (core/hooks.py): honour
        what user code did to `.grad` since the last one, then give autograd the full gradient's views.

        A cleared `.grad` (None, or zeroed in place) starts again from zero, in the full gradient
        and in the grad shard, as after zero_grad; an assigned tensor is the gradient to accumulate
        onto, as under DDP. Where the stage frees the full gradient between backwards it is allocated
        here (zeros), unless a no_sync micro-step kept it; stage 3 leaves it to be packed
        (`packs_grads`: stages/zero3.py [Note: gradients packed when complete]).
        """
        cleared, replaced = fp.user_grad_changes()
        state = self.states[fp.index]
        self.restart_grad_shard(state, cleared + replaced)
        if state.flat_grad is None and self.packs_grads and not replaced:
            fp.show_grads([None] * len(fp.params))  # autograd makes each parameter's own
            state.unpacked = True
            return
        if state.flat_grad is None:
            state.flat_grad = fp.new_flat()  # (padded_numel,) zeros
        else:
            fp.zero_grad_parts(state.flat_grad, cleared + replaced)
        fp.write_params(state.flat_grad, replaced, [fp.params[j].grad for j in replaced])
        fp.use_as_grad_storage(state.flat_grad)  # plain views: autograd accumulates into the full gradient

    def restart_grad_shard(self, state, js: list[int]) -> None:
        """params[j]'s part of the grad shard starts again from zero (j in js); the next reduce-scatter
        lands directly when that was every param, as after zero_grad (stage 0 has no grad shard).

        Stage 1 (`accumulates_grad_shards` False): once reduce-scattered, the full gradient holds the
        average in this rank's range and local sums elsewhere, and the next backward cannot add onto
        that, so its gradients are cleared all together (then as by zero_grad) or not at all.
        """
        if state.grad_shard_written and not self.accumulates_grad_shards and js and len(js) < len(state.fp.params):
            kept = next(names[0] for j, names in enumerate(state.fp.names) if j not in js)
            raise RuntimeError(
                f"stage {self.stage} (rank {self.rank}): some gradients of the bucket holding {kept!r} were cleared "
                "since the last synced backward and others not; stage 1 cannot accumulate onto an averaged "
                "gradient: clear all of them (model.zero_grad() or engine.zero_grad())")
        if state.grad_shard is not None and state.fp.zero_shard_parts(state.grad_shard, js):
            state.grad_shard_written = False

    def check_user_grads_before_step(self) -> None:
        """Called by every stage's `step`: take over what user code did to `param.grad` since backward.

        A gradient zeroed or scaled in place already reached the storage the optimizer reads.
        A `.grad` set to None after backward cannot be honoured (a torch optimizer would skip
        that parameter; zerokit updates whole flat buffers), so it is refused, as is an
        assigned tensor except at stage 0 (`adopt_assigned_grads`). Under reduction="tree",
        micro-batches still held as partial sums (no synced backward) are refused too, and the
        step's tree is done with: the next backward starts a new one even when the loop clears
        gradients with model.zero_grad() rather than engine.zero_grad(). A model cast or
        moved since zk.shard is refused first (core/model_guard.py).
        """
        self.check_last_backward()
        self.guard.before_step(self)  # dtype/device moves of the model: core/model_guard.py
        self.check_partials_sent()
        self.clear_partials()
        for fp in self.flat_params:
            if not fp.requires_grad:
                continue
            cleared, replaced = fp.user_grad_changes()
            dropped = [j for j in cleared if fp.params[j].grad is None]
            if dropped:
                raise RuntimeError(
                    f"zerokit stage {self.stage} (rank {self.rank}): param.grad of {fp.names[dropped[0]][0]!r} was set "
                    "to None between backward and engine.step() (model.zero_grad() or optimizer.zero_grad() in the "
                    "wrong place?). zerokit updates whole flat buffers and cannot skip one parameter as a torch "
                    "optimizer would: clear gradients before the forward or after step()")
            if replaced:
                self.adopt_assigned_grads(fp, replaced)

    def adopt_assigned_grads(self, fp, replaced: list[int]) -> None:
        """User code assigned new tensors to params[j].grad (j in `replaced`) after backward (stages 1-3: refused)."""
        raise RuntimeError(
            f"zerokit stage {self.stage} (rank {self.rank}): a tensor was assigned to param.grad of "
            f"{fp.names[replaced[0]][0]!r}; at this stage only this rank's shard of the averaged gradient exists, "
            "so an assigned full gradient cannot be used. Change gradients in place (p.grad.mul_(), clamp_(), "
            "zero_()) or use stage=0")
