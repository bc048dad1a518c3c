"""Cost as the work grows: every stage beside its torch peers from ~1M to 124M parameters, at 1, 2 and 4 ranks.

    python benchmarks/scaling.py                   # the whole sweep (about 20 minutes on 2 CPU cores)
    python benchmarks/scaling.py --quick           # 2 small sizes, 1 and 2 ranks, fp32: checks the script
    python benchmarks/scaling.py --sizes 1M 4M --world-sizes 2 --precisions fp32

Each cell (model size x world size x precision) is one spawn of benchmarks/speed.py's `speed_rank`:
zerokit's stages 0-3, each beside its peers (torch DDP; ZeroRedundancyOptimizer; FSDP1 SHARD_GRAD_OP;
FSDP1 FULL_SHARD and FSDP2), from the same weights on the same batches, then every run once more through
speed.py's allocator pass (the in-step peak and the between-step bytes, counted from just before the run
is built; on CPU through torch.profiler with every thread's allocations counted). Everything runs with
each library's defaults where a user would keep them: zerokit's bucket size, DDP's 25 MB cap. Under
bf16 the peers compute in bf16 too (DDP and ZeroRedundancyOptimizer under autocast, FSDP1 and FSDP2 with
bf16 params and reductions), zerokit with bf16 params and an fp32 master.

Per cell and stage:
  time ratio       zerokit's step time / its fastest peer's (median of the timed steps, slowest rank)
  peak ratio       zerokit's in-step allocator peak / the lowest peer's
  between / formula  zerokit's bytes at a step boundary / zk.estimate's model states (padding, the
                   allocator's view of flat buffers and the loss's few bytes make the difference)
  efficiency       compute-only time / step time, for zerokit and for its fastest peer. The compute-only
                   step is the same per-rank work in this one process on one thread with no collectives:
                   forward + backward of one rank's batch (autocast bf16 under bf16), plus torch's
                   AdamW (foreach) over Ψ parameters at stage 0 and Ψ/N at stages 1-3 (each rank steps
                   its shard; DDP steps all of them, ZeroRedundancyOptimizer and FSDP a shard). Ranks run
                   one thread each, so at 4 ranks on 2 cores two ranks share a core and efficiency is at
                   most about 0.5 for everyone.

Growth fits (least squares in log space): step time and the in-step peak against Ψ at each world size and
stage (the exponent α in t ∝ Ψ^α), and the between-step bytes against Ψ and N together (b ∝ Ψ^α N^β), set
beside the formulas' exponents (model states are linear in Ψ; in N, β is 0 at stage 0 and tends to -1 at
stage 3). Writes benchmarks/results/scaling.{json,md,png} (command, date, commit, machine: through
zerokit/provenance.py); the plot shows step time and peak bytes against Ψ (log-log), zerokit's line
beside each peer's, one panel per stage.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import speed  # noqa: E402  benchmarks/speed.py: the runs, the peers, the allocator pass
from zerokit.core.accounting.estimate import estimate  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.models import CharCorpus, GPTConfig, build_model, num_params  # noqa: E402
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402

BLOCK = 64  # tokens per sequence, every size
# name -> (layers, heads, width, vocabulary): the character model's vocabulary, GPT-2's at 124M
SIZES = {"1M": (4, 4, 128, None), "4M": (6, 6, 240, None), "15M": (8, 8, 384, None), "50M": (12, 12, 576, None),
         "124M": (12, 12, 768, 50257)}
# steps per run (the first left out) and rounds: fewer where a step takes seconds
STEPS = {"1M": (8, 2), "4M": (6, 2), "15M": (5, 1), "50M": (4, 1), "124M": (3, 1)}
BF16_SIZES = ("1M", "4M", "15M")  # bf16 matmuls on this CPU are slower than fp32: the large sizes are fp32 only
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CUDA: NCCL, one GPU per rank


def config(size: str) -> GPTConfig:
    layers, heads, width, vocab = SIZES[size]
    return GPTConfig(vocab_size=vocab or CharCorpus.vocab_size, block_size=BLOCK, n_layer=layers, n_head=heads,
                     n_embd=width)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def compute_only(size: str, precision: str, batch_size: int, steps: int = 4) -> dict:
    """One rank's work without collectives, in this process on one thread: forward + backward, and AdamW."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    device = torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device("cpu")
    try:
        model = build_model(config(size), seed=0).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
        corpus = CharCorpus.load()
        fb, step = [], []
        for i in range(steps + 1):
            x, y = (t.to(device) for t in corpus.batch(batch_size, BLOCK, i, 0, 1))
            t0 = _now(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                _, loss = model(x, y)
            loss.backward()
            t1 = _now(device)
            opt.step()
            opt.zero_grad()
            t2 = _now(device)
            if i:  # the first builds the optimizer states
                fb.append((t1 - t0) * 1e3)
                step.append((t2 - t1) * 1e3)
        return {"forward_backward_ms": statistics.median(fb), "optimizer_ms": statistics.median(step)}
    finally:
        torch.set_num_threads(threads)
        if device.type == "cuda":
            del model, opt
            torch.cuda.empty_cache()


def compute_only_ms(base: dict, stage: int, world_size: int) -> float:
    """The compute-only step of `stage` at `world_size`: the optimizer over Ψ at stage 0, Ψ/N above."""
    return base["forward_backward_ms"] + base["optimizer_ms"] / (1 if stage == 0 else world_size)


def run_cell(size: str, world_size: int, precision: str, batch_size: int, timeout: float,
             bucket_numel: int | None = None, stages: tuple[int, ...] = (0, 1, 2, 3)) -> dict:
    """One spawn: `stages` beside their peers, timed, then the allocator pass. bucket_numel None: zerokit's default."""
    steps, rounds = STEPS[size] if DEVICE == "cpu" else (20, 2)  # a CUDA step takes milliseconds
    cfg = {"model": config(size), "block_size": BLOCK, "nproc": world_size, "steps": steps, "warmup": 1,
           "rounds": rounds, "precision": precision, "batch_size": batch_size, "lr": 1e-3,
           "bucket_numel": bucket_numel, "ddp_bucket_numel": speed.DDP_DEFAULT_BUCKET_NUMEL,
           "seed": 0, "stages": list(stages), "device": DEVICE, "reduction": "default", "peers": "default",
           "peer_precision": "match", "memory_steps": 1, "memory_warmup": 1}
    start = time.perf_counter()
    per_rank = run_ranks(speed.speed_rank, world_size, cfg, timeout_s=timeout, threads_per_rank=1,
                         backend="nccl" if DEVICE == "cuda" else "gloo")
    result = speed.summarize(per_rank, cfg)
    return {"stages": result["stages"], "pairs": result["pairs"],
            "runs": {name: {k: run.get(k) for k in ("step_ms_median", "error")} | {
                "peak_step_bytes": speed._bytes_of(run, "peak_step_bytes"),
                "between_steps_bytes": speed._bytes_of(run, "between_steps_bytes")}
                for name, run in result["runs"].items()},
            "seconds": round(time.perf_counter() - start, 1)}


def rows_of(cells: list[dict]) -> list[dict]:
    """One row per cell and stage: the ratios, the efficiencies and the formula check."""
    rows = []
    for cell in cells:
        psi, n = cell["params"], cell["world_size"]
        for line in cell["result"]["stages"]:
            stage = line["stage"]
            base = compute_only_ms(cell["compute_only"], stage, n)
            formula = estimate(psi, n, stage, precision=cell["precision"]).total
            peak_ratio = (line["zerokit_peak_step_bytes"] / line["lowest_peer_peak_step_bytes"]
                          if line["zerokit_peak_step_bytes"] and line["lowest_peer_peak_step_bytes"] else None)
            between = line["zerokit_between_steps_bytes"]
            rows.append({
                "size": cell["size"], "params": psi, "world_size": n, "precision": cell["precision"], "stage": stage,
                "zerokit_ms": line["zerokit_ms"], "fastest_peer": line["fastest_peer"],
                "fastest_peer_ms": line["fastest_peer_ms"], "time_ratio": line["ratio_vs_fastest"],
                "zerokit_peak_bytes": line["zerokit_peak_step_bytes"], "lowest_peak_peer": line["lowest_peak_peer"],
                "lowest_peer_peak_bytes": line["lowest_peer_peak_step_bytes"], "peak_ratio": peak_ratio,
                "between_steps_bytes": between, "formula_bytes": formula,
                "between_over_formula": between / formula if between else None,
                "compute_only_ms": base, "zerokit_efficiency": base / line["zerokit_ms"],
                "peer_efficiency": base / line["fastest_peer_ms"] if line["fastest_peer_ms"] else None,
                "max_abs_loss_diff": line["max_abs_loss_diff"]})
    return rows


def _fit(xs: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares of log y on [1, log x...]: the exponents (the intercept dropped); None if underdetermined."""
    points = [(x, y) for x, y in zip(xs, ys) if y and all(v > 0 for v in x)]
    if len(points) <= len(xs[0]) + 0 or len({tuple(x) for x, _ in points}) <= len(xs[0]):
        return None
    a = torch.tensor([[1.0] + [math.log(v) for v in x] for x, _ in points], dtype=torch.float64)
    b = torch.tensor([[math.log(y)] for _, y in points], dtype=torch.float64)
    return [float(v) for v in torch.linalg.lstsq(a, b).solution[1:, 0]]


def fits(rows: list[dict]) -> list[dict]:
    """Growth exponents per (precision, stage): time and peak vs Ψ at each N; between-step bytes vs Ψ and N."""
    out = []
    for precision in dict.fromkeys(r["precision"] for r in rows):
        for stage in range(4):
            mine = [r for r in rows if r["precision"] == precision and r["stage"] == stage]
            if not mine:
                continue
            fit = {"precision": precision, "stage": stage, "time_vs_params": {}, "peak_vs_params": {},
                   "peer_time_vs_params": {}}
            for n in sorted({r["world_size"] for r in mine}):
                at = [r for r in mine if r["world_size"] == n]
                xs = [[r["params"]] for r in at]
                for key, field in (("time_vs_params", "zerokit_ms"), ("peer_time_vs_params", "fastest_peer_ms"),
                                   ("peak_vs_params", "zerokit_peak_bytes")):
                    got = _fit(xs, [r[field] for r in at])
                    fit[key][str(n)] = got and got[0]
            both = _fit([[r["params"], r["world_size"]] for r in mine], [r["between_steps_bytes"] for r in mine])
            formula = _fit([[r["params"], r["world_size"]] for r in mine], [r["formula_bytes"] for r in mine])
            fit["between_vs_params_and_n"] = both
            fit["formula_vs_params_and_n"] = formula
            out.append(fit)
    return out


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def _r(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _short(peer: str | None) -> str:
    return "-" if peer is None else peer.replace("torch ", "").replace("ZeroRedundancyOptimizer", "ZeRO-1 (ZRO)")


def markdown(record: dict) -> str:
    rows, args = record["rows"], record["settings"]
    md = ["# Cost as the work grows: zerokit's stages beside torch's peers, 1M to 124M parameters", "",
          *provenance_lines(record["provenance"]),
          f"- {args['batch_size']} x {BLOCK} tokens per rank per step, AdamW (lr 1e-3, weight decay 0.1), "
          "library defaults (zerokit's bucket size, DDP's 25 MB); "
          + ("NCCL ranks, one GPU each; " if args.get("device") == "cuda"
             else "gloo ranks of one thread each sharing the machine's CPUs; ")
          + f"{record['seconds']:.0f} s in all",
          "- time ratio: zerokit / fastest peer (step time: median of the timed steps, slowest rank); peak ratio: "
          "zerokit / lowest peer (allocator peak inside a step); between / formula: zerokit's allocator bytes at "
          "a step boundary over zk.estimate's model states; efficiency: compute-only step (one rank's work, one "
          "thread, no collectives) / step time",
          f"- cut to fit the machine: {record['cut']}",
          *([f"- note: {record['note']}"] if record.get("note") else []), "",
          *summary(rows), "",
          "## Every cell", "",
          "| Ψ | N | prec | stage | zk ms | fastest peer | peer ms | time ratio | peak MiB zk / lowest peer "
          "| peak ratio | between / formula | eff zk | eff peer |",
          "|---|---:|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['size']} ({r['params'] / 1e6:.1f}M) | {r['world_size']} | {r['precision']} | {r['stage']} "
                  f"| {r['zerokit_ms']:.0f} | {_short(r['fastest_peer'])} | {_r(r['fastest_peer_ms'], 0)} "
                  f"| {_r(r['time_ratio'])} | {_mb(r['zerokit_peak_bytes'])} / {_mb(r['lowest_peer_peak_bytes'])} "
                  f"({_short(r['lowest_peak_peer'])}) | {_r(r['peak_ratio'])} | {_r(r['between_over_formula'], 3)} "
                  f"| {_r(r['zerokit_efficiency'])} | {_r(r['peer_efficiency'])} |")
    md += ["", "## Growth exponents", "",
           "Least squares in log space. Time and peak: t ∝ Ψ^α at each world size (zerokit; its fastest peer's "
           "time beside it). Between-step bytes: b ∝ Ψ^α N^β over every size and world size, beside the same fit "
           "of zk.estimate's formula over the same cells.", "",
           "| prec | stage | α time zk (N=1, 2, 4) | α time peer (N=1, 2, 4) | α peak zk (N=1, 2, 4) "
           "| bytes α, β measured | bytes α, β formula |", "|---|---:|---|---|---|---|---|"]

    def by_n(d: dict) -> str:
        return ", ".join(_r(d.get(str(n))) for n in (1, 2, 4))

    def pair(v: list | None) -> str:
        return "-" if v is None else f"{v[0]:.3f}, {v[1]:.3f}"

    for f in record["fits"]:
        md.append(f"| {f['precision']} | {f['stage']} | {by_n(f['time_vs_params'])} | "
                  f"{by_n(f['peer_time_vs_params'])} | {by_n(f['peak_vs_params'])} | "
                  f"{pair(f['between_vs_params_and_n'])} | {pair(f['formula_vs_params_and_n'])} |")
    slow = [r for r in rows if r["time_ratio"] and r["world_size"] > 1]
    if slow:
        worst = max(slow, key=lambda r: r["time_ratio"])
        md += ["", f"Slowest cell at 2-4 ranks relative to its peer: {worst['size']}, N={worst['world_size']}, "
                   f"{worst['precision']}, stage {worst['stage']}: {worst['time_ratio']:.2f}x {worst['fastest_peer']}."]
    over = [r for r in rows if r["peak_ratio"] and r["peak_ratio"] > 1]
    md += ["", f"Cells whose in-step peak is above the lowest peer's: {len(over)} of "
               f"{sum(1 for r in rows if r['peak_ratio'])}"
           + (": " + "; ".join(f"{r['size']} N={r['world_size']} {r['precision']} stage {r['stage']} "
                               f"{r['peak_ratio']:.3f}" for r in over) if over else "") + "."]
    return "\n".join(md) + "\n"


def summary(rows: list[dict]) -> list[str]:
    """Per precision, stage and world size, over the sizes: the time ratio's range, the largest peak ratio,
    the median efficiencies."""
    out = ["## Summary over the sizes", "",
           "| prec | stage | N | sizes | time ratio (min - max) | peak ratio (max) | efficiency zk / peer (median) |",
           "|---|---:|---:|---:|---|---:|---|"]
    for precision in dict.fromkeys(r["precision"] for r in rows):
        for stage in range(4):
            for n in sorted({r["world_size"] for r in rows}):
                at = [r for r in rows if (r["precision"], r["stage"], r["world_size"]) == (precision, stage, n)]
                times = [r["time_ratio"] for r in at if r["time_ratio"]]
                peaks = [r["peak_ratio"] for r in at if r["peak_ratio"]]
                effs = [r["zerokit_efficiency"] for r in at]
                peer_effs = [r["peer_efficiency"] for r in at if r["peer_efficiency"]]
                if not times:
                    continue
                out.append(f"| {precision} | {stage} | {n} | {len(at)} | {min(times):.2f} - {max(times):.2f} | "
                           f"{_r(max(peaks) if peaks else None, 3)} | {statistics.median(effs):.2f} / "
                           f"{_r(statistics.median(peer_effs) if peer_effs else None)} |")
    return out


def plot(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = record["cells"]
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    for stage in range(4):
        for row, (what, zk_key, unit) in enumerate((("step time", "step_ms_median", "ms"),
                                                    ("in-step peak", "peak_step_bytes", "MiB"))):
            ax = axes[row][stage]
            lines: dict[str, list] = {}
            for cell in cells:
                if cell["precision"] != "fp32":
                    continue
                for name, run in cell["result"]["runs"].items():
                    if name != f"zerokit stage {stage}" and not any(
                            p == name for p, _ in speed.PEERS[stage] if (stage, p) not in speed.REFERENCES):
                        continue
                    value = run.get(zk_key)
                    if value is None:
                        continue
                    value = value / 2**20 if unit == "MiB" else value
                    lines.setdefault(f"{name} N={cell['world_size']}", []).append((cell["params"], value))
            for label, points in sorted(lines.items()):
                points.sort()
                style = "-" if label.startswith("zerokit") else "--"
                ax.plot([p for p, _ in points], [v for _, v in points], style, marker="o", markersize=3,
                        label=label.replace("torch ", ""))
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"stage {stage}: {what} (fp32)")
            ax.set_xlabel("parameters Ψ")
            ax.set_ylabel(unit)
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bucket_tradeoff(args) -> int:
    """`--buckets`: stages 0 and 2 (`--bucket-stages`) at 2 ranks (`--bucket-world-size`), fp32, for several bucket
    sizes beside their fastest peer (DDP's own 25 MB buckets) and the lowest peer peak."""
    prov = provenance(command_line(__file__, sys.argv[1:]))
    start = time.perf_counter()
    rows = []
    for size in args.sizes:
        psi = num_params(config(size))
        for label, numel in [("4 Mi", 1 << 22)] + [(f"Ψ/{k}", -(-psi // k)) for k in args.fractions]:
            result = run_cell(size, args.bucket_world_size, "fp32", args.batch_size, args.timeout, bucket_numel=numel,
                              stages=tuple(args.bucket_stages))
            for line in result["stages"]:
                rows.append({"size": size, "params": psi, "bucket": label, "bucket_numel": numel,
                             "stage": line["stage"], "zerokit_ms": line["zerokit_ms"],
                             "peer": line["fastest_peer"], "peer_ms": line["fastest_peer_ms"],
                             "time_ratio": line["ratio_vs_fastest"],
                             "zerokit_peak_bytes": line["zerokit_peak_step_bytes"],
                             "lowest_peer_peak_bytes": line["lowest_peer_peak_step_bytes"],
                             "peak_ratio": (line["zerokit_peak_step_bytes"] / line["lowest_peer_peak_step_bytes"]
                                            if line["lowest_peer_peak_step_bytes"] else None)})
                print(f"{size} bucket {label:>6} ({numel:>9,}) stage {line['stage']}: peak "
                      f"{_mb(line['zerokit_peak_step_bytes'])} / {_mb(line['lowest_peer_peak_step_bytes'])} MiB, "
                      f"time x{line['ratio_vs_fastest']:.2f} [{result['seconds']} s]", flush=True)
    record = {"provenance": prov, "seconds": time.perf_counter() - start, "rows": rows}
    stages = " and ".join(map(str, args.bucket_stages))
    md = [f"# Bucket size against the in-step peak and step time: stages {stages} at {args.bucket_world_size} ranks, "
          "fp32", "", *provenance_lines(prov),
          f"- {args.batch_size} x {BLOCK} tokens per rank per step, AdamW; beside each stage its fastest torch peer "
          f"(time; DDP with its own 25 MB buckets) and its lowest peer peak; {record['seconds']:.0f} s in all", "",
          "| Ψ | bucket | elements | stage | peak MiB zk / peer | peak ratio | zk ms | fastest peer | peer ms "
          "| time ratio |",
          "|---|---|---:|---:|---|---:|---:|---|---:|---:|"]
    for r in rows:
        md.append(f"| {r['size']} ({r['params'] / 1e6:.1f}M) | {r['bucket']} | {r['bucket_numel']:,} | {r['stage']} "
                  f"| {_mb(r['zerokit_peak_bytes'])} / {_mb(r['lowest_peer_peak_bytes'])} | {_r(r['peak_ratio'])} "
                  f"| {r['zerokit_ms']:.0f} | {_short(r['peer'])} | {_r(r['peer_ms'], 0)} | {_r(r['time_ratio'])} |")
    write_pair(args.out, record, "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


def _record(args, prov: dict, cells: list[dict], start: float, plan: list) -> dict:
    rows = rows_of(cells)
    skipped = [s for s in args.sizes if s not in BF16_SIZES and DEVICE == "cpu"]
    cut = (f"bf16 only at {', '.join(s for s in BF16_SIZES if s in args.sizes)} (bf16 on this CPU is slower than "
           f"fp32, and {', '.join(skipped)} would double the run)" if "bf16" in args.precisions and skipped
           else "nothing beyond the grid given") + "; steps per run (first left out), rounds: " + (
               f"{STEPS}" if DEVICE == "cpu" else "(20, 2) at every size")
    if len(cells) < len(plan):
        cut += f"; so far {len(cells)} of {len(plan)} cells"
    return {"provenance": prov, "settings": {"batch_size": args.batch_size, "block": BLOCK, "device": DEVICE},
            "seconds": time.perf_counter() - start, "cut": cut, "cells": cells, "rows": rows, "fits": fits(rows)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step (default 1)")
    p.add_argument("--quick", action="store_true", help="sizes 1M and 4M, 1 and 2 ranks, fp32 (a check)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per cell before its ranks are killed")
    p.add_argument("--buckets", action="store_true",
                   help="the bucket-size trade-off instead: stages 0 and 2, 2 ranks, fp32 (scaling_buckets.*)")
    p.add_argument("--fractions", type=int, nargs="+", default=[4, 8, 16, 32],
                   help="--buckets: bucket sizes as Ψ/k for these k, beside 4 Mi elements")
    p.add_argument("--bucket-world-size", type=int, default=2, help="--buckets: ranks (default 2)")
    p.add_argument("--bucket-stages", type=int, nargs="+", default=[0, 2], choices=[0, 1, 2, 3],
                   help="--buckets: zerokit's stages (default 0 2)")
    p.add_argument("--out", type=Path, default=None, help="results path without suffix")
    p.add_argument("--from-json", type=Path, default=None,
                   help="rewrite the .md and .png of an earlier run from its .json (no run)")
    p.add_argument("--note", default=None, help="--from-json: a note on the run, kept in the .json and shown")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = REPO / "benchmarks" / "results" / ("scaling_buckets" if args.buckets else "scaling")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.buckets:
        return bucket_tradeoff(args)
    if args.from_json:
        import json
        record = json.loads(args.from_json.read_text())
        if args.note:
            record["note"] = args.note
            args.from_json.write_text(json.dumps(record, indent=1) + "\n")
        args.from_json.with_suffix(".md").write_text(markdown(record))
        plot(record, args.from_json.with_suffix(".png"))
        return 0
    if args.quick:
        args.sizes, args.world_sizes, args.precisions = ["1M", "4M"], [1, 2], ["fp32"]
    prov = provenance(command_line(__file__, argv))
    start = time.perf_counter()
    cells, bases = [], {}
    plan = [(s, n, p) for p in args.precisions for s in args.sizes for n in args.world_sizes
            if p == "fp32" or s in BF16_SIZES or DEVICE == "cuda"]
    plan.sort(key=lambda cell: cell[0] == "124M")  # the largest size last: the longest cells, the most memory
    for size, n, precision in plan:
        if (size, precision) not in bases:
            bases[size, precision] = compute_only(size, precision, args.batch_size)
        result = run_cell(size, n, precision, args.batch_size, args.timeout)
        cells.append({"size": size, "params": num_params(config(size)), "world_size": n, "precision": precision,
                      "compute_only": bases[size, precision], "result": result})
        for line in result["stages"]:
            print(f"{size:>5} N={n} {precision} stage {line['stage']}: {line['zerokit_ms']:8.1f} ms, "
                  f"x{line['ratio_vs_fastest'] or float('nan'):.2f} vs {line['fastest_peer']}; peak "
                  f"{_mb(line['zerokit_peak_step_bytes'])} MiB vs {_mb(line['lowest_peer_peak_step_bytes'])} "
                  f"({line['lowest_peak_peer']})  [{result['seconds']} s]", flush=True)
        record = _record(args, prov, cells, start, plan)
        write_pair(args.out, record, markdown(record))  # after every cell: a run cut short keeps what it measured
    plot(record, args.out.with_suffix(".png"))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
