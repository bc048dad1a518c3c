"""The optimizer's side of the contract, measured: every optimizer, scheduler, dtype and layout vs torch DDP.

    python benchmarks/parity.py            # ~2 minutes on 2 CPU cores; writes benchmarks/results/parity.{json,md}

Every row runs 2 gloo ranks, each stage beside torch DDP + the same torch optimizer on the same model (the
loops of the tests that assert these cells bitwise, so the table and the tests measure one thing):

- optimizers x stage 0-3: the largest |zerokit - DDP| over every weight after 4 steps, and which path zerokit
  took (flat shards, or whole parameters: zerokit/optim/whole_params.py) — tests/distributed/
  test_optimizer_classes.py;
- torch LR schedulers x stage 0-3 (AdamW, 6 steps) — tests/distributed/test_schedulers.py;
- float64 models and strided parameters (channels_last conv, a transposed parameter) x stage 0-3 —
  tests/distributed/test_dtypes_and_layouts.py;
- what the whole-parameter path costs beside the flat path, for one optimizer taken both ways (AdamW, and a
  subclass declaring `elementwise = False`) on the tiny GPT (zerokit/models.py): bytes each rank moves per
  step (core/collectives/comm.py's count), the most optimizer-state bytes a rank holds, and the step's wall time (median
  of 8 steps after 2 warm-up steps, both paths interleaved in one process pair).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "distributed"), str(REPO / "examples")]

import torch  # noqa: E402

import test_dtypes_and_layouts as layouts  # noqa: E402
import test_optimizer_classes as classes  # noqa: E402
import test_schedulers as schedulers  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402

STAGES = (0, 1, 2, 3)
TABLE_OPTIMIZERS = ("AdamW", "SGD nesterov", "Adam amsgrad", "Adafactor", "HF Adafactor", "MuonLike", "LambLike",
                    "LionLike", "DeclaredLion")


class WholeAdamW(torch.optim.AdamW):
    """AdamW taken down the whole-parameter path: the same update, so only the path's cost differs."""

    elementwise = False


def _cost_cases(rank: int, world_size: int) -> dict:
    import zerokit as zk
    from zerokit.models import Block, build_model, preset

    cfg = preset("tiny")
    out = {}
    engines = {}
    for stage in (1, 2, 3):
        for name, cls in (("flat", torch.optim.AdamW), ("whole", WholeAdamW)):
            engines[stage, name] = zk.shard(build_model(cfg, seed=0), cls, stage=stage, wrap=(Block,), lr=1e-3)
    times: dict = {key: [] for key in engines}
    for step in range(10):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g)
        for key, engine in engines.items():  # interleaved: the machine's load falls on both paths alike
            engine.comm.reset_stats()
            engine.zero_grad()
            _logits, loss = engine(x, x)
            loss.backward()
            start = time.perf_counter()
            engine.step()
            times[key].append(time.perf_counter() - start)
            moved = sum(engine.comm.stats_by_phase().get("step", {}).values())
            out.setdefault(key, {})["step_bytes"] = moved
    for key, engine in engines.items():
        out[key]["step_seconds"] = statistics.median(times[key][2:])
        out[key]["state_bytes"] = sum(t.numel() * t.element_size() for t in engine.optimizer.state_tensors())
    final = {key: engine.state_dict(full=True) for key, engine in engines.items()}
    for stage in (1, 2, 3):
        a, b = final[stage, "flat"], final[stage, "whole"]
        out[stage, "same bits"] = all(torch.equal(a[k], b[k]) for k in a)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "parity")
    args = p.parse_args(argv)
    prov = provenance(command_line(__file__, argv))
    with tempfile.TemporaryDirectory() as tmp:
        opt = run_ranks(classes._cases, 2, tmp, timeout_s=400)
    with tempfile.TemporaryDirectory() as tmp:
        sched = run_ranks(schedulers._cases, 2, tmp, timeout_s=400)
    with tempfile.TemporaryDirectory() as tmp:
        fp64 = run_ranks(layouts._fp64_cases, 2, tmp, timeout_s=280)
    with tempfile.TemporaryDirectory() as tmp:
        strided = run_ranks(layouts._layout_cases, 2, tmp, timeout_s=280)
    cost = run_ranks(_cost_cases, 2, timeout_s=400)

    record = {"provenance": prov, "optimizers": {}, "schedulers": {}, "dtypes_and_layouts": {}, "cost": {}}
    lines = ["# The optimizer's side of the contract: max |zerokit - DDP| per stage", "", *provenance_lines(prov), "",
             "2 gloo ranks; each cell is the largest |zerokit - DDP| over every weight and both ranks (0: the same "
             "bits), after 4 steps (schedulers: 6), on the models of the tests that assert these cells bitwise "
             "(benchmarks/parity.py's docstring names them).", "",
             "## Optimizers", "", "| optimizer | path | " + " | ".join(f"stage {s}" for s in STAGES) + " |",
             "|---|---|" + "---|" * len(STAGES)]
    for name in TABLE_OPTIMIZERS:
        diffs = [max(r[name, s][0] for r in opt) for s in STAGES]
        path = "whole parameters" if opt[0][name, 1][3] else "flat shards"
        record["optimizers"][name] = {"path": path, "max_diff": diffs}
        lines.append(f"| {name} | {path} | " + " | ".join(f"{d:.3g}" for d in diffs) + " |")
    lines += ["", "## LR schedulers (AdamW)", "", "| scheduler | " + " | ".join(f"stage {s}" for s in STAGES)
              + " | learning rates equal DDP's |", "|---|" + "---|" * len(STAGES) + "---|"]
    for name in schedulers.SCHEDULERS:
        diffs = [max(r[name, s][1] for r in sched) for s in STAGES]
        lrs = all(r[name, s][0] for r in sched for s in STAGES)
        record["schedulers"][name] = {"max_diff": diffs, "lrs_equal": lrs}
        lines.append(f"| {name} | " + " | ".join(f"{d:.3g}" for d in diffs) + f" | {'yes' if lrs else 'no'} |")
    lines += ["", "## Dtypes and layouts", "", "| model, optimizer | " + " | ".join(f"stage {s}" for s in STAGES)
              + " |", "|---|" + "---|" * len(STAGES)]
    rows = [(f"float64 odd model, {o}", [max(r[(o, s)]["max_diff"] for r in fp64) for s in STAGES])
            for o in ("adamw", "sgd")]
    rows += [(f"{family}, {o}", [max(r[(family, o, s)]["max_diff"] for r in strided) for s in STAGES])
             for family in ("channels_last", "transposed") for o in ("adamw", "sgd")]
    for name, diffs in rows:
        record["dtypes_and_layouts"][name] = diffs
        lines.append(f"| {name} | " + " | ".join(f"{d:.3g}" for d in diffs) + " |")
    lines += ["", "## What the whole-parameter path costs (tiny GPT, AdamW both ways)", "",
              "Per rank and step; the most over both ranks. Time: median of 8 steps, both paths interleaved, on a "
              "shared 2-core machine (a ratio, not an absolute).", "",
              "| stage | bytes moved, flat | whole | state bytes, flat | whole | step ms, flat | whole | whole / flat "
              "time | same bits |", "|---|---|---|---|---|---|---|---|---|"]
    for stage in (1, 2, 3):
        f = {k: max(r[stage, "flat"][k] for r in cost) for k in ("step_bytes", "state_bytes", "step_seconds")}
        w = {k: max(r[stage, "whole"][k] for r in cost) for k in ("step_bytes", "state_bytes", "step_seconds")}
        same = all(r[stage, "same bits"] for r in cost)
        record["cost"][stage] = {"flat": f, "whole": w, "same_bits": same}
        lines.append(f"| {stage} | {f['step_bytes']:,} | {w['step_bytes']:,} | {f['state_bytes']:,} | "
                     f"{w['state_bytes']:,} | {f['step_seconds'] * 1e3:.2f} | {w['step_seconds'] * 1e3:.2f} | "
                     f"{w['step_seconds'] / f['step_seconds']:.2f}x | {'yes' if same else 'no'} |")
    lines.append("")
    write_pair(args.out, record, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
