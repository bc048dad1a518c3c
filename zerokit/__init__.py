"""zerokit: ZeRO stages 0-3 (DDP, sharded optimizer states, sharded gradients, sharded
parameters / FSDP) written from scratch on torch.distributed collectives.

The public API (zk.init_distributed, zk.shard, zk.hybrid_groups, zk.estimate, zk.lora, zk.quantize) with every
option, and the glossary of tensor names (param, flat_param, flat_data, flat_grad, param_shard,
grad_shard, master_shard, bucket, reduction, unit) used everywhere in the code: docs/design.md.
A complete training loop: examples/train_loop.py.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from zerokit.core.collectives.comm import Comm, Simulated
from zerokit.core.params.deferred import deferred_init
from zerokit.core.config import DEFAULT_BUCKET_NUMEL, ShardConfig, check_optimizer_kwargs, default_bucket_numel
from zerokit.core.collectives.hybrid import HybridComm, check_shard_group_size, hybrid_groups
from zerokit.core.precision import GradScaler, LossScaler, make_policy

__all__ = ["init_distributed", "shard", "deferred_init", "hybrid_groups", "estimate", "lora", "quantize", "dequantized_state_dict", "Comm", "HybridComm", "Simulated", "GradScaler",
           "STAGES"]

# stage -> "module:Class"; each stage file stands on its own.
STAGES = {
    0: "zerokit.stages.ddp:DDPEngine",
    1: "zerokit.stages.zero1:Zero1Engine",
    2: "zerokit.stages.zero2:Zero2Engine",
    3: "zerokit.stages.zero3:Zero3Engine",
}

def choose_backend(backend: str | None, local_rank: int, local_ranks: int, gpus: int) -> str:
    """`init_distributed`'s backend: the one given, else nccl with a GPU for every local rank, else gloo."""
    if backend is None:
        backend = "nccl" if 0 < local_ranks <= gpus else "gloo"
        if 0 < gpus < local_ranks:
            warnings.warn(f"{local_ranks} local ranks but {gpus} GPU(s): NCCL needs a GPU per rank, so zerokit "
                          "uses gloo on the CPU (start at most one rank per GPU for NCCL)", stacklevel=3)
    if backend == "nccl" and local_rank >= gpus:
        raise ValueError(f"backend='nccl' on local rank {local_rank} with {gpus} GPU(s) visible: NCCL needs a GPU "
                         "per rank; start at most one rank per GPU, or pass backend='gloo'")
    return backend


def init_distributed(backend: str | None = None, timeout_s: float = 600) -> tuple[int, int]:
    """Join the process group torchrun describes (env://); return (rank, world_size).

    nccl when CUDA is available with a GPU for every local rank, else gloo (with a warning when
    GPUs are there but fewer than torchrun's local ranks: NCCL needs one per rank). `timeout_s`: how long a collective waits for
    the other ranks before it fails (a rank that stopped, or ran fewer steps). Without
    torchrun's environment (no WORLD_SIZE) nothing is initialised and (0, 1) is returned:
    every zerokit collective is then an identity.

    Call `torch.distributed.destroy_process_group()` when done, on every path (try/finally);
    a group still alive when Python exits is destroyed by an atexit hook registered here,
    before the interpreter is torn down. See zerokit/launch.py [Note: process-group teardown].

    [Note: one store prefix per restart]
    torchrun's agent keeps its store across the restarts of `--max-restarts`, and a process group
    keys what its ranks publish (gloo's addresses) by names that are the same in every attempt, so
    a restarted worker can read the dead attempt's addresses and hang connecting to them, or fail.
    Under torchrun every key goes under a prefix naming the attempt (TORCHELASTIC_RESTART_COUNT):
    a restarted group sees only its own attempt's keys. The count is per agent; standalone (one
    agent) it is the same on every rank.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = choose_backend(backend, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                             torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    # Before the group exists: imported later (torch.optim imports it on first use), its
    # `group=group.WORLD` defaults would hold the group past destroy_process_group().
    importlib.import_module("torch.distributed.nn")
    import faulthandler
    if not faulthandler.is_enabled():  # a native crash (SIGSEGV, SIGABRT, ...) prints this rank's Python stack
        faulthandler.enable()
    timeout = timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
    else:  # [Note: one store prefix per restart]
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"zerokit/attempt-{attempt}/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    import atexit

    def destroy_at_exit() -> None:  # runs while the interpreter is whole, unlike the group's own destructor
        if dist.is_initialized():
            dist.destroy_process_group()
    atexit.register(destroy_at_exit)
    return dist.get_rank(), dist.get_world_size()


def shard(model: nn.Module, optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW, *, stage: int = 0,
          precision: str = "fp32", reduce_dtype: torch.dtype | None = None, bucket_numel: int | None = None,
          wrap=None, prefetch: int = 1, reshard_after_forward: bool = True, group=None, param_groups=None,
          loss_scaler: dict | None = None, ordered_reduction: bool | None = None, comm: Comm | None = None,
          accumulate: str | None = None, max_in_flight: int = 2, cast_inputs: bool = True,
          debug: bool | None = None, reduction: str = "linear", shard_group_size: int | None = None,
          broadcast_buffers: bool = True, param_init_fn=None, **optimizer_kwargs):
    """Wrap `model` for ZeRO stage `stage` (0 = DDP) and build its sharded optimizer.

    Every stage takes the same keywords (a stage ignores those it has no use for, such
    as `wrap` below stage 3), so switching stage is one argument; they are checked once,
    into a frozen core/config.py `ShardConfig`, and a keyword that is neither one of them
    nor an argument of `optimizer_cls` is a TypeError naming the closest of each. Optimizer
    hyperparameters (lr, weight_decay, betas, momentum, ...) pass through to
    `optimizer_cls`; `param_groups(name, param) -> dict` overrides them per parameter,
    and parameters with equal overrides share one flat buffer. `loss_scaler` holds
    LossScaler keywords for fp16 (init_scale, growth_interval, hysteresis, ...); `{"init_scale": 1.0,
    "growth_interval": 0}` is a static scale of 1, under which a plain `loss.backward()` is accepted
    (with a one-time underflow warning). Every engine has `engine.scaler`, torch GradScaler's shape
    (`engine.scaler.scale(loss).backward()`, `scaler.step(engine.optimizer)`, `scaler.update()`),
    disabled under fp32/bf16 so one loop runs at every precision (core/precision.py `GradScaler`).
    `bucket_numel` (stages 0-2): elements per flat gradient bucket; None (the default) picks an eighth of
    the trainable parameters at stage 0 (and at stage 1 on one rank), all of them at stage 1, a
    thirty-second at stage 2, within [32 Ki, 4 Mi] (core/config.py [Note: default bucket size]).
    `reduce_dtype` (e.g. torch.float32 with precision="bf16") is the dtype gradients are
    reduced and their shards kept in (default: the param dtype; see core/grads/grad_reduce.py).
    `ordered_reduction`: see core/collectives/ordered.py [Note: ordered reduction] (None = ordered on
    gloo, native on NCCL). `comm` replaces `group`/`ordered_reduction` with a ready Comm
    (for example a simulated rank of a larger world). `accumulate` (stage 2 only): how
    gradients accumulate under `no_sync()` — "reduce_scatter" every micro-step into the
    grad shard (low memory; the default) or "local" full gradients until the last micro-step
    (less communication; the only choice under reduction="tree"); see stages/zero2.py. `max_in_flight` (stages 1-2): reduce-scatters left
    running before a gradient hook waits, which bounds full-size gradient memory (stage 2) and the
    reduce-scatters' receive buffers (stages 1-2).
    `cast_inputs` (bf16/fp16): floating-point tensors among the arguments of `engine(...)`,
    nested in lists, tuples and dicts, are cast to the param dtype, as torch FSDP's mixed
    precision does; integer and bool tensors are untouched, and the output stays in the
    param dtype (see core/precision.py). False passes inputs as they are.
    `debug=True` (or the environment's ZEROKIT_DEBUG=1, which `debug=None` reads): before each
    collective every rank checks that every other rank is about to issue the same one, and if not
    raises at once on every rank, naming what each rank was doing in ZeRO terms ("rank 0 is
    reduce-scattering bucket 3 (blocks.2.*), rank 1 is all-gathering unit blocks.0") instead of
    hanging until the process group's timeout. Costs one small all-gather per collective; training
    is bitwise unchanged (core/collectives/recorder.py [Note: debug mode]). With `comm=`, it sets `comm.debug`.
    `reduction="tree"` (every stage and precision): the step's micro-batch gradients are summed
    in one fixed binary tree — pairwise partial sums on each rank under `no_sync()`, pairwise
    across ranks, an exact gradient norm — so a run's bits do not depend on the world size: one
    process with 4 micro-batches reproduces 4 ranks with 1 each (core/collectives/tree.py [Note:
    world-size-independent bits]). World size and micro-batches per rank must be powers of two.
    `shard_group_size=S` (hybrid sharding, S dividing the world size N): stages 1-3 shard over
    the S ranks of a node, [kS, (k+1)S), and replicate across nodes; gradients are reduce-scattered
    in the node, then their shard is averaged across nodes, bitwise equal to stage 0 at N ranks
    under the ordered reduction (core/collectives/hybrid.py [Note: hybrid sharding]). Stage 0 shards nothing
    and ignores it. `group=(shard_group, replicate_group)` passes ready-made groups instead, such
    as `zk.hybrid_groups(S)` builds once for several engines.
    `broadcast_buffers=True` (every stage, as torch DDP's default): rank 0's buffers (BatchNorm's
    running statistics, ...) are broadcast to every rank before a forward of `engine(...)` exactly
    when DDP would broadcast them before `ddp(x)` (the first forward, and any forward after one
    that ran with grad enabled outside `no_sync()`), so every replica holds rank 0's bits; one
    broadcast per buffer dtype, none for a model without buffers, counted by the comm ledger in
    phase "buffers". Calling `model(x)` itself does not broadcast (as `ddp.module(x)`). False
    keeps each rank's buffers local, as DDP(broadcast_buffers=False). `torch.nn.SyncBatchNorm`
    synchronises its own statistics in its forward, at every stage as under DDP.
    A model built on the meta device (`with torch.device("meta"): model = GPT(cfg)`, parameters and
    buffers shapes only) is accepted at every stage: each rank makes one flat param (stage 3: one unit) of
    values at a time and keeps what it owns, running each module's `reset_parameters()` and then
    `param_init_fn(module)` (if given) for every module, children first, in the order an eager build and
    `model.apply(param_init_fn)` run them, from rank 0's generator state: the same bits as the model built
    eagerly on CPU after the same seed (core/params/materialize.py [Note: the same bits as an eager build]). A
    parameter or buffer nothing initializes is refused, naming it, before anything is allocated.
    At construction every rank checks that every rank built the same model (parameters and
    buffers: names, shapes, dtypes, requires_grad) and, after rank 0's values are broadcast,
    holds the same bits, and raises on every rank naming the first difference otherwise; a model
    with no parameter that requires grad is refused. A model cast or moved after `zk.shard`
    (`model.half()`, `.to(...)`) is refused at the next `engine(...)` or step: cast or move
    it first (core/params/model_guard.py).
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {sorted(STAGES)}, got {stage!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class, got {optimizer_cls!r}")
    default_bucket = bucket_numel is None  # resolved once the world size is known, below
    config = ShardConfig(stage=stage, bucket_numel=DEFAULT_BUCKET_NUMEL if default_bucket else bucket_numel,
                         param_groups=param_groups, cast_inputs=cast_inputs,
                         accumulate=accumulate, max_in_flight=max_in_flight, wrap=wrap, prefetch=prefetch,
                         reshard_after_forward=reshard_after_forward, reduction=reduction,
                         broadcast_buffers=broadcast_buffers, param_init_fn=param_init_fn)
    check_optimizer_kwargs(optimizer_cls, optimizer_kwargs, _SHARD_OPTIONS)
    policy = make_policy(precision, reduce_dtype=reduce_dtype, params=model.named_parameters())  # float64: kept
    if loss_scaler is not None and not policy.uses_loss_scaler:
        raise ValueError(f"loss_scaler= is only used with precision='fp16', got precision={precision!r}")
    scaler = LossScaler(**(loss_scaler or {})) if policy.uses_loss_scaler else None
    if comm is None:
        comm = _make_comm(stage, group, shard_group_size, ordered_reduction, debug)
    else:
        if shard_group_size is not None or isinstance(group, tuple):
            raise ValueError("comm= replaces group= and shard_group_size=: pass a core.hybrid.HybridComm as comm, "
                             "or drop comm=")
        if debug is not None:
            comm.debug = bool(debug)
    if default_bucket:  # core/config.py [Note: default bucket size]
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        config = dataclasses.replace(config, bucket_numel=default_bucket_numel(trainable, stage, comm.world_size))
    module_name, class_name = STAGES[stage].split(":")
    engine_cls = getattr(importlib.import_module(module_name), class_name)
    engine = engine_cls(model, optimizer_cls, optimizer_kwargs, comm=comm, policy=policy, scaler=scaler, config=config)
    engine.optimizer.attach(engine)  # engine.optimizer.step() / zero_grad() are the engine's (optim/sharded.py)
    return engine


def _make_comm(stage: int, group, shard_group_size: int | None, ordered: bool | None, debug: bool | None) -> Comm:
    """One flat group, or a shard group and a replicate group (hybrid sharding, stages 1-3)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if isinstance(group, tuple):
        if len(group) != 2:
            raise ValueError("group= as a tuple is (shard_group, replicate_group), as zk.hybrid_groups(S) returns")
        groups = group
        size = dist.get_world_size(groups[0]) if world > 1 else 1
        if shard_group_size is not None and shard_group_size != size:
            raise ValueError(f"shard_group_size={shard_group_size} but the shard group passed has {size} ranks")
    elif shard_group_size is not None:
        check_shard_group_size(shard_group_size, world)
        if group is not None:
            raise ValueError("group= and shard_group_size= together: pass group=zk.hybrid_groups(S) (both groups), "
                             "or shard_group_size=S alone (over the default group)")
        groups = None if shard_group_size == world else "build"
    else:
        return Comm(group, ordered=ordered, debug=debug)
    if stage == 0 or groups is None:  # stage 0 shards nothing: one group of every rank
        return Comm(None, ordered=ordered, debug=debug)
    if groups == "build":
        groups = hybrid_groups(shard_group_size)
    return HybridComm(*groups, ordered=ordered, debug=debug)


# zk.shard's own keywords, for the unknown-option error (check_optimizer_kwargs)
_SHARD_OPTIONS = [name for name, p in inspect.signature(shard).parameters.items()
                  if p.kind is inspect.Parameter.KEYWORD_ONLY]


def estimate(num_params, world_size: int, stage: int, precision: str = "bf16", **kwargs):
    """Analytic bytes per rank by category (see core/accounting/estimate.py)."""
    from zerokit.core.accounting.estimate import estimate as _estimate
    return _estimate(num_params, world_size, stage, precision, **kwargs)


def quantize(model: nn.Module, fmt: str, targets=None, skip=(), block_size: int = 64,
             double_quant: bool = True) -> list[str]:
    """Store the frozen weights of `model`'s Linear layers as NF4 or int8 (QLoRA's base); see zerokit/quant.py."""
    from zerokit.quant import quantize as _quantize
    return _quantize(model, fmt, targets=targets, skip=skip, block_size=block_size, double_quant=double_quant)


def dequantized_state_dict(model: nn.Module, state_dict: dict | None = None) -> dict:
    """The state_dict with each quantized weight as its fp32 dequantized value, under its original name."""
    from zerokit.quant import dequantized_state_dict as _dequantized
    return _dequantized(model, state_dict)


def __getattr__(name):
    if name in ("lora", "quant"):  # imported on first use: zk.lora.inject(...)
        return importlib.import_module(f"zerokit.{name}")
    raise AttributeError(f"module 'zerokit' has no attribute {name!r}")
