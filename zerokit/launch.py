"""Run a function on N local ranks (gloo, CPU), the way tests and `zerokit train` do.

`run_ranks(fn, world_size, *args)` spawns one process per rank, makes them rendezvous
through a file in a fresh temporary directory (no fixed port, so parallel runs never
collide), calls `fn(rank, world_size, *args)` on each, and returns every rank's return
value (rank order). If a rank raises, the others are stopped and a RankFailed is raised
here: its message holds every failing rank's traceback, the root cause first, and its
attributes the root cause alone (`rank`, `message`, `user_error`) for a one-line report.
If the ranks do not all finish within `timeout_s`, they are stopped and a TimeoutError
names the ones still running. Under torchrun none of this is used: `zk.init_distributed()`
reads the environment instead.

[Note: process-group teardown]
A gloo process group owns threads (two `pt_gloo_runloop` workers, a `gloo_tcp_loop`).
If they are still running when the process exits, the rank can die with "terminate
called without an active exception" (SIGABRT) after its work is done — typically the
rank that exits first, when its peer's exit closes their connection. Two things kept
them running:
* `destroy_process_group()` skipped on a path (an exception, Ctrl-C);
* a reference to the group held past `destroy_process_group()`: torch.distributed.nn's
  functions take `group=group.WORLD` as a default argument, evaluated when the module is
  imported. Building the first torch optimizer imports it (through torch._dynamo), and
  zerokit builds it after the group exists, so the default group was captured, destroy
  only unregistered it, and its threads lived on to interpreter exit. Importing
  torch.distributed.nn before the group is created makes those defaults None.
So every rank imports torch.distributed.nn before `init_process_group` (here and in
`zk.init_distributed`) and tears down in one order on every path (return, exception,
Ctrl-C): fn returns or raises; its frames, the engine, its hooks and collective handles
are released (`gc.collect()`: hooks make reference cycles); `destroy_process_group()`
stops the gloo threads; only then does the process exit.

[Note: starting ranks]
A rank started with "spawn" is a fresh interpreter that imports torch and zerokit before it does
anything: about 1 s of CPU per rank, 2.3 s for 2 ranks and 4.6 s for 4 on this 2-core machine,
paid again by every `run_ranks` call (the test suite makes ~150). Ranks are therefore forked
from a forkserver: one process, started at the first `run_ranks`, that imports torch and
zerokit once (`_PRELOAD`) and forks a rank per request. The preload also holds what every rank
would otherwise import by itself later: torch._dynamo, which the first torch optimizer a rank
builds imports (`Optimizer.add_param_group` is wrapped by `torch._disable_dynamo`), 2.4 s of CPU
with sympy and DTensor's op tables, in every rank (without it, tests/distributed/test_zero12.py and
test_user_loops.py took 84 s, with it 53 s); and zerokit's stage modules, which `zk.shard` imports
when it picks one. The forkserver starts before any process group, thread pool or CUDA context
exists (importing these creates none), so a rank is as clean as a
spawned one; each rank then takes the caller's current environment (`os.environ` as the
forkserver saw it at its start is older) and its current stdout and stderr (pytest's capture of
the test that started the forkserver is another file), and runs the same `_worker`. A forked rank leaves
with os._exit once `_worker` returns: no interpreter teardown, so none of its atexit handlers
run and the abort of [Note: process-group teardown] cannot happen on the way out (a spawned
rank still tears down, and `run_ranks` still reports one that dies doing so). ZEROKIT_START=spawn
restores fresh interpreters (macOS and Windows have no forkserver and spawn anyway).

[Note: stacks of a stuck rank]
When a run fails (a rank raised, or the deadline passed), the ranks still running are the ones
to look at: a rank blocked inside a collective, or somewhere no collective reaches, cannot
report where it is (its SIGTERM handler runs only when the blocking C++ call returns). Every
rank therefore registers faulthandler on SIGUSR1, and run_ranks sends it to each rank still
running before stopping them: each prints every thread's Python stack to stderr (the caller's
stderr: pytest shows it under the failing test), one rank after another.

[Note: Ctrl-C]
Ctrl-C belongs to the parent: ranks ignore SIGINT (a terminal sends it to the whole
process group) and the parent stops them with SIGTERM, which each rank turns into one
exception, so it unwinds through the same teardown. A rank still running after
STOP_GRACE_S is killed.

[Note: orphaned ranks]
All of that needs the caller alive. A caller killed outright (SIGKILL, an OOM kill, SIGTERM to a
script without a handler, a closed terminal) runs no `finally`, and nothing else stopped its
ranks: they ran on to the end of fn, or for ever inside a collective, taking the CPU from whatever
ran next (a benchmark rerun after one was killed measured every step at twice its time). Forked
ranks are the forkserver's children, not the caller's, and the forkserver does not exit with the
caller while they live (each rank holds the pipe whose closing would tell it), so the kernel's
parent-death signal does not reach them. Every rank therefore watches the caller itself: a
daemon thread waits on a pidfd of the caller's process (`os.pidfd_open`, Linux 5.3+; elsewhere
it polls the pid twice a second) and, when the caller exits, kills its own rank with SIGKILL: with
the caller gone nobody can read a result, and a rank blocked inside a collective could run no
Python teardown anyway. A caller already gone when the rank starts is caught by the same wait.
"""
from __future__ import annotations

import faulthandler
import gc
import os
import sys
import pickle
import queue as queue_module
import select
import signal
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 -- before any group exists: see [Note: process-group teardown]
import torch.multiprocessing as mp

EXIT_GRACE_S = 60.0  # after every rank returned: how long they get to exit before they are killed
STOP_GRACE_S = 15.0  # after a failure or Ctrl-C: how long ranks get to tear down (about 2 s) before they are killed
STACKS_SIGNAL = signal.SIGUSR1  # a rank prints every thread's Python stack to stderr on it
STACKS_WAIT_S = 1.0  # how long the parent gives them to print
USER_ERRORS = (ValueError, TypeError, OSError)  # what zerokit raises for bad input; the CLI prints them as one line


class RankFailed(RuntimeError):
    """A rank raised (or died). str() holds every failing rank's traceback, the root cause first.

    `rank`, `world_size`: the root-cause rank (None when it died without a report);
    `message`: that rank's exception as it would print (`str(exc)`); `exc_type`: its class
    name; `user_error`: whether it is one of USER_ERRORS.
    """

    def __init__(self, text: str, rank: int | None = None, world_size: int | None = None, message: str = "",
                 exc_type: str = "", user_error: bool = False):
        super().__init__(text)
        self.rank, self.world_size = rank, world_size
        self.message, self.exc_type, self.user_error = message or text, exc_type, user_error


class _Stopped(KeyboardInterrupt):
    """Raised in a rank by the parent's SIGTERM (Ctrl-C in the parent, or another rank failed)."""


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one exception per rank; teardown must not be interrupted
    raise _Stopped("stopped by the parent (Ctrl-C, or another rank failed)")


def _error_report(exc: BaseException) -> dict:
    return {"traceback": traceback.format_exc(), "exc_type": type(exc).__name__, "message": str(exc),
            "user_error": isinstance(exc, USER_ERRORS),
            "stopped": isinstance(exc, KeyboardInterrupt)}


class _CallerFd:
    """The caller's file descriptor `fd` at `Process.start()`, handed to the rank (multiprocessing's DupFd,
    taken when the process is pickled: passed to the forkserver, or inherited by a spawned process)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction
        return (_fd_in_rank, (reduction.DupFd(self.fd),))


def _fd_in_rank(dup) -> int:
    return dup.detach()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _die_with_caller(caller_pid: int) -> None:
    """[Note: orphaned ranks]: a daemon thread that SIGKILLs this rank once the caller's process has exited."""
    try:
        pidfd = os.pidfd_open(caller_pid)
    except ProcessLookupError:
        os._exit(1)  # the caller is already gone
    except (AttributeError, OSError):  # no pidfd here (not Linux, an old kernel): poll the pid
        pidfd = None

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the process has exited
        else:
            while _alive(caller_pid):
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zerokit-caller-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _worker(rank: int, world_size: int, init_file: str, backend: str, timeout_s: float, threads: int,
            fn: Callable, args: tuple, results, env: dict[str, str], stdio: tuple[int | None, ...],
            caller_pid: int) -> None:
    # See [Note: process-group teardown], [Note: Ctrl-C], [Note: starting ranks], [Note: stacks of a stuck rank],
    # [Note: orphaned ranks].
    _die_with_caller(caller_pid)
    for target, fd in zip((1, 2), stdio):  # the caller's stdout and stderr now, not the forkserver's
        if fd is not None:
            os.dup2(fd, target)
            os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if dist.is_available():
        dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG was read when the forkserver imported torch
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # [Note: stacks of a stuck rank]
    report = None
    try:
        torch.set_num_threads(threads)  # N ranks share the machine's cores
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, chosen before the group exists
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            # Plain pickle to bytes: tensors travel by value, not as shared-memory handles that
            # would die with this process before the parent reads them.
            report = (rank, "ok", pickle.dumps(fn(rank, world_size, *args)))
        except BaseException as exc:  # noqa: BLE001 -- reported to the parent, then this rank exits non-zero
            report = (rank, "error", _error_report(exc))
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # teardown runs to the end (the parent kills after a grace)
        gc.collect()  # hooks make the engine a reference cycle: free it while the group still exists
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 -- a failure outside fn (init, teardown)
        if report is None or report[1] == "ok":
            report = (rank, "error", _error_report(exc))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    results.put(report)
    if report[1] != "ok":
        raise SystemExit(1)


# Imported once by the forkserver; every rank forked from it starts with them loaded ([Note: starting ranks]).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.nn", "torch._dynamo", "zerokit", "zerokit.launch",
            "zerokit.stages.ddp", "zerokit.stages.zero1", "zerokit.stages.zero2", "zerokit.stages.zero3"]


def _context():
    """How ranks are started: "forkserver" with torch preloaded on Linux, else (or with ZEROKIT_START=spawn) "spawn"."""
    method = os.environ.get("ZEROKIT_START", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"ZEROKIT_START must be 'forkserver' or 'spawn', got {method!r}")
    if method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return mp.get_context("spawn")


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0, backend: str = "gloo",
              threads_per_rank: int | None = None, store_dir: str | None = None,
              collective_timeout_s: float | None = None) -> list[Any]:
    """Call fn(rank, world_size, *args) on `world_size` fresh processes; return their results in rank order.

    `timeout_s`: deadline for the whole run; `collective_timeout_s`: the process group's
    timeout, how long one collective waits for the other ranks (default `timeout_s`).
    `store_dir`: where the rendezvous file goes (tests pass pytest's tmp_path); default a
    fresh temporary directory.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    pg_timeout_s = timeout_s if collective_timeout_s is None else collective_timeout_s
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="zerokit-rdzv-", dir=store_dir) as tmp:
        init_file = os.path.join(tmp, "store")
        env = dict(os.environ)  # the forkserver's was copied when it started: hand over today's
        sys.stdout.flush()
        sys.stderr.flush()
        stdio = tuple(_CallerFd(fd) if _is_open(fd) else None for fd in (1, 2))
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, backend, pg_timeout_s, threads, fn,
                                                   args, results, env, stdio, os.getpid()), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        values: dict[int, Any] = {}
        finished = False
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
                            code = procs[dead[0]].exitcode
                            raise RankFailed(f"rank {dead[0]} exited with code {code} without a traceback",
                                             rank=dead[0], world_size=world_size) from None
                    else:
                        continue
                if status == "error":
                    raise _rank_failed(world_size, {rank: value}, results)
                values[rank] = pickle.loads(value)
            finished = True
        except (RankFailed, TimeoutError) as exc:
            _print_stacks_of_running(procs, set(values) | getattr(exc, "reported", set()))
            raise
        finally:
            _stop(procs, results if not finished else None)
    # Every rank returned its result; one that then died on the way out (an abort at
    # interpreter exit, see [Note: process-group teardown]) is a failure all the same.
    unclean = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if unclean:
        r, code = unclean[0]
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        raise RankFailed(f"rank {r} returned its result, then exited with {how} (exit codes: "
                         f"{[p.exitcode for p in procs]})", rank=r, world_size=world_size)
    return [values[r] for r in range(world_size)]


def _print_stacks_of_running(procs: list, reported: set[int]) -> None:
    """[Note: stacks of a stuck rank]: ranks that sent no report and are still running print their stacks."""
    running = [r for r, p in enumerate(procs) if r not in reported and p.is_alive()]
    if not running:
        return
    print(f"zerokit: rank(s) {running} still running when the run failed; their Python stacks follow "
          f"(most recent call first):", file=sys.stderr, flush=True)
    for r in running:
        try:
            os.kill(procs[r].pid, STACKS_SIGNAL)
        except (ProcessLookupError, TypeError):
            pass
        time.sleep(STACKS_WAIT_S / len(running))  # one rank's stacks at a time: not interleaved


def _stop(procs: list, results) -> None:
    """Wait for the ranks to exit; after a failure or Ctrl-C (`results` given) ask them first (SIGTERM).

    The queue is drained meanwhile: a rank blocks at exit until what it put is read.
    """
    if results is not None:
        for p in procs:
            if p.is_alive():
                p.terminate()  # SIGTERM: the rank raises _Stopped and tears down (see _worker)
    deadline = time.monotonic() + (STOP_GRACE_S if results is not None else EXIT_GRACE_S)
    for p in procs:
        while p.is_alive() and time.monotonic() < deadline:
            p.join(timeout=0.05)
            if results is not None:
                try:
                    while True:
                        results.get_nowait()
                except (queue_module.Empty, OSError, EOFError, ValueError):
                    pass
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


_KNOCK_ON = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _rank_failed(world_size: int, errors: dict[int, dict], results, grace_s: float = 2.0) -> RankFailed:
    """A RankFailed holding all failing ranks' tracebacks, the root cause first and in its attributes.

    When one rank raises, its peers fail moments later inside a collective ("connection
    reset by peer"); collect those for a short grace period and list them after the
    rank whose failure was not such a knock-on effect (nor a stop asked by this parent).
    """
    deadline = time.monotonic() + grace_s
    reported = set(errors)
    while time.monotonic() < deadline and len(errors) < world_size:
        try:
            rank, status, value = results.get(timeout=max(0.05, deadline - time.monotonic()))
        except queue_module.Empty:
            break
        reported.add(rank)
        if status == "error":
            errors[rank] = value
    order = sorted(errors, key=lambda r: (errors[r]["stopped"],
                                          any(m in errors[r]["traceback"] for m in _KNOCK_ON), r))
    text = "\n".join(f"rank {r} of {world_size} failed:\n{errors[r]['traceback']}" for r in order)
    root = errors[order[0]]
    failed = RankFailed(text, rank=order[0], world_size=world_size, message=root["message"],
                        exc_type=root["exc_type"], user_error=root["user_error"])
    failed.reported = reported  # ranks that sent a report: not stuck ([Note: stacks of a stuck rank])
    return failed
