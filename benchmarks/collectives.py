"""What an all-gather costs on gloo: torch's all-gather beside zerokit's (into the output's rows, in place).

    python benchmarks/collectives.py                   # 2, 4 and 8 gloo ranks, three sizes, and several outputs at once
    python benchmarks/collectives.py --nproc 2 4 8 --numel 15744 111840 1048576 --calls 200 --rounds 5 \
        --many 73728 73728 73728 73728 73728 73728 5184 15456

core/collectives/gather.py [Note: gloo's all-gather temporary]: gloo's all-gather receives into a buffer of its
own, the output's size, for as long as the collective runs, and torch's wrapper allocates and frees
another as the gather is issued. zerokit gathers on gloo (when it does not coalesce several outputs
into one collective) into the output's rows in place: N broadcasts, rank r's from row r of the output,
or at 2 ranks one all-to-all (this rank's row to the peer, the peer's into its row). At 2 ranks the
broadcasts, zerokit's way before, are timed beside it ("zerokit, N broadcasts": the same Comm with
core/collectives/gather.py `fill_rows_from_ranks` issuing broadcasts at every world size); at 3+ ranks they are zerokit's way.

Several outputs at once (`--many`: by default the 8 buckets stages 1 and 2 gather after the step for the
`small` model, 463,008 elements): torch's coalesced all-gather (gloo concatenates the inputs, gathers
into one buffer of every output's size, copies out), which zerokit used before, beside zerokit's
packed gather (`Comm.all_gather_many`: the inputs copied into this rank's row of one staging buffer,
the other rows filled from their ranks as above, the rows copied out), the inputs being each rank's own
rows of the outputs as at stages 1-2; at 2 ranks also packed with broadcasts, as before.

For each world size, one spawn; for each output size (111,840 elements: one Block of the `small`
model, a stage-3 unit), each way is timed as `--calls` asynchronous gathers, each waited for before
the next, `--rounds` times, alternating which way goes first; a round counts at its slowest rank;
medians. "bytes allocated in flight": every allocation torch.profiler sees during one gather and its
wait, on the issuing thread and on gloo's worker threads (they run with the issuer's profiler state),
summed: what the gather adds to the allocator while it is in flight, beside the output itself.

Writes benchmarks/results/gather_cost.json and .md (command, date, commit, machine, versions).

Reduce-scatter mode (`--reduce-scatter`): What a reduce-scatter costs on gloo at 2 ranks: torch's, zerokit's N-row recipe and its exchange of halves.

    python benchmarks/collectives.py --reduce-scatter             # three sizes, 2 gloo ranks
    python benchmarks/collectives.py --reduce-scatter --numel 65536 1048576 --calls 200 --rounds 5

core/collectives/ordered.py [Note: ordered reduction]: on gloo zerokit reduce-scatters by an all-to-all and a local
sum, never by gloo's own reduce-scatter (an all-reduce of the whole buffer inside). The general
recipe (`core/collectives/ordered.py`'s `rows_reduce_scatter`) receives every rank's contribution to this rank's range, its own
included, as N rows of an (N·m,) buffer and sums them in rank order. At 2 ranks, `Comm.reduce_scatter`
exchanges halves instead (`core/collectives/ordered.py`'s `exchange_halves`): each rank sends the peer's half, receives the
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
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import zerokit.core.collectives.gather as gather  # noqa: E402
from zerokit.core.collectives.comm import Comm  # noqa: E402
from zerokit.core.collectives.ordered import rows_reduce_scatter  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402

WAYS = ("torch all_gather_into_tensor", "zerokit Comm.all_gather", "zerokit, N broadcasts")
MANY_WAYS = ("torch coalesced all-gather", "zerokit Comm.all_gather_many (packed)", "zerokit packed, N broadcasts")
BEFORE = (WAYS[2], MANY_WAYS[2])  # timed at 2 ranks only: at 3+ they are zerokit's way
OUTPUT, OUTPUTS = "output (fp32 elements)", "outputs (bytes in all)"  # the tables' first column


def _broadcasts(comm: Comm, rows: list[torch.Tensor]) -> list:
    """Every row filled by a broadcast from its rank, at every world size: zerokit's way at 2 ranks before."""
    return [dist.broadcast(row, src=comm._global_rank(r), group=comm.group, async_op=True)
            for r, row in enumerate(rows)]


def _comms(world_size: int) -> tuple[Comm, Comm | None]:
    """zerokit's Comm, and at 2 ranks one whose gathers fill rows by broadcasts (None at 3+ ranks)."""
    comm = Comm()
    if world_size != 2:
        return comm, None
    before = Comm()
    fill = gather.fill_rows_from_ranks
    gather.fill_rows_from_ranks = lambda c, rows: _broadcasts(c, rows) if c is before else fill(c, rows)
    return comm, before


def _gather(way: str, comm: Comm, output: torch.Tensor, shard: torch.Tensor) -> None:
    if way == WAYS[0]:
        dist.all_gather_into_tensor(output, shard, async_op=True).wait()
    else:
        comm.all_gather(output, shard, async_op=True).wait()


def allocated_while(fn) -> int:
    """Bytes of every allocation torch.profiler records while `fn()` runs, summed: the issuing thread's and
    gloo's worker threads' (they run a collective with the issuer's profiler state)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    total = 0

    def walk(node):
        nonlocal total
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation" and node.extra_fields.alloc_size > 0:
            total += node.extra_fields.alloc_size
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return total


def timed_rounds(calls_of: dict, calls: int, rounds: int) -> dict[str, list[float]]:
    """ms per call of each way (`calls_of`: name -> a no-argument call), `rounds` rounds of `calls` calls each,
    every round running every way after a barrier, alternating which way goes first."""
    ways = list(calls_of)
    times = {way: [] for way in ways}
    for r in range(rounds):
        for way in (ways if r % 2 == 0 else ways[::-1]):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                calls_of[way]()
            times[way].append(1e3 * (time.perf_counter() - start) / calls)
    return times


def slowest_rank_median(per_rank_ms: list[list[float]]) -> float:
    """The median over rounds of each round's slowest rank (per_rank_ms[rank][round])."""
    return statistics.median(max(ranks) for ranks in zip(*per_rank_ms))


def cost_rank(rank: int, world_size: int, cfg: dict) -> dict:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename, torch 2.13
    comm, before = _comms(world_size)
    ways = WAYS if before else WAYS[:2]
    out = {}
    for numel in cfg["numel"]:
        shard = torch.randn(numel // world_size, generator=torch.Generator().manual_seed(rank))
        output = torch.empty(shard.numel() * world_size)
        calls_of = {way: (lambda way=way: _gather(way, before if way in BEFORE else comm, output, shard))
                    for way in ways}
        expected = None
        for way in ways:  # right rows, and warm
            output.fill_(float("nan"))
            for _ in range(3):
                calls_of[way]()
            if expected is None:
                expected = output.clone()
            assert torch.equal(output, expected), way
        times = timed_rounds(calls_of, cfg["calls"], cfg["rounds"])
        dist.barrier()
        out[numel] = {"ms": times, "allocated": {way: allocated_while(calls_of[way]) for way in ways},
                      "output_bytes": output.numel() * output.element_size()}
    if cfg["many"]:
        out["many"] = _many(rank, world_size, comm, before, cfg)
    return out


def _many(rank: int, world_size: int, comm: Comm, before: Comm | None, cfg: dict) -> dict:
    """Several outputs gathered at once, each input this rank's own row of its output: every way timed and
    its in-flight allocations summed, the outputs checked equal."""
    g = torch.Generator().manual_seed(rank)
    outputs = [torch.empty(numel) for numel in cfg["many"]]
    inputs = [output.view(world_size, -1)[rank] for output in outputs]
    for shard in inputs:
        shard.copy_(torch.randn(shard.numel(), generator=g))
    calls_of = {MANY_WAYS[0]: lambda: gather.coalesced_gather(comm, outputs, inputs).wait(),
                MANY_WAYS[1]: lambda: comm.all_gather_many(outputs, inputs).wait()}
    if before is not None:
        calls_of[MANY_WAYS[2]] = lambda: before.all_gather_many(outputs, inputs).wait()
    results = []
    for way in calls_of:
        for o in outputs:  # every other rank's row is written by the gather
            for r in range(world_size):
                if r != rank:
                    o.view(world_size, -1)[r].fill_(float("nan"))
        for _ in range(3):
            calls_of[way]()
        results.append(torch.cat(outputs))
    assert all(torch.equal(results[0], other) for other in results[1:])
    times = timed_rounds(calls_of, cfg["calls"], cfg["rounds"])
    dist.barrier()
    return {"ms": times, "allocated": {way: allocated_while(call) for way, call in calls_of.items()},
            "output_bytes": sum(output.numel() * output.element_size() for output in outputs),
            "outputs": len(outputs)}


def summarize(measured: list[dict], world_size: int) -> dict:
    """One row from every rank's measurement of the same thing (`ms` and `allocated`, way -> ...)."""
    ways = list(measured[0]["ms"])
    ms = {way: slowest_rank_median([m["ms"][way] for m in measured]) for way in ways}
    return {"world_size": world_size, "output_bytes": measured[0]["output_bytes"], "ms": ms,
            "ratio": ms[ways[1]] / ms[ways[0]],
            "allocated": {way: max(m["allocated"][way] for m in measured) for way in ways}}


def table(rows: list[dict], ways: tuple[str, ...], first: str) -> list[str]:
    """`first`: the first column's heading, from each row's "what"."""
    torch_way, zk, before = ways
    lines = [f"| ranks | {first} | torch ms | zerokit ms | ratio (zk / torch) | zerokit by broadcasts ms "
             "| bytes allocated in flight, torch | zerokit |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ms = r["ms"]
        by_broadcasts = f"{ms[before]:.3f}" if before in ms else "(zerokit's way)"
        lines.append(f"| {r['world_size']} | {r['what']} | {ms[torch_way]:.3f} | {ms[zk]:.3f} | {r['ratio']:.2f} | "
                     f"{by_broadcasts} | {r['allocated'][torch_way]:,} | {r['allocated'][zk]:,} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--reduce-scatter" in argv:
        return reduce_scatter_main(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4, 8], help="gloo world sizes, one spawn each")
    p.add_argument("--numel", type=int, nargs="+", default=[15744, 111840, 1048576],
                   help="output sizes in fp32 elements (rounded down to a multiple of the world size)")
    p.add_argument("--many", type=int, nargs="*", default=[73728] * 6 + [5184, 15456],
                   help="output sizes gathered together (each rounded down to a multiple of the world size); none: "
                        "skip that part")
    p.add_argument("--calls", type=int, default=200, help="gathers per timed round")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of each way, alternating which goes first")
    p.add_argument("--timeout", type=float, default=600, help="deadline for each spawn (s)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gather_cost",
                   help="results path without extension (.json and .md are written)")
    args = p.parse_args(argv)
    record = provenance(command_line(__file__, argv))
    start = time.perf_counter()
    rows, many = [], []
    for n in args.nproc:
        cfg = {"numel": [k - k % n for k in args.numel], "calls": args.calls, "rounds": args.rounds,
               "many": [k - k % n for k in args.many]}
        per_rank = run_ranks(cost_rank, n, cfg, timeout_s=args.timeout)
        for numel in cfg["numel"]:
            rows.append({**summarize([rank[numel] for rank in per_rank], n), "numel": numel, "what": f"{numel:,}"})
        if args.many:
            row = summarize([rank["many"] for rank in per_rank], n)
            many.append({**row, "outputs": per_rank[0]["many"]["outputs"],
                         "what": f"{per_rank[0]['many']['outputs']} ({row['output_bytes']:,})"})
    result = {**record, "config": {"calls": args.calls, "rounds": args.rounds, "many": args.many},
              "seconds": round(time.perf_counter() - start, 1), "rows": rows, "many": many}
    print("\n".join(table(rows, WAYS, OUTPUT) + ([""] + table(many, MANY_WAYS, OUTPUTS) if many else [])))
    write_pair(args.out, result, _markdown(result))
    return 0


def _markdown(r: dict) -> str:
    c = r["config"]
    return "\n".join([
        "# What an all-gather costs on gloo", "", *provenance_lines(r),
        f"- each way: {c['rounds']} rounds of {c['calls']} asynchronous gathers (each waited for before the next), "
        "rounds alternating which way goes first; a round counts at its slowest rank; medians of the rounds",
        "", *table(r["rows"], WAYS, OUTPUT), "",
        "\"torch\": `dist.all_gather_into_tensor(output, shard, async_op=True).wait()`. \"zerokit\": "
        "`Comm.all_gather(output, shard, async_op=True).wait()`, which on gloo fills the output's rows in place: "
        "at 2 ranks one all-to-all (this rank's row to the peer, the peer's into its row), at 3+ ranks N "
        "broadcasts, rank r's from row r (core/collectives/gather.py [Note: gloo's all-gather temporary]). \"zerokit by "
        "broadcasts\": the same Comm issuing N broadcasts at 2 ranks too, zerokit's way there before. All give "
        "the same bits. \"Bytes allocated in flight\": every allocation torch.profiler records during one gather "
        "and its wait (issuing thread and gloo's workers), summed: torch's is two buffers of the output's size "
        "(the wrapper's, freed at once, and gloo's receive buffer, live while the gather runs); zerokit's write "
        "in place.",
        *([] if not r.get("many") else [
            "", f"## Several outputs at once ({len(c['many'])}: {', '.join(f'{k:,}' for k in c['many'])} "
            "fp32 elements)",
            "", *table(r["many"], MANY_WAYS, OUTPUTS), "",
            "\"torch coalesced\": the outputs' `all_gather_into_tensor`s in one "
            "`torch.distributed._coalescing_manager` "
            "(what zerokit's stages 1-2 used after the step before): gloo concatenates the inputs, gathers into one "
            "buffer of every output's size and copies the rows out. \"zerokit packed\": `Comm.all_gather_many` (core/"
            "gather.py [Note: gloo's all-gather temporary]): the inputs copied into this rank's row of one (N, Σ m) "
            "staging buffer, the other rows filled from their ranks (at 2 ranks one all-to-all; \"by broadcasts\": one "
            "broadcast from each rank, as before), the rows copied out, the staging freed. Each input is "
            "this rank's own row of its output, as at stages 1-2; both give the same bits (checked in the "
            "run)."])]) + "\n"


# ----------------------------------------------------------------------------- --reduce-scatter
RS_WORLD_SIZE = 2
RS_WAYS = ("torch reduce_scatter_tensor", "zerokit N rows", "zerokit halves")


def _rs_reduce_scatter(way: str, comm: Comm, output: torch.Tensor, input: torch.Tensor) -> None:
    if way == RS_WAYS[0]:
        dist.reduce_scatter_tensor(output, input, async_op=True).wait()
    elif way == RS_WAYS[1]:
        rows_reduce_scatter(comm, output, input, async_op=True).wait()
    else:
        comm.reduce_scatter(output, input, async_op=True).wait()


def rs_cost_rank(rank: int, world_size: int, cfg: dict) -> dict:
    comm = Comm(ordered=True)
    out = {}
    for numel in cfg["numel"]:
        input = torch.randn(numel, generator=torch.Generator().manual_seed(rank))  # (B,) fp32
        outputs = {way: torch.full((numel // world_size,), float("nan")) for way in RS_WAYS}  # (B/N,) each
        calls_of = {way: (lambda way=way: _rs_reduce_scatter(way, comm, outputs[way], input)) for way in RS_WAYS}
        for way in RS_WAYS:  # warm
            for _ in range(3):
                calls_of[way]()
        same = all(torch.equal(outputs[way], outputs[RS_WAYS[0]]) for way in RS_WAYS)
        times = timed_rounds(calls_of, cfg["calls"], cfg["rounds"])
        dist.barrier()
        out[numel] = {"ms": times, "allocated": {way: allocated_while(calls_of[way]) for way in RS_WAYS},
                      "same_bits": same, "input_bytes": input.numel() * input.element_size()}
    return out


def rs_summarize(per_rank: list[dict]) -> list[dict]:
    rows = []
    for numel in per_rank[0]:
        ms = {way: slowest_rank_median([rank[numel]["ms"][way] for rank in per_rank]) for way in RS_WAYS}
        rows.append({"numel": numel, "input_bytes": per_rank[0][numel]["input_bytes"], "ms": ms,
                     "halves_vs_rows": ms[RS_WAYS[2]] / ms[RS_WAYS[1]], "halves_vs_torch": ms[RS_WAYS[2]] / ms[RS_WAYS[0]],
                     "same_bits": all(rank[numel]["same_bits"] for rank in per_rank),
                     "allocated": {way: max(rank[numel]["allocated"][way] for rank in per_rank) for way in RS_WAYS}})
    return rows


def rs_table(rows: list[dict]) -> list[str]:
    lines = ["| input (fp32 elements) | torch ms | N rows ms | halves ms | halves / N rows | halves / torch "
             "| same bits | bytes allocated in flight: torch | N rows | halves |",
             "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        ms, alloc = r["ms"], r["allocated"]
        lines.append(f"| {r['numel']:,} | {ms[RS_WAYS[0]]:.3f} | {ms[RS_WAYS[1]]:.3f} | {ms[RS_WAYS[2]]:.3f} | "
                     f"{r['halves_vs_rows']:.2f} | {r['halves_vs_torch']:.2f} | {'yes' if r['same_bits'] else 'NO'} | "
                     f"{alloc[RS_WAYS[0]]:,} | {alloc[RS_WAYS[1]]:,} | {alloc[RS_WAYS[2]]:,} |")
    return lines


def reduce_scatter_main(argv: list[str]) -> int:
    """--reduce-scatter: see the module docstring's "Reduce-scatter mode"."""
    p = argparse.ArgumentParser(description="zerokit's reduce-scatter beside torch's, time and bytes allocated")
    p.add_argument("--reduce-scatter", action="store_true", required=True, help="this mode")
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
    cfg = {"numel": [k - k % RS_WORLD_SIZE for k in args.numel], "calls": args.calls, "rounds": args.rounds}
    rows = rs_summarize(run_ranks(rs_cost_rank, RS_WORLD_SIZE, cfg, timeout_s=args.timeout))
    result = {**record, "config": {"world_size": RS_WORLD_SIZE, "calls": args.calls, "rounds": args.rounds},
              "seconds": round(time.perf_counter() - start, 1), "rows": rows}
    print("\n".join(rs_table(rows)))
    write_pair(args.out, result, _rs_markdown(result))
    return 0 if all(r["same_bits"] for r in rows) else 1


def _rs_markdown(r: dict) -> str:
    c = r["config"]
    return "\n".join([
        "# What a reduce-scatter costs on gloo at 2 ranks", "", *provenance_lines(r),
        f"- {c['world_size']} gloo ranks; each way: {c['rounds']} rounds of {c['calls']} asynchronous reduce-scatters "
        "(each waited for before the next), rounds alternating which way goes first; a round counts at its slowest "
        "rank; medians of the rounds",
        "", *rs_table(r["rows"]), "",
        "\"torch\": `dist.reduce_scatter_tensor(output, input, async_op=True).wait()` (gloo: an all-reduce of the "
        "whole input inside). \"N rows\": `core/collectives/ordered.py`'s `rows_reduce_scatter`, zerokit's recipe at 3+ ranks: an all-to-all "
        "of the whole input into an (N·m,) buffer, every rank's contribution to this rank's range as a row, its own "
        "included, summed in rank order. \"halves\": what `Comm.reduce_scatter` does at 2 ranks "
        "(`core/collectives/ordered.py`'s `exchange_halves`): an all-to-all with empty splits for the rank itself, the peer's half out, the "
        "peer's part of this rank's half into an (m,) buffer, added to the own half (core/collectives/ordered.py [Note: ordered "
        "reduction]). \"same bits\": every way's output equal bit for bit on both ranks (at 2 ranks each is one "
        "addition per element). \"Bytes allocated in flight\": every allocation torch.profiler records during one "
        "reduce-scatter and its wait (issuing thread and gloo's workers), summed."]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
