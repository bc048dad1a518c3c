"""Where fp16 training time goes on a CPU: zerokit beside plain torch, and torch's own kernels per dtype.

    python benchmarks/investigations/fp16_cpu.py                          # model small, 8 x 64 tokens, one process
    python benchmarks/investigations/fp16_cpu.py --model tiny --steps 6   # quicker

fp16 trains several times slower than fp32 and bf16 on CPU. This asks whose time that is, in one
process (world size 1, so no collective is involved):

1. step time per precision, zerokit stage 0 (`train_step`: zero_grad, forward, backward, clip
   1.0, step; fp32 master weights, and under fp16 the loss scaler) beside plain torch on the same
   model cast to the dtype (`model.to(dtype)`, `torch.optim.AdamW`, `loss.backward()`: no
   zerokit, no master, no scaler). If zerokit's fp16/bf16 ratio matches plain torch's, the
   slowness is in torch's kernels, not in zerokit;
2. one zerokit step per precision under `torch.profiler`: self CPU time of the ops that take the
   most, side by side, so the kernels that slow down are named;
3. those kernels alone, outside any model: `mm`, `addmm`, `sum` over a dim, `add_`, for the
   shapes the small GPT's linear layers use, per dtype.

Writes benchmarks/results/fp16_cpu.json and .md (command, date, commit, machine, versions).
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
from zerokit.models import CharCorpus, build_model  # noqa: E402
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _median_ms(fn, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def step_times(cfg: dict, batches: list) -> dict:
    """Median step ms per precision: zerokit stage 0 and plain torch on the model cast to the dtype."""
    out = {}
    for name, dtype in PRECISIONS.items():
        model = build_model(cfg["model"], seed=0)
        engine = zk.shard(model, torch.optim.AdamW, stage=0, precision=name, lr=1e-3)
        i = iter(range(10 ** 9))
        zk_ms = _median_ms(lambda: train_step(engine, [batches[next(i) % len(batches)]],
                                              lambda b: engine(*b)[1], clip=1.0), cfg["steps"], cfg["warmup"])
        plain = build_model(cfg["model"], seed=0).to(dtype)
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
        j = iter(range(10 ** 9))

        def plain_step():
            opt.zero_grad()
            x, y = batches[next(j) % len(batches)]
            plain(x, y)[1].backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
            opt.step()

        out[name] = {"zerokit_ms": zk_ms, "plain_torch_ms": _median_ms(plain_step, cfg["steps"], cfg["warmup"])}
    return out


def profiles(cfg: dict, batches: list, top: int) -> dict:
    """Self CPU ms per op in one zerokit stage-0 step (after warm-up), per precision."""
    out = {}
    for name in PRECISIONS:
        model = build_model(cfg["model"], seed=0)
        engine = zk.shard(model, torch.optim.AdamW, stage=0, precision=name, lr=1e-3)
        for b in batches[:2]:
            train_step(engine, [b], lambda b: engine(*b)[1], clip=1.0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            train_step(engine, [batches[2]], lambda b: engine(*b)[1], clip=1.0)
        ops = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
        out[name] = ops
    # the ops that take the most under fp16, with their time under every precision
    keys = sorted(out["fp16"], key=out["fp16"].get, reverse=True)[:top]
    return {"ops": keys, "self_ms": {name: {k: out[name].get(k, 0.0) for k in keys} for name in PRECISIONS},
            "total_ms": {name: sum(out[name].values()) for name in PRECISIONS}}


def kernels(cfg: dict) -> list[dict]:
    """torch's kernels alone, per dtype, at the small GPT's shapes (rows = batch x tokens)."""
    m = build_model(cfg["model"]).cfg
    rows, d = cfg["batch_size"] * m.block_size, m.n_embd
    cases = {
        f"mm ({rows}x{d}) @ ({d}x{4 * d})": lambda a, w, b, s: torch.mm(a, w),
        f"addmm bias + ({rows}x{d}) @ ({d}x{4 * d})": lambda a, w, b, s: torch.addmm(b, a, w),
        f"sum over rows of ({rows}x{4 * d}) (a bias gradient)": lambda a, w, b, s: s.sum(0),
        f"add_ ({rows}x{4 * d})": lambda a, w, b, s: s.add_(s),
    }
    out = []
    for label, fn in cases.items():
        row = {"kernel": label}
        for name, dtype in PRECISIONS.items():
            g = torch.Generator().manual_seed(0)
            a = torch.randn(rows, d, generator=g).to(dtype)
            w = torch.randn(d, 4 * d, generator=g).to(dtype)
            b = torch.randn(4 * d, generator=g).to(dtype)
            s = torch.randn(rows, 4 * d, generator=g).mul_(1e-3).to(dtype)
            row[name] = _median_ms(lambda: fn(a, w, b, s), cfg["kernel_repeats"], 3)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="model preset (zerokit.models)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=10, help="measured steps per run (median)")
    p.add_argument("--warmup", type=int, default=2, help="steps per run before measuring")
    p.add_argument("--top", type=int, default=10, help="ops listed from the profile")
    p.add_argument("--kernel-repeats", type=int, default=20, help="timed calls per kernel and dtype (median)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "fp16_cpu",
                   help="results path without extension (.json and .md are written)")
    args = p.parse_args(argv)
    record = provenance(command_line(__file__, argv))
    record["torch_threads"] = torch.get_num_threads()
    record["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    cfg = {"model": args.model, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
           "kernel_repeats": args.kernel_repeats}
    corpus = CharCorpus.load()
    block = build_model(args.model).cfg.block_size
    batches = [corpus.batch(args.batch_size, block, s) for s in range(8)]
    result = {**record, "config": cfg, "steps": step_times(cfg, batches), "profile": profiles(cfg, batches, args.top),
              "kernels": kernels(cfg)}
    md = _markdown(result)
    print(md)
    write_pair(args.out, result, md)
    return 0


def _markdown(r: dict) -> str:
    c, st, pr = r["config"], r["steps"], r["profile"]
    lines = ["# Where fp16 training time goes on a CPU", "", *provenance_lines(r),
             f"- torch threads: {r['torch_threads']}; CPU capability (torch): {r['cpu_capability']}; one process, "
             f"model {c['model']}, {c['batch_size']} sequences per step; medians of {c['steps']} steps after "
             f"{c['warmup']}", "",
             "## Step time: zerokit stage 0 beside plain torch (the model cast to the dtype)", "",
             "| precision | zerokit ms | plain torch ms | zerokit / plain | zerokit vs its bf16 | plain torch vs its bf16 |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, s in st.items():
        lines.append(f"| {name} | {s['zerokit_ms']:.1f} | {s['plain_torch_ms']:.1f} | "
                     f"{s['zerokit_ms'] / s['plain_torch_ms']:.2f} | {s['zerokit_ms'] / st['bf16']['zerokit_ms']:.2f}x | "
                     f"{s['plain_torch_ms'] / st['bf16']['plain_torch_ms']:.2f}x |")
    lines += ["", "## One zerokit step under torch.profiler: self CPU ms of the ops that take the most under fp16", "",
              "| op | " + " | ".join(PRECISIONS) + " | fp16 / bf16 |", "|---|" + "---:|" * (len(PRECISIONS) + 1)]
    for op in pr["ops"]:
        ms = pr["self_ms"]
        ratio = ms["fp16"][op] / ms["bf16"][op] if ms["bf16"][op] else float("inf")
        lines.append(f"| `{op}` | " + " | ".join(f"{ms[n][op]:.1f}" for n in PRECISIONS) + f" | {ratio:.1f}x |")
    lines.append("| all ops | " + " | ".join(f"{pr['total_ms'][n]:.1f}" for n in PRECISIONS)
                 + f" | {pr['total_ms']['fp16'] / pr['total_ms']['bf16']:.1f}x |")
    lines += ["", "## torch's kernels alone (ms per call, median)", "",
              "| kernel | " + " | ".join(PRECISIONS) + " | fp16 / bf16 |", "|---|" + "---:|" * (len(PRECISIONS) + 1)]
    for k in r["kernels"]:
        lines.append(f"| {k['kernel']} | " + " | ".join(f"{k[n]:.3f}" for n in PRECISIONS)
                     + f" | {k['fp16'] / k['bf16']:.1f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
