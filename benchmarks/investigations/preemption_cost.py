"""What training through failures costs per step: the stop agreement (`engine.stop_requested()`) and a
committed checkpoint after every step (`zerokit train --save-every 1`), on the small GPT.

    python benchmarks/investigations/preemption_cost.py                 # 2 gloo ranks, stages 2 and 3, 100 rounds
    python benchmarks/investigations/preemption_cost.py --rounds 10 --stages 2

One engine per stage, built as `zerokit train` builds it (model small, batch 8 per rank, AdamW,
the no-decay group). Three kinds of step alternate in ABC-CBA rounds, so drift hits every arm
alike: a plain step; a step followed by `engine.stop_requested()` (one max over one element per
rank, core/preemption.py); and that followed by `engine.save(dir)` into the same directory (the
whole commit protocol: agreement, rank files and model file with fsync and sha256, meta.json, the
pointer, removing the previous snapshot). The agreement's and the save's own times are timed too.
Rank 0's times; medians after one warm-up round. The directory is a fresh temporary one (`--dir`
to choose where; its filesystem is in the results).

Writes benchmarks/results/preemption_cost.json and .md (command, date, commit, machine, versions).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import zerokit as zk  # noqa: E402
from zerokit import bench  # noqa: E402
from zerokit.commands.step import train_step  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.models import Block, CharCorpus, build_model  # noqa: E402
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402

ARMS = ("step", "step + agreement", "step + agreement + save")


def _measure(rank, world_size, stage, rounds, directory):
    from zerokit.core import preemption
    model = build_model("small", seed=0)
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, lr=3e-3, weight_decay=0.1, wrap=(Block,),
                      param_groups=bench.no_decay)
    corpus = CharCorpus.load()
    times = {arm: [] for arm in ARMS}
    own = {"agreement": [], "save": []}
    step_index = [0]

    def one(arm):
        batch = corpus.batch(8, model.cfg.block_size, step_index[0], rank, world_size)
        step_index[0] += 1
        start = time.perf_counter()
        train_step(engine, [batch], lambda b: engine(*b)[1], clip=1.0)
        if arm != "step":
            t = time.perf_counter()
            engine.stop_requested()
            own["agreement"].append(time.perf_counter() - t)
        if arm == ARMS[2]:
            t = time.perf_counter()
            engine.save(directory, extra={"step": step_index[0]})
            own["save"].append(time.perf_counter() - t)
        return time.perf_counter() - start

    for r in range(rounds + 1):
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        for arm in order:
            elapsed = one(arm)
            if r > 0:  # round 0 warms up
                times[arm].append(elapsed)
    preemption.SIGNALS.release()
    nbytes = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
    return {"times": times, "own": own, "checkpoint_bytes": nbytes,
            "params": sum(p.numel() for p in model.parameters())}


def _filesystem(path: str) -> str:
    try:
        return subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
    except Exception:  # noqa: BLE001 -- only a label
        return "unknown"


def markdown(result: dict) -> str:
    lines = ["# The cost of the stop agreement and of --save-every 1", ""] + provenance_lines(result["provenance"])
    lines += ["", f"2 gloo ranks on CPU, model small ({result['params']:,} parameters), batch 8 per rank, fp32; "
              f"{result['rounds']} ABC-CBA rounds; rank 0's medians, in ms. Checkpoints written to a "
              f"{result['filesystem']} filesystem.", "",
              "| stage | step | step + agreement | agreement alone | step + agreement + save | save alone | "
              "checkpoint size | agreement / step | agreement alone / step | save / step |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for stage, r in result["stages"].items():
        m = {arm: statistics.median(r["times"][arm]) * 1e3 for arm in ARMS}
        own = {k: statistics.median(v) * 1e3 for k, v in r["own"].items()}
        lines.append(f"| {stage} | {m[ARMS[0]]:.1f} | {m[ARMS[1]]:.1f} | {own['agreement']:.2f} | {m[ARMS[2]]:.1f} | "
                     f"{own['save']:.1f} | {r['checkpoint_bytes'] / 1e6:.1f} MB | "
                     f"{(m[ARMS[1]] - m[ARMS[0]]) / m[ARMS[0]]:+.1%} | {own['agreement'] / m[ARMS[0]]:.1%} | "
                     f"{(m[ARMS[2]] - m[ARMS[1]]) / m[ARMS[0]]:+.0%} |")
    lines += ["", "agreement / step: (step + agreement - step) / step; save / step: (step + agreement + save - "
              "step + agreement) / step. The agreement's own time includes waiting for the slower rank, which "
              "without it the next step's first collective pays; on a loaded machine the paired difference can "
              "come out below zero, when the agreement is smaller than the steps' spread.", ""]
    return "\n".join(lines)


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3])
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "preemption_cost")
    args = p.parse_args(argv)
    prov = provenance(command_line(__file__, argv))
    result = {"provenance": prov, "rounds": args.rounds, "stages": {}}
    with tempfile.TemporaryDirectory(prefix="zerokit-preemption-cost-", dir=args.dir) as tmp:
        result["filesystem"] = _filesystem(tmp)
        for stage in args.stages:
            directory = os.path.join(tmp, f"stage{stage}")
            ranks = run_ranks(_measure, 2, stage, args.rounds, directory, timeout_s=3600)
            result["stages"][str(stage)] = {k: ranks[0][k] for k in ("times", "own", "checkpoint_bytes")}
            result["params"] = ranks[0]["params"]
    md = markdown(result)
    print(md)
    write_pair(args.out, result, md)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
