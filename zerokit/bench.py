"""The harness the benchmarks (benchmarks/) and `zerokit compare` share.

* `no_decay`: the parameter groups `zerokit train`, `compare`, `explain --no-decay` and the
  benchmarks give zerokit (no weight decay below 2-D: biases, norms); `decay_groups` is the same
  split as torch optimizer groups, for the torch peers.
* `torch_ddp`: the one torch DDP reference build, with the bucket size zerokit uses and, when
  asked, a communication hook that counts bytes the way zerokit does (all-reduce: 2B).
* `timed_step` / `median_after`: the one timed loop body (warm-up steps are run and left out of
  the median). The optimizer step, the step's `zero_grad()` and reading the loss (a sync point on
  every device) are inside the timed region.
* `unique_bytes`: bytes of distinct storages, for the torch peers' memory by category.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable

import torch


def no_decay(name: str, param: torch.nn.Parameter) -> dict:
    """`param_groups=` for zk.shard: no weight decay below 2-D (biases, norms), the default otherwise."""
    return {"weight_decay": 0.0} if param.dim() < 2 else {}


def decay_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]],
                 no_decay_names: set[str] | None = None) -> list[dict]:
    """torch optimizer groups with `no_decay`'s split: [decayed params, {params, weight_decay 0}].

    `no_decay_names`, when given, decides by name instead of by shape (FSDP1's sharded params are
    1-D views, so the split must be read from the unwrapped model's names).
    """
    named = [(n, p) for n, p in named_params if p.requires_grad]
    if no_decay_names is None:
        skip = [bool(no_decay(n, p)) for n, p in named]
    else:
        skip = [n in no_decay_names for n, _ in named]
    return [{"params": [p for (_, p), s in zip(named, skip) if not s]},
            {"params": [p for (_, p), s in zip(named, skip) if s], "weight_decay": 0.0}]


def torch_ddp(model: torch.nn.Module, bucket_numel: int, device: torch.device | None = None,
              gradient_as_bucket_view: bool = False, count_comm: bool = False):
    """torch's DistributedDataParallel around `model`, its bucket cap zerokit's `bucket_numel` (fp32 bytes).

    Returns (ddp, sent): with `count_comm`, a hook doing torch's default (divide by N, all-reduce)
    adds 2B per all-reduce of B bytes to `sent[0]` (ZeRO's accounting, as zerokit's counters);
    `sent` stays [0] otherwise.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device is not None and device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_numel * 4 / 2**20,
                                  gradient_as_bucket_view=gradient_as_bucket_view)
    sent = [0]
    if count_comm:
        world_size = dist.get_world_size()

        def counting_allreduce(state, bucket):
            buf = bucket.buffer()
            sent[0] += 2 * buf.numel() * buf.element_size()
            buf.div_(world_size)
            return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])

        ddp.register_comm_hook(None, counting_allreduce)
    return ddp, sent


def timed_step(train_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], zero_grad: Callable[[], None],
               x: torch.Tensor, y: torch.Tensor, device: torch.device,
               between: Callable[[], None] | None = None) -> tuple[float, float]:
    """One timed step: (milliseconds, loss). `train_step(x, y)` (forward, backward, optimizer step),
    then `zero_grad()`, then reading the loss are timed; `between()` runs after the optimizer step
    and before zero_grad, its time taken out. On CUDA the device is synchronized at both ends."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    loss = train_step(x, y)
    if between is not None:
        pause = time.perf_counter()
        between()  # not part of the step
        start += time.perf_counter() - pause
    zero_grad()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the step's kernels, not just their launch
    loss_value = float(loss.detach())  # a sync point on every device; inside the timed region
    return 1e3 * (time.perf_counter() - start), loss_value


def median_after(times: list[float], warmup: int) -> float:
    """Median of `times` without the first `warmup` (at least the last one is kept)."""
    return statistics.median(times[min(warmup, len(times) - 1):])


def unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if (s.data_ptr(), s.nbytes()) not in seen:
            seen.add((s.data_ptr(), s.nbytes()))
            total += s.nbytes()
    return total
