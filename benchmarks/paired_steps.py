"""zerokit beside a torch peer step by step: paired, alternating steps, so that the machine's drift cancels.

    python benchmarks/paired_steps.py                                   # 2 gloo ranks, stages 0 and 1, 300 pairs
    python benchmarks/paired_steps.py --nproc 2 --stages 0 1 2 3 --steps 300 --warmup 20

benchmarks/speed_vs_torch.py runs each engine for a block of steps, then its peer: on this 2-core
machine the ratio of two such blocks moves by ±15% with nothing changed (its "by round" spread),
so a difference of a few percent cannot be read from it. Here each rank builds the zerokit stage
and its peer once (speed_vs_torch.py's construction: the same weights, batches, AdamW with the
decay / no-decay split, bucket size), keeps both alive, and runs them in turns: step i of one,
then step i of the other, the order swapped at every pair, each on the same batch. A step is timed
as speed_vs_torch.py times it (forward, backward, optimizer step, the peer's zero_grad, reading
the loss), and a pair's figure is the slowest rank's. Each pair gives one ratio, zerokit's time over
the peer's, taken a few milliseconds apart, so slow drift (a neighbour's load, clock changes)
divides out. Reported: the median of the pair ratios with its distribution-free 95% confidence
interval (order statistics of a binomial(n, 1/2)), the share of pairs zerokit won, the ratio of
the two median step times, and the largest loss difference (0: bit for bit).

The peers of each stage are speed_vs_torch.py's (`PEERS`; not the DDP reference beside stage 2).
Both engines issue their collectives on the same gloo group, one step after the other, the same on
every rank. Writes benchmarks/results/paired_steps.json and .md (command, date, commit, machine).
"""
from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import speed_vs_torch as S  # noqa: E402  (the runs' construction, the data)
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402


def pairs_of(stages: list[int]) -> list[tuple[int, str]]:
    """(stage, peer) for every peer speed_vs_torch.py sets beside each stage, references left out."""
    return [(stage, peer) for stage in stages for peer, _ in S.PEERS[stage] if (stage, peer) not in S.REFERENCES]


def paired_rank(rank: int, world_size: int, cfg: dict) -> dict:
    """For each (stage, peer): both built once, then `steps` pairs of steps in turns, the order swapped every pair.
    Returns "stage|peer" -> {"zerokit": [ms], "peer": [ms], "zerokit_loss": [...], "peer_loss": [...]}."""
    device = torch.device("cpu")
    batches = S._batches(cfg, rank, world_size, device, cfg["steps"])
    out = {}
    for stage, peer in pairs_of(cfg["stages"]):
        loops = {"zerokit": S._builder(f"zerokit stage {stage}", cfg, world_size, device)(),
                 "peer": S._builder(peer, cfg, world_size, device)()}
        record = {"zerokit": [], "peer": [], "zerokit_loss": [], "peer_loss": []}
        for i, (x, y) in enumerate(batches):
            for name in (("zerokit", "peer") if i % 2 == 0 else ("peer", "zerokit")):
                train_step, zero_grad, _ = loops[name]
                ms, loss = S.timed_step(train_step, zero_grad, x, y, device)  # as speed_vs_torch.py times a step
                record[name].append(ms)
                record[f"{name}_loss"].append(loss)
        out[f"{stage}|{peer}"] = record
        del loops
        gc.collect()
    return out


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median: the order statistics x_(j) and x_(n+1-j)
    with j the largest index such that P(Binomial(n, 1/2) < j) <= (1 - level) / 2 (no assumption on the
    distribution, no resampling)."""
    xs = sorted(values)
    n = len(xs)
    tail, cumulative, j = (1 - level) / 2, 0.0, 0
    while True:
        p = math.comb(n, j) / 2 ** n  # P(Binomial(n, 1/2) == j)
        if cumulative + p > tail:
            break
        cumulative += p
        j += 1
    if j == 0:  # too few pairs for this level: the whole range
        return xs[0], xs[-1]
    return xs[j - 1], xs[n - j]


def summarize(per_rank: list[dict], warmup: int) -> list[dict]:
    rows = []
    for key in per_rank[0]:
        stage, peer = key.split("|")
        zk = [max(rank[key]["zerokit"][i] for rank in per_rank) for i in range(len(per_rank[0][key]["zerokit"]))]
        pe = [max(rank[key]["peer"][i] for rank in per_rank) for i in range(len(per_rank[0][key]["peer"]))]
        zk, pe = zk[warmup:], pe[warmup:]
        ratios = [a / b for a, b in zip(zk, pe)]
        low, high = median_interval(ratios)
        dloss = max(abs(a - b) for rank in per_rank
                    for a, b in zip(rank[key]["zerokit_loss"], rank[key]["peer_loss"]))
        rows.append({"stage": int(stage), "peer": peer, "pairs": len(ratios),
                     "median_ratio": statistics.median(ratios), "ci95": [low, high],
                     "zerokit_faster": sum(r < 1 for r in ratios) / len(ratios),
                     "zerokit_ms": statistics.median(zk), "peer_ms": statistics.median(pe),
                     "ratio_of_medians": statistics.median(zk) / statistics.median(pe), "max_abs_dloss": dloss})
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| zerokit | torch peer | pairs | median pair ratio (zk / peer) | 95% interval | zerokit faster in "
             "| zerokit ms | peer ms | ratio of medians | max abs Δloss |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| stage {r['stage']} | {r['peer'].removeprefix('torch ')} | {r['pairs']} | "
                     f"{r['median_ratio']:.3f} | {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f} | "
                     f"{100 * r['zerokit_faster']:.0f}% | {r['zerokit_ms']:.1f} | {r['peer_ms']:.1f} | "
                     f"{r['ratio_of_medians']:.3f} | {r['max_abs_dloss']:.1e} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from zerokit.models import preset

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--model", default="small", help="model preset (default small)")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1], choices=[0, 1, 2, 3],
                   help="zerokit stages, each beside its peers (default 0 1)")
    p.add_argument("--steps", type=int, default=300, help="pairs of steps per stage and peer, warm-up included")
    p.add_argument("--warmup", type=int, default=20, help="pairs left out at the start (default 20)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--bucket-numel", type=int, default=1 << 16, help="zerokit's bucket_numel and DDP's cap (x 4 bytes)")
    p.add_argument("--timeout", type=float, default=1800, help="deadline for the spawn (s)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "paired_steps",
                   help="results path without extension (.json and .md are written)")
    args = p.parse_args(argv)
    if min(args.nproc, args.steps, args.batch_size) < 1 or not 0 <= args.warmup < args.steps:
        p.error("--nproc, --steps, --batch-size must be >= 1 and 0 <= --warmup < --steps")
    record = provenance(command_line(__file__, argv))
    cfg = {"model": args.model, "seed": 0, "peers": "default", "precision": "fp32", "reduction": "default",
           "batch_size": args.batch_size, "block_size": preset(args.model).block_size, "steps": args.steps,
           "lr": 3e-3, "bucket_numel": args.bucket_numel, "stages": args.stages, "device": "cpu"}
    start = time.perf_counter()
    rows = summarize(run_ranks(paired_rank, args.nproc, cfg, timeout_s=args.timeout), args.warmup)
    result = {**record, "nproc": args.nproc, "config": cfg, "warmup": args.warmup,
              "seconds": round(time.perf_counter() - start, 1), "rows": rows}
    print("\n".join(table(rows)))
    write_pair(args.out, result, _markdown(result))
    return 0


def _markdown(r: dict) -> str:
    c = r["config"]
    return "\n".join([
        "# zerokit beside its torch peers, step by step", "", *provenance_lines(r),
        f"- {r['nproc']} gloo ranks, model {c['model']}, {c['batch_size']} x {c['block_size']} tokens per rank per "
        f"step, fp32 AdamW (lr {c['lr']}, weight decay 0.1, none on biases/LayerNorms), bucket {c['bucket_numel']} "
        f"elements; zerokit's default reduction (ordered on gloo); {c['steps']} pairs of steps per row, the first "
        f"{r['warmup']} left out; {r['seconds']} s in all", "", *table(r["rows"]), "",
        "Both engines are built once per row and run in turns, one step each on the same batch, the order "
        "swapped at every pair; a step is the slowest rank's time for forward, backward, optimizer step, the "
        "peer's zero_grad and reading the loss (as benchmarks/speed_vs_torch.py times it). A pair's ratio is "
        "zerokit's step over the peer's step beside it, so drift of the machine over seconds divides out; the "
        "interval is the distribution-free 95% confidence interval of the median pair ratio (binomial order "
        "statistics). An interval wholly below 1 says zerokit's step is the faster one on this machine; one "
        "that straddles 1 says the two cannot be told apart here. Max abs Δloss: the largest difference of "
        "the two engines' losses at the same step on any rank (0: bit for bit)."]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
