"""`zerokit memory`: the table (from CS224N lecture 12) of per-rank model-state memory, one row per ZeRO stage.

    zerokit memory --params 7.5e9 --world-size 64

prints, for Ψ = 7.5e9 parameters on N = 64 ranks with bf16 + Adam, 120 / 31.4 / 16.6 / 1.9 GB
per rank for stages 0-3, split into params, grads, fp32 master params and optimizer states,
beside the formula each row evaluates. The numbers come from `zerokit.core.accounting.estimate.estimate`
(exact integers, padded shards); GB means 10^9 bytes, as in the ZeRO paper and the lecture.
`--model NAME` takes Ψ from a models.py preset, and then also shows the stage-3 working set and
the activations of one sequence, which the stage rows leave out. `--json PATH` writes the bytes.

    zerokit memory --simulate --model gpt2-small --world-size 64 --stage 3

measures instead of computing: this one process builds the real model and plays rank 0 of N
(`Comm(simulate=Simulated(0, N))`: collectives return correctly shaped results computed
locally, see core/collectives/comm.py), runs one forward, backward and optimizer step on a tiny batch
(1 sequence of 8 tokens), and prints the ledger of what it really allocated (core/accounting/ledger.py
`ledger`) next to the formula, category by category. The values trained are meaningless (every
"gathered" shard is a copy of this rank's own); the allocations are exactly a real rank's.

    zerokit memory --params 1.5e9 --world-size 16 --shard-group-size 8

is hybrid sharding: stages 1-3 shard within groups of S = 8 ranks (one node) and replicate
across the R = 2 groups, so every row uses N = S (a hybrid rank holds exactly what a rank of a
world of S holds; core/accounting/estimate.py [Note: hybrid sharding bytes]); stage 0 shards nothing and
is unchanged. The command also prints the logical bytes a rank sends per step within its
shard group and across its replicate group (`comm_bytes_by_group`). With --simulate it plays a
rank of a world of S for stages 1-3, for the same reason.

    zerokit memory --params 70e9 --world-size 2 --quantize nf4 --lora --gpu-memory 24

is QLoRA sharded (FSDP-QLoRA's headline case: 70B on two 24 GB GPUs): LoRA adapters (Ψ_t, for
q and v at r = 8 on the model's shape, or a GPT-3-like shape guessed from Ψ, as `zerokit plan`)
train over a frozen base of Ψ parameters quantized to NF4 (core/accounting/estimate.py [Note: a quantized
base]; all Ψ counted as quantized, embeddings too). `--lora` alone keeps the base in the param
dtype. `--gpu-memory` marks the rows whose model states fit (activations and working set apart).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerokit.models import GPTConfig

from zerokit.cli import UNITS, model_preset, parse_bytes, parse_count, positive_int
from zerokit.core.accounting.estimate import (
    OPTIMIZER_STATE_BYTES,
    PRECISIONS,
    STAGE_NAMES,
    activation_bytes_estimate,
    bytes_per_param,
    comm_bytes_by_group,
    comm_bytes_per_step,
    estimate,
    per_rank_formula,
    quantized_weight_bytes,
    resolve_shard_group_size,
    stage2_in_flight_grad_bytes,
    tied_head_grad_bytes,
    zero3_working_set_bytes,
)

CATEGORY_HEADERS = (("params", "params"), ("grads", "grads"), ("master_params", "master"),
                    ("optimizer_states", "opt states"))


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


def stage_rows(num_params: int, world_size: int, precision: str, optimizer: str,
               shard_group_size: int | None = None, lora_params: int | None = None,
               quantize: str | None = None) -> list[dict[str, Any]]:
    """One dict per stage 0-3: stage, name, formula, bytes per category and total, bytes sent per step.

    shard_group_size: S for hybrid sharding (None: world_size). Then the categories are those of
    a rank of a world of S, and the formula reads "/S" instead of "/N". The bytes one rank sends
    per step are `comm_bytes_shard_group` and `comm_bytes_replicate_group` (`comm_bytes_by_group`).
    """
    shard_ranks = resolve_shard_group_size(shard_group_size, world_size)
    hybrid = shard_ranks != world_size
    per = bytes_per_param(precision, optimizer)
    rows = []
    total_params = num_params + (lora_params or 0)  # adapters are extra parameters; only they train
    for stage in range(4):
        est = estimate(total_params, world_size, stage, precision, optimizer, shard_group_size=shard_ranks,
                       trainable_params=lora_params, quantize=quantize)
        formula = per_rank_formula(stage, precision, optimizer)
        if lora_params is not None:
            base = (f"{quantized_weight_bytes(10**6, quantize) / 10**6:.3f}Ψ" if quantize
                    else f"{per.params}Ψ") + ("/N" if stage == 3 else "")
            formula = f"{base}+{formula.replace('Ψ', 'Ψ_t')}"
        row: dict[str, Any] = {"stage": stage, "name": STAGE_NAMES[stage],
                               "formula": formula.replace("/N", "/S") if hybrid else formula}
        row.update({key: getattr(est, key) for key, _ in CATEGORY_HEADERS})
        row["quantized_params"] = est.quantized_params
        row["total"] = est.total
        sent = comm_bytes_by_group(total_params, stage, per.params, per.grads, world_size, shard_ranks,
                                   trainable_params=lora_params)
        if quantize and world_size == shard_ranks:  # stage 3 gathers the base's bytes
            sent["shard_group"] = comm_bytes_per_step(total_params, stage, per.params, per.grads, lora_params,
                                                      quantize=quantize) if world_size > 1 else 0
        row["comm_bytes_shard_group"] = sent["shard_group"]
        row["comm_bytes_replicate_group"] = sent["replicate_group"]
        rows.append(row)
    return rows


def format_auto(num_bytes: int) -> str:
    """num_bytes in its own decimal unit, e.g. "750.0 MB", "9.0 GB", "0 B"."""
    unit = choose_unit([num_bytes])
    return f"{format_in(num_bytes, unit)} {unit}"


def render_comm(rows: list[dict[str, Any]], world_size: int, shard_ranks: int) -> list[str]:
    """The bytes one rank sends per step: one line when flat; within / across per stage when hybrid."""
    if shard_ranks == world_size:
        sent = ", ".join(f"stage {r['stage']} {format_auto(r['comm_bytes_shard_group'])}" for r in rows)
        return [f"Bytes one rank sends per step (ZeRO accounting): {sent}"]
    lines = [f"Bytes one rank sends per step (ZeRO accounting), within its shard group of {shard_ranks} / "
             f"across its replicate group of {world_size // shard_ranks}:"]
    for r in rows:
        within, across = r["comm_bytes_shard_group"], r["comm_bytes_replicate_group"]
        note = ""
        if r["stage"] == 0 and within:
            note = f" (DDP ignores S: its all-reduce spans all {world_size} ranks, across nodes too)"
        lines.append(f"  stage {r['stage']}: {format_auto(within)} / {format_auto(across)}{note}")
    return lines


def render_table(rows: list[dict[str, Any]], unit: str, gpu_memory: int | None = None) -> list[str]:
    columns = list(CATEGORY_HEADERS)
    if any(r.get("quantized_params") for r in rows):
        columns.insert(1, ("quantized_params", "quantized"))
    headers = ["stage", "sharded", "formula"] + [h for _, h in columns] + ["total"]
    body = [[str(r["stage"]), r["name"], r["formula"]]
            + [format_in(r[key], unit) for key, _ in columns] + [format_in(r["total"], unit)]
            for r in rows]
    if gpu_memory is not None:
        headers.append("fits")
        for line, r in zip(body, rows):
            line.append("yes" if r["total"] <= gpu_memory else "no")
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
                      help="take Ψ from a models.py preset (tiny, small, gpt2-small, gpt2-medium, gpt2-xl, gpt3-6.7b)")
    parser.add_argument("--world-size", type=positive_int, required=True, metavar="N", help="number of ranks N (>= 1)")
    parser.add_argument("--shard-group-size", type=positive_int, metavar="S",
                        help="hybrid sharding: stages 1-3 shard within groups of S ranks (e.g. the GPUs per node) "
                             "and replicate across the N/S groups; S must divide N (default: N, flat)")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16",
                        help="fp32, or mixed precision bf16/fp16 with fp32 master weights (default bf16)")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATE_BYTES), default="adam",
                        help="decides the optimizer-state bytes per parameter (default adam)")
    parser.add_argument("--unit", choices=("auto",) + tuple(UNITS), default="auto",
                        help="unit of the table; auto picks a decimal unit (GB for CS224N lecture 12's example)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the table, in bytes, as JSON")
    parser.add_argument("--lora", action="store_true",
                        help="LoRA on q and v (r = 8) over a frozen base: only the adapters carry grads, masters "
                             "and optimizer states")
    parser.add_argument("--quantize", choices=("nf4", "int8"),
                        help="the frozen base quantized (QLoRA with nf4; needs --lora), zerokit/quant.py")
    parser.add_argument("--gpu-memory", type=parse_bytes, metavar="GB",
                        help="memory per GPU (a number is GB): mark the rows whose model states fit")
    parser.add_argument("--simulate", action="store_true",
                        help="measure instead: this process builds --model and plays rank 0 of --world-size "
                             "for one training step (needs --model and --stage)")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), metavar="S",
                        help="with --simulate: the ZeRO stage to measure")
    parser.add_argument("--seq-len", type=positive_int, default=8, metavar="T",
                        help="with --simulate: tokens in the one training sequence (default 8)")
    parser.add_argument("--device", default=None,
                        help="with --simulate: where the model lives (default cuda if available, else cpu)")
    parser.add_argument("--build", choices=("meta", "deferred", "eager"), default="meta",
                        help="with --simulate: build the model on the meta device and let zk.shard initialize it one "
                             "unit at a time (meta, the default), record its construction with zk.deferred_init() "
                             "(deferred), or build it whole first (eager)")
    parser.add_argument("--no-save", action="store_true",
                        help="with --simulate: skip the save and load phases (this rank's part of engine.save and "
                             "engine.load, into a temporary directory: the whole model file is written, 4Ψ bytes)")


def simulate_rank(model: "str | GPTConfig", world_size: int, stage: int, precision: str = "bf16", optimizer: str = "adam",
                  rank: int = 0, seq_len: int = 8, device: str | None = None, bucket_numel: int | None = None,
                  lora: bool = False, build: str = "meta", save: bool = False) -> dict[str, Any]:
    """Build `model` (a preset name or a GPTConfig), wrap it as `rank` of a simulated world of `world_size`, train one step, measure.

    Returns `core.ledger.ledger(...)` (measured and predicted bytes per category, relative errors,
    configuration) plus "seconds" (wall time of the whole measurement), "device" and "phases": the
    process's peak memory in each phase ("build": constructing the model and zk.shard; "step": one
    forward, backward and optimizer step; with `save` (the command's default) also "save" and "load", see
    `simulated_save_and_load`), measured by `core.ledger.PeakMeter`, beside the bound `phase_bound`
    computes. `build="meta"` (the default) builds the model on the meta device and lets
    zk.shard initialize it one flat param at a time (core/params/materialize.py); "eager" builds it whole
    first, as a user without meta-device init would; "deferred" records the construction under
    zk.deferred_init() (core/params/deferred.py) and works with LoRA, whose adapters are then drawn for real
    after the recorded base (a meta build cannot replay them). Activations are measured around the
    forward and backward (saved tensors on CPU, the allocator on CUDA) and predicted with
    `activation_bytes_estimate`.
    """
    import torch

    import zerokit as zk
    from zerokit.core.accounting.ledger import ActivationMeter, PeakMeter, ledger
    from zerokit.models import GPT, Block, build_model, preset

    cfg = preset(model) if isinstance(model, str) else model
    if not 1 <= seq_len <= cfg.block_size:
        raise ValueError(f"seq_len must be in [1, {cfg.block_size}] for model {model!r}, got {seq_len}")
    if build not in ("meta", "deferred", "eager"):
        raise ValueError(f"build must be 'meta', 'deferred' or 'eager', got {build!r}")
    if save and rank != 0:
        raise ValueError("the save and load phases play rank 0, the rank that writes the model file: pass rank=0 "
                         "or save=False")
    if lora and build == "meta":
        raise ValueError("--lora needs --build deferred or eager: LoRA's adapters are drawn after the base model's "
                         "init, which a meta build cannot replay")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    optimizer_cls, kwargs = optimizer_for(optimizer)
    comm = zk.Comm(simulate=zk.Simulated(rank, world_size))
    shard_kwargs = {} if bucket_numel is None else {"bucket_numel": bucket_numel}
    meter = PeakMeter(device)
    with meter.phase("build"):
        if build == "meta":
            with torch.random.fork_rng(devices=[]):  # the seed build_model uses; the caller's generator untouched
                torch.manual_seed(0)
                with torch.device("meta"):
                    net = GPT(cfg)
                engine = zk.shard(net, optimizer_cls, stage=stage, precision=precision, comm=comm, wrap=(Block,),
                                  param_init_fn=GPT._init_weights, **shard_kwargs, **kwargs)
        else:
            if build == "deferred":
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    with zk.deferred_init():
                        net = GPT(cfg)
                    if lora:
                        zk.lora.inject(net, targets=("q", "v"), rank=8, alpha=1.0)
            else:
                net = build_model(cfg).to(device)
            if lora and build == "eager":
                zk.lora.inject(net, targets=("q", "v"), rank=8, alpha=1.0)
            engine = zk.shard(net, optimizer_cls, stage=stage, precision=precision, comm=comm, wrap=(Block,),
                              **shard_kwargs, **kwargs)
    gen = torch.Generator().manual_seed(rank)
    x, y = (torch.randint(cfg.vocab_size, (1, seq_len), generator=gen).to(device) for _ in range(2))
    with meter.phase("step"):
        with ActivationMeter(exclude=net) as activations:
            _, loss = engine(x, y)
            engine.backward(loss)
        engine.step()
    predicted_activations = activation_bytes_estimate(cfg, 1, precision, seq_len=seq_len)
    out = ledger(engine, activation_bytes=activations.peak_bytes, predicted_activations=predicted_activations)
    if save:
        saved_bytes = simulated_save_and_load(engine, meter)
    out["seconds"] = time.perf_counter() - start
    out["device"] = str(device)
    out["config"].update(model=model if isinstance(model, str) else repr(model), seq_len=seq_len, simulated=True,
                         build=build)
    if save:
        out["saved_bytes"] = saved_bytes
    bound = phase_bound(out, cfg, stage, precision, meter.baseline, **stage2_buckets(engine))
    out["phases"] = {"baseline_bytes": meter.baseline, "bound_bytes": bound, "measured_by": (
        "CUDA allocator peak" if meter.cuda else "resident set high-water mark (VmHWM)"),
        "largest_unit_bytes": max(4 * fp.padded_numel for fp in engine.flat_params),  # one flat param in fp32
        "peaks": {name: {"peak_bytes": peak, "ratio_to_bound": peak / bound, "seconds": meter.seconds[name],
                         "growth_bytes": peak - meter.starts[name]}
                  for name, peak in meter.peaks.items()}}
    return out


def stage2_buckets(engine) -> dict[str, Any]:
    """`phase_bound`'s stage-2 arguments read off `engine` ({} at other stages): its buckets' padded sizes, its
    max_in_flight, and the larger of its param and reduce dtypes' bytes."""
    if engine.stage != 2:
        return {}
    sizes = [engine.policy.param_dtype.itemsize, engine.policy.reduce_dtype.itemsize]
    return {"bucket_numels": [fp.padded_numel for fp in engine.flat_params if fp.requires_grad],
            "max_in_flight": engine.config.max_in_flight, "grad_bytes": max(sizes)}


def simulated_save_and_load(engine, meter) -> dict[str, int]:
    """The save and load phases of one simulated rank, into a temporary directory; returns the bytes written.

    [Note: save and resume on a simulated rank]
    At a simulated world size only this rank exists, so only this rank's files can: `engine.save`
    writes them and then fails at its commit, whose meta.json lists all N ranks' files, and
    `engine.load` refuses a checkpoint missing N - 1 rank files before reading any tensor. What a
    real rank holds in either is still measurable, because everything large it handles is its own:

    * "save": the write step of engine.save (checkpoint/commit.py `_write_model_files` and
      `_write_rank_file`, the very functions it calls): every rank gathers the model one flat param
      at a time and rank 0 streams each into model.safetensors; then this rank writes its rank file
      (its pieces of the fp32 masters and optimizer states). Left out: the commit (meta.json, a few
      kB, and two fsyncs), which needs the other ranks' file records.
    * "load": the install step of engine.load for the same world size (checkpoint/loading.py
      `_install`, the very function it calls): each flat param's range this rank keeps
      (`engine.kept_range`: its shard at stage 3, the whole flat param at stages 0-2, where params
      are whole) read a slice at a time from the model file just written and written into the
      engine's storage, one flat param at a time; then each master's values and optimizer states
      read from this rank's rank file and installed, one master at a time (at the saved world size
      the only rank file holding data this rank reads; the others are not opened). Left out: the
      check before it (headers, and the sha256 digests, streamed through a fixed-size buffer) and the
      verdict's all-gather.

    A phase that gathered or read the whole model (a `state_dict(full=True)` in the save, say) shows
    in its peak: tests/unit/test_memory_phases.py plants exactly that.
    """
    import os
    import tempfile

    from zerokit.checkpoint.commit import _write_model_files, _write_rank_file
    from zerokit.checkpoint.format import aliases, param_records, rank_file, state_kinds
    from zerokit.checkpoint.loading import _install, _Plan

    with tempfile.TemporaryDirectory(prefix="zerokit-simulated-save-") as directory:
        with meter.phase("save"):
            engine.finish_backward()
            kinds = state_kinds(engine)
            files = _write_model_files(engine, directory)
            files[rank_file(engine.rank, engine.world_size)] = _write_rank_file(engine, directory, kinds,
                                                                                aliases(engine.module))
        written = {name: os.path.getsize(os.path.join(directory, name)) for name in files}
        with meter.phase("load"):
            meta = {"files": files, "aliases": aliases(engine.module), "params": param_records(engine),
                    "world_size": engine.world_size, "optimizer": {"state": kinds}, "loss_scaler": None}
            _install(engine, _Plan(meta, directory), ranks=[engine.rank])
    return written


def phase_bound(result: dict[str, Any], cfg, stage: int, precision: str, baseline: int,
                bucket_numels: "list[int] | None" = None, max_in_flight: int = 2, grad_bytes: int | None = None) -> int:
    """What a rank may hold at its peak in any phase:

        process baseline + model states (formula) + gradients in flight + tied head + activations (predicted)

    gradients in flight: at stage 3 the working set of gathered units (`zero3_working_set_bytes`: the
    root and 1 + prefetch blocks, their params and grads); at stage 2 the full-size buckets backward
    holds before their reduce-scatters complete (`stage2_in_flight_grad_bytes` over `bucket_numels`,
    each bucket's padded elements, with `max_in_flight` and `grad_bytes`, default the param dtype's;
    required at stage 2); stages 0-1 hold every full gradient among the model states. tied head: the two
    (V, d) gradients autograd holds for a tied embedding/head beside the buffer counted above
    (`tied_head_grad_bytes`), at every stage. Both terms are derived in core/accounting/estimate.py."""
    predicted = result["predicted"]
    states = sum(predicted[c] or 0 for c in ("params", "grads", "master_params", "optimizer_states"))
    working = tied_head_grad_bytes(cfg, precision)
    if stage == 3:
        working += zero3_working_set_bytes(cfg, precision)
    elif stage == 2:
        if bucket_numels is None:
            raise ValueError("phase_bound at stage 2 needs bucket_numels (each bucket's padded elements)")
        e = 4 if precision == "fp32" else 2
        working += stage2_in_flight_grad_bytes(bucket_numels, max_in_flight, grad_bytes or e)
    return baseline + states + working + (predicted.get("activations") or 0)


def optimizer_for(name: str) -> tuple[type, dict]:
    """(torch optimizer class, hyperparameters) for an `estimate` optimizer name; the state sizes are what matter."""
    import torch

    table = {"adam": (torch.optim.AdamW, {"lr": 1e-4}), "adamw": (torch.optim.AdamW, {"lr": 1e-4}),
             "sgd_momentum": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}), "sgd": (torch.optim.SGD, {"lr": 1e-3})}
    if name not in table:
        raise ValueError(f"optimizer must be one of {tuple(table)}, got {name!r}")
    return table[name]

LEDGER_CATEGORIES = ("params", "grads", "master_params", "optimizer_states", "comm_buffers", "activations")


def render_ledger(result: dict[str, Any], unit: str) -> list[str]:
    """Measured beside predicted, one row per category, with the relative error."""
    headers = ["category", f"measured {unit}", f"formula {unit}", "error"]
    rows = []
    for category in LEDGER_CATEGORIES:
        m, p = result["measured"].get(category), result["predicted"].get(category)
        err = result["relative_error"].get(category)
        rows.append([category, "-" if m is None else format_in(m, unit), "-" if p is None else format_in(p, unit),
                     "-" if err is None else f"{100 * err:+.3f}%"])
    model_states = [result["measured"][c] for c in ("params", "grads", "master_params", "optimizer_states")]
    predicted_states = [result["predicted"][c] for c in ("params", "grads", "master_params", "optimizer_states")]
    total_m, total_p = sum(model_states), sum(predicted_states)
    rows.append(["model states", format_in(total_m, unit), format_in(total_p, unit),
                 f"{100 * (total_m - total_p) / total_p:+.3f}%" if total_p else "-"])
    widths = [max(len(r[i]) for r in [headers] + rows) for i in range(len(headers))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]


def render_phases(phases: dict[str, Any], unit: str) -> list[str]:
    """The peak of each phase beside the bound, one row per phase."""
    if not phases["peaks"]:
        return ["(per-phase peaks: not measurable on this platform)"]
    bound = phases["bound_bytes"]
    lines = [f"per-phase peak ({phases['measured_by']}; process baseline {format_in(phases['baseline_bytes'], unit)} "
             f"{unit}) beside the bound = baseline + model states + gradients in flight (stage 3: working set; stage 2: "
             f"buckets) + tied head's autograd gradients + activations = "
             f"{format_in(bound, unit)} {unit}:"]
    for name, row in phases["peaks"].items():
        lines.append(f"  {name:<6} {format_in(row['peak_bytes'], unit):>10} {unit}  {row['ratio_to_bound']:.2f} x bound"
                     f"  ({row['seconds']:.1f} s; +{format_in(row['growth_bytes'], unit)} {unit} over the phase's "
                     "start)")
    if "save" in phases["peaks"]:
        lines.append("  save: this rank's part of engine.save (the model file streamed one flat param at a time, its "
                     "rank file); load: its slices of them read back; the commit and the other ranks' files cannot "
                     "exist in a simulated world (commands/memory.py [Note: save and resume on a simulated rank])")
    return lines


def _shard_group_size(args: argparse.Namespace) -> int:
    """S from --shard-group-size (default: --world-size), refused in one line unless it divides N."""
    try:
        return resolve_shard_group_size(getattr(args, "shard_group_size", None), args.world_size)
    except ValueError as err:
        why = str(err).partition(": ")[2] or str(err)
        raise SystemExit(f"zerokit memory: --shard-group-size {args.shard_group_size} does not divide --world-size "
                         f"{args.world_size}: {why}") from None


def run_simulate(args: argparse.Namespace) -> int:
    if args.model is None or args.stage is None:
        raise SystemExit("zerokit memory --simulate needs --model NAME and --stage S")
    shard_ranks = _shard_group_size(args)
    # A hybrid rank at stages 1-3 holds exactly what a rank of a world of S holds, so that is the
    # world simulated; stage 0 shards nothing, so N and S give the same rank.
    simulated_world = shard_ranks if args.stage >= 1 else args.world_size
    try:
        result = simulate_rank(args.model, simulated_world, args.stage, args.precision, args.optimizer,
                               seq_len=args.seq_len, device=args.device, build=args.build,
                               save=not args.no_save)
    except ValueError as err:
        raise SystemExit(f"zerokit memory --simulate: {err}") from None
    cfg = result["config"]
    values = [v for v in result["measured"].values() if v] + [v for v in result["predicted"].values() if v]
    unit = choose_unit(values) if args.unit == "auto" else args.unit
    if shard_ranks != args.world_size:
        result["hybrid"] = {"world_size": args.world_size, "shard_group_size": shard_ranks,
                            "replicate_groups": args.world_size // shard_ranks, "simulated_world_size": simulated_world}
        shared = ("a hybrid rank holds exactly what a rank of a world of S holds" if args.stage >= 1
                  else "stage 0 shards nothing and ignores S")
        print(f"Hybrid sharding: shard group of {shard_ranks} ranks; replicated {args.world_size // shard_ranks} "
              f"times (N = {args.world_size}); {shared}: this measures rank 0 of N = {simulated_world}")
    print(f"Measured on one process playing rank 0 of N = {simulated_world} (simulated): model {args.model}, "
          f"Ψ = {cfg['num_params']:,}, stage {args.stage} ({STAGE_NAMES[args.stage]}), {args.precision} + "
          f"{cfg['optimizer']}, device {result['device']}; one step on 1 x {args.seq_len} tokens; "
          f"{unit} = {UNITS[unit]:,} bytes")
    for line in render_ledger(result, unit):
        print(line)
    print(f"formula: {per_rank_formula(args.stage, args.precision, cfg['optimizer'])} per rank (model states); "
          f"activations predicted by activation_bytes_estimate; {result['seconds']:.1f} s")
    for line in render_phases(result["phases"], unit):
        print(line)
    if shard_ranks != args.world_size:
        per = bytes_per_param(args.precision, cfg["optimizer"])
        sent = comm_bytes_by_group(cfg["num_params"], args.stage, per.params, per.grads, args.world_size,
                                   shard_ranks, trainable_params=cfg["trainable_params"])
        result["hybrid"]["comm_bytes_per_step"] = sent
        print(f"bytes one rank sends per step (formula, not measured): {format_auto(sent['shard_group'])} within "
              f"the shard group, {format_auto(sent['replicate_group'])} across replicate groups")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.simulate:
        return run_simulate(args)
    if args.stage is not None:
        raise SystemExit("zerokit memory: --stage is only used with --simulate (the table shows every stage)")
    cfg = None
    if args.model is not None:
        cfg, num_params = model_preset("memory", args.model)
    else:
        num_params = args.params

    shard_ranks = _shard_group_size(args)
    hybrid = shard_ranks != args.world_size
    quantize, lora_params = getattr(args, "quantize", None), None
    if quantize and not getattr(args, "lora", False):
        raise SystemExit("zerokit memory: --quantize quantizes a frozen base: add --lora (the adapters that train)")
    if getattr(args, "lora", False):
        from zerokit.commands.plan import guess_shape, lora_adapter_params
        lora_params = lora_adapter_params(cfg if cfg is not None else guess_shape(num_params))
    rows = stage_rows(num_params, args.world_size, args.precision, args.optimizer, shard_ranks, lora_params, quantize)
    unit = choose_unit([r["total"] for r in rows]) if args.unit == "auto" else args.unit
    source = f"model {args.model}, " if cfg is not None else ""
    print(f"Model states per rank: {source}Ψ = {num_params:,} parameters, N = {args.world_size} ranks, "
          f"{args.precision} + {args.optimizer}; {unit} = {UNITS[unit]:,} bytes")
    if lora_params is not None:
        base = (f"quantized to {quantize} ({quantized_weight_bytes(10**6, quantize) / 10**6:.3f} B/param, "
                f"{format_auto(quantized_weight_bytes(num_params, quantize))} in all)" if quantize
                else f"in {args.precision} ({bytes_per_param(args.precision).params} B/param)")
        print(f"LoRA: Ψ_t = {lora_params:,} adapter parameters (q, v, r = 8) train; the frozen base of Ψ is {base}")
    if hybrid:
        print(f"Hybrid sharding: shard group of S = {shard_ranks} ranks; replicated R = "
              f"{args.world_size // shard_ranks} times. Stages 1-3 shard within the group only, so each row "
              f"holds what a rank of N = {shard_ranks} holds; stage 0 shards nothing.")
    gpu_memory = getattr(args, "gpu_memory", None)
    for line in render_table(rows, unit, gpu_memory):
        print(line)
    if gpu_memory is not None:
        print(f"fits: model states <= {format_auto(gpu_memory)} per GPU (activations and the stage-3 working set "
              "come on top: `zerokit plan`)")
    if hybrid:
        print("Sharded categories hold ceil(Ψ/S) elements per rank (flat buffers padded to a multiple of S).")
    else:
        print("Sharded categories hold ceil(Ψ/N) elements per rank (flat buffers padded to a multiple of N).")
    for line in render_comm(rows, args.world_size, shard_ranks):
        print(line)

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
                  "optimizer": args.optimizer, "model": args.model, "unit": "bytes", "stages": rows,
                  "lora_params": lora_params, "quantize": quantize,
                  "shard_group_size": shard_ranks, "replicate_groups": args.world_size // shard_ranks, **extras}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
