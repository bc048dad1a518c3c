"""Do torchrun's restarts of gloo workers need a store prefix per attempt (zerokit/__init__.py [Note: one store
prefix per restart])?

    python benchmarks/investigations/restart_store.py                 # 3 trials per arm, 5 restarts each
    python benchmarks/investigations/restart_store.py --trials 1

Each trial: `torchrun --standalone --nproc-per-node 2 --max-restarts 5` runs `zerokit train --model tiny
--steps 8 --save DIR --save-every 1 --resume auto`, and rank 1 is SIGKILLed in the second forward of each
of the first five attempts (tests/distributed/interrupt_at.py), so a complete run needs five restarts.
Arms: zk.init_distributed as it is, and with TORCHELASTIC_RESTART_COUNT hidden from it (no prefix: the
process group's keys are the same in every attempt). Counted per trial: the exit status, the kills that
happened, gloo's "connectFullMesh failed" (a restarted rank connecting to a dead attempt's address), and
whether the run printed its digest. A trial is stopped after --timeout seconds (a hang).

Writes benchmarks/results/restart_store.json and .md (command, date, commit, machine, versions).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402

INTERRUPT_AT = REPO / "tests" / "distributed" / "interrupt_at.py"
HIDE = ("import os, runpy, sys; os.environ.pop('TORCHELASTIC_RESTART_COUNT', None); sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')")


def _kill_run(agent: int, tmp: str) -> None:
    """SIGKILL a hung trial: its agent, and its workers (torchrun starts each in a session of its own), found by
    the trial's own temporary directory on their command line."""
    os.kill(agent, signal.SIGKILL)
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and tmp.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


def trial(prefixed: bool, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="zerokit-restart-store-") as tmp:
        marker = Path(tmp) / "fired"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                   ZEROKIT_INTERRUPT=f"1:kill:{marker}:" + ",".join(["forward@2"] * 5))
        script = [str(INTERRUPT_AT)] if prefixed else ["--no-python", sys.executable, "-c", HIDE, str(INTERRUPT_AT)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "5"] + script + ["train", "--model", "tiny", "--steps", "8", "--no-progress",
                                                   "--save", str(Path(tmp) / "ck"), "--save-every", "1",
                                                   "--resume", "auto"]
        start = time.time()
        log = Path(tmp) / "out.txt"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = "hung"
                _kill_run(proc.pid, tmp)
        out = log.read_text(errors="replace")
        kills = len(marker.read_text().splitlines()) if marker.exists() else 0
        return {"prefixed": prefixed, "returncode": rc, "seconds": time.time() - start, "kills": kills,
                "connect_failures": out.count("Gloo connectFullMesh failed"),
                "finished": bool(re.search(r"weights sha256: [0-9a-f]{64}", out))}


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--timeout", type=float, default=150)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "restart_store")
    args = p.parse_args(argv)
    result = {"provenance": provenance(command_line(__file__, argv)), "trials": []}
    for _ in range(args.trials):
        for prefixed in (True, False):
            result["trials"].append(trial(prefixed, args.timeout))
            print(result["trials"][-1], flush=True)
    lines = ["# torchrun restarts of gloo workers with and without a store prefix per attempt", ""]
    lines += provenance_lines(result["provenance"]) + ["", "| zk.init_distributed | trial | exit status | kills "
              "(of 5) | gloo connectFullMesh failures | finished (digest printed) | seconds |", "|---|---|---|---|---|---|---|"]
    for arm in (True, False):
        for i, t in enumerate(t for t in result["trials"] if t["prefixed"] == arm):
            lines.append(f"| {'prefix per attempt' if arm else 'no prefix'} | {i + 1} | {t['returncode']} | "
                         f"{t['kills']} | {t['connect_failures']} | {'yes' if t['finished'] else 'no'} | "
                         f"{t['seconds']:.0f} |")
    write_pair(args.out, result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
