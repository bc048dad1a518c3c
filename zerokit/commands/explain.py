"""`zerokit explain`: where every parameter lands — flat buffer, offset, rank(s), padding.

    zerokit explain --model tiny --world-size 4 --stage 3

The layout is not re-derived here: the real engine is built, for the real model structure,
on PyTorch's "meta" device (shapes and dtypes, no storage, so even gpt2-xl costs nothing)
as rank 0 of a simulated world (`Comm(simulate=Simulated(0, N))`, no process group). Its
`flat_params` come from core/params/flat_param.py `build_flat_params` (buckets of at most
`bucket_numel` elements at stages 0 and 2, closing once they reach it at stage 1, one group
per ZeRO-3 unit at stage 3), and each
buffer's `FlatLayout` (core/params/partition.py) answers which rank owns which elements:

    flat buffer k (padded_numel,)   | p0 ...... | p1 .. | p2 ........ | pad |
    rank r owns                     [r * shard_numel, (r + 1) * shard_numel)

For each parameter: its names (tied ones share one entry), shape, offset in its buffer, and
the ranks whose shard it overlaps, with the first rank's element range and shard offset. For
each buffer: extent, padding, shard size, the unit it belongs to (stage 3), its optimizer
overrides. At the end: bytes per rank by category, summed over the padded buffers of this
layout under this stage's sharding, beside `estimate()`; and what an optimizer that needs whole
parameters adds to each step at this layout (optim/whole_params.py `step_cost`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from zerokit import bench
from zerokit.core.params.materialize import layout_only
from zerokit.core.accounting.estimate import OPTIMIZER_STATE_BYTES, PRECISIONS, bytes_per_param, estimate
from zerokit.optim.whole_params import step_cost


def layout_report(model_name: str, world_size: int, stage: int, bucket_numel: int | None = None,
                  precision: str = "fp32", optimizer: str = "adam", no_decay: bool = False,
                  lora: bool = False) -> dict[str, Any]:
    """The layout of preset `model_name` at `stage` on `world_size` ranks, as plain data (see module docstring)."""
    import zerokit as zk
    from zerokit.models import GPT, Block, preset

    cfg = preset(model_name)
    with torch.device("meta"):  # shapes only: nothing is allocated, whatever the model size
        model = GPT(cfg)
    if lora:
        zk.lora.inject(model, targets=("q", "v"), rank=8, alpha=1.0)
    kwargs = {} if bucket_numel is None else {"bucket_numel": bucket_numel}
    with layout_only():  # the layout alone: the meta-built model stays on meta (core/params/materialize.py)
        engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, wrap=(Block,), lr=1e-3,
                          comm=zk.Comm(simulate=zk.Simulated(0, world_size)),
                          param_groups=bench.no_decay if no_decay else None, **kwargs)
    unit_of = {}
    units = []
    for unit in getattr(engine, "units", None) or []:
        units.append({"index": unit.index, "name": unit.name or "(root)",
                      "flat_indices": [fp.index for fp in unit.flat_params]})
        for fp in unit.flat_params:
            unit_of[fp.index] = unit.name or "(root)"

    flats = []
    for fp in engine.flat_params:
        layout = fp.layout
        pieces_by_param: dict[int, list[dict]] = {}
        for r in range(world_size):
            for piece in layout.pieces(r):
                pieces_by_param.setdefault(piece.index, []).append(
                    {"rank": r, "start": piece.start, "end": piece.end, "shard_offset": piece.shard_offset})
        params = [{"names": list(names), "shape": list(shape), "numel": numel, "offset": offset,
                   "pieces": pieces_by_param.get(i, [])}
                  for i, (names, shape, numel, offset) in enumerate(zip(fp.names, layout.shapes, layout.numels,
                                                                       layout.offsets))]
        flats.append({"index": fp.index, "unit": unit_of.get(fp.index), "dtype": str(fp.dtype).replace("torch.", ""),
                      "requires_grad": fp.requires_grad, "options": dict(fp.options), "numel": layout.numel,
                      "padded_numel": layout.padded_numel, "padding": layout.padding,
                      "shard_numel": layout.shard_numel, "params": params})

    num_params = sum(f["numel"] for f in flats)
    trainable = sum(f["numel"] for f in flats if f["requires_grad"])
    return {"model": model_name, "world_size": world_size, "stage": stage, "precision": precision,
            "optimizer": optimizer,
            "bucket_numel": bucket_numel or zk.default_bucket_numel(trainable, stage, world_size),
            "num_params": num_params, "trainable_params": trainable, "units": units, "flat_params": flats,
            "bytes_per_rank": layout_bytes_per_rank(flats, stage, precision, optimizer),
            # an optimizer that needs whole parameters (Adafactor, Muon, LAMB: optim/whole_params.py) at this layout
            "whole_parameter_step": step_cost([fp.layout for fp in engine.flat_params if fp.requires_grad],
                                              world_size if stage > 0 else 1, master_bytes=4),
            "estimate": estimate(num_params, world_size, stage, precision, optimizer,
                                 trainable_params=trainable).as_dict()}


def layout_bytes_per_rank(flats: list[dict], stage: int, precision: str, optimizer: str) -> dict[str, int]:
    """Model-state bytes one rank holds for these padded buffers: a category sharded at `stage` costs shard_numel."""
    per = bytes_per_param(precision, optimizer)
    out = {"params": 0, "grads": 0, "master_params": 0, "optimizer_states": 0}
    for f in flats:
        whole, shard = f["padded_numel"], f["shard_numel"]
        out["params"] += per.params * (shard if stage >= 3 else whole)
        if f["requires_grad"]:
            out["grads"] += per.grads * (shard if stage >= 2 else whole)
            states = shard if stage >= 1 else whole
            out["master_params"] += per.master_params * states
            out["optimizer_states"] += per.optimizer_states * states
    return out


def _ranks_text(pieces: list[dict], world_size: int) -> str:
    if not pieces:
        return "-"
    first, last = pieces[0], pieces[-1]
    ranks = f"rank {first['rank']}" if first is last else f"ranks {first['rank']}-{last['rank']}"
    if world_size == 1:
        return ranks
    head = f"r{first['rank']} [{first['start']}, {first['end']}) @{first['shard_offset']}"
    if first is last:
        return f"{ranks}: {head}"
    return f"{ranks}: {head} ... r{last['rank']} [{last['start']}, {last['end']}) @{last['shard_offset']}"


def render(report: dict) -> list[str]:
    n = report["world_size"]
    lines = [f"model {report['model']}: Ψ = {report['num_params']:,} ({report['trainable_params']:,} trainable), "
             f"N = {n}, stage {report['stage']}, {report['precision']}, bucket_numel = {report['bucket_numel']:,}; "
             f"{len(report['flat_params'])} flat buffers"
             + (f" in {len(report['units'])} units" if report["units"] else "")]
    lines.append("  per parameter: offset in its buffer; ranks whose shard it overlaps, "
                 "r<rank> [param elements) @shard offset")
    current_unit = object()
    for f in report["flat_params"]:
        if f["unit"] != current_unit and f["unit"] is not None:
            current_unit = f["unit"]
            lines.append(f"unit {current_unit}")
        opts = ", ".join(f"{k}={v}" for k, v in f["options"].items())
        where = f", on rank {n - 1}" if f["padding"] else ""
        lines.append(f"  flat {f['index']}: {f['dtype']} {'trainable' if f['requires_grad'] else 'frozen'}"
                     f"{' (' + opts + ')' if opts else ''}, {len(f['params'])} params, numel {f['numel']:,}, "
                     f"padded {f['padded_numel']:,} (+{f['padding']} padding{where}), "
                     f"shard {f['shard_numel']:,} per rank")
        width = max(len(", ".join(p["names"])) for p in f["params"])
        for p in f["params"]:
            shape = "x".join(str(d) for d in p["shape"]) or "scalar"
            lines.append(f"    {', '.join(p['names']):<{width}}  {shape:>11}  {p['numel']:>11,}  "
                         f"offset {p['offset']:>11,}  {_ranks_text(p['pieces'], n)}")
    layout_bytes, est = report["bytes_per_rank"], report["estimate"]
    lines.append(f"bytes per rank (stage {report['stage']}, {report['precision']} + {report['optimizer']}): "
                 "this layout (padded) / estimate()")
    for c in ("params", "grads", "master_params", "optimizer_states"):
        lines.append(f"  {c:<17} {layout_bytes[c]:>16,} / {est[c]:>16,}")
    total_l, total_e = sum(layout_bytes.values()), sum(est[c] for c in layout_bytes)
    lines.append(f"  {'total':<17} {total_l:>16,} / {total_e:>16,}")
    whole = report["whole_parameter_step"]
    lines.append("an optimizer that needs whole parameters (Adafactor, Muon, LAMB, any class not known elementwise: "
                 "optim/whole_params.py), per step and rank, beyond the flat path:")
    if whole["buffers_gathered"] == 0:
        lines.append("  nothing: every parameter lies inside one rank's shard" if report["stage"] > 0 else
                     "  nothing: at stage 0 every rank steps every parameter, whole")
    else:
        lines.append(f"  {whole['buffers_gathered']} of {whole['buffers']} buffers hold a parameter that crosses a "
                     f"shard boundary ({whole['straddlers']} such parameters): all-gathers "
                     f"{whole['all_gather_bytes']:,} B + broadcasts {whole['broadcast_bytes']:,} B (fp32), "
                     f"transient {whole['transient_bytes']:,} B")
        lines.append(f"  the most parameter elements one rank steps (holds state for): "
                     f"{whole['max_owned_elements']:,}, vs a shard's {whole['shard_elements']:,}")
    padding = sum(f["padding"] for f in report["flat_params"])
    lines.append(f"padding: {padding:,} elements in all ({padding / max(1, report['num_params']):.4%} of Ψ)")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    from zerokit.cli import positive_int

    p.add_argument("--model", required=True, help="model preset (tiny, small, gpt2-small, gpt2-medium, gpt2-xl, gpt3-6.7b)")
    p.add_argument("--world-size", type=positive_int, required=True, metavar="N", help="number of ranks N (>= 1)")
    p.add_argument("--stage", type=int, required=True, choices=(0, 1, 2, 3))
    p.add_argument("--bucket-numel", type=positive_int, default=None, metavar="K",
                   help="elements per bucket (stages 0-2; default zk.shard's)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATE_BYTES), default="adam",
                   help="for the bytes per rank only")
    p.add_argument("--no-decay", action="store_true",
                   help="the parameter groups `zerokit train` uses (no weight decay below 2-D: own buffers)")
    p.add_argument("--lora", action="store_true", help="inject LoRA on q and v (r=8) first: frozen base buffers")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the whole layout as JSON")


def run(args: argparse.Namespace) -> int:
    from zerokit.models import PRESETS

    if args.model not in PRESETS:
        raise SystemExit(f"zerokit explain: unknown --model {args.model!r}; presets: {', '.join(PRESETS)}")
    report = layout_report(args.model, args.world_size, args.stage, args.bucket_numel, args.precision,
                           args.optimizer, args.no_decay, args.lora)
    for line in render(report):
        print(line)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
