"""The tensor subclasses that stand in for sharded values and refuse misuse, in one place.

Two kinds of tensor look whole to user code while this rank holds only a part, and each lets through
what is safe and refuses the rest with a RuntimeError that names the way out (`move_hint` adds the fix
when the refused op casts or moves the model):

* `ShardedGrad`: what `param.grad` holds at stages 1-3 after a synchronised backward, this rank's
  part of the averaged gradient; norms (`PartialNorm`, reduced over ranks lazily) and in-place
  scaling, clamping and zeroing pass, anything else is refused ([Note: param.grad belongs to the
  user] in core/grads/user_grads.py).
* `_ShardedParameter`: mixed into a stage-3 parameter's own class while its unit is sharded
  (`sharded_class`); metadata passes, reads and writes of the values are refused ([Note: a sharded
  parameter refuses reads] in core/params/unit.py).

Both are built by the parameter layout (core/params/flat_param.py makes the ShardedGrads,
core/params/unit.py switches parameter classes), so they live with it, below the gradients' code.
"""
from __future__ import annotations

from typing import Callable

import torch

from zerokit.core.precision import master_dtype_of

__all__ = ["ShardedGrad", "PartialNorm", "sharded_class", "move_hint", "MOVE_FIX", "KIND_QUERIES"]

MOVE_FIX = ("cast or move the model before zk.shard and build the engine after (for low-precision training pass "
            "precision='bf16' or 'fp16' to zk.shard instead)")


_CONVERSIONS = {"half()", "double()", "float()", "bfloat16()", "to()", "cuda()", "cpu()", "type()", "_to_copy()"}


def move_hint(what: str) -> str:
    """For a refusal of `what` (an op on a sharded parameter or gradient): the fix when it casts or moves."""
    return (f" If {what} comes from casting or moving the model after zk.shard (model.half(), .to(...)): "
            + MOVE_FIX + "." if what in _CONVERSIONS else "")


# Flags about a tensor's kind, no values: what torch.compile's dynamo asks of every tensor it meets, the
# sharded parameters and their `.grad`s included (core/params/unit.py [Note: torch.compile]).
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


# ------------------------------------------------------------ what a sharded parameter allows
# Methods that read no values (metadata, hooks, the storage object itself, which is 0 bytes).
_SHARDED_PARAM_METHODS = {"size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
                          "stride", "is_contiguous", "storage_offset", "get_device", "data_ptr", "untyped_storage",
                          "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "__hash__",
                          "__len__", "__format__", "__dir__", "is_shared", "is_pinned"} | KIND_QUERIES
# Properties that are the values, or views of them; every other property (shape, grad, ...) is metadata.
_SHARDED_PARAM_VALUE_PROPERTIES = {"data", "T", "mT", "H", "mH", "real", "imag"}


class _ShardedParameter:
    """Mixed into a parameter's own class while its unit is sharded: [Note: a sharded parameter refuses reads]."""

    __slots__ = ()
    _zerokit_name: str

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in ("__get__", "__set__", "__delete__"):  # a property: read, assigned or deleted
            prop = getattr(getattr(func, "__self__", None), "__name__", None)
            if prop in _SHARDED_PARAM_VALUE_PROPERTIES:
                _refuse_sharded(args[0], f"`.{prop}`" if name == "__get__" else f"assigning `.{prop}`")
        elif name not in _SHARDED_PARAM_METHODS:
            found = [a for a in _flat_args(args, kwargs) if isinstance(a, _ShardedParameter)]
            _refuse_sharded(found[0] if found else None, f"{name}()")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self) -> str:
        return (f"ShardedParameter({getattr(self, '_zerokit_name', '?')!r}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, device={self.device}: sharded by zerokit stage 3; its values exist "
                f"inside `with engine.summon_full_params():`)")

    __str__ = __repr__


_SHARDED_CLASSES: dict[type, type] = {}


def sharded_class(cls: type) -> type:
    """`cls` with reads refused: [Note: a sharded parameter refuses reads]."""
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(cls)(f"Sharded{cls.__name__}", (_ShardedParameter, cls), {"__module__": __name__})
    return _SHARDED_CLASSES[cls]


def _refuse_sharded(param, what: str):
    # RuntimeError, not TypeError: torch turns a TypeError inside `+`, `*`, ... into NotImplemented.
    which = (f"parameter {getattr(param, '_zerokit_name', '?')!r} (shape {tuple(param.shape)})"
             if param is not None else "a parameter")
    raise RuntimeError(
        f"zerokit stage 3: {which} is sharded: outside its unit's forward and backward this rank holds only "
        f"its shard, inside the engine, and the parameter has no values. {what} is not supported on it. "
        "Read or change parameters inside `with engine.summon_full_params():` (every rank enters it), take the "
        "whole model with `engine.state_dict(full=True)` (a collective: every rank calls it), and save or load "
        "with `engine.save()` / `engine.load()`. A method that runs the model without calling it (a PEFT "
        "model's generate()) needs `engine.register_forward_method(\"generate\")` first." + move_hint(what))
