"""`zerokit` with interruptions armed at exact points, for test_interruptions.py and
benchmarks/investigations/interruptions.py (run as a script, under torchrun or alone):

    ZEROKIT_INTERRUPT="RANK:ACTION:MARKER:WHERE@CALL,WHERE@CALL@ACTION,..." python tests/distributed/interrupt_at.py train ...
    ZEROKIT_INTERRUPT=... python tests/distributed/interrupt_at.py examples/resumable_loop.py DIR   # a script

Process attempt i (the i-th start of a rank, counted in the MARKER file) is armed with the i-th
WHERE@CALL (and its own ACTION, if it names one): the CALL-th time (from 1) rank RANK enters the model's forward (`forward`), runs its
backward (`backward`, from a hook on the logits), enters the optimizer step (`optimizer`), or has
written its checkpoint file with nothing committed yet (`save`), it appends a line to MARKER (point, action, time) and
ACTION happens: `kill` (SIGKILL itself), `term` (SIGTERM itself), `term-agent` (SIGTERM its parent,
torchrun's agent, which forwards it to every rank). Past the last entry nothing is armed, so
torchrun's last restart, or a resume, runs clean.
"""
import os
import signal
import sys
import time
from pathlib import Path


def _arm() -> None:
    spec = os.environ.get("ZEROKIT_INTERRUPT")
    if not spec:
        return
    rank, action, marker, plan = spec.split(":", 3)
    if int(os.environ.get("RANK", "0")) != int(rank):
        return
    fired = len(Path(marker).read_text().splitlines()) if Path(marker).exists() else 0
    points = plan.split(",")
    if fired >= len(points):
        return
    where, call, *own = points[fired].split("@")
    action = own[0] if own else action
    call, count = int(call), [0]

    def fire() -> None:
        count[0] += 1
        if count[0] != call:
            return
        with open(marker, "a") as f:
            f.write(f"{where}@{call} {action} {time.time():.3f}\n")  # the time: signal-to-exit in the benchmark
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif action == "term-agent":
            os.kill(os.getppid(), signal.SIGTERM)
        else:
            raise ValueError(f"unknown action {action!r}")

    import torch

    from zerokit import models
    from zerokit.checkpoint import commit
    from zerokit.optim import sharded

    if where in ("forward", "backward"):
        forward = models.GPT.forward

        def armed_forward(self, *args, **kwargs):
            if where == "forward" and torch.is_grad_enabled():
                fire()
            out = forward(self, *args, **kwargs)
            if where == "backward" and torch.is_grad_enabled():
                out[0].register_hook(lambda grad: fire())
            return out
        models.GPT.forward = armed_forward
    elif where == "optimizer":
        step = sharded.ShardedOptimizer.apply  # what every stage calls from engine.step()

        def armed_step(self, *args, **kwargs):
            fire()
            return step(self, *args, **kwargs)
        sharded.ShardedOptimizer.apply = armed_step
    elif where == "save":
        write = commit._write_rank_file

        def armed_write(*args, **kwargs):
            record = write(*args, **kwargs)
            fire()
            return record
        commit._write_rank_file = armed_write
    else:
        raise ValueError(f"unknown point {where!r}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    _arm()
    if sys.argv[1].endswith(".py"):  # a script of one's own (examples/resumable_loop.py)
        import runpy
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
        sys.exit(0)
    from zerokit.cli import main
    sys.exit(main(sys.argv[1:]))
