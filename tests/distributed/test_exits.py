"""Clean exits on every path, under torchrun and under `zerokit train --nproc`: a normal end, an error inside
a rank, Ctrl-C. See zerokit/launch.py [Note: process-group teardown] for the abort these guard against."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from common import assert_session_gone
from zerokit.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TRAIN = ["-m", "zerokit", "train", "--model", "tiny"]
ABORT = "terminate called"


def _env() -> dict:
    env = dict(os.environ)
    env.pop("ZEROKIT_VERBOSE", None)
    return env


def _run(argv: list[str], timeout_s: float = 180) -> tuple[int, str]:
    done = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout_s)
    return done.returncode, done.stdout + done.stderr


def _zerokit_frames(out: str) -> list[str]:
    """Traceback lines inside zerokit's own files (torchrun's report of a failed child has frames of its own)."""
    return [line for line in out.splitlines() if re.search(r'File ".*zerokit/[a-z_/]+\.py"', line)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torchrun_form_exits_cleanly(stage):
    """`torchrun --standalone --nproc-per-node 2 -m zerokit train` ends with exit 0 and no rank aborting."""
    rc, out = _run(TORCHRUN + TRAIN + ["--stage", str(stage), "--steps", "2", "--no-progress"])
    assert rc == 0 and ABORT not in out, out
    assert "loss: first" in out and "rank 1" in out, out


_THREADS_SCRIPT = """
import gc, os, time, torch, torch.distributed as dist
import zerokit as zk
from zerokit.models import Block, CharCorpus, build_model
rank, world_size = zk.init_distributed()
model = build_model("tiny")
engine = zk.shard(model, torch.optim.AdamW, stage=int(os.environ["STAGE"]), wrap=(Block,), lr=1e-3)
x, y = CharCorpus.load().batch(2, model.cfg.block_size, 0, rank, world_size)
_, loss = engine(x, y)
engine.backward(loss)
engine.step()
del engine, model, loss
gc.collect()
dist.destroy_process_group()
def thread_names():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except (FileNotFoundError, ProcessLookupError):  # the thread ended between the listing and the read
            pass  # (ENOENT before the open, ESRCH between the open and the read: seen once in CI)
    return sorted(names)
for _ in range(20):  # gloo's loop thread may take a moment to stop after the group is destroyed
    names = thread_names()
    if not any(n.startswith("gloo") for n in names):
        break
    time.sleep(0.1)
print(f"rank {rank} threads after destroy_process_group: {names}", flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads through /proc (Linux)")
@pytest.mark.parametrize("stage", [0, 3])
def test_no_gloo_thread_outlives_destroy_process_group(tmp_path, stage):
    """After zk.init_distributed, zk.shard (a torch optimizer) and a step, destroy_process_group stops gloo's threads
    (within 2 s: seen once, under a full test run's load, a moment late; the bug kept them until exit).

    Before the fix torch.distributed.nn, imported by the first optimizer after the group existed, held the
    group in its default arguments: its threads ran on into interpreter exit, where ranks aborted."""
    script = tmp_path / "threads.py"
    script.write_text(_THREADS_SCRIPT)
    env = _env()
    env["STAGE"] = str(stage)
    done = subprocess.run(TORCHRUN + [str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    # The ranks share one pipe: their lines may interleave, so match each bracketed list on its own.
    reports = re.findall(r"rank (\d) threads after destroy_process_group: (\[[^\]]*\])", out)
    assert done.returncode == 0 and len(reports) == 2, out
    for rank, names in reports:
        assert "gloo" not in names, f"rank {rank}: {names}"


@pytest.fixture(scope="module")
def corrupt_checkpoint(tmp_path_factory):
    """A 2-rank checkpoint of the tiny model with one byte flipped inside rank 1's file (refused at load)."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "run")
    assert main(["train", "--model", "tiny", "--stage", "0", "--nproc", "2", "--steps", "1", "--no-progress",
                 "--save", directory]) == 0
    (snapshot,) = [e for e in os.listdir(directory) if e.startswith("ckpt-")]
    path = os.path.join(directory, snapshot, "rank1-of-2.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-100] ^= 0x10  # inside the tensor bytes: only the checksum can tell
    open(path, "wb").write(data)
    return directory


def test_an_error_inside_a_rank_is_one_line_and_exit_1(capsys, monkeypatch, corrupt_checkpoint):
    """`zerokit train --nproc 2 --resume <corrupted>`: exit 1, one line naming the file, no traceback;
    --verbose prints every failing rank's traceback."""
    monkeypatch.delenv("ZEROKIT_VERBOSE", raising=False)
    argv = ["train", "--model", "tiny", "--stage", "0", "--nproc", "2", "--steps", "3", "--no-progress",
            "--resume", corrupt_checkpoint]
    assert main(argv) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerokit train: error"), captured.err
    assert "rank1-of-2.safetensors" in lines[0] and "Traceback" not in captured.err, captured.err
    assert main(argv + ["--verbose"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "rank 0 of 2 failed" in err, err


def test_torchrun_error_inside_the_ranks_is_one_line_per_rank(corrupt_checkpoint):
    """Under torchrun a refused load ends every rank with one line, no zerokit traceback, and no abort."""
    rc, out = _run(TORCHRUN + TRAIN + ["--stage", "0", "--steps", "3", "--no-progress", "--resume",
                                       corrupt_checkpoint])
    assert rc != 0 and ABORT not in out, out
    # The ranks share one pipe and may interleave their lines: count occurrences, not lines.
    assert out.count("zerokit train: error") == 2 and out.count("rank1-of-2.safetensors") >= 2, out
    assert _zerokit_frames(out) == [], out


def _interrupt(argv: list[str], to_group: bool) -> tuple[int, str, float]:
    """Start argv in its own session; once rank 0's progress bar shows, send SIGINT (to the whole group, as a
    terminal's Ctrl-C does, or to the leader only); -> (exit code, output, seconds from SIGINT to exit)."""
    proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(4096), b"")),
                              daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while b"step/s" not in b"".join(chunks) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)  # tqdm's rate field: the ranks are inside the training loop
    time.sleep(0.5)
    sent = time.monotonic()
    (os.killpg if to_group else os.kill)(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout=60)
    seconds = time.monotonic() - sent
    reader.join(timeout=5)
    assert_session_gone(proc.pid, " after Ctrl-C")
    return rc, b"".join(chunks).decode(errors="replace"), seconds


def test_ctrl_c_stops_zerokit_train_nproc_cleanly():
    """Ctrl-C on `zerokit train --nproc 2`: exit 130 within the teardown grace, one line, no traceback, no abort."""
    rc, out, seconds = _interrupt([sys.executable] + TRAIN + ["--stage", "2", "--nproc", "2", "--steps", "100000"],
                                  to_group=True)
    assert rc == 130 and "zerokit train: interrupted (SIGINT)" in out, out
    assert "Traceback" not in out and ABORT not in out, out
    assert seconds < 20, seconds  # STOP_GRACE_S = 15 s: the ranks tore down themselves, nobody was killed


def test_sigint_to_torchrun_stops_the_ranks_cleanly():
    """SIGINT to torchrun, which forwards it: each rank ends with one line, no zerokit traceback, no abort."""
    rc, out, _ = _interrupt(TORCHRUN + TRAIN + ["--stage", "3", "--steps", "100000"], to_group=False)
    assert rc != 0 and ABORT not in out, out
    assert out.count("zerokit train: interrupted (SIGINT)") == 2, out
    assert _zerokit_frames(out) == [], out


def _abort_at_exit(rank, world_size):
    import atexit
    if rank == 1:
        atexit.register(os.kill, os.getpid(), signal.SIGABRT)  # what "terminate called ..." does, after the result
    return rank


def test_run_ranks_fails_a_rank_that_aborts_after_returning(tmp_path, monkeypatch):
    """A spawned rank that returns its result and then aborts on the way out is a failure, not ignored.

    Spawned: a rank forked from the forkserver (the default) leaves with os._exit and runs no
    interpreter teardown, so it cannot abort there; a spawned one (ZEROKIT_START=spawn) can."""
    from zerokit.launch import RankFailed, run_ranks
    monkeypatch.setenv("ZEROKIT_START", "spawn")
    with pytest.raises(RankFailed, match="rank 1 returned its result, then exited with signal SIGABRT"):
        run_ranks(_abort_at_exit, 2, store_dir=str(tmp_path), timeout_s=60)


def _imported_before_fn(rank, world_size):
    """What this rank had imported when fn started, of what ranks import anyway (a torch optimizer, zk.shard)."""
    return sorted(m for m in ("torch._dynamo", "zerokit.stages.ddp", "zerokit.stages.zero3") if m in sys.modules)


def test_forked_ranks_start_with_what_every_rank_imports(tmp_path, monkeypatch):
    """[Note: starting ranks]: torch._dynamo (2.4 s of CPU, imported by a rank's first torch optimizer) and the
    stage modules come from the forkserver's preload, not imported again by every rank."""
    from zerokit.launch import run_ranks
    monkeypatch.delenv("ZEROKIT_START", raising=False)
    assert run_ranks(_imported_before_fn, 2, store_dir=str(tmp_path), timeout_s=60) == \
        [["torch._dynamo", "zerokit.stages.ddp", "zerokit.stages.zero3"]] * 2


def _blocked_where_no_collective_reaches(rank, world_size):
    if rank == 0:
        time.sleep(0.5)
        raise ValueError("rank 0 gives up")
    while True:  # rank 1: never reaches a collective, so nothing fails on it
        time.sleep(0.05)


def _blocked_for_ever(rank, world_size):
    while True:
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["a rank raised", "deadline"])
def test_a_rank_still_running_when_the_run_fails_prints_its_stack(tmp_path, capfd, how):
    """[Note: stacks of a stuck rank]: the rank that cannot report shows where it is blocked."""
    from zerokit.launch import RankFailed, run_ranks
    if how == "deadline":
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 3 s"):
            run_ranks(_blocked_for_ever, 2, store_dir=str(tmp_path), timeout_s=3)
        stuck, frame = [0, 1], "_blocked_for_ever"
    else:
        with pytest.raises(RankFailed, match="rank 0 gives up"):
            run_ranks(_blocked_where_no_collective_reaches, 2, store_dir=str(tmp_path), timeout_s=60)
        stuck, frame = [1], "_blocked_where_no_collective_reaches"
    err = capfd.readouterr().err
    assert f"zerokit: rank(s) {stuck} still running when the run failed" in err, err
    assert err.count(f'line {_line_of(frame)} in {frame}') == len(stuck), err  # one stack per stuck rank


def _line_of(name: str) -> int:
    """The line of `time.sleep` inside the loop of the function `name` in this file."""
    import inspect
    lines, start = inspect.getsourcelines(globals()[name])
    return start + next(i for i, line in enumerate(lines) if "time.sleep(0.05)" in line)


def _write_pid_and_wait(rank, world_size, folder):
    from pathlib import Path
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_ranks_die_with_a_caller_killed_outright(tmp_path, start):
    """[Note: orphaned ranks]: SIGKILL the process that called run_ranks while its ranks run; they do not outlive it."""
    here = os.path.dirname(os.path.abspath(__file__))  # test_exits, and tests/ for the common module it imports
    script = (f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]\n"
              "from test_exits import _write_pid_and_wait\n"
              "from zerokit.launch import run_ranks\n"
              f"run_ranks(_write_pid_and_wait, 2, {str(tmp_path)!r}, timeout_s=600)\n")
    env = dict(os.environ, ZEROKIT_START=start)
    caller = subprocess.Popen([sys.executable, "-c", script], env=env)
    pid_files = [tmp_path / f"rank{r}.pid" for r in range(2)]
    deadline = time.monotonic() + 60
    while not all(f.exists() and f.read_text() for f in pid_files):
        assert caller.poll() is None and time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    pids = [int(f.read_text()) for f in pid_files]
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if not _gone(pid)]
    for pid in left:  # leave nothing behind, then fail
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their caller"
