"""What is live at a step's allocator peak, and at the step boundary after it, by the op that allocated it.

`benchmarks/speed.py` says how many bytes a step peaks at; this says what they are. For each
run (zerokit at a stage, or one of its torch peers, built exactly as speed.py builds them), on
rank 0: a few warm-up steps, then one measured step under `torch.profiler(profile_memory=True)` with
c10's all-threads counter on (speed.py's `_all_threads_counter`). The peak is the highest
"Total Allocated" the counter reports inside the step; the boundary is its value just after the
step. Then every allocation this thread made and had not freed at that moment is grouped by the ops
around it ("zerokit::all_gather > aten::empty", "autograd::engine::evaluate_function:
AccumulateGrad > aten::zeros", "gloo:all_gather > aten::cat"), biggest first.

The grouping uses this thread's allocation events only: a block freed on another thread (a gloo
worker letting go of a collective's buffer) has no free event here and still appears, so the
groups can sum to more than the counter (that difference is itself what
zerokit/core/collectives/gather.py [Note: frees at a fixed point] is about). Used for the fixes listed in the
docs/benchmarks.md (stage 3's grad shards and unit gathers, the step-boundary frees).

    python benchmarks/investigations/where_peak.py                                   # zerokit stage 3 and FSDP2, 2 ranks
    python benchmarks/investigations/where_peak.py --runs "zerokit stage 1" --repeat 4   # the boundary, run after run
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import speed as S  # noqa: E402  (benchmarks/speed.py: the runs and the counter)
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402

TOP = 12  # groups listed per moment
MEASURED = "zerokit.where_peak.measured"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=["zerokit stage 3", "torch FSDP2 fully_shard"],
                   help="speed.py run names (default: 'zerokit stage 3' 'torch FSDP2 fully_shard')")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="small", help="a zerokit preset, or a size of benchmarks/scaling.py (4M, ...)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--reduction", default="default", choices=["default", "ordered", "native"],
                   help="zerokit's reduction recipe (speed.py's --reduction; default: ordered on gloo)")
    p.add_argument("--bucket-numel", type=int, default=1 << 16, help="zerokit's (and DDP's) bucket; 0: the defaults")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--warmup", type=int, default=3, help="steps before the measured one (default 3)")
    p.add_argument("--repeat", type=int, default=1, help="fresh runs of each (the boundary can vary between them)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "where_peak")
    return p.parse_args(argv)


def _stack_name(node) -> str:
    try:
        return node.name
    except UnicodeDecodeError:  # a name the profiler could not decode
        return "?"


def _group(stack: tuple[str, ...]) -> str:
    """The ops that say what an allocation is for: zerokit's and torch's scopes, autograd nodes, the op."""
    keep = [s for s in stack if s != MEASURED and (s.startswith(("zerokit", "FSDP", "gloo", "aten::", "autograd::",
                                                                   "Optimizer")) or "Backward" in s)]
    return " > ".join(keep[-3:]) if keep else " > ".join(stack[-2:]) or "(no op)"


def rank_fn(rank: int, world_size: int, name: str, cfg: dict, warmup: int) -> dict | None:
    from torch.profiler import ProfilerActivity, profile, record_function

    device = torch.device("cpu")
    build = S._builder(name, cfg, world_size, device)
    batches = S._batches(cfg, rank, world_size, device, warmup + 1)
    with S._all_threads_counter() as all_threads, \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step, zero_grad, _ = build()
        for x, y in batches[:-1]:
            float(train_step(x, y).detach())
            zero_grad()
        with record_function(MEASURED):
            x, y = batches[-1]
            loss = train_step(x, y)
            zero_grad()
        float(loss.detach())
        S._probe(S.MARK)  # one allocation just after the step: the counter at the boundary
    if rank != 0:
        return None
    events = []  # (time, ptr, size, counter, stack, inside the measured step)

    def walk(node, stack, inside):
        name_ = _stack_name(node)
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            f = node.extra_fields
            events.append((node.start_time_ns, f.ptr, f.alloc_size, f.total_allocated, tuple(stack), inside))
        for child in node.children:
            walk(child, stack + [name_], inside or name_ == MEASURED)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, [], False)
    events.sort(key=lambda e: e[0])
    mark = next(i for i in range(len(events) - 1, -1, -1) if events[i][4] and events[i][4][-1] == S.MARK)
    first = next(i for i, e in enumerate(events) if e[5])
    live: dict[int, tuple[int, tuple]] = {}
    peak, peak_live, peak_at = -1, {}, ()
    for i, (_, ptr, size, counter, stack, inside) in enumerate(events[:mark]):
        if size > 0:
            live[ptr] = (size, stack)
        elif ptr in live:
            live.pop(ptr)
        if i >= first and inside and counter > peak:
            peak, peak_live, peak_at = counter, dict(live), stack
    boundary = events[mark][3] - events[mark][2]

    def groups(blocks):
        by = collections.Counter()
        for size, stack in blocks.values():
            by[_group(stack)] += size
        return [[g, b] for g, b in by.most_common(TOP)]

    return {"all_threads": all_threads, "peak_bytes": peak, "peak_at": " > ".join(s for s in peak_at[-4:] if s != MEASURED),
            "peak_groups": groups(peak_live), "boundary_bytes": boundary, "boundary_groups": groups(live)}


def markdown(record: dict) -> str:
    cfg = record["config"]
    lines = ["# What is live at a step's peak and at the boundary after it (rank 0)", ""]
    lines += provenance_lines(record)
    lines += [f"- setup: {cfg['nproc']} gloo ranks, model `{cfg['model']}`, {cfg['precision']}, AdamW, built as "
              f"benchmarks/speed.py builds each run; {record['warmup']} warm-up steps, then one measured",
              "- counter: c10's all-threads allocator total, counted from just before the run is built (as "
              "speed.py counts), MB = 10^6 bytes; groups: this thread's live allocations by the ops around "
              "them (blocks freed on another thread still appear, so groups can sum to more)", ""]
    for run in record["runs"]:
        lines += [f"## {run['name']} (run {run['repeat'] + 1})", "",
                  f"peak {run['peak_bytes'] / 1e6:.3f} MB at `{run['peak_at']}`; "
                  f"boundary {run['boundary_bytes'] / 1e6:.3f} MB", "",
                  "| MB at the peak | allocated by | | MB at the boundary | allocated by |", "|---:|---|---|---:|---|"]
        rows = max(len(run["peak_groups"]), len(run["boundary_groups"]))
        for k in range(rows):
            a = run["peak_groups"][k] if k < len(run["peak_groups"]) else ["", None]
            b = run["boundary_groups"][k] if k < len(run["boundary_groups"]) else ["", None]
            fa = f"{a[1] / 1e6:.3f}" if a[1] is not None else ""
            fb = f"{b[1] / 1e6:.3f}" if b[1] is not None else ""
            lines.append(f"| {fa} | `{a[0]}` | | {fb} | `{b[0]}` |" if a[0] or b[0] else "")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from zerokit.launch import run_ranks
    from zerokit.models import preset

    args = parse_args(argv)
    record = provenance(command_line(__file__, argv))  # before the run: the code that produced the numbers
    import scaling

    model = scaling.config(args.model) if args.model in scaling.SIZES else args.model
    block = model.block_size if args.model in scaling.SIZES else preset(args.model).block_size
    cfg = {"model": model, "block_size": block, "nproc": args.nproc, "steps": 1,
           "warmup": 0, "rounds": 1, "precision": args.precision, "batch_size": args.batch_size, "lr": 3e-3,
           "bucket_numel": args.bucket_numel or None, "seed": 0, "stages": [0, 1, 2, 3], "device": "cpu", "reduction": args.reduction, "peer_precision": "match",
           "peers": "default", "memory_steps": 1, "memory_warmup": args.warmup}
    runs = []
    for name in args.runs:
        for k in range(args.repeat):
            out = run_ranks(rank_fn, args.nproc, name, cfg, args.warmup, timeout_s=600)[0]
            runs.append({"name": name, "repeat": k, **out})
            print(f"{name} (run {k + 1}): peak {out['peak_bytes'] / 1e6:.3f} MB, "
                  f"boundary {out['boundary_bytes'] / 1e6:.3f} MB")
    record.update(config={**cfg, "model": args.model}, warmup=args.warmup, runs=runs)
    write_pair(args.out, record, markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
