"""What a reduce-scatter costs on gloo at 2 ranks: torch's, zerokit's N-row recipe and its exchange of halves.

    python benchmarks/reduce_scatter_cost.py             # three sizes, 2 gloo ranks
    python benchmarks/reduce_scatter_cost.py --numel 65536 1048576 --calls 200 --rounds 5

core/comm.py [Note: ordered reduction]: on gloo zerokit reduce-scatters by an all-to-all and a local
sum, never by gloo's own reduce-scatter (an all-reduce of the whole buffer inside). The general
recipe (`Comm._rows_reduce_scatter`) receives every rank's contribution to this rank's range, its own
included, as N rows of an (N·m,) buffer and sums them in rank order. At 2 ranks, `Comm.reduce_scatter`
exchanges halves instead (`Comm._exchange_halves`): each rank sends the peer's half, receives the
peer's part of its own half into an (m,) buffer and adds its own half to it, one addition per
element, the same bits.

One spawn of 2 ranks; for each input size (65,536 fp32 elements: the benchmarks' bucket cap;
111,840: one Block of the `small` model, a stage-3 unit), each way is timed as `--calls`
asynchronous reduce-scatters, each waited for before the next, `--rounds` times, alternating which
way goes first; a round counts at its slowest rank; medians. Every way reduces the same input into
its own output, and the outputs are checked equal bit for bit. "bytes allocated in flight": every
allocation torch.profiler sees during one reduce-scatter and its wait, on the issuing thread and on
gloo's worker threads, summed.

Writes benchmarks/results/reduce_scatter_cost.json and .md (command, date, commit, machine, versions).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from zerokit.core.comm import Comm  # noqa: E402
from zerokit.core.ordered import rows_reduce_scatter  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from _results import command_line, provenance, provenance_lines, write_pair  # noqa: E402  (benchmarks/_results.py)
from gather_cost import allocated_while, slowest_rank_median, timed_rounds  # noqa: E402

WORLD_SIZE = 2
WAYS = ("torch reduce_scatter_tensor", "zerokit N rows", "zerokit halves")


def _reduce_scatter(way: str, comm: Comm, output: torch.Tensor, input: torch.Tensor) -> None:
    if way == WAYS[0]:
        dist.reduce_scatter_tensor(output, input, async_op=True).wait()
    elif way == WAYS[1]:
        rows_reduce_scatter(comm, output, input, async_op=True).wait()
    else:
        comm.reduce_scatter(output, input, async_op=True).wait()


def cost_rank(rank: int, world_size: int, cfg: dict) -> dict:
    comm = Comm(ordered=True)
    out = {}
    for numel in cfg["numel"]:
        input = torch.randn(numel, generator=torch.Generator().manual_seed(rank))  # (B,) fp32
        outputs = {way: torch.full((numel // world_size,), float("nan")) for way in WAYS}  # (B/N,) each
        calls_of = {way: (lambda way=way: _reduce_scatter(way, comm, outputs[way], input)) for way in WAYS}
        for way in WAYS:  # warm
            for _ in range(3):
                calls_of[way]()
        same = all(torch.equal(outputs[way], outputs[WAYS[0]]) for way in WAYS)
        times = timed_rounds(calls_of, cfg["calls"], cfg["rounds"])
        dist.barrier()
        out[numel] = {"ms": times, "allocated": {way: allocated_while(calls_of[way]) for way in WAYS},
                      "same_bits": same, "input_bytes": input.numel() * input.element_size()}
    return out


def summarize(per_rank: list[dict]) -> list[dict]:
    rows = []
    for numel in per_rank[0]:
        ms = {way: slowest_rank_median([rank[numel]["ms"][way] for rank in per_rank]) for way in WAYS}
        rows.append({"numel": numel, "input_bytes": per_rank[0][numel]["input_bytes"], "ms": ms,
                     "halves_vs_rows": ms[WAYS[2]] / ms[WAYS[1]], "halves_vs_torch": ms[WAYS[2]] / ms[WAYS[0]],
                     "same_bits": all(rank[numel]["same_bits"] for rank in per_rank),
                     "allocated": {way: max(rank[numel]["allocated"][way] for rank in per_rank) for way in WAYS}})
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| input (fp32 elements) | torch ms | N rows ms | halves ms | halves / N rows | halves / torch "
             "| same bits | bytes allocated in flight: torch | N rows | halves |",
             "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        ms, alloc = r["ms"], r["allocated"]
        lines.append(f"| {r['numel']:,} | {ms[WAYS[0]]:.3f} | {ms[WAYS[1]]:.3f} | {ms[WAYS[2]]:.3f} | "
                     f"{r['halves_vs_rows']:.2f} | {r['halves_vs_torch']:.2f} | {'yes' if r['same_bits'] else 'NO'} | "
                     f"{alloc[WAYS[0]]:,} | {alloc[WAYS[1]]:,} | {alloc[WAYS[2]]:,} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, nargs="+", default=[65536, 111840, 1048576],
                   help="input sizes in fp32 elements (rounded down to a multiple of 2)")
    p.add_argument("--calls", type=int, default=200, help="reduce-scatters per timed round")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of each way, alternating which goes first")
    p.add_argument("--timeout", type=float, default=600, help="deadline for the spawn (s)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "reduce_scatter_cost",
                   help="results path without extension (.json and .md are written)")
    args = p.parse_args(argv)
    record = provenance(command_line(__file__, argv))
    start = time.perf_counter()
    cfg = {"numel": [k - k % WORLD_SIZE for k in args.numel], "calls": args.calls, "rounds": args.rounds}
    rows = summarize(run_ranks(cost_rank, WORLD_SIZE, cfg, timeout_s=args.timeout))
    result = {**record, "config": {"world_size": WORLD_SIZE, "calls": args.calls, "rounds": args.rounds},
              "seconds": round(time.perf_counter() - start, 1), "rows": rows}
    print("\n".join(table(rows)))
    write_pair(args.out, result, _markdown(result))
    return 0 if all(r["same_bits"] for r in rows) else 1


def _markdown(r: dict) -> str:
    c = r["config"]
    return "\n".join([
        "# What a reduce-scatter costs on gloo at 2 ranks", "", *provenance_lines(r),
        f"- {c['world_size']} gloo ranks; each way: {c['rounds']} rounds of {c['calls']} asynchronous reduce-scatters "
        "(each waited for before the next), rounds alternating which way goes first; a round counts at its slowest "
        "rank; medians of the rounds",
        "", *table(r["rows"]), "",
        "\"torch\": `dist.reduce_scatter_tensor(output, input, async_op=True).wait()` (gloo: an all-reduce of the "
        "whole input inside). \"N rows\": `Comm._rows_reduce_scatter`, zerokit's recipe at 3+ ranks: an all-to-all "
        "of the whole input into an (N·m,) buffer, every rank's contribution to this rank's range as a row, its own "
        "included, summed in rank order. \"halves\": what `Comm.reduce_scatter` does at 2 ranks "
        "(`Comm._exchange_halves`): an all-to-all with empty splits for the rank itself, the peer's half out, the "
        "peer's part of this rank's half into an (m,) buffer, added to the own half (core/comm.py [Note: ordered "
        "reduction]). \"same bits\": every way's output equal bit for bit on both ranks (at 2 ranks each is one "
        "addition per element). \"Bytes allocated in flight\": every allocation torch.profiler records during one "
        "reduce-scatter and its wait (issuing thread and gloo's workers), summed."]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
