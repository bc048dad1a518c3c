"""What stage 3's per-step agreement costs (core/collectives/recorder.py [Note: rank-dependent units]).

    python benchmarks/investigations/agree_on_step_cost.py            # 2 gloo ranks, tiny GPT, 200 pairs of steps
    python benchmarks/investigations/agree_on_step_cost.py --pairs 500

Before each optimizer step after the first, stage 3 all-gathers every rank's collective count and a
digest of the step's collectives (`Comm.agree_on_step`, one (2N,) int64 all-gather). Steps with and
without it alternate (ABBA order, so drift hits both arms alike) on one engine; the agreement's own
time is timed too. Its time includes the wait for the slower rank, which without it is paid at the
next forward's first gather instead, so the step's difference is the cost, not the agreement's time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import zerokit as zk
from zerokit.launch import run_ranks
from zerokit.models import Block, CharCorpus, build_model

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402


def _paired(rank, world_size, pairs):
    torch.manual_seed(0)
    model = build_model("tiny")
    engine = zk.shard(model, torch.optim.AdamW, stage=3, wrap=(Block,), lr=1e-3)
    agree = engine.comm.agree_on_step
    x, y = CharCorpus.load().batch(2, model.cfg.block_size, 0, rank, world_size)
    agreeing: list[float] = []

    def timed(what):
        start = time.perf_counter()
        agree(what)
        agreeing.append(time.perf_counter() - start)

    def step():
        _, loss = engine(x, y)
        loss.backward()
        engine.step()
        engine.zero_grad()

    for _ in range(10):  # warm-up; the first step is the checked one
        step()
    with_it, without = [], []
    for i in range(2 * pairs):
        on = (i % 2 == 0) == ((i // 2) % 2 == 0)  # ABBA
        engine.comm.agree_on_step = timed if on else (lambda what: None)
        start = time.perf_counter()
        step()
        (with_it if on else without).append(time.perf_counter() - start)
    engine.comm.agree_on_step = agree
    ms = lambda values, f: f(values) * 1e3  # noqa: E731
    return {"step with (median ms)": ms(with_it, statistics.median), "step without": ms(without, statistics.median),
            "step with (mean ms)": ms(with_it, statistics.mean), "step without (mean)": ms(without, statistics.mean),
            "agreement itself (median ms)": ms(agreeing, statistics.median)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "agree_on_step_cost",
                        help="results path without extension (.json and .md are written)")
    args = parser.parse_args(argv)
    record = provenance(command_line(__file__, argv))
    ranks = run_ranks(_paired, args.nproc, args.pairs, timeout_s=1800)
    lines = [f"| {rank} | " + " | ".join(f"{v:.3f}" for v in result.values()) + " |" for rank, result in enumerate(ranks)]
    table = ["| rank | " + " | ".join(ranks[0]) + " |", "|---" * (len(ranks[0]) + 1) + "|", *lines]
    print("\n".join(table))
    result = {**record, "nproc": args.nproc, "pairs": args.pairs, "ranks": ranks}
    write_pair(args.out, result, "\n".join([
        "# What stage 3's per-step agreement costs", "", *provenance_lines(result),
        f"- {args.nproc} gloo ranks, stage 3, tiny GPT, AdamW; {args.pairs} pairs of steps with and without "
        "`Comm.agree_on_step`, ABBA order on one engine; times per rank in ms", "", *table]) + "\n")


if __name__ == "__main__":
    main()
