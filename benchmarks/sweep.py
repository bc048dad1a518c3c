"""How cost grows: step time and per-rank bytes per stage, over model size and world size (issue 12).

    python benchmarks/sweep.py                                        # 4 sizes (~1M to ~50M params) x N = 1, 2, 4
    python benchmarks/sweep.py --sizes 1 4 --world-sizes 1 2 --steps 3   # quicker

One spawn per world size trains, for every model size and stage, `--warmup` + `--steps` steps of
the character GPT (fp32, AdamW, clip 1.0, `--batch-size` sequences of 64 tokens per rank) and
records, on every rank:

* the median step time (a step counts at its slowest rank);
* the model states this rank holds after a step (`engine.memory()`: params, grads, master,
  optimizer states) and the peak bytes autograd saved for backward during one step
  (`zerokit.core.ledger.ActivationMeter`, saved-tensor hooks on CPU), and their sum: the ledger's
  view of what a rank needs beyond temporaries;
* the allocator's view, temporaries included: the engine built afresh and trained `--memory-warmup`
  + 1 more steps under torch.profiler, with c10's counter made to see every thread (gloo's too),
  as benchmarks/speed_vs_torch.py's allocator pass does: the most bytes live inside the measured
  step and those live after it, both counted from just before the build (so the model's own
  weights count, as on a GPU they would), for the sizes in `--memory-sizes` (default all but
  the 50M one, whose profiler pass alone takes about 3.7 GB per rank); `--memory-warmup 0` leaves
  it out.

Model sizes are GPTs of 4-12 layers and widths 128-768 (see SIZES); their exact parameter counts
are in the results. Writes benchmarks/results/sweep.json, sweep.md and sweep.png (step time and
bytes against parameters, one line per stage, one column per world size).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import zerokit as zk  # noqa: E402
from zerokit.commands.step import train_step  # noqa: E402
from zerokit.core.ledger import ActivationMeter  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.models import Block, CharCorpus, GPTConfig, build_model  # noqa: E402
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402
import speed_vs_torch as S  # noqa: E402  (its allocator pass: benchmarks/speed_vs_torch.py)

STAGES = (0, 1, 2, 3)
MODEL_STATES = ("params", "grads", "master_params", "optimizer_states")
# nominal millions of parameters -> (layers, heads, width): about 12 * layers * width^2 parameters
SIZES = {1: (4, 4, 128), 4: (6, 6, 240), 15: (8, 8, 384), 50: (12, 12, 576)}
BLOCK = 64


def _config(size: int) -> GPTConfig:
    layers, heads, width = SIZES[size]
    return GPTConfig(vocab_size=CharCorpus.vocab_size, block_size=BLOCK, n_layer=layers, n_head=heads, n_embd=width)


def _engine(size: int, stage: int):
    model = build_model(_config(size), seed=0)
    return model, zk.shard(model, torch.optim.AdamW, stage=stage, lr=1e-3, weight_decay=0.1, wrap=(Block,))


def _allocator_loop(size: int, stage: int):
    """speed_vs_torch.py's Loop for its allocator pass: (train_step(x, y) -> loss, zero_grad, memory)."""
    _, engine = _engine(size, stage)

    def step(x, y):  # zero_grad comes first inside train_step (commands/step.py)
        return train_step(engine, [(x, y)], lambda b: engine(*b)[1], clip=1.0).loss

    return step, lambda: None, engine.memory


def sweep_rank(rank: int, world_size: int, cfg: dict) -> dict:
    corpus = CharCorpus.load()
    out = {}
    for size in cfg["sizes"]:
        for stage in STAGES:
            model, engine = _engine(size, stage)
            times = []
            for s in range(cfg["warmup"] + cfg["steps"]):
                batch = corpus.batch(cfg["batch_size"], BLOCK, s, rank, world_size)
                start = time.perf_counter()
                train_step(engine, [batch], lambda b: engine(*b)[1], clip=1.0)
                if s >= cfg["warmup"]:
                    times.append(1e3 * (time.perf_counter() - start))
            states = engine.memory()
            with ActivationMeter(exclude=model, use_cuda_allocator=False) as meter:  # one more step, measured
                train_step(engine, [corpus.batch(cfg["batch_size"], BLOCK, 10 ** 6, rank, world_size)],
                           lambda b: engine(*b)[1], clip=1.0)
            out[(size, stage)] = {"params": sum(p.numel() for p in model.parameters()), "times_ms": times,
                                  "model_states": sum(states[c] for c in MODEL_STATES),
                                  "activations": meter.saved_peak_bytes}
            del engine, model
            gc.collect()  # hooks make cycles: free this engine before the next one is built
            if cfg["memory_warmup"] > 0 and size in cfg["memory_sizes"]:
                alloc = S._allocator_steps({**cfg, "block_size": BLOCK, "memory_steps": 1}, rank, world_size,
                                           torch.device("cpu"), lambda: _allocator_loop(size, stage))
                out[(size, stage)].update(peak=alloc["peak_step_bytes"][0], after=alloc["between_steps_bytes"][-1],
                                          allocator=alloc["method"])
                gc.collect()
    return out


def summarize(runs: dict[int, list[dict]], cfg: dict) -> list[dict]:
    rows = []
    for world_size, per_rank in runs.items():
        for size in cfg["sizes"]:
            for stage in STAGES:
                res = [r[(size, stage)] for r in per_rank]
                slowest = [max(ts) for ts in zip(*(r["times_ms"] for r in res))]
                rows.append({"world_size": world_size, "size": size, "stage": stage, "params": res[0]["params"],
                             "step_ms": statistics.median(slowest),
                             "model_states": max(r["model_states"] for r in res),
                             "activations": max(r["activations"] for r in res),
                             "total": max(r["model_states"] + r["activations"] for r in res),
                             # the allocator pass (absent with --memory-warmup 0): the largest rank's
                             "peak": max(r["peak"] for r in res) if "peak" in res[0] else None,
                             "after": max(r["after"] for r in res) if "after" in res[0] else None})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(2, len(worlds), figsize=(4.2 * len(worlds), 7), squeeze=False)
    for j, n in enumerate(worlds):
        for stage in STAGES:
            pts = sorted((r["params"] / 1e6, r["step_ms"], r["total"] / 2**20, r["peak"]) for r in rows
                         if r["world_size"] == n and r["stage"] == stage)
            xs = [p[0] for p in pts]
            line, = axes[0][j].plot(xs, [p[1] for p in pts], marker="o", label=f"stage {stage}")
            measured = [p for p in pts if p[3] is not None]  # the sizes the allocator pass ran at
            if measured:
                axes[1][j].plot([p[0] for p in measured], [p[3] / 2**20 for p in measured], marker="o",
                                color=line.get_color(), label=f"stage {stage}, allocator peak")
            axes[1][j].plot(xs, [p[2] for p in pts], linestyle="--", marker=".", color=line.get_color(),
                            label=f"stage {stage}, ledger")
        axes[0][j].set_title(f"N = {n}")
        for i, ylabel in enumerate(("step ms (slowest rank, median)",
                                    "MiB per rank: allocator peak in a step;\nledger (model states + activations)")):
            ax = axes[i][j]
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("parameters (millions)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    axes[1][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=sorted(SIZES), choices=sorted(SIZES),
                   help="nominal model sizes, millions of parameters")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch-size", type=int, default=4, help="sequences of 64 tokens per rank per step")
    p.add_argument("--steps", type=int, default=4, help="measured steps per (size, stage)")
    p.add_argument("--warmup", type=int, default=1, help="steps before measuring")
    p.add_argument("--memory-warmup", type=int, default=1,
                   help="steps before the allocator pass's measured step (0: no allocator pass)")
    p.add_argument("--memory-sizes", type=int, nargs="+", default=[1, 4, 15], choices=sorted(SIZES),
                   help="sizes that get the allocator pass (default 1 4 15: at 50 the profiler's own memory, about "
                        "3.7 GB per rank at N = 1, puts 4 ranks past a 24 GiB machine)")
    p.add_argument("--timeout", type=float, default=3600, help="deadline for each spawn (s)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "sweep",
                   help="results path without extension (.json, .md and .png are written)")
    args = p.parse_args(argv)
    record = provenance(command_line(__file__, argv))
    cfg = {"sizes": args.sizes, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
           "memory_warmup": args.memory_warmup, "memory_sizes": args.memory_sizes}
    start = time.perf_counter()
    runs = {n: run_ranks(sweep_rank, n, cfg, timeout_s=args.timeout) for n in args.world_sizes}
    rows = summarize(runs, cfg)
    result = {**record, "config": cfg, "world_sizes": args.world_sizes, "rows": rows,
              "seconds": round(time.perf_counter() - start, 1)}
    md = _markdown(result)
    print(md)
    write_pair(args.out, result, md)
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.png')}")
    return 0


def _markdown(r: dict) -> str:
    c = r["config"]
    mib = 2 ** 20
    alloc = c["memory_warmup"] > 0 and any(x.get("peak") is not None for x in r["rows"])
    lines = ["# Step time and per-rank bytes over model size and world size", "", *provenance_lines(r),
             f"- fp32, AdamW, clip 1.0, {c['batch_size']} x {BLOCK} tokens per rank per step, stage 3 wrapping every "
             f"Block; median of {c['steps']} steps after {c['warmup']}, a step at its slowest rank; gloo ranks "
             f"sharing 2 CPU cores ({r['seconds']:.0f} s in all)",
             "- ledger: model states after a step (`engine.memory()`) + the most bytes autograd saved in a step"]
    if alloc:
        lines.append(f"- allocator (sizes {', '.join(f'{s}M' for s in c['memory_sizes'])} nominal; '-' where it did "
                     f"not run): a fresh engine, {c['memory_warmup']} step(s), then one measured step under "
                     "torch.profiler with every thread's allocations counted (speed_vs_torch.py's allocator pass); "
                     "bytes from just before the engine was built, the largest rank's")
    head = "| N | params | stage | step ms | model states MiB | activations MiB | ledger sum MiB |"
    rule = "|---|---:|---|---:|---:|---:|---:|"
    if alloc:
        head += " allocator peak MiB | live after the step MiB | peak vs stage 0 |"
        rule += "---:|---:|---:|"
    else:
        head += " sum vs stage 0 |"
        rule += "---:|"
    lines += ["", head, rule]
    stage0 = {(x["world_size"], x["size"]): x for x in r["rows"] if x["stage"] == 0}
    for x in r["rows"]:
        line = (f"| {x['world_size']} | {x['params'] / 1e6:.1f}M | {x['stage']} | {x['step_ms']:.0f} | "
                f"{x['model_states'] / mib:.1f} | {x['activations'] / mib:.1f} | {x['total'] / mib:.1f} |")
        base = stage0[(x["world_size"], x["size"])]
        if not alloc:
            line += f" {x['total'] / base['total']:.2f} |"
        elif x.get("peak") is None:
            line += " - | - | - |"
        else:
            line += f" {x['peak'] / mib:.1f} | {x['after'] / mib:.1f} | {x['peak'] / base['peak']:.2f} |"
        lines.append(line)
    lines += ["", "Picture: `sweep.png` beside this file. Step times on 2 shared cores grow with N because the N "
              "ranks share the cores (compute per rank is fixed); compare stages within a column. The allocator "
              "peak adds to the ledger what the ledger leaves out: temporaries (the loss's logits, the "
              "optimizer's foreach intermediates, collective buffers), stage 2's full-size gradient of each bucket "
              "in flight beside its shard, stage 3's gathered units; and it is lower where the ledger counts "
              "something the step does not hold at its peak (stage 3's grad shards, freed by zero_grad and "
              "rebuilt in backward)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
