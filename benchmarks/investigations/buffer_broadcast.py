"""What `broadcast_buffers=True` (the default, as torch DDP's) costs per step: time and bytes.

    python benchmarks/investigations/buffer_broadcast.py                  # 2 gloo ranks, GPT small and a ResNet-style CNN
    python benchmarks/investigations/buffer_broadcast.py --nproc 2 --gpt small --cnn-width 32 --steps 20 --warmup 3 --stage 0

Before each `engine(...)` forward that DDP would sync, rank 0's buffers are broadcast, one collective
per buffer dtype (core/params/model_guard.py [Note: buffers as DDP keeps them]). Two models: zerokit's GPT
(zerokit/models.py), which has no buffers, so the option must cost zero collectives and zero bytes;
and a small ResNet-style CNN with BatchNorm (running mean, variance, and an int64 counter per layer).
One spawn trains two engines per model from the same weights, with and without `broadcast_buffers`,
and steps them in turns (with, without, without, with, ...) so that drift of the machine favours
neither; a step (zero_grad, forward, backward, step) counts at the slowest rank's time. Bytes and
collectives per step come from the comm ledger (phase "buffers").

Writes benchmarks/results/buffer_broadcast.json and .md (command, date, commit, machine, versions).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import zerokit as zk  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.models import Block, CharCorpus, build_model, preset  # noqa: E402
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402


class ResBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class SmallResNet(nn.Module):
    """A stem, `depth` residual blocks with BatchNorm, pooling and a linear head (10 classes, 16x16 inputs)."""

    def __init__(self, width: int = 32, depth: int = 4):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.blocks = nn.Sequential(*[ResBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x, y):
        h = self.blocks(F.relu(self.bn(self.stem(x))))
        return F.cross_entropy(self.head(h.mean((2, 3))), y)


def _batches(model_name: str, cfg: dict, corpus, step: int, rank: int, world_size: int):
    if model_name == "gpt":
        x, y = corpus.batch(cfg["batch_size"], cfg["block_size"], step * world_size + rank)
        return x, y
    g = torch.Generator().manual_seed(step * world_size + rank)
    n = cfg["batch_size"]
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def _build(model_name: str, cfg: dict):
    if model_name == "gpt":
        return build_model(cfg["gpt"], seed=0)
    torch.manual_seed(0)
    return SmallResNet(cfg["cnn_width"], cfg["cnn_depth"])


def bench_rank(rank: int, world_size: int, cfg: dict) -> dict:
    corpus = CharCorpus.load()
    out = {}
    for model_name in ("gpt", "cnn"):
        engines = {}
        for on in (True, False):
            model = _build(model_name, cfg)
            engines[on] = zk.shard(model, torch.optim.AdamW, stage=cfg["stage"], lr=1e-3, wrap=(Block, ResBlock),
                                   broadcast_buffers=on)
        times = {True: [], False: []}
        ledger = {}
        for step in range(cfg["warmup"] + cfg["steps"]):
            order = (True, False) if step % 2 == 0 else (False, True)  # paired, alternating
            for on in order:
                engine = engines[on]
                x, y = _batches(model_name, cfg, corpus, step, rank, world_size)
                calls, nbytes = engine.comm.calls["broadcast"], engine.comm.stats_by_phase().get("buffers", {}).get(
                    "broadcast", 0)
                torch.distributed.barrier()
                start = time.perf_counter()
                engine.zero_grad()
                out_ = engine(x, y)
                loss = out_[1] if isinstance(out_, tuple) else out_
                engine.backward(loss)
                engine.step()
                elapsed = 1e3 * (time.perf_counter() - start)
                if step >= cfg["warmup"]:
                    times[on].append(elapsed)
                    ledger[on] = (engine.comm.calls["broadcast"] - calls,
                                  engine.comm.stats_by_phase().get("buffers", {}).get("broadcast", 0) - nbytes)
        buffers = list(engines[True].module.buffers())
        out[model_name] = {"times_ms": times, "ledger": ledger,
                           "params": sum(p.numel() for p in engines[True].module.parameters()),
                           "buffers": len(buffers), "buffer_bytes": sum(b.numel() * b.element_size() for b in buffers),
                           "buffer_dtypes": sorted({str(b.dtype).replace("torch.", "") for b in buffers})}
    return out


def summarize(per_rank: list[dict]) -> list[dict]:
    rows = []
    for model_name in ("gpt", "cnn"):
        first = per_rank[0][model_name]
        row = {"model": model_name, "params": first["params"], "buffers": first["buffers"],
               "buffer_bytes": first["buffer_bytes"], "buffer_dtypes": first["buffer_dtypes"]}
        for on, key in ((True, "with"), (False, "without")):
            slowest = [max(ts) for ts in zip(*(r[model_name]["times_ms"][on] for r in per_rank))]
            calls, nbytes = first["ledger"][on]
            row[key] = {"step_ms": statistics.median(slowest), "collectives_per_step": calls, "bytes_per_step": nbytes}
        pairs = [max(a) - max(b) for a, b in zip(zip(*(r[model_name]["times_ms"][True] for r in per_rank)),
                                                   zip(*(r[model_name]["times_ms"][False] for r in per_rank)))]
        row["paired_diff_ms"] = statistics.median(pairs)
        row["ratio"] = row["with"]["step_ms"] / row["without"]["step_ms"]
        rows.append(row)
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| model | params | buffers (bytes, dtypes) | step ms, with | step ms, without | with / without "
             "| median paired difference | broadcasts / step (with) | buffer bytes / step (with) | bytes (without) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w, wo = r["with"], r["without"]
        lines.append(f"| {r['model']} | {r['params']:,} | {r['buffers']} ({r['buffer_bytes']:,} B, "
                     f"{', '.join(r['buffer_dtypes']) or '-'}) | {w['step_ms']:.2f} | {wo['step_ms']:.2f} | "
                     f"{r['ratio']:.3f}x | {r['paired_diff_ms']:+.2f} ms | {w['collectives_per_step']} | "
                     f"{w['bytes_per_step']:,} | {wo['bytes_per_step']:,} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks")
    p.add_argument("--gpt", default="small", help="GPT preset (zerokit.models)")
    p.add_argument("--cnn-width", type=int, default=32, help="channels of the ResNet-style CNN")
    p.add_argument("--cnn-depth", type=int, default=4, help="residual blocks of the CNN")
    p.add_argument("--batch-size", type=int, default=8, help="samples (sequences, images) per rank per step")
    p.add_argument("--stage", type=int, default=0, help="ZeRO stage of both engines")
    p.add_argument("--steps", type=int, default=20, help="measured steps per engine")
    p.add_argument("--warmup", type=int, default=3, help="steps per engine before measuring")
    p.add_argument("--timeout", type=float, default=1800, help="deadline for the whole spawn (s)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "buffer_broadcast",
                   help="results path without extension (.json and .md are written)")
    args = p.parse_args(argv)
    record = provenance(command_line(__file__, argv))
    cfg = {"gpt": args.gpt, "block_size": preset(args.gpt).block_size, "cnn_width": args.cnn_width,
           "cnn_depth": args.cnn_depth, "batch_size": args.batch_size,
           "stage": args.stage, "steps": args.steps, "warmup": max(1, args.warmup)}
    start = time.perf_counter()
    rows = summarize(run_ranks(bench_rank, args.nproc, cfg, timeout_s=args.timeout))
    result = {**record, "nproc": args.nproc, "config": cfg, "seconds": round(time.perf_counter() - start, 1),
              "rows": rows}
    print("\n".join(table(rows)))
    write_pair(args.out, result, _markdown(result))
    return 0


def _markdown(r: dict) -> str:
    c = r["config"]
    return "\n".join([
        "# What broadcast_buffers=True costs per step", "", *provenance_lines(r),
        f"- {r['nproc']} gloo ranks, stage {c['stage']}, AdamW, {c['batch_size']} samples per rank per step; GPT "
        f"preset {c['gpt']} (no buffers) and a ResNet-style CNN ({c['cnn_depth']} residual blocks of width "
        f"{c['cnn_width']}, BatchNorm after every conv, 16x16 inputs); two engines per model from the same weights, "
        f"stepped in turns (with/without alternating first), {c['steps']} measured steps after {c['warmup']}; a "
        "step counts at its slowest rank; medians", "", *table(r["rows"]), "",
        "Broadcasts and bytes per step: the comm ledger's phase \"buffers\" (kind broadcast, logical bytes as "
        "core/collectives/comm.py counts them); one broadcast per buffer dtype per synced forward (core/params/model_guard.py)."]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
