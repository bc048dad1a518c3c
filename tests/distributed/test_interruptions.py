"""Interrupted runs end with the weights of the run never interrupted (commands/train.py [Note: the training
position], core/preemption.py [Note: agreeing to stop], zerokit/__init__.py [Note: one store prefix per
restart]).

Interruptions are armed at exact points by interrupt_at.py (a rank SIGKILLed inside the forward, the
backward, the optimizer step and a save; SIGTERM to one rank; SIGTERM to torchrun's agent). Under
`--reduction tree` every run is compared with one process taking the 4 micro-batches of each step
itself, so a resume at another world size must give the same digest; under the default reduction
with the uninterrupted torchrun run at the same world size. benchmarks/investigations/interruptions.py
runs the larger matrix (random kill steps, resume world sizes, stages).
"""
import os
import re
import subprocess
import sys

import pytest
import torch.distributed as dist

from zerokit.cli import main
from zerokit.launch import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INTERRUPT_AT = os.path.join(REPO, "tests", "distributed", "interrupt_at.py")
EXAMPLE = os.path.join(REPO, "examples", "resumable_loop.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
STEPS = ["--model", "tiny", "--steps", "6", "--no-progress"]
TREE = STEPS + ["--reduction", "tree"]


def _env(interrupt: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop("ZEROKIT_VERBOSE", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    if interrupt:
        env["ZEROKIT_INTERRUPT"] = interrupt
    return env


def _torchrun(args: list[str], interrupt: str | None = None, restarts: int = 0) -> tuple[int, str]:
    done = subprocess.run(TORCHRUN + ["--max-restarts", str(restarts), INTERRUPT_AT, "train"] + args, cwd=REPO,
                          env=_env(interrupt), capture_output=True, text=True, timeout=240)
    return done.returncode, done.stdout + done.stderr


def _digests(out: str) -> list[str]:
    return re.findall(r"weights sha256: ([0-9a-f]{64})", out)


@pytest.fixture(scope="module")
def tree_digest(tmp_path_factory, capsys_module=None):
    """The uninterrupted run's digest: one process, 4 micro-batches per step."""
    import io
    from contextlib import redirect_stdout
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["train"] + TREE + ["--nproc", "1", "--accumulate", "4"]) == 0
    return _digests(out.getvalue())[0]


def _resume_in_process(args: list[str]) -> str:
    import io
    from contextlib import redirect_stdout
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["train"] + args) == 0
    assert "resumed from" in out.getvalue(), out.getvalue()
    return _digests(out.getvalue())[0]


def test_torchrun_restarts_through_kills_in_forward_backward_optimizer_save_and_a_sigterm(tmp_path):
    """Default reduction, world size 2, --max-restarts 5: rank 1 SIGKILLed once in each of the forward, the
    backward, the optimizer step and a save, then SIGTERMed. Each restart resumes from the last commit (a kill
    during a save leaves the one before; the SIGTERM makes every rank commit the same step and exit 75), and the
    run ends with the digest of the same command never interrupted."""
    rc, out = _torchrun(STEPS)
    assert rc == 0, out
    (expected,) = _digests(out)
    marker = tmp_path / "fired"
    rc, out = _torchrun(STEPS + ["--save", str(tmp_path / "ck"), "--save-every", "1", "--resume", "auto"],
                        interrupt=f"1:kill:{marker}:forward@2,backward@2,optimizer@2,save@2,optimizer@1@term",
                        restarts=5)
    assert rc == 0, out
    fired = [line.split()[:2] for line in marker.read_text().splitlines()]
    assert fired == [["forward@2", "kill"], ["backward@2", "kill"], ["optimizer@2", "kill"], ["save@2", "kill"],
                     ["optimizer@1", "term"]], out
    # the attempts' last commits: steps 1, 2, 3, 4 (the save of step 5 killed), 5 (stopped); the last resumes at 5
    assert "stopped by a signal to another rank after step 5; checkpoint committed" in out, out
    assert re.search(r"exitcode:? +75", out), out  # torchrun's record of the stopped attempt
    assert "resumed from" in out and "at step 5" in out, out
    assert _digests(out)[-1] == expected, out


def test_sigterm_to_torchruns_agent_then_resume_on_one_rank(tmp_path, tree_digest):
    """SIGTERM to the agent (as a scheduler's preemption): it forwards it, the ranks commit step 3 and exit 75;
    the same command on 1 rank x 4 micro-batches (--reduction tree) ends with the uninterrupted 2 x 2 digest."""
    ck = tmp_path / "ck"
    rc, out = _torchrun(TREE + ["--accumulate", "2", "--save", str(ck), "--resume", "auto"],
                        interrupt=f"0:term-agent:{tmp_path / 'fired'}:forward@5")
    assert rc != 0, out
    assert f"stopped by SIGTERM after step 3; checkpoint committed to {ck} (step 3): exit status 75" in out, out
    assert _resume_in_process(TREE + ["--nproc", "1", "--accumulate", "4", "--save", str(ck), "--resume",
                                      "auto"]) == tree_digest


def test_a_resume_that_changes_the_run_is_refused_naming_the_option(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    assert main(["train"] + STEPS + ["--nproc", "1", "--steps", "1", "--save", ck]) == 0
    capsys.readouterr()
    for change, fragment in ((["--seed", "1"], "--seed 0, this run has --seed 1"),
                             (["--weight-decay", "0"], "--weight-decay 0.1, this run has --weight-decay 0.0"),
                             (["--accumulate", "2"], "1 micro-batches per step")):
        assert main(["train"] + STEPS + ["--nproc", "1", "--save", ck, "--resume", "auto"] + change) == 1
        assert fragment in capsys.readouterr().err


def _agree(rank, world_size):
    import signal

    import torch

    import zerokit as zk
    from zerokit.core import preemption
    engine = zk.shard(torch.nn.Linear(4, 4), stage=3)
    answers = [engine.stop_requested()]  # installs the handlers
    for step in range(4):
        if rank == 1 and step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        answers.append(engine.stop_requested())
    preemption.SIGNALS.release()
    return answers, preemption.received_signal()


def test_stop_requested_is_the_same_on_every_rank_once_any_rank_was_signalled(tmp_path):
    (a0, s0), (a1, s1) = run_ranks(_agree, 2, store_dir=str(tmp_path))
    assert a0 == a1 == [False, False, True, True, True]
    assert (s0, s1) == (None, "SIGTERM")
    assert not dist.is_initialized()


def _example_in_process(directory, capsys) -> str:
    import runpy

    from zerokit.core import preemption
    argv = sys.argv
    sys.argv = [EXAMPLE, str(directory)]
    try:
        runpy.run_path(EXAMPLE, run_name="__main__")
    finally:
        sys.argv = argv
        preemption.SIGNALS.release()
    return re.findall(r"rank 0 weights sha256 ([0-9a-f]{64})", capsys.readouterr().out)[0]


def test_the_readme_loop_saves_on_sigterm_and_its_rerun_ends_as_the_run_never_stopped(tmp_path, capsys):
    """examples/resumable_loop.py (the loop the README points to): SIGTERM during step 15's optimizer step makes it save
    step 15 and exit 75; the same command again resumes there and ends with the uninterrupted run's weights."""
    expected = _example_in_process(tmp_path / "straight", capsys)
    done = subprocess.run([sys.executable, INTERRUPT_AT, EXAMPLE, str(tmp_path / "ck")], cwd=REPO, timeout=240,
                          env=_env(f"0:term:{tmp_path / 'fired'}:optimizer@15"), capture_output=True, text=True)
    assert done.returncode == 75 and "rank 0: stopped after step 15, saved" in done.stdout, done.stdout + done.stderr
    assert _example_in_process(tmp_path / "ck", capsys) == expected
