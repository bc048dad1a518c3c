"""Killed and preempted runs, resumed at three world sizes: do they end with the uninterrupted run's weights?

    python benchmarks/investigations/interruptions.py                          # 10 kill steps per cell: 80 runs
    python benchmarks/investigations/interruptions.py --kills 2 --stages 0     # quicker

For each stage (0 and 3), each interruption and each of `--kills` random steps (seeded, drawn in
[1, --steps - 1]) one torchrun run (`--standalone --nproc-per-node 2 --max-restarts 0`, the small
`tiny` GPT, `--reduction tree --accumulate 2 --save DIR --save-every 1 --resume auto`) is interrupted
at an exact point by tests/distributed/interrupt_at.py:

* SIGKILL a rank: a random rank, inside the forward, the backward or the optimizer step of the step;
* SIGTERM the agent: a rank sends it to torchrun's agent inside that step's first forward (the agent
  forwards it to both ranks, as on a scheduler's preemption);
* SIGTERM one rank: a random rank, inside the forward, the backward or the optimizer step;
* SIGKILL during a save: a random rank, after writing its file of the save that follows the step.

Then DIR, copied three times, is resumed by the same command at 2 ranks x 2 micro-batches (the same
world size), 4 x 1 and 1 x 4; every final `weights sha256` is compared with the uninterrupted run's
(one process, 4 micro-batches per step, which under the tree reduction every split reproduces). Also
recorded: the step the committed checkpoint holds against the step the interruption hit, and for the
SIGTERMs the time from the signal to torchrun's exit.

Writes benchmarks/results/interruptions.json and .md (command, date, commit, machine, versions).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from zerokit import checkpoint  # noqa: E402
from zerokit.cli import main  # noqa: E402
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402

INTERRUPT_AT = REPO / "tests" / "distributed" / "interrupt_at.py"
KINDS = ["SIGKILL a rank", "SIGTERM the agent", "SIGTERM one rank", "SIGKILL during a save"]
RESUMES = {"same (2 x 2)": (2, 2), "4 x 1": (4, 1), "1 x 4": (1, 4)}
DIGEST = re.compile(r"weights sha256: ([0-9a-f]{64})")


def _args(stage: int, steps: int) -> list[str]:
    return ["--model", "tiny", "--steps", str(steps), "--no-progress", "--reduction", "tree", "--stage", str(stage)]


def _train_in_process(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["train"] + argv)
    return rc, out.getvalue()


def _plan(kind: str, step: int, rng: random.Random) -> tuple[int, str]:
    """(rank, ZEROKIT_INTERRUPT's action and point) for an interruption inside 0-based `step` (accumulate 2)."""
    where = rng.choice(["forward", "backward", "optimizer"])
    call = {"forward": 2 * step + 1 + rng.randrange(2), "backward": 2 * step + 1 + rng.randrange(2),
            "optimizer": step + 1}
    rank = rng.randrange(2)
    if kind == "SIGKILL a rank":
        return rank, f"kill:{where}@{call[where]}"
    if kind == "SIGTERM one rank":
        return rank, f"term:{where}@{call[where]}"
    if kind == "SIGTERM the agent":
        return rank, f"term-agent:forward@{2 * step + 1}"
    return rank, f"kill:save@{step + 1}"  # the save after `step`: step + 1 steps done


def interrupted_run(kind: str, stage: int, step: int, steps: int, rng: random.Random, work: Path) -> dict:
    ck, marker = work / "ck", work / "fired"
    rank, spec = _plan(kind, step, rng)
    action, point = spec.split(":")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               ZEROKIT_INTERRUPT=f"{rank}:{action}:{marker}:{point}")
    env.pop("ZEROKIT_VERBOSE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "0", str(INTERRUPT_AT), "train"] + _args(stage, steps) + [
           "--accumulate", "2", "--save", str(ck), "--save-every", "1", "--resume", "auto"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    ended = time.time()
    fired = marker.read_text().split() if marker.exists() else []
    committed = None
    if (ck / checkpoint.POINTER_FILE).exists():
        with open(Path(checkpoint.committed_snapshot(ck)) / checkpoint.META_FILE) as f:
            committed = json.load(f)["extra"]["step"]
    return {"kind": kind, "stage": stage, "step": step, "rank": rank, "point": point, "action": action,
            "fired": bool(fired), "returncode": done.returncode, "committed_step": committed,
            "signal_to_exit_s": ended - float(fired[2]) if fired and action.startswith("term") else None,
            "tail": (done.stdout + done.stderr)[-1500:] if not fired or committed is None else ""}


def resume(stage: int, steps: int, ck: Path, nproc: int, accumulate: int, work: Path) -> str | None:
    copy = work / f"resume-{nproc}x{accumulate}"
    shutil.copytree(ck, copy)
    rc, out = _train_in_process(_args(stage, steps) + ["--nproc", str(nproc), "--accumulate", str(accumulate),
                                                       "--save", str(copy), "--resume", "auto"])
    found = DIGEST.findall(out)
    return found[-1] if rc == 0 and found else None


def markdown(result: dict) -> str:
    lines = ["# Interrupted runs resumed at three world sizes", ""] + provenance_lines(result["provenance"]) + [""]
    c = result["config"]
    lines += [f"torchrun, 2 ranks x {c['accumulate']} micro-batches, model tiny, {c['steps']} steps, "
              "`--reduction tree --save-every 1 --resume auto`; each run interrupted once, inside a step drawn at "
              f"random in [1, {c['steps'] - 1}] (seed {c['seed']}), then resumed from a copy of its checkpoint "
              "directory by the same command at each world size. A cell: runs whose final digest equals the "
              "uninterrupted run's / runs.", ""]
    head = "| interruption | stage | kill steps | " + " | ".join(f"resume {r}" for r in RESUMES) + " |"
    lines += [head, "|" + "---|" * (3 + len(RESUMES))]
    for kind in KINDS:
        for stage in c["stages"]:
            runs = [r for r in result["runs"] if r["kind"] == kind and r["stage"] == stage]
            if not runs:
                continue
            cells = []
            for name in RESUMES:
                equal = sum(r["resumes"].get(name) == result["reference"][str(stage)] for r in runs)
                cells.append(f"{'yes' if equal == len(runs) else 'NO'} ({equal}/{len(runs)})")
            steps = ", ".join(str(r["step"]) for r in runs)
            lines.append(f"| {kind} | {stage} | {steps} | " + " | ".join(cells) + " |")
    lines += ["", "Which step the committed checkpoint holds (steps counted from 1; the interruption hit step "
              "`s`, counted from 0, so `s` steps were complete):", "",
              "| interruption | runs | checkpoint holds | signal to torchrun's exit (s): median, max |", "|---|---|---|---|"]
    for kind in KINDS:
        runs = [r for r in result["runs"] if r["kind"] == kind]
        if not runs:
            continue
        offsets = sorted({(r["committed_step"] - r["step"]) if r["committed_step"] is not None else None
                          for r in runs}, key=lambda v: (v is None, v))
        holds = ", ".join("nothing" if o is None else f"s{o:+d}" if o else "s" for o in offsets)
        times = [r["signal_to_exit_s"] for r in runs if r["signal_to_exit_s"] is not None]
        timing = f"{statistics.median(times):.1f}, {max(times):.1f}" if times else "-"
        lines.append(f"| {kind} | {len(runs)} | {holds} | {timing} |")
    lines += ["", f"Uninterrupted digests (1 x 4): " + ", ".join(f"stage {s}: `{d[:16]}...`"
                                                                  for s, d in result["reference"].items()),
              f"Wall time: {result['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def run(args) -> dict:
    rng = random.Random(args.seed)
    start = time.time()
    reference = {}
    for stage in args.stages:
        rc, out = _train_in_process(_args(stage, args.steps) + ["--nproc", "1", "--accumulate", "4"])
        reference[str(stage)] = DIGEST.findall(out)[-1]
    runs = []
    for stage in args.stages:
        for kind in args.kinds:
            for _ in range(args.kills):
                step = rng.randrange(1, args.steps)
                with tempfile.TemporaryDirectory(prefix="zerokit-interrupt-") as tmp:
                    work = Path(tmp)
                    r = interrupted_run(kind, stage, step, args.steps, rng, work)
                    r["resumes"] = {}
                    if r["committed_step"] is not None:
                        for name, (nproc, acc) in RESUMES.items():
                            r["resumes"][name] = resume(stage, args.steps, work / "ck", nproc, acc, work)
                runs.append(r)
                ok = all(d == reference[str(stage)] for d in r["resumes"].values()) and len(r["resumes"]) == 3
                print(f"stage {stage} {kind:22s} step {step:2d} {r['point']:14s} rank {r['rank']}: checkpoint "
                      f"step {r['committed_step']}, resumes {'equal' if ok else 'DIFFER ' + str(r['resumes'])}"
                      + (f", signal to exit {r['signal_to_exit_s']:.1f} s" if r["signal_to_exit_s"] else ""),
                      flush=True)
    return {"reference": reference, "runs": runs, "seconds": time.time() - start,
            "config": {"steps": args.steps, "accumulate": 2, "seed": args.seed, "kills": args.kills,
                       "stages": args.stages, "kinds": args.kinds}}


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10, help="random kill steps per (interruption, stage)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[0, 3])
    p.add_argument("--kinds", type=lambda s: [KINDS[int(x)] for x in s.split(",")], default=KINDS,
                   help="indices into " + ", ".join(f"{i}: {k}" for i, k in enumerate(KINDS)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "interruptions")
    args = p.parse_args(argv)
    prov = provenance(command_line(__file__, argv))
    result = run(args)
    result["provenance"] = prov
    write_pair(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
