"""zerokit: ZeRO stages 0-3 (DDP, sharded optimizer states, sharded gradients, sharded
parameters / FSDP) written from scratch on torch.distributed collectives.

Glossary — one name per kind of tensor, used everywhere in the code:

  param         a module's parameter (an nn.Parameter; after wrapping, a view into a flat buffer)
  flat_param    a padded 1-D buffer holding several params back to back: (padded_numel,),
                padded with zeros to a multiple of the world size N
  param_shard   this rank's range of a flat_param: (padded_numel // N,)
  grad_shard    the gradient averaged over ranks for exactly that range: (padded_numel // N,)
  master_shard  the fp32 copy of param_shard the optimizer updates (a view of it under fp32)
  unsharded     a flat_param gathered whole again (stage 3, around a unit's forward/backward)
  bucket        a flat_param considered as one unit of gradient communication
  unit          (stage 3) a group of modules whose params are gathered and freed together
  Ψ, N          parameter count, world size (ranks)

Public API (stable names; the full contract is docs/design.md):

  zk.init_distributed(backend=None, timeout_s=600)
  engine = zk.shard(model, torch.optim.AdamW, stage=2, lr=3e-4, precision="bf16", ...)
  loss = ...; engine.backward(loss); engine.clip_grad_norm_(1.0); engine.step(); engine.zero_grad()
  engine.memory(), engine.comm_stats(), engine.state_dict(full=True), engine.loss_scale
  engine.save(dir), engine.load(dir)       sharded checkpoints; load may change world size and stage
  zk.estimate(num_params, world_size, stage, precision)   analytic bytes per rank
  zk.lora.inject(model, targets=("q", "v"), rank=8, alpha=1.0)
"""
from __future__ import annotations

import importlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from zerokit.core.comm import Comm, Simulated
from zerokit.core.precision import LossScaler, make_policy

__all__ = ["init_distributed", "shard", "estimate", "lora", "Comm", "Simulated", "STAGES"]

# stage -> "module:Class"; each stage file stands on its own.
STAGES = {
    0: "zerokit.stages.ddp:DDPEngine",
    1: "zerokit.stages.zero1:Zero1Engine",
    2: "zerokit.stages.zero2:Zero2Engine",
    3: "zerokit.stages.zero3:Zero3Engine",
}

DEFAULT_BUCKET_NUMEL = 1 << 22  # 4 Mi elements: 16 MiB of fp32 gradient per bucket


def init_distributed(backend: str | None = None, timeout_s: float = 600) -> tuple[int, int]:
    """Join the process group torchrun describes (env://); return (rank, world_size).

    nccl when CUDA is available, else gloo. `timeout_s`: how long a collective waits for
    the other ranks before it fails (a rank that stopped, or ran fewer steps). Without
    torchrun's environment (no WORLD_SIZE) nothing is initialised and (0, 1) is returned:
    every zerokit collective is then an identity.

    Call `torch.distributed.destroy_process_group()` when done, on every path (try/finally);
    a group still alive when Python exits is destroyed by an atexit hook registered here,
    before the interpreter is torn down. See zerokit/launch.py [Note: process-group teardown].
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # Before the group exists: imported later (torch.optim imports it on first use), its
    # `group=group.WORLD` defaults would hold the group past destroy_process_group().
    importlib.import_module("torch.distributed.nn")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    import atexit

    def destroy_at_exit() -> None:  # runs while the interpreter is whole, unlike the group's own destructor
        if dist.is_initialized():
            dist.destroy_process_group()
    atexit.register(destroy_at_exit)
    return dist.get_rank(), dist.get_world_size()


def shard(model: nn.Module, optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW, *, stage: int = 0,
          precision: str = "fp32", reduce_dtype: torch.dtype | None = None, bucket_numel: int = DEFAULT_BUCKET_NUMEL,
          wrap=None, prefetch: int = 1, reshard_after_forward: bool = True, group=None, param_groups=None,
          loss_scaler: dict | None = None, ordered_reduction: bool | None = None, comm: Comm | None = None,
          accumulate: str = "reduce_scatter", max_in_flight: int = 2, cast_inputs: bool = True,
          **optimizer_kwargs):
    """Wrap `model` for ZeRO stage `stage` (0 = DDP) and build its sharded optimizer.

    Every stage takes the same keywords (a stage ignores those it has no use for, such
    as `wrap` below stage 3), so switching stage is one argument. Optimizer
    hyperparameters (lr, weight_decay, betas, momentum, ...) pass through to
    `optimizer_cls`; `param_groups(name, param) -> dict` overrides them per parameter,
    and parameters with equal overrides share one flat buffer. `loss_scaler` holds
    LossScaler keywords for fp16 (init_scale, growth_interval, hysteresis, ...).
    `reduce_dtype` (e.g. torch.float32 with precision="bf16") is the dtype gradients are
    reduced and their shards kept in (default: the param dtype; see core/grad_reduce.py).
    `ordered_reduction`: see core/comm.py [Note: ordered reduction] (None = ordered on
    gloo, native on NCCL). `comm` replaces `group`/`ordered_reduction` with a ready Comm
    (for example a simulated rank of a larger world). `accumulate` (stage 2 only): how
    gradients accumulate under `no_sync()` — "reduce_scatter" every micro-step into the
    grad shard (low memory) or "local" full gradients until the last micro-step (less
    communication); see stages/zero2.py. `max_in_flight` (stage 2): reduce-scatters left
    running before a gradient hook waits, which bounds full-size gradient memory.
    `cast_inputs` (bf16/fp16): floating-point tensors among the arguments of `engine(...)`,
    nested in lists, tuples and dicts, are cast to the param dtype, as torch FSDP's mixed
    precision does; integer and bool tensors are untouched, and the output stays in the
    param dtype (see core/precision.py). False passes inputs as they are.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {sorted(STAGES)}, got {stage!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class, got {optimizer_cls!r}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    if accumulate not in ("reduce_scatter", "local"):
        raise ValueError(f"accumulate must be 'reduce_scatter' or 'local', got {accumulate!r}")
    if max_in_flight < 0:
        raise ValueError(f"max_in_flight must be >= 0, got {max_in_flight}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    policy = make_policy(precision, reduce_dtype=reduce_dtype)
    if loss_scaler is not None and not policy.uses_loss_scaler:
        raise ValueError(f"loss_scaler= is only used with precision='fp16', got precision={precision!r}")
    scaler = LossScaler(**(loss_scaler or {})) if policy.uses_loss_scaler else None
    if comm is None:
        comm = Comm(group, ordered=ordered_reduction)
    module_name, class_name = STAGES[stage].split(":")
    engine_cls = getattr(importlib.import_module(module_name), class_name)
    return engine_cls(model, optimizer_cls, optimizer_kwargs, comm=comm, policy=policy, scaler=scaler,
                      bucket_numel=bucket_numel, param_groups=param_groups, wrap=wrap, prefetch=prefetch,
                      reshard_after_forward=reshard_after_forward, accumulate=accumulate,
                      max_in_flight=max_in_flight, cast_inputs=bool(cast_inputs))


def estimate(num_params, world_size: int, stage: int, precision: str = "bf16", **kwargs):
    """Analytic bytes per rank by category (see core/memory.py)."""
    from zerokit.core.memory import estimate as _estimate
    return _estimate(num_params, world_size, stage, precision, **kwargs)


def __getattr__(name):
    if name == "lora":  # imported on first use: zk.lora.inject(...)
        return importlib.import_module("zerokit.lora")
    raise AttributeError(f"module 'zerokit' has no attribute {name!r}")
