"""What debug mode costs per training step: step time with and without `zk.shard(..., debug=True)`.

    python benchmarks/investigations/debug_overhead.py                    # 2 gloo ranks, model small, stages 0-3
    python benchmarks/investigations/debug_overhead.py --nproc 2 --model small --steps 20 --warmup 3 --rounds 3

Debug mode (core/collectives/recorder.py [Note: debug mode]) adds, before every collective, one all-gather of a
(2,) int64 fingerprint per rank, and one such check per optimizer step; nothing else changes (the
collectives, their order and the numbers trained are the same: tests/distributed/test_debug_mode.py).
Its cost is therefore a latency per collective, which this measures in place: one spawn of
`--nproc` ranks trains each stage from the same initial weights on the same batches, once with
debug off and once on, `--rounds` times, odd rounds in reverse order so that slow drift of the
machine favours neither. A step is `train_step` (zero_grad, forward, backward, clip at 1.0,
step); its time is taken on every rank and a step counts at the slowest rank's time. Per stage
the table gives the median step time of each mode over every round's steps after `--warmup`,
the difference, the collectives a step issues (from the recorder, core/collectives/recorder.py), and the
difference per collective; step times on a shared CPU are noisy, so the cost of one check is also
timed on its own (`--checks` sync points in a row: the same fixed-size all-gather).

Writes benchmarks/results/debug_overhead.json and .md (command, date, commit, machine, versions).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import zerokit as zk  # noqa: E402
from zerokit.commands.step import train_step  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.models import Block, CharCorpus, build_model  # noqa: E402
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402

STAGES = (0, 1, 2, 3)


def _timed_run(rank: int, world_size: int, cfg: dict, stage: int, debug: bool, corpus: CharCorpus) -> dict:
    """Train `warmup + steps` steps from fresh weights; the measured steps' times (ms) and collectives per step."""
    torch.manual_seed(0)
    model = build_model(cfg["model"])
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, wrap=(Block,), lr=1e-3, weight_decay=0.1, debug=debug)
    times, losses = [], []
    for step in range(cfg["warmup"] + cfg["steps"]):
        x, y = corpus.batch(cfg["batch_size"], model.cfg.block_size, step, rank, world_size)
        if step == cfg["warmup"]:
            first_seq = engine.comm.recorder.seq
        start = time.perf_counter()
        result = train_step(engine, [(x, y)], lambda b: engine(*b)[1], clip=1.0)
        losses.append(result.loss.item())  # the loss on the host: the step is over
        times.append(1e3 * (time.perf_counter() - start))
    return {"times_ms": times[cfg["warmup"]:], "losses": losses,
            "collectives_per_step": (engine.comm.recorder.seq - first_seq) / cfg["steps"]}


def check_cost_us(checks: int) -> float:
    """Microseconds one debug-mode check takes on its own: `checks` sync points in a row (after 10 warm-up)."""
    comm = zk.Comm(debug=True)
    for _ in range(10):
        comm.sync_point("warm-up")
    start = time.perf_counter()
    for i in range(checks):
        comm.sync_point(f"check {i}")
    return 1e6 * (time.perf_counter() - start) / checks


def overhead_rank(rank: int, world_size: int, cfg: dict) -> dict:
    """Every (stage, debug, round) run on this rank, odd rounds in reverse order; then the cost of one check."""
    runs = [(stage, debug) for stage in STAGES for debug in (False, True)]
    # Loaded once: the corpus is zerokit's own source files, which may be edited while this runs.
    corpus = CharCorpus.load()
    out = {"check_us": check_cost_us(cfg["checks"])}
    for r in range(cfg["rounds"]):
        for stage, debug in (runs if r % 2 == 0 else runs[::-1]):
            out[(stage, debug, r)] = _timed_run(rank, world_size, cfg, stage, debug, corpus)
    out["check_us"] = (out["check_us"] + check_cost_us(cfg["checks"])) / 2  # before and after the runs
    return out


def summarize(per_rank: list[dict], cfg: dict) -> list[dict]:
    rows = []
    for stage in STAGES:
        row = {"stage": stage}
        for debug in (False, True):
            slowest = []  # per measured step, the slowest rank's time
            for r in range(cfg["rounds"]):
                slowest += [max(ts) for ts in zip(*(rank[(stage, debug, r)]["times_ms"] for rank in per_rank))]
            key = "debug" if debug else "plain"
            row[f"{key}_ms"] = statistics.median(slowest)
            row[f"{key}_losses"] = per_rank[0][(stage, debug, 0)]["losses"]
        row["collectives_per_step"] = per_rank[0][(stage, True, 0)]["collectives_per_step"]
        row["overhead_ms"] = row["debug_ms"] - row["plain_ms"]
        row["overhead_pct"] = 100 * row["overhead_ms"] / row["plain_ms"]
        row["overhead_us_per_collective"] = 1e3 * row["overhead_ms"] / row["collectives_per_step"]
        # every run of the stage, either mode, any round, on every rank: the same losses as rank's round-0 plain run
        row["runs_with_other_losses"] = [
            f"rank {k}, debug {'on' if debug else 'off'}, round {r}" for k, rank in enumerate(per_rank)
            for debug in (False, True) for r in range(cfg["rounds"])
            if rank[(stage, debug, r)]["losses"] != rank[(stage, False, 0)]["losses"]]
        row["same_losses"] = not row["runs_with_other_losses"]
        rows.append(row)
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| stage | step ms, debug off | step ms, debug on | overhead ms | overhead | collectives per step "
             "| overhead per collective | losses equal |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['stage']} | {r['plain_ms']:.1f} | {r['debug_ms']:.1f} | {r['overhead_ms']:+.1f} | "
                     f"{r['overhead_pct']:+.0f}% | {r['collectives_per_step']:.0f} | "
                     f"{r['overhead_us_per_collective']:+.0f} µs | {'yes' if r['same_losses'] else 'NO'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks")
    p.add_argument("--model", default="small", help="model preset (zerokit.models)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=40, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps per run before measuring")
    p.add_argument("--rounds", type=int, default=4, help="runs of each (stage, debug), odd rounds reversed")
    p.add_argument("--checks", type=int, default=500, help="debug checks timed on their own, per rank")
    p.add_argument("--timeout", type=float, default=1800, help="deadline for the whole spawn (s)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "debug_overhead",
                   help="results path without extension (.json and .md are written)")
    args = p.parse_args(argv)
    record = provenance(command_line(__file__, argv))
    cfg = {"model": args.model, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
           "rounds": args.rounds, "checks": args.checks}
    start = time.perf_counter()
    per_rank = run_ranks(overhead_rank, args.nproc, cfg, timeout_s=args.timeout)
    rows = summarize(per_rank, cfg)
    result = {**record, "nproc": args.nproc, "config": cfg, "seconds": round(time.perf_counter() - start, 1),
              "rows": rows, "check_us_per_rank": [r["check_us"] for r in per_rank]}
    print("\n".join(table(rows)))
    print(f"one check on its own: {_check_line(result)}")
    write_pair(args.out, result, _markdown(result))
    return 0


def _markdown(r: dict) -> str:
    c = r["config"]
    lines = ["# What debug mode costs per step", "", *provenance_lines(r),
             f"- {r['nproc']} gloo ranks, model {c['model']}, {c['batch_size']} sequences per rank, AdamW, clip 1.0, "
             f"stage 3 wrapping every Block; {c['rounds']} rounds of {c['steps']} measured steps after "
             f"{c['warmup']} warm-up steps, odd rounds reversed; a step counts at its slowest rank; medians", "",
             *table(r["rows"]), "",
             f"One check on its own ({c['checks']} sync points in a row, before and after the runs): "
             f"{_check_line(r)}.", "",
             "Debug mode adds one all-gather of a (2,) int64 fingerprint per rank before each collective, one "
             "per optimizer step, and on gloo one before the all-gather half of each (ordered) all-reduce "
             "(core/collectives/recorder.py [Note: debug mode]); the CPU waits for each, so async collectives overlap less. "
             "\"losses equal\": every run of the stage, with and without debug mode, in every round, trained the "
             "same losses (the same floats) on each rank."]
    return "\n".join(lines) + "\n"


def _check_line(r: dict) -> str:
    return ", ".join(f"rank {k}: {us:.0f} µs" for k, us in enumerate(r["check_us_per_rank"]))


if __name__ == "__main__":
    raise SystemExit(main())
