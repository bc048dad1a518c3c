"""`zerokit memory`: the lecture's table of per-rank model-state memory, one row per ZeRO stage.

    zerokit memory --params 7.5e9 --world-size 64

prints, for Ψ = 7.5e9 parameters on N = 64 ranks with bf16 + Adam, 120 / 31.4 / 16.6 / 1.9 GB
per rank for stages 0-3, split into params, grads, fp32 master params and optimizer states,
beside the formula each row evaluates. The numbers come from `zerokit.core.memory.estimate`
(exact integers, padded shards); GB means 10^9 bytes, as in the ZeRO paper and the lecture.
`--model NAME` takes Ψ from a models.py preset, and then also shows the stage-3 working set and
the activations of one sequence, which the stage rows leave out. `--json PATH` writes the bytes.
"""
from __future__ import annotations

import argparse
import json
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from zerokit.core.memory import (
    OPTIMIZER_STATE_BYTES,
    PRECISIONS,
    STAGE_NAMES,
    activation_bytes_estimate,
    estimate,
    per_rank_formula,
    zero3_working_set_bytes,
)

# Decimal units first: they are what `auto` chooses from, matching the lecture's GB.
UNITS: dict[str, int] = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
_COUNT_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_NUMBER = r"([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)"

CATEGORY_HEADERS = (("params", "params"), ("grads", "grads"), ("master_params", "master"),
                    ("optimizer_states", "opt states"))


def parse_count(text: str) -> int:
    """A parameter count: "7.5e9", "7_500_000_000", "7.5B", "350M", "125k" -> int (must be whole)."""
    match = re.fullmatch(_NUMBER + r"\s*([kKmMbBgGtT]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (try 7.5e9 or 7.5B)")
    try:
        value = Decimal(match.group(1).replace("_", "")) * _COUNT_SUFFIXES[match.group(2).upper()]
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r}") from None
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"parameter count {text!r} is not a whole number")
    return int(value)


def parse_bytes(text: str) -> int:
    """A memory size: "80" (GB, 10^9 bytes), "80GB", "80GiB", "512MiB" -> bytes."""
    match = re.fullmatch(_NUMBER + r"\s*([KMGT]i?B|B)?", text.strip(), flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (try 80, 80GB or 80GiB)")
    unit = match.group(2) or "GB"
    # Case-insensitive lookup, but keep the 'i' meaning binary: "gib" -> "GiB".
    canonical = {u.lower(): u for u in UNITS}[unit.lower()]
    value = Decimal(match.group(1).replace("_", "")) * UNITS[canonical]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"memory size must be positive, got {text!r}")
    return int(value)


def choose_unit(values: list[int]) -> str:
    """The largest decimal unit in which the smallest nonzero value still reads as >= 1."""
    smallest = min((v for v in values if v > 0), default=0)
    chosen = "B"
    for name in ("KB", "MB", "GB", "TB"):
        if smallest >= UNITS[name]:
            chosen = name
    return chosen


def format_in(num_bytes: int, unit: str) -> str:
    """num_bytes in `unit` with one decimal, the lecture's precision; plain integers for bytes."""
    if unit == "B":
        return f"{num_bytes:,}"
    return f"{num_bytes / UNITS[unit]:.1f}"


def stage_rows(num_params: int, world_size: int, precision: str, optimizer: str) -> list[dict[str, Any]]:
    """One dict per stage 0-3: stage, name, formula, bytes per category and total."""
    rows = []
    for stage in range(4):
        est = estimate(num_params, world_size, stage, precision, optimizer)
        row: dict[str, Any] = {"stage": stage, "name": STAGE_NAMES[stage],
                               "formula": per_rank_formula(stage, precision, optimizer)}
        row.update({key: getattr(est, key) for key, _ in CATEGORY_HEADERS})
        row["total"] = est.total
        rows.append(row)
    return rows


def render_table(rows: list[dict[str, Any]], unit: str) -> list[str]:
    headers = ["stage", "sharded", "formula"] + [h for _, h in CATEGORY_HEADERS] + ["total"]
    body = [[str(r["stage"]), r["name"], r["formula"]]
            + [format_in(r[key], unit) for key, _ in CATEGORY_HEADERS] + [format_in(r["total"], unit)]
            for r in rows]
    widths = [max(len(line[i]) for line in [headers] + body) for i in range(len(headers))]
    # Text columns left-aligned, numbers right-aligned.
    def fmt(line: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
    return [fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(line) for line in body]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=parse_count, metavar="P",
                      help="parameter count Ψ, e.g. 7.5e9 or 7.5B")
    what.add_argument("--model", metavar="NAME",
                      help="take Ψ from a models.py preset (tiny, small, gpt2-small, gpt2-medium, gpt2-xl)")
    parser.add_argument("--world-size", type=int, required=True, metavar="N", help="number of ranks N")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16",
                        help="fp32, or mixed precision bf16/fp16 with fp32 master weights (default bf16)")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATE_BYTES), default="adam",
                        help="decides the optimizer-state bytes per parameter (default adam)")
    parser.add_argument("--unit", choices=("auto",) + tuple(UNITS), default="auto",
                        help="unit of the table; auto picks a decimal unit (GB for the lecture's example)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the table, in bytes, as JSON")


def run(args: argparse.Namespace) -> int:
    if args.world_size < 1:
        raise SystemExit(f"zerokit memory: --world-size must be >= 1, got {args.world_size}")
    cfg = None
    if args.model is not None:
        from zerokit import models  # lazy: torch is only needed when a preset is asked for

        try:
            cfg = models.preset(args.model)
        except ValueError as err:
            raise SystemExit(f"zerokit memory: --model: {err}") from None
        num_params = models.num_params(cfg)
    else:
        num_params = args.params

    rows = stage_rows(num_params, args.world_size, args.precision, args.optimizer)
    unit = choose_unit([r["total"] for r in rows]) if args.unit == "auto" else args.unit
    source = f"model {args.model}, " if cfg is not None else ""
    print(f"Model states per rank: {source}Ψ = {num_params:,} parameters, N = {args.world_size} ranks, "
          f"{args.precision} + {args.optimizer}; {unit} = {UNITS[unit]:,} bytes")
    for line in render_table(rows, unit):
        print(line)
    print("Sharded categories hold ceil(Ψ/N) elements per rank (flat buffers padded to a multiple of N).")

    extras: dict[str, int] = {}
    if cfg is not None:
        extras["zero3_working_set"] = zero3_working_set_bytes(cfg, args.precision)
        extras["activations_per_sequence"] = activation_bytes_estimate(cfg, 1, args.precision)
        extras["activations_per_sequence_checkpointed"] = activation_bytes_estimate(
            cfg, 1, args.precision, checkpointing=True)
        print(f"Not in the rows above, for {args.model} at T = {cfg.block_size}:")
        print(f"  stage-3 working set (root unit + 2 blocks gathered, params + grads): "
              f"{format_in(extras['zero3_working_set'], unit)} {unit}")
        print(f"  activations of one sequence: {format_in(extras['activations_per_sequence'], unit)} {unit}, "
              f"with checkpointing {format_in(extras['activations_per_sequence_checkpointed'], unit)} {unit} "
              f"(per rank, times the per-rank batch size)")
    else:
        print("Not included: activations (grow with batch and sequence; see `zerokit plan`), the stage-3 "
              "working set, communication buffers.")

    if args.json is not None:
        record = {"num_params": num_params, "world_size": args.world_size, "precision": args.precision,
                  "optimizer": args.optimizer, "model": args.model, "unit": "bytes", "stages": rows, **extras}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
