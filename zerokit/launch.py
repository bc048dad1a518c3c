"""Run a function on N local ranks (gloo, CPU), the way tests and `zerokit train` do.

`run_ranks(fn, world_size, *args)` spawns one process per rank, makes them rendezvous
through a file in a fresh temporary directory (no fixed port, so parallel runs never
collide), calls `fn(rank, world_size, *args)` on each, and returns every rank's return
value (rank order). If a rank raises, dies by a signal or exits without reporting, the
others are stopped and a RankFailed is raised here: its message holds every failing rank's
report, the root cause first (see [Note: the root cause of a failed run]), and its attributes
the root cause alone (`rank`, `message`, `user_error`, ...) for a one-line report.
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
anything, and the cost grows with the number of ranks sharing the CPUs, paid again by every
`run_ranks` call (the test suite makes ~150). Ranks are therefore forked
from a forkserver: one process, started at the first `run_ranks`, that imports torch and
zerokit once (`_PRELOAD`) and forks a rank per request. The preload also holds what every rank
would otherwise import by itself later: torch._dynamo, which the first torch optimizer a rank
builds imports (`Optimizer.add_param_group` is wrapped by `torch._disable_dynamo`), a heavy
import with sympy and DTensor's op tables; and zerokit's stage modules, which `zk.shard` imports
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

[Note: the root cause of a failed run]
When one rank fails, the others fail moments later inside a collective, and their errors are
knock-on effects: the peer-reset texts of gloo ("Connection closed by peer", "Connection reset by
peer", ...) and, under TORCH_DISTRIBUTED_DEBUG=DETAIL, the monitored barrier's ("Ranks 2 failed to
pass monitoredBarrier in <timeout> ms" appears within seconds of rank 2 raising or dying: it quotes the
configured timeout, not a wait; "received errors while waiting for send/recv from rank 0" names the
rank that ran the barrier, not the one that failed). A rank killed by a signal or that exits without
a report sends nothing, and its exit code is seen only by polling. So, at the first failure seen (an
error report, or a rank that exited without one), the parent keeps collecting for `grace_s`, or
until every rank has reported or exited, then reads every queued report and every exit code, and
only then picks the root cause: a rank that died by a signal or exited without reporting, the
earliest seen first; else the earliest reported exception that is not a knock-on error; else the
earliest knock-on error. Each rank times its report when it catches the exception, and puts it on
the queue before its teardown (which a broken group can slow), so the order does not depend on
who tore down first. Every rank enables faulthandler into a file of its own: a native crash
(SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) writes the rank's Python stacks there, and the parent
puts them in that rank's part of the report, named, instead of anonymous lines among N ranks'
output on the shared stderr.
"""
from __future__ import annotations

import faulthandler
import gc
import os
import sys
import pickle
import queue as queue_module
import re
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
STOP_GRACE_S = 15.0  # after a failure or Ctrl-C: how long ranks get to tear down before they are killed
STACKS_SIGNAL = signal.SIGUSR1  # a rank prints every thread's Python stack to stderr on it
STACKS_WAIT_S = 1.0  # how long the parent gives them to print
FAILURE_GRACE_S = 2.0  # after the first failure: how long the other ranks' reports and exits are collected
UNREPORTED_EXIT_S = 1.0  # a rank that exited with code 0 and sent no report within this long failed
USER_ERRORS = (ValueError, TypeError, OSError)  # what zerokit raises for bad input; the CLI prints them as one line


class RankFailed(RuntimeError):
    """A rank raised or died. str() holds every failing rank's report, the root cause first.

    `rank`, `world_size`: the root-cause rank; `message`: its exception as it would print
    (`str(exc)`), or how it died; `exc_type`: the exception's class name ("" for a death);
    `user_error`: whether it is one of USER_ERRORS; `exitcode`: the exit code of a rank that
    died without a report (negative: killed by that signal), else None; `seconds`: when it
    failed, in seconds since the ranks were started.
    """

    def __init__(self, text: str, rank: int | None = None, world_size: int | None = None, message: str = "",
                 exc_type: str = "", user_error: bool = False, exitcode: int | None = None,
                 seconds: float | None = None):
        super().__init__(text)
        self.rank, self.world_size = rank, world_size
        self.message, self.exc_type, self.user_error = message or text, exc_type, user_error
        self.exitcode, self.seconds = exitcode, seconds


class _Stopped(KeyboardInterrupt):
    """Raised in a rank by the parent's SIGTERM (Ctrl-C in the parent, or another rank failed)."""


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one exception per rank; teardown must not be interrupted
    raise _Stopped("stopped by the parent (Ctrl-C, or another rank failed)")


def _error_report(exc: BaseException) -> dict:
    return {"traceback": traceback.format_exc(), "exc_type": type(exc).__name__, "message": str(exc),
            "user_error": isinstance(exc, USER_ERRORS),
            "stopped": isinstance(exc, KeyboardInterrupt), "time": time.time()}


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
            caller_pid: int, crash_file: str) -> None:
    # See [Note: process-group teardown], [Note: Ctrl-C], [Note: starting ranks], [Note: stacks of a stuck rank],
    # [Note: orphaned ranks], [Note: the root cause of a failed run].
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
    global _crash_log
    _crash_log = open(crash_file, "w")  # kept open for the rank's life: faulthandler writes into it on a crash
    faulthandler.enable(file=_crash_log, all_threads=True)  # [Note: the root cause of a failed run]
    report, sent = None, False
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
        if report[1] == "error":  # before the teardown, which a broken group can slow
            results.put(report)
            sent = True
        gc.collect()  # hooks make the engine a reference cycle: free it while the group still exists
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 -- a failure outside fn (init, teardown)
        if report is None or report[1] == "ok":
            report = (rank, "error", _error_report(exc))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not sent:
        results.put(report)
    if report[1] != "ok":
        raise SystemExit(1)


_crash_log = None  # a rank's faulthandler file ([Note: the root cause of a failed run])

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
        crash_files = [os.path.join(tmp, f"rank{r}.faulthandler") for r in range(world_size)]
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, backend, pg_timeout_s, threads, fn,
                                                   args, results, env, stdio, os.getpid(), crash_files[r]),
                             daemon=True)
                 for r in range(world_size)]
        ranks = _Ranks(procs, results, crash_files)
        for p in procs:
            p.start()
        finished = False
        deadline = time.monotonic() + timeout_s
        try:
            while len(ranks.values) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(ranks.values))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
                ranks.poll(min(remaining, 0.1))
                if ranks.failure_seen():
                    raise ranks.failed(FAILURE_GRACE_S)
            finished = True
        except (RankFailed, TimeoutError) as exc:
            _print_stacks_of_running(procs, set(ranks.values) | getattr(exc, "reported", set()))
            raise
        finally:
            _stop(procs, results if not finished else None)
        # Every rank returned its result; one that then died on the way out (an abort at
        # interpreter exit, see [Note: process-group teardown]) is a failure all the same.
        unclean = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if unclean:
            r, code = unclean[0]
            stack = ranks.crash_stack(r)
            raise RankFailed(f"rank {r} returned its result, then exited with {_how(code)} (exit codes: "
                             f"{[p.exitcode for p in procs]})" + (f"\n{stack}" if stack else ""),
                             rank=r, world_size=world_size, exitcode=code)
    return [ranks.values[r] for r in range(world_size)]


def _how(code: int) -> str:
    """An exit code as words: "signal SIGKILL" (negative: killed by that signal) or "code 3"."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


# Errors a rank gets because another rank failed ([Note: the root cause of a failed run]).
_KNOCK_ON = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed",
             "typically caused by a remote worker", "failed to pass monitoredBarrier",
             "received errors while waiting for send/recv", "timed out in monitoredBarrier")
_GLOO_ENFORCE = re.compile(r"enforce fail at [^\]\n]*gloo")


def _knock_on(report: dict) -> bool:
    text = report["traceback"]
    return any(m in text for m in _KNOCK_ON) or _GLOO_ENFORCE.search(text) is not None


class _Ranks:
    """What the parent knows of each rank: its result or error report, and when it was first seen to exit."""

    def __init__(self, procs: list, results, crash_files: list[str]):
        self.procs, self.results, self.crash_files = procs, results, crash_files
        self.start, self.start_wall = time.monotonic(), time.time()
        self.values: dict[int, Any] = {}  # rank -> fn's return value
        self.errors: dict[int, dict] = {}  # rank -> _error_report(...)
        self.exited: dict[int, float] = {}  # rank -> seconds since start when its exit was first seen

    def poll(self, timeout: float) -> bool:
        """Read one report (waiting up to `timeout`), then note every rank that has exited; -> whether one was read."""
        try:
            rank, status, value = self.results.get(timeout=timeout)
        except queue_module.Empty:
            got = False
        else:
            got = True
            if status == "ok":
                self.values[rank] = pickle.loads(value)
            else:
                self.errors[rank] = value
        now = time.monotonic() - self.start
        for r, p in enumerate(self.procs):
            if r not in self.exited and p.exitcode is not None:
                self.exited[r] = now
        return got

    def _unreported(self) -> list[int]:
        """Ranks that exited without reporting (a report still in the pipe is read by the time this is asked)."""
        return [r for r in self.exited if r not in self.values and r not in self.errors]

    def failure_seen(self) -> bool:
        if self.errors:
            return True
        now = time.monotonic() - self.start
        # Any code but 0 fails at once (a report on its way is read in the grace); code 0 fails once its
        # report is overdue. Negative codes (killed by a signal) are failures like positive ones.
        return any(self.procs[r].exitcode != 0 or now - self.exited[r] > UNREPORTED_EXIT_S
                   for r in self._unreported())

    def crash_stack(self, rank: int) -> str:
        """What faulthandler wrote in `rank`'s file (its Python stacks at a fatal signal), or ""."""
        try:
            with open(self.crash_files[rank], errors="replace") as f:
                return f.read().strip()
        except OSError:
            return ""

    def failed(self, grace_s: float) -> RankFailed:
        """[Note: the root cause of a failed run]: collect for `grace_s`, then a RankFailed, the root cause first."""
        world_size = len(self.procs)
        deadline = time.monotonic() + grace_s
        while (time.monotonic() < deadline and
               len(set(self.values) | set(self.errors) | set(self.exited)) < world_size):
            self.poll(min(0.05, max(0.0, deadline - time.monotonic())))
        while self.poll(0.05):  # whatever is still queued
            pass
        entries = []  # (kind, seconds, rank, header, body): kind 0 died unreported, 1 raised, 2 knock-on, 3 stopped
        for r in self._unreported():
            code = self.procs[r].exitcode
            stack = self.crash_stack(r)
            body = (f"Python stacks when the signal arrived (faulthandler):\n{stack}\n" if stack else
                    "no Python stack: faulthandler writes one for SIGSEGV, SIGABRT, SIGBUS, SIGFPE and SIGILL, "
                    "not for SIGKILL (an OOM kill, `kill -9`)\n" if code < 0 else
                    "it exited before reporting (os._exit, or a failure before fn started: its stderr says which)\n")
            entries.append((0, self.exited[r], r, f"died by {_how(code)}" if code < 0 else f"exited with {_how(code)}",
                            body))
        for r, report in self.errors.items():
            kind = 3 if report["stopped"] else 2 if _knock_on(report) else 1
            entries.append((kind, report["time"] - self.start_wall, r, "failed", report["traceback"]))
        entries.sort(key=lambda e: e[:3])
        root_kind, root_s, root, root_how, _ = entries[0]
        parts = []
        for kind, seconds, r, how, body in entries:
            where = "" if r == root else f" (after rank {root}'s failure: a knock-on error)" if kind == 2 else ""
            when = f"without a report (its exit seen at {seconds:.1f} s)" if kind == 0 else f"at {seconds:.1f} s"
            parts.append(f"rank {r} of {world_size} {how} {when}{where}:\n{body}")
        if root_kind == 0:
            failed = RankFailed("\n".join(parts), rank=root, world_size=world_size,
                                message=f"rank {root} {root_how} without a report (its exit seen at {root_s:.1f} s)",
                                exitcode=self.procs[root].exitcode, seconds=root_s)
        else:
            report = self.errors[root]
            failed = RankFailed("\n".join(parts), rank=root, world_size=world_size, message=report["message"],
                                exc_type=report["exc_type"], user_error=report["user_error"], seconds=root_s)
        failed.reported = set(self.values) | set(self.errors)  # not stuck ([Note: stacks of a stuck rank])
        return failed


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
