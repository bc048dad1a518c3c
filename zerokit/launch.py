"""Run a function on N local ranks (gloo, CPU), the way tests and `zerokit train` do.

`run_ranks(fn, world_size, *args)` spawns one process per rank, makes them rendezvous
through a file in a fresh temporary directory (no fixed port, so parallel runs never
collide), calls `fn(rank, world_size, *args)` on each, and returns every rank's return
value (rank order). If a rank raises, the others are stopped and its traceback is
re-raised here; if the ranks do not all finish within `timeout_s`, they are killed and
a TimeoutError names the ones still running. Under torchrun none of this is used:
`zk.init_distributed()` reads the environment instead.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_module
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    pass


def _worker(rank: int, world_size: int, init_file: str, backend: str, timeout_s: float, threads: int,
            fn: Callable, args: tuple, results) -> None:
    try:
        torch.set_num_threads(threads)  # N ranks share the machine's cores
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, chosen before the group exists
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle to bytes: tensors travel by value, not as shared-memory handles that
        # would die with this process before the parent reads them.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # report every failure, then exit non-zero
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1)


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0, backend: str = "gloo",
              threads_per_rank: int | None = None, store_dir: str | None = None) -> list[Any]:
    """Call fn(rank, world_size, *args) on `world_size` fresh processes; return their results in rank order.

    `store_dir`: where the rendezvous file goes (tests pass pytest's tmp_path); default a
    fresh temporary directory.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="zerokit-rdzv-", dir=store_dir) as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, backend, timeout_s, threads, fn, args,
                                                   results), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        values: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(values) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(values))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                except queue_module.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
                    if dead:
                        # A rank died without reporting (segfault, OOM kill): give a moment for
                        # a late report, then fail.
                        try:
                            rank, status, value = results.get(timeout=2.0)
                        except queue_module.Empty:
                            raise RankFailed(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                             "without a traceback") from None
                    else:
                        continue
                if status == "error":
                    raise RankFailed(_describe_failures(world_size, {rank: value}, results))
                values[rank] = pickle.loads(value)
        finally:
            for p in procs:
                p.join(timeout=5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    return [values[r] for r in range(world_size)]


_KNOCK_ON = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _describe_failures(world_size: int, errors: dict[int, str], results, grace_s: float = 2.0) -> str:
    """All failing ranks' tracebacks, the root cause first.

    When one rank raises, its peers fail moments later inside a collective ("connection
    reset by peer"); collect those for a short grace period and list them after the
    rank whose failure was not such a knock-on effect.
    """
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and len(errors) < world_size:
        try:
            rank, status, value = results.get(timeout=max(0.05, deadline - time.monotonic()))
        except queue_module.Empty:
            break
        if status == "error":
            errors[rank] = value
    order = sorted(errors, key=lambda r: (any(m in errors[r] for m in _KNOCK_ON), r))
    return "\n".join(f"rank {r} of {world_size} failed:\n{errors[r]}" for r in order)
