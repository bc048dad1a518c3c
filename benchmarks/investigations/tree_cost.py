"""What `reduction="tree"` costs: step time, clip time and memory beside the default reduction.

    python benchmarks/investigations/tree_cost.py                         # 2 gloo ranks, 4 micro-batches each, model small
    python benchmarks/investigations/tree_cost.py --nproc 2 --accumulate 4 --model small --steps 10 --warmup 2 --rounds 2

The tree (core/collectives/tree.py [Note: world-size-independent bits]) changes three things in a step:
each `no_sync()` micro-batch's gradient is added into pairwise partial sums (up to log2(k)
gradient-sized buffers alive at once instead of accumulating in place), the cross-rank sum is
pairwise instead of in rank order, and `clip_grad_norm_` sums squares exactly in integer bins
instead of one fp64 dot product. One spawn of `--nproc` ranks trains each stage from the same
initial weights on the same batches, once per reduction, `--rounds` times, odd rounds in reverse
order so that slow drift of the machine favours neither. A step is zero_grad, k forward/backward
(all but the last under `engine.no_sync()`), `clip_grad_norm_(1.0)`, step; a step counts at the
slowest rank's time, and the clip is timed on its own too. Memory: `engine.memory()` after each
micro-batch of one extra step ("tree_partials" at its largest, and the gradient storage
"grads" beside it).

Writes benchmarks/results/tree_cost.json and .md (command, date, commit, machine, versions).
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
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.models import Block, CharCorpus, build_model  # noqa: E402
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402

STAGES = (0, 1, 2, 3)
REDUCTIONS = ("linear", "tree")


def _step(engine, batches, probe=None) -> float:
    """One optimizer step over this rank's micro-batches; returns the clip's milliseconds."""
    k = len(batches)
    engine.zero_grad()
    for j, (x, y) in enumerate(batches):
        if j < k - 1:
            with engine.no_sync():
                engine.backward(engine(x, y)[1] / k)
        else:
            engine.backward(engine(x, y)[1] / k)
        if probe is not None:
            probe.append(engine.memory())
    start = time.perf_counter()
    engine.clip_grad_norm_(1.0)
    clip_ms = 1e3 * (time.perf_counter() - start)
    engine.step()
    return clip_ms


def _timed_run(rank: int, world_size: int, cfg: dict, stage: int, reduction: str, corpus: CharCorpus) -> dict:
    torch.manual_seed(0)
    model = build_model(cfg["model"])
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, wrap=(Block,), lr=1e-3, weight_decay=0.1,
                      reduction=reduction)
    k, block = cfg["accumulate"], model.cfg.block_size
    times, clips, probe = [], [], []
    for step in range(cfg["warmup"] + cfg["steps"]):
        batches = [corpus.batch(cfg["batch_size"], block, step * k * world_size + rank * k + j) for j in range(k)]
        start = time.perf_counter()
        clip_ms = _step(engine, batches, probe if step == 0 else None)  # step 0 (warm-up) probes memory
        if step >= cfg["warmup"]:
            times.append(1e3 * (time.perf_counter() - start))
            clips.append(clip_ms)
    return {"times_ms": times, "clip_ms": clips,
            "tree_partials_peak": max(m.get("tree_partials", 0) for m in probe),
            "grads_peak": max(m["grads"] for m in probe),
            "weights": {name: t.clone() for name, t in engine.state_dict(full=True).items()}}


def cost_rank(rank: int, world_size: int, cfg: dict) -> dict:
    """Every (stage, reduction, round) on this rank, odd rounds in reverse order."""
    runs = [(stage, reduction) for stage in STAGES for reduction in REDUCTIONS]
    corpus = CharCorpus.load()  # once: the corpus is zerokit's own source, which may be edited meanwhile
    out = {}
    for r in range(cfg["rounds"]):
        for stage, reduction in (runs if r % 2 == 0 else runs[::-1]):
            res = _timed_run(rank, world_size, cfg, stage, reduction, corpus)
            if r > 0:
                res.pop("weights")
            out[(stage, reduction, r)] = res
    return out


def summarize(per_rank: list[dict], cfg: dict) -> list[dict]:
    rows = []
    for stage in STAGES:
        row = {"stage": stage}
        for reduction in REDUCTIONS:
            slowest, clip = [], []
            for r in range(cfg["rounds"]):
                runs = [rank[(stage, reduction, r)] for rank in per_rank]
                slowest += [max(ts) for ts in zip(*(run["times_ms"] for run in runs))]
                clip += [max(ts) for ts in zip(*(run["clip_ms"] for run in runs))]
            first = per_rank[0][(stage, reduction, 0)]
            row[reduction] = {"step_ms": statistics.median(slowest), "clip_ms": statistics.median(clip),
                              "tree_partials_bytes": max(rank[(stage, reduction, 0)]["tree_partials_peak"]
                                                         for rank in per_rank),
                              "grads_bytes": first["grads_peak"]}
        row["step_ratio"] = row["tree"]["step_ms"] / row["linear"]["step_ms"]
        row["clip_extra_ms"] = row["tree"]["clip_ms"] - row["linear"]["clip_ms"]
        # a sanity check, not the claim (that is tests/distributed/test_tree_reduction.py): the weights differ
        # from linear's in the last bits only
        a, b = (per_rank[0][(stage, red, 0)]["weights"] for red in REDUCTIONS)
        row["max_weight_diff_vs_linear"] = max(float((a[n] - b[n]).abs().max()) for n in a)
        rows.append(row)
    # tree: every stage trained the same weights, bit for bit (stage 0's)
    ref = per_rank[0][(0, "tree", 0)]["weights"]
    for row in rows:
        w = per_rank[0][(row["stage"], "tree", 0)]["weights"]
        row["tree_equals_stage0"] = all(torch.equal(w[n], ref[n]) for n in ref)
    for rank in per_rank:
        for r in range(cfg["rounds"]):
            for stage in STAGES:
                for reduction in REDUCTIONS:
                    rank[(stage, reduction, r)].pop("weights", None)
    return rows


def table(rows: list[dict]) -> list[str]:
    mib = 1 << 20
    lines = ["| stage | step ms, linear | step ms, tree | tree / linear | clip ms, linear | clip ms, tree "
             "| partial sums (peak) | gradient storage | weights equal stage 0's (tree) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lin, tree = r["linear"], r["tree"]
        lines.append(f"| {r['stage']} | {lin['step_ms']:.1f} | {tree['step_ms']:.1f} | {r['step_ratio']:.2f}x | "
                     f"{lin['clip_ms']:.2f} | {tree['clip_ms']:.2f} | {tree['tree_partials_bytes'] / mib:.2f} MiB | "
                     f"{tree['grads_bytes'] / mib:.2f} MiB | {'yes' if r['tree_equals_stage0'] else 'NO'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks (a power of two)")
    p.add_argument("--accumulate", type=int, default=4, help="micro-batches per rank per step (a power of two)")
    p.add_argument("--model", default="small", help="model preset (zerokit.models)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=10, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps per run before measuring (the first probes memory)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each (stage, reduction), odd rounds reversed")
    p.add_argument("--timeout", type=float, default=1800, help="deadline for the whole spawn (s)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "tree_cost",
                   help="results path without extension (.json and .md are written)")
    args = p.parse_args(argv)
    record = provenance(command_line(__file__, argv))
    cfg = {"model": args.model, "batch_size": args.batch_size, "accumulate": args.accumulate, "steps": args.steps,
           "warmup": max(1, args.warmup), "rounds": args.rounds}
    start = time.perf_counter()
    per_rank = run_ranks(cost_rank, args.nproc, cfg, timeout_s=args.timeout)
    rows = summarize(per_rank, cfg)
    result = {**record, "nproc": args.nproc, "config": cfg, "seconds": round(time.perf_counter() - start, 1),
              "rows": rows}
    print("\n".join(table(rows)))
    write_pair(args.out, result, _markdown(result))
    return 0


def _markdown(r: dict) -> str:
    c = r["config"]
    return "\n".join([
        "# What reduction=\"tree\" costs per step", "", *provenance_lines(r),
        f"- {r['nproc']} gloo ranks x {c['accumulate']} micro-batches of {c['batch_size']} sequences, model "
        f"{c['model']}, AdamW, clip 1.0, stage 3 wrapping every Block; {c['rounds']} rounds of {c['steps']} measured "
        f"steps after {c['warmup']} warm-up steps, odd rounds reversed; a step counts at its slowest rank; medians",
        "", *table(r["rows"]), "",
        "\"partial sums (peak)\": `engine.memory()[\"tree_partials\"]` at its largest over one step's micro-batches "
        f"(with k = {c['accumulate']}, at most log2(k) gradient-sized buffers; linear keeps none); \"gradient "
        "storage\": `engine.memory()[\"grads\"]` at its largest in the same step, for scale. \"clip\": "
        "`engine.clip_grad_norm_` alone (tree: the exact integer-bin sum of squares, core/collectives/tree.py). The last "
        "column: under the tree, every stage trained stage 0's weights bit for bit."]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
