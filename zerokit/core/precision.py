"""Mixed precision: which dtype each kind of tensor lives in, and the fp16 loss scaler.

The recipe CS224N lecture 12 teaches (Micikevicius et al. 2018) in zerokit's vocabulary:

1. `param` (the working copy the model computes with) lives in `param_dtype`: fp32, bf16 or fp16.
2. Gradients come out of backward in `param_dtype` and are reduced across ranks in
   `reduce_dtype` (default: the same; fp32 reduction of bf16 gradients trades 2x
   communication bytes for a sum that does not lose low bits at every hop of the ring).
3. When `param_dtype` is not fp32, the optimizer updates an fp32 `master_shard`
   (`master_dtype`) and copies the result back into the low-precision params, because an
   update of 1e-4 added to a weight of 1.0 vanishes in fp16/bf16 (see `zerokit formats`).
4. fp16 only: the loss is multiplied by a scale before backward so small activation
   gradients do not underflow (fp16 has 5 exponent bits); gradients are divided by the same
   scale before the update; a step whose gradients hold inf/nan is skipped and the scale
   backs off. bf16 has fp32's 8 exponent bits, so it needs no scaler. Users reach it the torch
   way, through `engine.scaler` (`GradScaler` below: `engine.scaler.scale(loss).backward()`).

5. The forward inputs: floating-point tensors among the root call's arguments are cast to
   `param_dtype` (`cast_floating_tensors`), as torch FSDP's mixed precision does, so a model
   fed fp32 data (`torch.randn`) computes in bf16/fp16 without a dtype mismatch in its first
   matmul; integer and bool tensors (token ids, masks) are left alone. The output is whatever
   the module computes: param-dtype activations (bf16 logits, a bf16 loss) — nothing is cast
   back. `zk.shard(..., cast_inputs=False)` turns the cast off.

6. A float64 model (`model.double()`) trains in float64: [Note: float64 models].

[Note: float64 models]
Under precision="fp32" the dtype a model's parameters come in is kept when it is float64: `make_policy`
sees the parameters and builds a policy whose param, reduce and master dtypes are all float64, so the
flat buffers, gradients, reductions and optimizer states are float64, as under torch DDP with the same
optimizer on the same model (bitwise: tests/distributed/test_dtypes_and_layouts.py). Parameters below
fp32 (bf16, fp16) under "fp32" are upcast to fp32. Refused, each naming the fix, because each
would silently round what the user asked to keep in float64: a model mixing float64 and other floating
parameters (cast it to one dtype: `model.double()` or `model.float()`), a `reduce_dtype` other than
float64 for a float64 model, and precision="bf16"/"fp16" on a float64 model (mixed precision keeps fp32
masters here: `model.float()` first). Packed byte parameters (zerokit/quant.py) take no part in the rule.
Gradient norms are float64 too; their sum of squares rounds in float64 (an fp32 square is exact there, a
float64 one is not), so a clipped float64 run is equal to DDP's to float64 rounding, not claimed bitwise.

This module is pure: no process group. The engine computes `has_inf_or_nan` over its local
gradients, does one all-reduce (MAX) of that flag so every rank agrees, and then calls
`LossScaler.update(found_overflow)` with the same value on every rank, which keeps the scale
identical everywhere without ever communicating it.
"""
from __future__ import annotations

import copy
import math
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from zerokit.core.nest import map_tensors

__all__ = ["PRECISIONS", "PrecisionPolicy", "make_policy", "master_dtype_of", "LossScaler", "make_loss_scaler",
           "GradScaler", "refuse_scaled", "has_inf_or_nan", "cast_floating_tensors"]

# name -> dtype the params (and by default gradients) live in.
PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_DTYPE_NAMES = {dtype: name for name, dtype in PRECISIONS.items()}


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype params, gradient reductions and master weights use.

    `param_dtype` and `reduce_dtype` default from `name`; build one with `make_policy`.
    """

    name: str
    param_dtype: torch.dtype | None = None  # None -> PRECISIONS[name]
    reduce_dtype: torch.dtype | None = None  # None -> param_dtype
    master_dtype: torch.dtype | None = None  # None -> fp32 (float64 for a float64 model)

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"precision={self.name!r} is not one of {sorted(PRECISIONS)}")
        expected = PRECISIONS[self.name]
        if self.param_dtype is None:
            object.__setattr__(self, "param_dtype", expected)
        elif self.param_dtype != expected and not (self.name == "fp32" and self.param_dtype == torch.float64):
            raise ValueError(
                f"PrecisionPolicy(name={self.name!r}) needs param_dtype={expected}, got {self.param_dtype}")
        fp64 = self.param_dtype == torch.float64  # [Note: float64 models]: float64 throughout
        if self.reduce_dtype is None:
            object.__setattr__(self, "reduce_dtype", self.param_dtype)
        elif fp64 and self.reduce_dtype != torch.float64:
            raise ValueError(f"reduce_dtype={self.reduce_dtype} would round the float64 model's gradients before "
                             "they are summed; drop reduce_dtype= (a float64 model reduces in float64)")
        elif self.reduce_dtype not in _DTYPE_NAMES and not fp64:
            raise ValueError(
                f"reduce_dtype={self.reduce_dtype} is not one of {[str(d) for d in _DTYPE_NAMES]}")
        master = torch.float64 if fp64 else torch.float32
        if self.master_dtype is None:
            object.__setattr__(self, "master_dtype", master)
        elif self.master_dtype != master:
            # The memory formulas (12 bytes/param of master + Adam states) and the update
            # precision argument both assume fp32 masters (float64 ones for a float64 model).
            raise ValueError(f"master_dtype must be {master} with param_dtype={self.param_dtype}, "
                             f"got {self.master_dtype}")

    @property
    def needs_master(self) -> bool:
        """True when params are low precision, so the optimizer updates a separate fp32 master copy."""
        return self.param_dtype != self.master_dtype

    @property
    def uses_loss_scaler(self) -> bool:
        """True for fp16 only: its 5 exponent bits let small gradients underflow without a scale."""
        return self.param_dtype == torch.float16


def _as_dtype(value: torch.dtype | str, what: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in PRECISIONS:
        return PRECISIONS[value]
    raise ValueError(f"{what}={value!r} is not a torch.dtype or one of {sorted(PRECISIONS)}")


def master_dtype_of(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype the optimizer updates for params in `param_dtype`: fp32, float64 for float64 params."""
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def make_policy(precision: str | PrecisionPolicy,
                reduce_dtype: torch.dtype | str | None = None, params=None) -> PrecisionPolicy:
    """Policy for "fp32" | "bf16" | "fp16" (or an existing policy), optionally overriding reduce_dtype.

    `params`: the model's named parameters ((name, tensor) pairs, e.g. `model.named_parameters()`); a
    float64 model gets a float64 policy under "fp32", or is refused naming the fix ([Note: float64 models]).

    >>> make_policy("bf16", reduce_dtype="fp32").reduce_dtype
    torch.float32
    """
    if isinstance(precision, PrecisionPolicy):
        policy = precision
    elif isinstance(precision, str):
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not one of {sorted(PRECISIONS)}")
        policy = PrecisionPolicy(precision)
    else:
        raise TypeError(f"precision must be a str or PrecisionPolicy, got {type(precision).__name__}")
    if params is not None and _is_float64_model(params, policy.name):
        # float64 throughout: a reduce dtype set on a policy object is dropped; the argument is checked below
        policy = replace(policy, param_dtype=torch.float64, reduce_dtype=None, master_dtype=None)
    if reduce_dtype is not None:
        policy = replace(policy, reduce_dtype=_as_dtype(reduce_dtype, "reduce_dtype"))
    return policy


def _is_float64_model(params, name: str) -> bool:
    """True when every floating parameter is float64 (and there is one); refuse what [Note: float64 models]
    refuses. Non-floating parameters (packed bytes) are left out."""
    first: dict[torch.dtype, str] = {}
    for pname, p in params:
        if p.is_floating_point():
            first.setdefault(p.dtype, pname)
    if torch.float64 not in first:
        return False
    if len(first) > 1:
        other = next(d for d in first if d != torch.float64)
        raise ValueError(f"the model mixes float64 parameters ({first[torch.float64]!r}) with {other} ones "
                         f"({first[other]!r}): zerokit trains one floating dtype per model; cast it first, "
                         "model.double() to train in float64 or model.float() for float32")
    if name != "fp32":
        raise ValueError(f"precision={name!r} on a float64 model ({first[torch.float64]!r} is float64): mixed "
                         "precision keeps fp32 master weights, so cast the model first (model.float()), or keep "
                         "float64 throughout with precision='fp32'")
    return True


class LossScaler:
    """The fp16 loss scale as a state machine, with DeepSpeed's knobs and defaults.

    Per optimizer step the engine multiplies the loss by `scale`, runs backward, finds out
    (identically on every rank) whether any gradient holds inf/nan, skips the step if so, and
    calls `update(found_overflow)`. The state is three numbers: `scale`, the count of
    consecutive clean steps, and the hysteresis budget left.

    Exactly what `update` does (dynamic=True):

    - overflow, hysteresis budget left > 1: the budget drops by one; the scale stays. With
      `hysteresis=h` the first h-1 overflows are tolerated (the steps are still skipped).
    - overflow, budget == 1: the scale backs off to `max(scale * backoff_factor, min_scale)`.
      If the scale already equals `min_scale`, no smaller scale exists, so RuntimeError: the
      gradients are inf/nan even at the minimum scale, which means the model has diverged
      (or the loss itself is inf), not that the scale is too high.
    - any overflow resets the clean-step count to 0.
    - clean step: the count goes up by one; when it reaches `growth_interval` the scale is
      multiplied by `growth_factor`, the count resets to 0 and the hysteresis budget is
      refilled to `hysteresis`.

    Like DeepSpeed's default (`consecutive_hysteresis=false`) the budget is refilled only when
    the scale grows, not after every clean step: once spent, each further overflow halves the
    scale until a full clean window has passed. One difference from DeepSpeed, on purpose:
    DeepSpeed grows on the (window+1)-th clean step after an overflow; here the scale grows on
    exactly the `growth_interval`-th consecutive clean step, as torch's GradScaler does.

    `dynamic=False` is a static scale: `update` never changes anything (an overflowed step is
    still skipped by the engine) and never raises. `growth_interval=0` ("never grow") means the
    same: `{"init_scale": 1.0, "growth_interval": 0}` is a static scale of 1 (`dynamic` left
    unset follows it; `dynamic=True` with it is refused, since a dynamic scale that never grows
    only ever falls). A static scale of exactly 1 leaves nothing to unscale, so the engine
    accepts a plain `loss.backward()` under it (GradScaler [Note: a static scale of 1]).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, hysteresis: int = 1, min_scale: float = 1.0,
                 dynamic: bool | None = None) -> None:
        if dynamic is None:
            dynamic = growth_interval != 0
        elif dynamic and growth_interval == 0:
            raise ValueError("growth_interval=0 means a static scale (it never grows): drop dynamic=True, or pass "
                             "growth_interval >= 1 for a dynamic one")
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale}")
        if not (math.isfinite(min_scale) and min_scale > 0):
            raise ValueError(f"min_scale must be a positive finite number, got {min_scale}")
        if dynamic and min_scale > init_scale:
            raise ValueError(f"min_scale={min_scale} is larger than init_scale={init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval >= (1 if dynamic else 0)):
            raise ValueError(f"growth_interval must be an int >= 1 (or 0: a static scale), got {growth_interval!r}")
        if not (isinstance(hysteresis, int) and hysteresis >= 1):
            raise ValueError(f"hysteresis must be an int >= 1 (1 = back off on every overflow), got {hysteresis!r}")
        self.init_scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.dynamic = bool(dynamic)
        self._scale = float(init_scale)
        self._clean_steps = 0  # consecutive steps without overflow since the last growth/overflow
        self._hysteresis_left = hysteresis
        self.num_overflows = 0  # skipped steps so far, for logs

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward (gradients divided by after)."""
        return self._scale

    def update(self, found_overflow: bool) -> None:
        """Advance the state machine by one optimizer step (see the class docstring)."""
        if found_overflow:
            self.num_overflows += 1
        if not self.dynamic:
            return
        if found_overflow:
            self._clean_steps = 0
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
                return
            if self._scale <= self.min_scale:
                raise RuntimeError(
                    f"loss scale stuck at minimum ({self.min_scale:g}): gradients are inf/nan even at scale "
                    f"{self._scale:g} after {self.num_overflows} overflowed steps; check for a diverged model "
                    f"(loss inf/nan, learning rate too high) or use bf16, which needs no loss scale")
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self._scale *= self.growth_factor
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        """Scale, counters and configuration, as plain Python numbers."""
        return {
            "scale": self._scale,
            "clean_steps": self._clean_steps,
            "hysteresis_left": self._hysteresis_left,
            "num_overflows": self.num_overflows,
            "init_scale": self.init_scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore everything `state_dict` saved (the checkpoint's configuration wins)."""
        missing = set(self.state_dict()) - set(state)
        if missing:
            raise ValueError(f"LossScaler state_dict is missing keys {sorted(missing)}")
        # Re-run the constructor's validation on the loaded configuration.
        self.__init__(state["init_scale"], state["growth_factor"], state["backoff_factor"],
                      int(state["growth_interval"]), int(state["hysteresis"]), state["min_scale"],
                      bool(state["dynamic"]))
        self._scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.num_overflows = int(state["num_overflows"])

    def __repr__(self) -> str:
        return (f"LossScaler(scale={self._scale:g}, dynamic={self.dynamic}, clean_steps={self._clean_steps}/"
                f"{self.growth_interval}, hysteresis_left={self._hysteresis_left}/{self.hysteresis})")


class GradScaler:
    """`engine.scaler`: torch.amp.GradScaler's shape over the engine's LossScaler, so torch's fp16 loop runs.

        engine.scaler.scale(loss).backward()
        engine.scaler.step(engine.optimizer)   # or engine.step(): unscale, agree on overflow, skip or step
        engine.scaler.update()                 # nothing left to do: the step above updated the scale

    Every precision has one, so the loop above runs unchanged under fp32/bf16/fp16: under
    fp32/bf16 it is disabled, as torch's `GradScaler(enabled=False)` (`scale` returns its
    argument itself, `get_scale()` is 1.0, `state_dict()` is {}). What differs from torch's:

    - the unscale, the all-ranks overflow check, the skip and the scale update all happen inside
      the engine's step (optim/sharded.py `apply`), one multiply with the clip coefficient; so
      `step` is `engine.step()` (True when it stepped, False when an inf/nan on any rank
      skipped it, on every rank alike), `update()` does nothing and `unscale_` does nothing:
      `param.grad` and `engine.clip_grad_norm_` already read unscaled gradients under fp16
      (core/grads/user_grads.py), so torch's clipping idiom (`unscale_`, then
      `torch.nn.utils.clip_grad_norm_(model.parameters(), c)`) clips by the same norm.
    - the scale lives in the LossScaler (`engine.loss_scaler`, DeepSpeed's knobs and
      hysteresis), configured by `zk.shard(..., loss_scaler={...})`, not by this object.

    [Note: which backward `scale` marks]
    Under fp16 the engine refuses a step on gradients of a backward the scale never multiplied
    (core/grads/hooks.py [Note: which backward was scaled]). `scale(loss)` returns `loss * scale`
    with a gradient hook on it: the hook runs first in that tensor's backward (it is the root,
    before any parameter's gradient) and sets the tracker's `engine_backward` for that backward
    only, a callback queued at its end clears it again. So the mark is per backward: a scaled
    backward followed by a plain one still counts the plain one, each `no_sync()` micro-batch
    is marked by its own `scale(...)`, and a backward that raised is forgotten by
    `engine.zero_grad()`. A tensor `scale` returned is refused by `engine.backward` and by a
    second `scale` (`refuse_scaled`): either would scale the gradients twice. Combining a scaled
    tensor with an unscaled term (`(scale(a) + b).backward()`) is as wrong here as under torch:
    scale the whole loss.

    `scale_grad(t)` is the same mark for code that cannot reach the loss (a test adapter that
    only wraps the model: the CS336 FSDP tests compute the loss themselves): `t` is returned
    unchanged in forward, and its gradient is multiplied by the scale in backward, which
    scales every parameter gradient upstream exactly as scaling the loss would.

    [Note: a static scale of 1]
    `loss_scaler={"init_scale": 1.0, "growth_interval": 0}` is fp16 without loss scaling: the
    step divides by 1, so a plain `loss.backward()` is accepted (`plain_backward_ok`), once
    per engine with a warning that fp16 gradients below 2**-24 (~6e-8) flush to zero and
    those below 2**-14 lose precision without a scale; an overflowed step is still skipped.
    Any other scale (or under reduction="tree", whose loss is divided by N before backward)
    still needs the scaled backward.
    """

    def __init__(self, engine: Any, loss_scaler: LossScaler | None) -> None:
        self._engine = weakref.ref(engine)  # the engine holds this object: no reference cycle
        self.loss_scaler = loss_scaler

    # -- torch.amp.GradScaler's methods ---------------------------------------------------
    def is_enabled(self) -> bool:
        """True under fp16 (a LossScaler exists); False under fp32/bf16."""
        return self.loss_scaler is not None

    def get_scale(self) -> float:
        """The current loss scale (1.0 when disabled), as torch's `get_scale()`."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def scale(self, outputs: Any) -> Any:
        """`outputs` (a tensor, or tensors nested in lists/tuples/dicts) times the loss scale, each marked
        so its backward counts as scaled ([Note: which backward `scale` marks]). Disabled: `outputs` itself."""
        if self.loss_scaler is None:
            return outputs
        factor = self._engine().loss_factor
        return map_tensors(outputs, lambda t: self._marked(refuse_scaled(t, "engine.scaler.scale") * factor))

    def scale_grad(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` unchanged in forward; in backward its gradient times the loss scale, and the backward
        marked as scaled ([Note: which backward `scale` marks]). Disabled: `tensor` itself."""
        if self.loss_scaler is None:
            return tensor
        return self._marked(_ScaleGrad.apply(refuse_scaled(tensor, "engine.scaler.scale_grad"), self._engine().loss_factor))

    def unscale_(self, optimizer: Any = None) -> None:
        """Nothing to do: under fp16 `param.grad` and `engine.clip_grad_norm_` already read unscaled gradients
        (the step unscales the shards it updates), so clipping after this call clips by the unscaled norm."""
        self._check_optimizer(optimizer, "unscale_")

    def step(self, optimizer: Any = None, *args: Any, **kwargs: Any) -> bool:
        """`engine.step()`: unscale, agree on overflow across ranks, skip or step, update the scale.
        Returns True when it stepped, False when fp16 skipped the step (the same on every rank)."""
        if args or kwargs:
            raise TypeError("engine.scaler.step(optimizer) takes no closure or extra arguments: "
                            "the engine's step runs one update")
        self._check_optimizer(optimizer, "step")
        return self._engine().step()

    def update(self, new_scale: float | None = None) -> None:
        """Nothing to do: `engine.step()` (and `step` above) already updated the scale, on every rank alike.
        Kept so torch's loop (`scaler.step(opt); scaler.update()`) runs unchanged. A `new_scale` is refused."""
        if new_scale is not None:
            raise ValueError("engine.scaler.update(new_scale) is not offered: configure the scale with "
                             "zk.shard(..., loss_scaler={'init_scale': ...}) or restore it with load_state_dict")

    def state_dict(self) -> dict[str, Any]:
        """The LossScaler's state (`LossScaler.state_dict`); {} when disabled, as torch's."""
        return self.loss_scaler.state_dict() if self.loss_scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s state; disabled: ignored, as torch's."""
        if self.loss_scaler is None:
            return
        if not state:
            raise RuntimeError("this scaler state_dict is empty: it was saved under fp32/bf16 (a disabled scaler)")
        self.loss_scaler.load_state_dict(state)

    # -- zerokit's own ----------------------------------------------------------------------
    @property
    def plain_backward_ok(self) -> bool:
        """True when a plain `loss.backward()` gives the gradients the step expects ([Note: a static scale of 1])."""
        s = self.loss_scaler
        return s is None or (not s.dynamic and s.scale == 1.0 and self._engine().loss_factor == 1.0)

    def _marked(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor._zerokit_scaled = True  # engine.backward and a second scale() refuse it: scaled twice
        if tensor.requires_grad:
            engine = self._engine
            tensor.register_hook(lambda grad: (engine().mark_scaled_backward(), grad)[1])
        return tensor

    def _check_optimizer(self, optimizer: Any, method: str) -> None:
        engine = self._engine()
        if optimizer is None or optimizer is engine.optimizer or optimizer is getattr(engine.optimizer, "optimizer", None):
            return
        raise ValueError(
            f"engine.scaler.{method}() was given an optimizer the engine does not own "
            f"({type(optimizer).__name__}); the engine's optimizer steps the shards: pass engine.optimizer "
            f"(or nothing)")

    def __repr__(self) -> str:
        return f"GradScaler(enabled={self.is_enabled()}, {self.loss_scaler!r})"


def refuse_scaled(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """`tensor`, unless `engine.scaler.scale` / `scale_grad` made it: scaling it again would leave every gradient
    the loss scale times too large."""
    if getattr(tensor, "_zerokit_scaled", False):
        raise RuntimeError(
            f"zerokit (fp16): {what}() was given a tensor engine.scaler already scaled, so the gradients would be "
            "scaled twice: call .backward() on the scaled loss (engine.scaler.scale(loss).backward()), or "
            "engine.backward(loss) on the unscaled one")
    return tensor


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor` (GradScaler.scale_grad)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def make_loss_scaler(policy: PrecisionPolicy, **kwargs: Any) -> LossScaler | None:
    """A LossScaler for fp16 policies, None otherwise (the engine's 'no scaling' signal)."""
    return LossScaler(**kwargs) if policy.uses_loss_scaler else None


def has_inf_or_nan(tensors: list[torch.Tensor]) -> torch.Tensor:
    """float32 scalar tensor: 1.0 if any element of any tensor is inf, -inf or nan, else 0.0.

    One max-|x| reduction per tensor (`_foreach_norm` with ord=inf: fused on CUDA, no copy of
    the data, inf stays inf and nan propagates), then one max over those; never reads the
    result on the host, so the engine can all-reduce (MAX) it before the only sync. The inf
    norm is exact in every dtype, so, unlike a sum or a 2-norm, a large but finite gradient
    cannot overflow into a false alarm. The result lives on the first tensor's device
    (CPU for an empty list).
    """
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(tensors, ord=float("inf"))
    device = tensors[0].device
    largest = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms]).max()
    return (~torch.isfinite(largest)).to(torch.float32)


def cast_floating_tensors(obj: Any, dtype: torch.dtype) -> Any:
    """`obj` with every floating-point tensor inside it cast to `dtype` (item 5 of the module docstring).

    Walks tensors nested in lists, tuples and dicts (core/nest.py: containers keep their
    type); integer, bool and complex tensors and non-tensor leaves come back as they are.
    The cast is differentiable, so an input that requires grad gets its gradient in its own dtype.
    """
    return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)
