"""The launcher names the root cause of a failed run: the rank that raised, died by a signal or exited without
reporting, how, and when, before the other ranks' knock-on errors (peer resets; under TORCH_DISTRIBUTED_DEBUG=DETAIL
the monitored barrier's "Ranks 2 failed to pass monitoredBarrier"). See zerokit/launch.py
[Note: the root cause of a failed run]."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import zerokit as zk
from common import OddBlock, assert_session_gone, odd_batch, odd_model
from zerokit.launch import RankFailed, run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _planted(how: str):
    """A gradient hook that fails the way `how` says, inside the backward pass."""
    def hook(grad):
        if how == "raise":
            raise RuntimeError("planted failure in rank 2's backward")
        os.kill(os.getpid(), getattr(signal, how))
        time.sleep(30)  # SIGKILL and SIGSEGV end the process before this returns
    return hook


def _rank2_fails_in_stage3_backward(rank, world_size, how):
    """Stage 3, plain torch loop; in step 1 rank 2's backward fails (raises, SIGSEGV, SIGKILL) while the other ranks
    are inside the backward's reduce-scatters."""
    model = odd_model()
    engine = zk.shard(model, torch.optim.SGD, stage=3, wrap=(OddBlock,), lr=0.1)
    for step in range(3):
        x, y = odd_batch(step, 2, rank, world_size)
        hooks = []
        if rank == 2 and step == 1:  # on the first block's output: its gradient comes late in the backward
            hooks.append(model.blocks[0].register_forward_hook(
                lambda module, inputs, out: out.register_hook(_planted(how)) and None))
        loss = engine(x, y)
        for h in hooks:
            h.remove()
        loss.backward()
        engine.step()
        model.zero_grad()
    return rank


def _hook_line() -> int:
    """The line of `os.kill` in _planted: where faulthandler's stack of the SIGSEGV must point."""
    import inspect
    lines, start = inspect.getsourcelines(_planted)
    return start + next(i for i, line in enumerate(lines) if "os.kill(" in line)


@pytest.mark.parametrize("debug", ["OFF", "DETAIL"])
@pytest.mark.parametrize("how", ["raise", "SIGSEGV", "SIGKILL"])
def test_the_rank_that_failed_is_named_first(tmp_path, monkeypatch, how, debug):
    """4 ranks, rank 2 fails in stage 3's backward: RankFailed names rank 2 (its exception, or the signal with the
    Python stack faulthandler wrote for SIGSEGV) as the root cause, first in the text, with and without DETAIL."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", debug)  # the ranks take the caller's environment
    with pytest.raises(RankFailed) as info:
        run_ranks(_rank2_fails_in_stage3_backward, 4, how, store_dir=str(tmp_path), timeout_s=120)
    exc, text = info.value, str(info.value)
    assert exc.rank == 2 and exc.world_size == 4, text
    first, *others = re.split(r"\n(?=rank \d of 4 )", text)
    if how == "raise":
        assert exc.exc_type == "RuntimeError" and exc.message == "planted failure in rank 2's backward", text
        assert exc.exitcode is None and re.match(r"rank 2 of 4 failed at \d+\.\d s:\nTraceback", first), text
        assert "RuntimeError: planted failure in rank 2's backward" in first, text
    else:
        assert exc.exitcode == -getattr(signal, how), text
        assert re.match(rf"rank 2 of 4 died by signal {how} without a report \(its exit seen at \d+\.\d s\):",
                        first), text
        if how == "SIGSEGV":  # faulthandler's Python stack, in rank 2's own part of the report
            assert "Fatal Python error: Segmentation fault" in first, text
            assert f"line {_hook_line()} in hook" in first and "in _rank2_fails_in_stage3_backward" in first, text
    for part in others:  # everything after the root cause is another rank's error, marked as its knock-on
        assert not part.startswith("rank 2 "), text
        assert "(after rank 2's failure: a knock-on error)" in part.splitlines()[0], text


def _one_rank_ends_silently(rank, world_size, how):
    """Rank 1 ends without a report (SIGKILL, os._exit) while rank 0 is where no collective can fail it."""
    if rank == 1:
        time.sleep(0.5)
        if how == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)
    while True:
        time.sleep(0.05)


@pytest.mark.parametrize("how, named", [("SIGKILL", "died by signal SIGKILL"), ("exit 0", "exited with code 0")])
def test_a_rank_that_ends_without_a_report_fails_the_run_at_once(tmp_path, how, named):
    """A rank killed by a signal (a negative exit code) or that exits without reporting fails the run within
    seconds, named, however long timeout_s is; the rank still running shows its stack and is stopped."""
    began = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_one_rank_ends_silently, 2, how, store_dir=str(tmp_path), timeout_s=120)
    seconds = time.monotonic() - began
    assert info.value.rank == 1 and str(info.value).startswith(f"rank 1 of 2 {named} without a report"), \
        str(info.value)
    assert seconds < 15, seconds  # not the 120 s deadline


def _forkserver_children(launcher_pid: int) -> list[int]:
    """The ranks of `zerokit train --nproc N` started as `launcher_pid`: the children of its forkserver child."""
    def children(pid):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                return [int(c) for c in f.read().split()]
        except FileNotFoundError:
            return []
    ranks = [grandchild for child in children(launcher_pid) for grandchild in children(child)]
    return sorted(ranks)  # forked in rank order, one after another: rank r has the r-th pid


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="finds the ranks through /proc/PID/task/PID/children (Linux)")
def test_zerokit_train_names_a_rank_killed_from_outside():
    """`zerokit train --nproc 2`, `kill -9` of rank 1 mid-run: exit 1, and the report starts with rank 1 and SIGKILL,
    before rank 0's "Connection reset by peer"; nothing is left running."""
    env = dict(os.environ)
    env.pop("ZEROKIT_VERBOSE", None)
    proc = subprocess.Popen([sys.executable, "-m", "zerokit", "train", "--model", "tiny", "--nproc", "2",
                             "--steps", "100000"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(4096), b"")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while b"step/s" not in b"".join(chunks) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # tqdm's rate field: the ranks are inside the training loop
        ranks = _forkserver_children(proc.pid)
        assert len(ranks) == 2, (ranks, b"".join(chunks).decode(errors="replace"))
        os.kill(ranks[1], signal.SIGKILL)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=5)
    out = b"".join(chunks).decode(errors="replace")
    assert rc == 1, out
    report = out[out.index("rank 1 of 2 died by signal SIGKILL without a report"):]  # ValueError if absent
    assert "rank 0 of 2 failed at" not in out[:len(out) - len(report)], out  # rank 0's knock-on error comes after
    assert_session_gone(proc.pid, "")
