"""The options of `zk.shard`, checked once, in one frozen place.

`ShardConfig` holds every option that shapes how a stage lays out and moves its tensors;
the precision policy (core/precision.py), the loss scaler and the process group (core/collectives/comm.py)
travel beside it. `zk.shard` builds it, so a bad value is refused on every rank before
anything is wrapped, and every stage constructor receives the same object: a stage reads
the options it uses (the docstring says which stage uses which) and never sees a keyword it
does not know. An option the optimizer does not take either is refused by `zk.shard`
(`check_optimizer_kwargs`), naming the closest option of each.
"""
from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, fields
from typing import Callable

import torch
from torch import nn

from zerokit.core.collectives.tree import REDUCTIONS

DEFAULT_BUCKET_NUMEL = 1 << 22  # the most elements a default bucket holds (4 Mi; 4 bytes each in fp32)
MIN_BUCKET_NUMEL = 1 << 15  # the fewest a default bucket holds, unless the model is smaller
# buckets per model by stage: [Note: default bucket size]
BUCKETS_PER_MODEL = {0: 8, 1: 1, 2: 32, 3: 32}


def default_bucket_numel(trainable_numel: int, stage: int = 2, world_size: int = 2) -> int:
    """`zk.shard`'s bucket size when none is given: Ψ_t / 8 at stage 0 (and at stage 1 on one rank), Ψ_t at
    stage 1, Ψ_t / 32 at stages 2-3, within [32 Ki, 4 Mi] elements.

    [Note: default bucket size]
    A fixed size is wrong at both ends, and the stages want different sizes. Stage 2 holds up to
    (max_in_flight + 2) buckets of full-size gradients inside backward, where FSDP holds about one
    unit's: a thirty-second of the model keeps its peak at or below FSDP1's at every size measured.
    Stages 0 and 1 keep the full gradient anyway; what a bucket costs them is the optimizer's
    temporaries and, at 3+ ranks, the ordered reduction's receive buffer (one bucket). Stage 0
    updates whole buckets, and torch's per-tensor AdamW makes two temporaries the size of the flat
    shard it updates, where DDP's foreach AdamW makes one the size of the model: an eighth keeps
    stage 0 at or below DDP's peak, a whole-model bucket does not. Stage 1 updates 1/N of a bucket:
    one bucket of up to 4 Mi stays at or below ZeroRedundancyOptimizer's peak (at one rank it
    updates whole buckets, as stage 0, and takes stage 0's size). And every bucket is a collective,
    so many small ones cost stages 0-1 step time. The cap keeps large models' buckets near the size
    DDP uses, the floor keeps small models from paying a collective per few thousand elements. The
    trade-off, bucket size against peak and step time, is measured by benchmarks/scaling.py
    --buckets; docs/scaling.md ("The default bucket size") gives the figures, from
    benchmarks/results/scaling_buckets.md and scaling_buckets_n4.md. Stage 3's flat params are its
    units; the bucket size does not apply.
    """
    per_model = BUCKETS_PER_MODEL[0 if stage == 1 and world_size == 1 else stage]
    return max(MIN_BUCKET_NUMEL, min(DEFAULT_BUCKET_NUMEL, -(-trainable_numel // per_model)))


ACCUMULATE_POLICIES = ("reduce_scatter", "local")

ParamGroupFn = Callable[[str, nn.Parameter], dict]  # name, param -> optimizer overrides (`param_groups`)
WrapPolicy = tuple | type | Callable[[nn.Module], bool] | None


@dataclass(frozen=True)
class ShardConfig:
    """How a stage lays out and moves its tensors (see `zk.shard` for each option's meaning)."""

    stage: int
    bucket_numel: int = DEFAULT_BUCKET_NUMEL  # stages 0-2: elements per gradient bucket
    param_groups: ParamGroupFn | None = None  # every stage: per-parameter optimizer overrides
    cast_inputs: bool = True  # every stage: cast floating inputs to the param dtype (bf16/fp16)
    accumulate: str | None = None  # stage 2: how no_sync() micro-steps accumulate (None: the reduction's default)
    max_in_flight: int = 2  # stages 1-2: reduce-scatters left running before a gradient hook waits
    wrap: WrapPolicy = None  # stage 3: which modules are units
    prefetch: int = 1  # stage 3: units gathered ahead of the one computing
    reshard_after_forward: bool = True  # stage 3: free a unit's params between its forward and backward
    reduction: str = "linear"  # every stage: "tree" for world-size-independent bits (core/collectives/tree.py)
    broadcast_buffers: bool = True  # every stage: rank 0's buffers before each forward, as DDP (core/params/model_guard.py)
    param_init_fn: Callable | None = None  # every stage: init of a meta-device model, per module (core/params/materialize.py)

    def __post_init__(self) -> None:
        _check_int("stage", self.stage, 0, 3)
        _check_int("bucket_numel", self.bucket_numel, 1)
        _check_int("max_in_flight", self.max_in_flight, 0)
        _check_int("prefetch", self.prefetch, 0)
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.accumulate is None:  # tree: micro-batches are summed locally, in pairwise partial sums
            object.__setattr__(self, "accumulate", "local" if self.reduction == "tree" else "reduce_scatter")
        if self.accumulate not in ACCUMULATE_POLICIES:
            raise ValueError(f"accumulate must be one of {ACCUMULATE_POLICIES}, got {self.accumulate!r}")
        if self.reduction == "tree" and self.accumulate != "local":
            raise ValueError("reduction='tree' sums a rank's micro-batches locally, in pairwise partial sums, "
                             f"before one reduce-scatter; accumulate={self.accumulate!r} would reduce every "
                             "micro-step across ranks: drop accumulate= (or pass accumulate='local')")
        if self.param_groups is not None and not callable(self.param_groups):
            raise TypeError(f"param_groups must be a callable(name, param) -> dict, got {self.param_groups!r}")
        wrap_matcher(self.wrap)  # raises on a policy that is neither classes nor a callable
        object.__setattr__(self, "cast_inputs", bool(self.cast_inputs))
        object.__setattr__(self, "broadcast_buffers", bool(self.broadcast_buffers))
        object.__setattr__(self, "reshard_after_forward", bool(self.reshard_after_forward))

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")


def wrap_matcher(wrap: WrapPolicy) -> Callable[[nn.Module], bool]:
    """The stage-3 wrap policy as a predicate: module classes (one or a tuple), or a callable(module) -> bool."""
    if wrap is None:
        return lambda m: False
    if isinstance(wrap, type):
        wrap = (wrap,)
    if isinstance(wrap, tuple) and all(isinstance(c, type) and issubclass(c, nn.Module) for c in wrap):
        return lambda m: isinstance(m, wrap)
    if callable(wrap) and not isinstance(wrap, tuple):
        return lambda m: bool(wrap(m))
    raise TypeError(f"wrap must be a tuple of nn.Module classes or a callable(module) -> bool, got {wrap!r}")


def check_optimizer_kwargs(optimizer_cls: type[torch.optim.Optimizer], kwargs: dict,
                           zerokit_options: list[str]) -> None:
    """Refuse a keyword that is neither a zerokit option nor an argument of `optimizer_cls`.

    Only checked when the optimizer's constructor names its arguments (no **kwargs).
    """
    try:
        parameters = inspect.signature(optimizer_cls.__init__).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    accepted = [name for name in parameters if name not in ("self", "params")]
    for key in kwargs:
        if key in accepted:
            continue
        hint = difflib.get_close_matches(key, zerokit_options + accepted, n=1)
        raise TypeError(f"zk.shard got an unknown option {key!r}: not a zerokit option nor an argument of "
                        f"{optimizer_cls.__name__}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                        + f". zerokit options: {', '.join(zerokit_options)}")
