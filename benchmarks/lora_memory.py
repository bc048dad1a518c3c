"""Per-rank memory by category: full fine-tuning vs LoRA, at every ZeRO stage.

The question LoRA answers is the lecture's: when the model's weights fit but its training
state does not, freeze the weights and train a low-rank update instead. With Ψ parameters of
which Ψ_t train (LoRA on q and v, r = 8, alpha = 1), AdamW needs gradients, master copies and
two moments for Ψ_t only; the frozen Ψ - Ψ_t cost their weight bytes alone. ZeRO then shards
what is left: stages 1-2 divide the (already small) trainable state by N, and stage 3 also
divides the frozen weights, which become the dominant cost under LoRA.

What is measured. For each precision, stage and mode (full / lora) the built-in GPT is wrapped
with `zk.shard`, trained one warm-up step (AdamW allocates its state lazily) and `--steps`
measured steps on `--nproc` gloo ranks; then every rank reports `engine.memory()`: live bytes
of the engine's own storage by category (params, grads, master_params, optimizer_states, and at
stage 3 any unsharded buffers still alive). Activations are not model state and are not
included. Beside each total stands `zk.estimate(Ψ, N, stage, precision, trainable_params=Ψ_t)`.
Optionally (`--simulate 8 64`) one process plays rank 0 of a larger world through
`Comm(simulate=Simulated(0, N))`: the buffers are allocated exactly as on that rank (the
collectives return correctly shaped local data), so the 1/N columns can be seen shrinking.

Where measured and formula differ: stage 3 may hold a unit's unsharded buffers at the
moment of measurement ("other"); every flat buffer is padded to a multiple of N.

    python benchmarks/lora_memory.py                       # small GPT, 2 ranks, fp32 and bf16
    python benchmarks/lora_memory.py --simulate 8 64       # plus simulated ranks of 8 and 64

Writes <out>.json (every rank's numbers, machine, versions, command, date) and <out>.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: import the checkout's zerokit
    sys.path.insert(0, str(REPO))

import zerokit as zk  # noqa: E402
from zerokit.provenance import git_commit  # noqa: E402
from zerokit.commands.step import train_step  # noqa: E402
from zerokit.core.comm import Comm, Simulated  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.models import Block, CharCorpus, build_model  # noqa: E402

STAGES = (0, 1, 2, 3)
MODES = ("full", "lora")
BASE_CATEGORIES = ("params", "grads", "master_params", "optimizer_states")


def measure_one(rank: int, world_size: int, cfg: dict, precision: str, stage: int, mode: str,
                comm: Comm | None = None) -> dict:
    """Build, warm up, train `cfg['steps']` steps, and return this rank's memory and step time."""
    torch.manual_seed(0)  # the adapters' A matrices come from the global generator
    model = build_model(cfg["model"], seed=0)
    if mode == "lora":
        zk.lora.inject(model, targets=("q", "v"), rank=8, alpha=1.0)
    num_params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, lr=1e-3,
                      bucket_numel=cfg["bucket_numel"], wrap=(Block,), comm=comm)
    corpus = CharCorpus(cfg["text"])
    block = model.cfg.block_size
    times = []
    for step in range(1 + cfg["steps"]):  # step 0 is the warm-up that allocates optimizer state
        start = time.perf_counter()
        batch = corpus.batch(cfg["batch_size"], block, step, rank if comm is None else 0,
                             world_size if comm is None else 1)
        train_step(engine, [batch], lambda b: engine(*b)[1])
        if step > 0:
            times.append(time.perf_counter() - start)
    memory = engine.memory()  # after the last step, before zero_grad: the steady state
    est = zk.estimate(num_params, engine.world_size, stage, precision, optimizer="adamw",
                      trainable_params=trainable)
    return {"rank": engine.rank, "world_size": engine.world_size, "precision": precision, "stage": stage,
            "mode": mode, "num_params": num_params, "trainable_params": trainable, "memory": memory,
            "formula": {c: getattr(est, c) for c in BASE_CATEGORIES}, "step_s_median": sorted(times)[len(times) // 2]}


def all_configs(rank: int, world_size: int, cfg: dict) -> list[dict]:
    """One rank's measurements of every (precision, stage, mode), in a fixed order on every rank."""
    return [measure_one(rank, world_size, cfg, precision, stage, mode)
            for precision in cfg["precisions"] for stage in STAGES for mode in MODES]


def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """One row per config: the largest value over ranks in each category (ranks differ only by padding)."""
    rows = []
    for configs in zip(*per_rank):
        row = dict(configs[0])
        categories = sorted({c for r in configs for c in r["memory"]}, key=_category_order)
        row["memory"] = {c: max(r["memory"].get(c, 0) for r in configs) for c in categories}
        row["per_rank_memory"] = [r["memory"] for r in configs]
        row["step_s_median"] = max(r["step_s_median"] for r in configs)
        rows.append(row)
    return rows


def _category_order(c: str) -> tuple[int, str]:
    return (BASE_CATEGORIES.index(c) if c in BASE_CATEGORIES else len(BASE_CATEGORIES), c)


# ------------------------------------------------------------------------------- output
def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.3f}"


def table(rows: list[dict]) -> str:
    """A markdown table: one row per (world, precision, stage, mode), measured beside the formula."""
    head = ("| ranks | precision | stage | mode | trainable Ψ_t | params | grads | master | optim. states "
            "| other | total | formula total | LoRA / full |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    totals = {}
    for r in rows:
        totals[(r["world_label"], r["precision"], r["stage"], r["mode"])] = sum(r["memory"].values())
    for r in rows:
        m = r["memory"]
        other = sum(v for c, v in m.items() if c not in BASE_CATEGORIES)
        total = sum(m.values())
        formula = sum(r["formula"].values())
        ratio = ""
        if r["mode"] == "lora":
            full = totals[(r["world_label"], r["precision"], r["stage"], "full")]
            ratio = f"{total / full:.2f}"
        lines.append(f"| {r['world_label']} | {r['precision']} | {r['stage']} | {r['mode']} | "
                     f"{r['trainable_params']:,} | " + " | ".join(_mb(m.get(c, 0)) for c in BASE_CATEGORIES)
                     + f" | {_mb(other)} | {_mb(total)} | {_mb(formula)} | {ratio} |")
    return "\n".join(lines)


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="GPT preset (tiny, small)")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks")
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    p.add_argument("--simulate", nargs="*", type=int, default=[], help="also simulate rank 0 of these world sizes")
    p.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    p.add_argument("--bucket-numel", type=int, default=1 << 16)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "lora_memory"),
                   help="output path without extension (.json and .md are written)")
    args = p.parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO)] + sys.argv[1:])
    commit = git_commit()  # taken before the run: the code that produced the numbers
    # Read the corpus once here and pass the text to the ranks, so every rank trains on the same bytes.
    text = "".join(path.read_text(encoding="utf-8", errors="replace")
                   for path in sorted((REPO / "zerokit").rglob("*.py")))
    cfg = {"model": args.model, "steps": args.steps, "batch_size": args.batch_size,
           "bucket_numel": args.bucket_numel, "precisions": args.precision, "text": text}

    rows = []
    per_rank = run_ranks(all_configs, args.nproc, cfg, timeout_s=3600)
    for row in merge_ranks(per_rank):
        rows.append({**row, "world_label": f"{args.nproc} (gloo)"})
    for n in args.simulate:
        for precision in args.precision:
            for stage in STAGES:
                for mode in MODES:
                    r = measure_one(0, n, cfg, precision, stage, mode, comm=Comm(simulate=Simulated(0, n)))
                    rows.append({**r, "per_rank_memory": [r["memory"]], "world_label": f"{n} (simulated)"})

    labels = list(dict.fromkeys(r["world_label"] for r in rows))  # first-seen order
    tables = {label: table([r for r in rows if r["world_label"] == label]) for label in labels}
    for label in labels:
        print(f"\n{label} ranks\n{tables[label]}")
    info = machine()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result = {"command": command, "date": date, "commit": commit, "machine": info, "model": args.model,
              "num_params": rows[0]["num_params"], "config": {k: v for k, v in cfg.items() if k != "text"},
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lora_row = next(r for r in rows if r["mode"] == "lora")
    md = [
        "# Per-rank memory: full fine-tuning vs LoRA, per ZeRO stage",
        "",
        f"- command: `{command}`",
        f"- date: {date}",
        f"- machine: {info['cpu']} ({info['cpu_count']} logical CPUs), {info['platform']}",
        f"- commit: {result['commit']}",
        f"- versions: Python {info['python']}, torch {info['torch']}",
        f"- model: GPT preset `{args.model}`, Ψ = {rows[0]['num_params']:,} parameters; LoRA on q and v, "
        f"r = 8, alpha = 1: Ψ_t = {lora_row['trainable_params']:,} trainable adapter parameters "
        f"({100 * lora_row['trainable_params'] / rows[0]['num_params']:.2f}% of the base Ψ; "
        f"Ψ = {lora_row['num_params']:,} with them)",
        f"- optimizer AdamW; {args.steps} measured steps after one warm-up; batch {args.batch_size} "
        f"sequences per rank; bucket_numel {args.bucket_numel}",
        "",
        "MB = 10^6 bytes, per rank, the largest over ranks, measured with `engine.memory()` after a step.",
        "`other` = stage 3's unsharded buffers alive at that moment. `formula total` = "
        "`zk.estimate(Ψ, N, stage, precision, trainable_params=Ψ_t)` (params + grads + master + states).",
        "Largest |measured - formula| / formula over the params+grads+master+states of all rows: "
        f"{max(abs(sum(r['memory'][c] for c in BASE_CATEGORIES) / sum(r['formula'].values()) - 1) for r in rows):.3%}"
        " (padding). Simulated rows: one process allocates exactly what rank 0 of N would.",
    ]
    for label in labels:
        md += ["", f"## {label} ranks", "", tables[label]]
    md.append("")
    out.with_suffix(".md").write_text("\n".join(md))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
