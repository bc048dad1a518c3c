"""Where stage 0's step time goes beside torch DDP's: forward, backward, step and zero_grad, and how many all-reduces.

    python benchmarks/investigations/stage0_phases.py                 # 2 gloo ranks, model small, bucket 65536, 4 rounds
    python benchmarks/investigations/stage0_phases.py --nproc 2 --model small --steps 30 --warmup 5 --rounds 4 --bucket-numel 65536

The same runs as benchmarks/speed.py's stage 0 pair (same weights, batches, AdamW with
the decay / no-decay split, bucket size, DDP with `gradient_as_bucket_view=True`). It measures
the current code only: an earlier version also ran stage 0 with one all-reduce per bucket by
patching zerokit's private grouping function; that arm is dropped (no public setting chooses the
grouping: core/grads/grad_reduce.py [Note: all-reduce groups]); its figures stay in
benchmarks/results/stage0_phases.json from that run. Each run is built afresh per round,
rounds alternate the order; each phase is timed on its own (`time.perf_counter` around
zero_grad, the forward, the backward including the wait for its all-reduces, and the optimizer
step); a phase's figure is the median over the steps after `--warmup`, then the median over
rounds, on the slowest rank. "all-reduces per step": zerokit's all-reduce groups (one
all-reduce each); DDP's from `DistributedDataParallel._get_ddp_logging_data()`
(`rebuilt_bucket_sizes`, after its first iterations).

Writes benchmarks/results/stage0_phases.json and .md (command, date, commit, machine, versions).
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

import speed as S  # noqa: E402  (the peers' construction, the data, the no-decay split)
from zerokit.bench import no_decay, torch_ddp  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402

PHASES = ("zero_grad", "forward", "backward", "step")
RUNS = ("zerokit stage 0", "torch DDP")


def _build(name: str, cfg: dict):
    """(zero_grad, forward -> loss, backward(loss), step, all-reduces per step or a function giving it)."""
    import zerokit as zk
    from zerokit.models import Block

    model = S._initial_model(cfg)
    if name.startswith("zerokit"):
        bucket = {"bucket_numel": cfg["bucket_numel"]} if cfg["bucket_numel"] else {}  # 0: zerokit's default
        engine = zk.shard(model, torch.optim.AdamW, stage=0, lr=cfg["lr"], weight_decay=0.1,
                          wrap=(Block,), param_groups=no_decay, **bucket)
        return (engine.zero_grad, lambda x, y: engine(x, y)[1], engine.backward, engine.step,
                lambda: len(engine.groups))
    ddp, _ = torch_ddp(model, cfg["bucket_numel"] or S.DDP_DEFAULT_BUCKET_NUMEL, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(S._param_groups(model), lr=cfg["lr"], weight_decay=0.1, foreach=True)
    return (lambda: opt.zero_grad(set_to_none=False), lambda x, y: ddp(x, y)[1], lambda loss: loss.backward(),
            opt.step, lambda: ddp_all_reduces(ddp))


def ddp_all_reduces(ddp) -> int:
    """How many all-reduces torch DDP makes per step: its buckets after the first iterations' rebuild."""
    sizes = ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")
    return len(sizes.split(",")) if sizes else -1


def phases_rank(rank: int, world_size: int, cfg: dict, build=_build, runs: tuple[str, ...] = RUNS) -> dict:
    """Every run in `runs`, built by `build(name, cfg)`, `rounds` times: each phase's per-round medians
    (benchmarks/investigations/stage1_phases.py passes its own runs)."""
    batches = S._batches(cfg, rank, world_size, torch.device("cpu"), cfg["steps"])
    out = {name: {"ms": {p: [] for p in PHASES}, "whole_ms": []} for name in runs}
    for r in range(cfg["rounds"]):
        for name in (runs if r % 2 == 0 else runs[::-1]):
            zero_grad, forward, backward, step, buckets = build(name, cfg)
            times = {p: [] for p in PHASES}
            whole = []  # each step's four phases together: a step's median is not the sum of the phases' medians
            for i, (x, y) in enumerate(batches):
                t0 = time.perf_counter()
                zero_grad()
                t1 = time.perf_counter()
                loss = forward(x, y)
                t2 = time.perf_counter()
                backward(loss)
                t3 = time.perf_counter()
                step()
                t4 = time.perf_counter()
                loss.item()
                if i >= cfg["warmup"]:
                    for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                        times[p].append(1e3 * dt)
                    whole.append(1e3 * (t4 - t0))
            for p in PHASES:
                out[name]["ms"][p].append(statistics.median(times[p]))
            out[name]["whole_ms"].append(statistics.median(whole))
            out[name]["all_reduces"] = buckets()
    return out


def summarize(per_rank: list[dict]) -> list[dict]:
    rows = []
    for name in per_rank[0]:
        rounds = len(per_rank[0][name]["ms"]["forward"])
        ms = {p: statistics.median(max(rank[name]["ms"][p][k] for rank in per_rank) for k in range(rounds))
              for p in PHASES}
        whole = statistics.median(max(rank[name]["whole_ms"][k] for rank in per_rank) for k in range(rounds))
        rows.append({"run": name, "ms": ms, "total_ms": sum(ms.values()), "whole_ms": whole,
                     "all_reduces": per_rank[0][name]["all_reduces"]})
    return rows


def table(rows: list[dict], peer: str = "torch DDP", collectives: str = "all-reduces per step") -> list[str]:
    ddp = next(r for r in rows if r["run"] == peer)
    short = peer.removeprefix("torch ")
    lines = [f"| run | {collectives} | zero_grad ms | forward ms | backward ms (incl. wait) | step ms | sum ms "
             f"| sum / {short}'s | whole step ms | whole / {short}'s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ms = r["ms"]
        lines.append(f"| {r['run']} | {r['all_reduces']} | {ms['zero_grad']:.2f} | {ms['forward']:.2f} | "
                     f"{ms['backward']:.2f} | {ms['step']:.2f} | {r['total_ms']:.2f} | {r['total_ms'] / ddp['total_ms']:.2f} "
                     f"| {r['whole_ms']:.2f} | {r['whole_ms'] / ddp['whole_ms']:.2f} |")
    return lines


def main(argv: list[str] | None = None, *, script: str = __file__, doc: str = __doc__, build=_build,
         runs: tuple[str, ...] = RUNS, peer: str = "torch DDP", collectives: str = "all-reduces per step",
         markdown=None) -> int:
    """Run `runs` (built by `build`), print the table, write the results. stage1_phases.py passes its own."""
    name = Path(script).stem
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks")
    p.add_argument("--model", default="small", help="model preset (zerokit.models) or a size of benchmarks/scaling.py")
    p.add_argument("--steps", type=int, default=30, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=5, help="steps of each run left out of the medians")
    p.add_argument("--rounds", type=int, default=4, help="runs of each, alternating the order")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--bucket-numel", type=int, default=65536,
                   help="zerokit's bucket_numel and DDP's cap (x 4 bytes); 0: each one's default")
    p.add_argument("--timeout", type=float, default=900, help="deadline for the spawn (s)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / name,
                   help="results path without extension (.json and .md are written)")
    args = p.parse_args(argv)
    record = provenance(command_line(script, argv))
    from zerokit.models import preset

    import scaling

    sized = args.model in scaling.SIZES
    cfg = {"model": scaling.config(args.model) if sized else args.model, "seed": 0, "peers": "default",
           "batch_size": args.batch_size, "block_size": scaling.BLOCK if sized else preset(args.model).block_size, "steps": args.steps, "warmup": args.warmup,
           "rounds": args.rounds, "lr": 3e-3, "bucket_numel": args.bucket_numel}
    start = time.perf_counter()
    rows = summarize(run_ranks(phases_rank, args.nproc, cfg, build, runs, timeout_s=args.timeout))
    result = {**record, "nproc": args.nproc, "config": {**cfg, "model": args.model}, "seconds": round(time.perf_counter() - start, 1),
              "rows": rows}
    print("\n".join(table(rows, peer, collectives)))
    write_pair(args.out, result, (markdown or _markdown)(result))
    return 0


def _markdown(r: dict) -> str:
    c = r["config"]
    return "\n".join([
        "# Stage 0 beside torch DDP, phase by phase", "", *provenance_lines(r),
        f"- {r['nproc']} gloo ranks, model {c['model']}, {c['batch_size']} x {c['block_size']} tokens per rank per "
        f"step, fp32 AdamW (lr {c['lr']}, weight decay 0.1, none on biases/LayerNorms), bucket {c['bucket_numel']} "
        f"elements (DDP: bucket_cap_mb = that x 4 bytes, gradient_as_bucket_view); "
        f"{c['rounds']} rounds of {c['steps']} steps, the first {c['warmup']} of each left out; medians, slowest rank",
        "", *table(r["rows"]), "",
        "Each phase is timed on its own; \"sum\" adds the phases' medians, \"whole step\" is the median of each "
        "step's four phases together (what benchmarks/speed.py times): the two differ where a phase varies. "
        "\"backward\" includes waiting for the step's all-reduces. DDP's buckets close once they reach the cap, so "
        "they hold a little more than it; zerokit's buckets never exceed it, and the decay / no-decay split puts "
        "every bias and LayerNorm in a bucket of its own, so one all-reduce per bucket would make more "
        "collectives than DDP. Stage 0 all-reduces consecutive buckets together, a "
        "group closing once it reaches the cap (DDP's rule applied to whole buckets: core/grads/grad_reduce.py [Note: "
        "all-reduce groups]), so its collectives are fewer and larger than DDP's. zerokit's hooks are "
        "Python (two per parameter and backward: core/grads/hooks.py), DDP's reducer is C++; zerokit's step is AdamW "
        "over its 10 flat buffers (torch's for-loop implementation, the CPU default), DDP's a foreach AdamW "
        "over every parameter."]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
