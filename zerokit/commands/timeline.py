"""`zerokit timeline`: where one rank's memory goes during one training step, event by event.

    zerokit timeline --stage 3 --nproc 2 --precision bf16 --model small --out out/timeline

spawns `--nproc` gloo ranks (NCCL on GPUs), wraps the model at ZeRO stage `--stage`, trains one
warm-up step (so that the optimizer states exist, as in every later step) and then records the
second step. At every *event* of that step each rank takes a snapshot of its live bytes by
category:

    params, grads, master_params, optimizer_states, comm_buffers   engine.memory() (core/accounting/ledger.py
                                                                   [Note: the measured ledger])
    unsharded_params, unsharded_grads                              stage 3's gathered units, also
                                                                   from engine.memory(), while alive
    activations                                                    tensors autograd holds for backward
                                                                   right now (saved-tensor hooks,
                                                                   core/accounting/ledger.py ActivationMeter)

The events are
* the step's own boundaries, which this command drives: forward start, forward end, backward
  end, after step, after zero_grad;
* every collective the engine issues, just before it is issued: the command appends a listener
  to `engine.comm.recorder.listeners` (core/collectives/recorder.py) and labels the snapshot with the
  record's ZeRO-level label ("bucket 3 (blocks.2.*)", "unit blocks.0");
* each transformer block's forward start and end and the start of its backward, observed from
  outside through the command's own module hooks (registered after the engine's, so they run
  after them: at stage 3 a snapshot at "forward start" sees the unit gathered, one at "forward
  end" sees it freed again) and a gradient hook on the block's output.

It writes `timeline.json` (every event of every rank, the formula's bytes, and the provenance:
command, date, git commit, machine, versions, as zerokit/provenance.py records them) and
`timeline.png`: per rank, the categories stacked over the step's events, each event's label under
the x axis, and the formula's bytes (`zk.estimate`: model states; plus the activation estimate and,
at stage 3, the working-set estimate of core/accounting/estimate.py) as horizontal lines.

`--simulate-world-size W` runs one process playing rank 0 of W instead (core/collectives/comm.py `Simulated`,
as `zerokit memory --simulate`): the allocations are a real rank's, the values meaningless.

On CUDA every event also records `torch.cuda.memory_allocated()` (the allocator, which the ledger
reads for activations on CUDA: it also counts temporaries and whatever else is alive), drawn as a
line over the stacked categories. This path has not been run on a GPU yet. Activations themselves are counted with
saved-tensor hooks on every device, so the stacked categories mean the same everywhere.
"""
from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from typing import Any, Callable

from zerokit.provenance import provenance

# Stacking order, bottom to top: what persists between steps first, what one step creates on top.
CATEGORIES: tuple[str, ...] = ("optimizer_states", "master_params", "params", "grads", "unsharded_params",
                               "unsharded_grads", "comm_buffers", "activations")
MODEL_STATES: tuple[str, ...] = ("params", "grads", "master_params", "optimizer_states")
BOUNDARIES: tuple[str, ...] = ("forward start", "forward end", "backward end", "after step", "after zero_grad")
LABELS = {"params": "params", "grads": "grads", "master_params": "fp32 master",
          "optimizer_states": "optimizer states", "unsharded_params": "gathered params (stage 3 units)",
          "unsharded_grads": "full-size grads (stage 3 units)", "comm_buffers": "comm buffers",
          "activations": "activations (saved for backward)"}
COLORS = {"params": "#4c72b0", "grads": "#dd8452", "master_params": "#55a868", "optimizer_states": "#c44e52",
          "unsharded_params": "#9ec3ea", "unsharded_grads": "#f6c59f", "comm_buffers": "#8172b2",
          "activations": "#b5b5b5"}
OP_COLORS = {"all_reduce": "#2d6a2d", "reduce_scatter": "#b35900", "all_gather": "#1f4e99", "broadcast": "#555555",
             "all_reduce_scalars": "#7a3d99"}
MAX_LABELLED_EVENTS = 70  # x-axis labels beyond this are thinned (boundaries and the peak always kept)
MAX_PANELS = 4  # ranks drawn; timeline.json holds every rank


def add_arguments(p: argparse.ArgumentParser) -> None:
    from zerokit.cli import int_in_range, positive_float, positive_int

    p.add_argument("--stage", type=int_in_range(0, 3), required=True, metavar="S", help="ZeRO stage 0-3")
    p.add_argument("--nproc", type=positive_int, default=None,
                   help="gloo ranks to spawn (>= 1, default 2; NCCL ranks when CUDA is used)")
    p.add_argument("--simulate-world-size", type=positive_int, default=None, metavar="W",
                   help="instead of spawning ranks, this one process plays rank 0 of W (core/collectives/comm.py Simulated)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16", help="default bf16")
    p.add_argument("--model", default="small", help="model preset (default small; tiny for a quick look)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="sequences per rank (default 4)")
    p.add_argument("--bucket-numel", type=positive_int, default=1 << 16,
                   help="elements per gradient bucket, stages 0-2 (default 65536: several buckets for small)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when there is a GPU per rank, else CPU (default auto)")
    p.add_argument("--out", type=Path, default=Path("out/timeline"), help="directory for timeline.json and .png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=positive_float, default=600, help="seconds before the ranks are killed")


# ----------------------------------------------------------------------------- one rank
class Timeline:
    """One rank's snapshots: live bytes by category at each event, in order."""

    def __init__(self, engine: Any, meter: Any) -> None:
        import torch

        self.engine, self.meter = engine, meter
        self.events: list[dict] = []
        self.phase = "forward"  # which part of the step the driver is in (forward, backward, step, zero_grad)
        device = next((p.device for p in engine.module.parameters()), torch.device("cpu"))
        self._cuda_device = device if device.type == "cuda" else None

    def snapshot(self, kind: str, label: str, **extra: Any) -> dict:
        """Record the live bytes now: engine.memory()'s categories (0 when absent) and the saved activations."""
        import torch

        memory = self.engine.memory()
        row = {c: int(memory.get(c, 0)) for c in CATEGORIES if c != "activations"}
        row.update({c: int(v) for c, v in memory.items() if c not in row})  # a category added later is kept
        row["activations"] = int(self.meter.current_bytes)
        event = {"index": len(self.events), "kind": kind, "label": label, "phase": self.phase, **extra,
                 "bytes": row, "total": sum(row.values())}
        if self._cuda_device is not None:
            event["cuda_allocated"] = int(torch.cuda.memory_allocated(self._cuda_device))
        self.events.append(event)
        return event

    def on_collective(self, rec: Any) -> None:
        """A recorder listener (core/collectives/recorder.py): called just before each collective is issued."""
        self.snapshot("collective", rec.label, op=rec.op, seq=rec.seq, numel=rec.numel, dtype=rec.dtype,
                      comm_phase=rec.phase)


def watched_modules(engine: Any, model: Any) -> list[tuple[str, Any]]:
    """(name, module) of what the timeline follows from outside: stage 3's units (root excluded), else the Blocks."""
    from zerokit.models import Block

    units = getattr(engine, "units", None)
    if units:
        return [(f"unit {unit.name}", unit.module) for unit in units[1:]]
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Block)]


def _watch(modules: list[tuple[str, Any]], timeline: Timeline) -> list[Any]:
    """Forward pre/post hooks and a hook on the output's gradient, per module; returns the handles to remove."""
    import torch

    from zerokit.core.nest import tensors_in

    handles = []
    for name, module in modules:
        def pre(mod, args, name=name) -> None:
            timeline.snapshot("module", f"{name}: forward start")

        def post(mod, args, output, name=name) -> None:
            timeline.snapshot("module", f"{name}: forward end")
            if not torch.is_grad_enabled():
                return
            for t in tensors_in(output):
                if t.requires_grad:
                    def on_grad(grad, name=name) -> None:  # after the engine's own hook on this output
                        timeline.snapshot("module", f"{name}: backward start")
                    t.register_hook(on_grad)
                    break  # once per call
        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def record_step(engine: Any, model: Any, batch: tuple, probe: Callable[[str, Any, dict], None] | None = None
                ) -> tuple[list[dict], int]:
    """Run one training step on `batch` = (x, y) and snapshot every event; returns (events, saved-tensor peak).

    The step is forward, backward, step, zero_grad (no clipping). `probe(boundary, engine, event)`,
    if given, is called right after each boundary's snapshot (tests compare it with engine.memory()).
    """
    from zerokit.core.accounting.ledger import ActivationMeter

    meter = ActivationMeter(exclude=model, use_cuda_allocator=False)
    timeline = Timeline(engine, meter)
    listeners = engine.comm.recorder.listeners
    listeners.append(timeline.on_collective)
    handles = _watch(watched_modules(engine, model), timeline)

    def boundary(name: str, phase: str) -> None:
        timeline.phase = phase
        event = timeline.snapshot("boundary", name)
        if probe is not None:
            probe(name, engine, event)

    x, y = batch
    try:
        with meter:
            boundary("forward start", "forward")
            _, loss = engine(x, y)
            boundary("forward end", "forward")
            timeline.phase = "backward"
            engine.backward(loss)
            del loss
        boundary("backward end", "backward")
        timeline.phase = "step"
        engine.step()
        boundary("after step", "step")
        timeline.phase = "zero_grad"
        engine.zero_grad()
        boundary("after zero_grad", "zero_grad")
    finally:
        listeners.remove(timeline.on_collective)
        for h in handles:
            h.remove()
    return timeline.events, meter.saved_peak_bytes


def timeline_rank(rank: int, world_size: int, cfg: dict, probe: Callable | None = None) -> dict:
    """Build the model, wrap it at cfg["stage"], train a warm-up step, record the next one; this rank's record."""
    import torch

    import zerokit as zk
    from zerokit.core.accounting.estimate import activation_bytes_estimate, per_rank_formula, zero3_working_set_bytes
    from zerokit.core.accounting.ledger import ledger
    from zerokit.models import Block, CharCorpus, build_model, preset

    if cfg["device"] == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # run_ranks chose it for this rank
    else:
        device = torch.device("cpu")
    model_cfg = preset(cfg["model"])
    model = build_model(model_cfg, seed=cfg["seed"]).to(device)
    simulate = cfg.get("simulate_world_size")
    comm = zk.Comm(simulate=zk.Simulated(rank, simulate)) if simulate else None
    # fp16: a small initial scale, so the warm-up step is not skipped (Adam's states exist after it).
    scaler = {"init_scale": 16.0} if cfg["precision"] == "fp16" else None
    engine = zk.shard(model, torch.optim.AdamW, stage=cfg["stage"], precision=cfg["precision"], lr=1e-3,
                      weight_decay=0.1, bucket_numel=cfg["bucket_numel"], wrap=(Block,), loss_scaler=scaler,
                      comm=comm)
    corpus = CharCorpus.load()
    seq_len = model_cfg.block_size

    def batch(step: int) -> tuple:
        x, y = corpus.batch(cfg["batch_size"], seq_len, step, engine.rank, engine.world_size)
        return x.to(device), y.to(device)

    x, y = batch(0)  # warm-up: the optimizer states are created by the first step
    _, loss = engine(x, y)
    engine.backward(loss)
    if not engine.step():
        raise RuntimeError("the warm-up step was skipped (fp16 overflow); the timeline needs optimizer states")
    engine.zero_grad()
    del loss
    events, saved_peak = record_step(engine, model, batch(1), probe)

    est = ledger(engine)  # its "predicted" is zk.estimate for exactly this engine (counts, N, stage, precision)
    formula = {c: int(est["predicted"][c]) for c in MODEL_STATES}
    formula["model_states"] = sum(formula.values())
    formula["text"] = per_rank_formula(cfg["stage"], cfg["precision"], est["config"]["optimizer"])
    formula["activations_estimate"] = activation_bytes_estimate(model_cfg, cfg["batch_size"], cfg["precision"],
                                                                seq_len=seq_len)
    formula["working_set_estimate"] = (zero3_working_set_bytes(model_cfg, cfg["precision"], engine.prefetch)
                                       if cfg["stage"] == 3 else 0)
    return {"rank": engine.rank, "world_size": engine.world_size, "device": str(device), "events": events,
            "saved_activation_peak": saved_peak, "formula": formula, "ledger_config": est["config"]}


# ----------------------------------------------------------------------------- the record
def peaks(events: list[dict], categories: list[str]) -> dict:
    """Largest bytes per category over the events, and the largest total with the event it happened at."""
    top = max(events, key=lambda e: e["total"])
    return {"by_category": {c: max(e["bytes"].get(c, 0) for e in events) for c in categories},
            "total": top["total"], "total_at": {"index": top["index"], "label": top["label"]}}


def command_of(args: argparse.Namespace) -> str:
    """The command line that reproduces this run, from the repository root (defaults left out)."""
    parts = ["python", "-m", "zerokit", "timeline", "--stage", str(args.stage)]
    if args.simulate_world_size is not None:
        parts += ["--simulate-world-size", str(args.simulate_world_size)]
    else:
        parts += ["--nproc", str(args.nproc or 2)]
    parts += ["--precision", args.precision, "--model", args.model]
    for flag, value, default in (("--batch-size", args.batch_size, 4), ("--bucket-numel", args.bucket_numel, 1 << 16),
                                 ("--device", args.device, "auto"), ("--seed", args.seed, 0)):
        if value != default:
            parts += [flag, str(value)]
    parts += ["--out", str(args.out)]
    return " ".join(shlex.quote(p) for p in parts)


def build_record(per_rank: list[dict], cfg: dict, command: str) -> dict:
    """timeline.json: provenance, configuration, the formula, and every rank's events and peaks."""
    categories = list(CATEGORIES)
    for r in per_rank:  # a category the engine reports that this command does not know yet
        for e in r["events"]:
            categories[-1:-1] = [c for c in e["bytes"] if c not in categories]
    first = per_rank[0]
    config = dict(cfg, world_size=first["world_size"], num_params=first["ledger_config"]["num_params"],
                  trainable_params=first["ledger_config"]["trainable_params"],
                  optimizer=first["ledger_config"]["optimizer"], device=first["device"])
    ranks = [{"rank": r["rank"], "peak": peaks(r["events"], categories),
              "saved_activation_peak": r["saved_activation_peak"], "events": r["events"]} for r in per_rank]
    return {**provenance(command), "config": config, "unit": "bytes", "categories": categories,
            "boundaries": list(BOUNDARIES), "formula": first["formula"], "ranks": ranks}


# ----------------------------------------------------------------------------- the picture
def _unit_for(value: float) -> tuple[str, float]:
    for name, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if value >= scale:
            return name, scale
    return "B", 1.0


def _labelled(events: list[dict], keep: set[int]) -> list[int]:
    """Indices of the events labelled under the x axis: all when few, else boundaries, `keep` and an even subset."""
    if len(events) <= MAX_LABELLED_EVENTS:
        return [e["index"] for e in events]
    always = {e["index"] for e in events if e["kind"] == "boundary"} | keep
    stride = -(-len(events) // max(1, MAX_LABELLED_EVENTS - len(always)))
    return sorted(always | set(range(0, len(events), stride)))


def _short(event: dict) -> str:
    """The x-axis label of an event: boundaries as they are, collectives prefixed with their operation."""
    if event["kind"] == "collective":
        op = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather",
              "all_reduce_scalars": "scalars"}.get(event["op"], event["op"])
        text = f"{op}: {event['label']}"
    else:
        text = event["label"]
    return text if len(text) <= 50 else text[:49] + "…"


def plot(record: dict, path: Path) -> None:
    """timeline.png: per rank (at most MAX_PANELS), stacked categories over events, formula lines, labelled events."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    cfg, formula, categories = record["config"], record["formula"], record["categories"]
    ranks = record["ranks"][:MAX_PANELS]
    n_events = max(len(r["events"]) for r in ranks)
    highest = max([r["peak"]["total"] for r in ranks]
                  + [formula["model_states"] + formula["activations_estimate"] + formula["working_set_estimate"]]
                  + [e.get("cuda_allocated", 0) for r in ranks for e in r["events"]])
    unit, scale = _unit_for(highest)
    width = min(26.0, max(11.0, 0.2 * n_events + 4))
    fig, axes = plt.subplots(len(ranks), 1, figsize=(width, 3.3 * len(ranks) + 3.0), sharex=True, squeeze=False,
                             layout="constrained")
    axes = axes[:, 0]
    shown = [c for c in categories if any(e["bytes"].get(c, 0) for r in ranks for e in r["events"])]
    colors = dict(COLORS)
    extra_colors = iter(["#64b5cd", "#ccb974", "#8c8c8c", "#e377c2"])
    for c in shown:
        colors.setdefault(c, next(extra_colors, "#999999"))

    for ax, r in zip(axes, ranks):
        events = r["events"]
        xs = [e["index"] for e in events]
        ys = [[e["bytes"].get(c, 0) / scale for e in events] for c in shown]
        ax.stackplot(xs, ys, colors=[colors[c] for c in shown], step="mid", linewidth=0.3, edgecolor="white")
        # Phases: light bands behind backward and behind the optimizer step, boundaries as vertical lines.
        at = {e["label"]: e["index"] for e in events if e["kind"] == "boundary"}
        ax.axvspan(at["forward end"] + 0.5, at["backward end"] + 0.5, color="#f2f2f2", zorder=-2)
        ax.axvspan(at["backward end"] + 0.5, at["after step"] + 0.5, color="#e8f0e0", zorder=-2)
        for name in BOUNDARIES:
            ax.axvline(at[name], color="black", linewidth=0.6, linestyle=":", zorder=1)
        top = r["peak"]["total"] / scale
        for text, x0, x1 in (("forward", at["forward start"], at["forward end"]),
                             ("backward", at["forward end"] + 0.5, at["backward end"]),
                             ("step", at["backward end"] + 0.5, at["after step"])):
            ax.text((x0 + x1) / 2, 1.0, text, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                    fontsize=8, color="#444444")
        # The formula.
        ms = formula["model_states"] / scale
        ax.axhline(ms, color="black", linestyle="--", linewidth=1.0)
        lines = [(ms, f"formula (zk.estimate): model states,\n{formula['text']} per rank = {ms:.2f} {unit}", "--")]
        extra = formula["activations_estimate"] + formula["working_set_estimate"]
        if extra:
            with_extra = (formula["model_states"] + extra) / scale
            what = "activation estimate" + ("\n+ stage-3 working-set estimate" if formula["working_set_estimate"]
                                            else "")
            ax.axhline(with_extra, color="black", linestyle="-.", linewidth=0.9)
            lines.append((with_extra, f"model states + {what}\n= {with_extra:.2f} {unit}", "-."))
        if any("cuda_allocated" in e for e in events):
            ax.plot(xs, [e.get("cuda_allocated", 0) / scale for e in events], color="#d62728", linewidth=1.2,
                    drawstyle="steps-mid", label="torch.cuda.memory_allocated()")
        # The peak.
        peak_i = r["peak"]["total_at"]["index"]
        ax.annotate(f"peak {top:.2f} {unit}", xy=(peak_i, top), xytext=(0, 10), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8, fontweight="bold", zorder=5,
                    bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.9},
                    arrowprops={"arrowstyle": "-", "color": "black", "linewidth": 0.6})
        ax.set_ylim(0, 1.22 * max(top, max(v for v, _, _ in lines)))
        ax.set_ylabel(f"{unit} on rank {r['rank']}")
        ax.set_xlim(-0.6, len(events) - 0.4)
        ax.grid(axis="y", linewidth=0.3, alpha=0.6)
        ax.set_axisbelow(True)

    # Event labels under the last panel, coloured by kind (collectives by operation).
    last = ranks[-1]["events"]
    ticks = _labelled(last, {ranks[-1]["peak"]["total_at"]["index"]})
    ax = axes[-1]
    ax.set_xticks(ticks, [_short(last[i]) for i in ticks], rotation=90, fontsize=7)
    for label, i in zip(ax.get_xticklabels(), ticks):
        e = last[i]
        if e["kind"] == "boundary":
            label.set_fontweight("bold")
        elif e["kind"] == "collective":
            label.set_color(OP_COLORS.get(e["op"], "#333333"))
        else:
            label.set_color("#666666")
    drawn = (f"; ranks {ranks[0]['rank']}-{ranks[-1]['rank']} of {len(record['ranks'])} drawn, every rank in "
             "timeline.json" if len(record["ranks"]) > len(ranks) else "")
    ax.set_xlabel(f"events of one training step, in order (rank {ranks[-1]['rank']}'s labels{drawn})", fontsize=8)

    world = cfg["world_size"]
    how = (f"one process as rank 0 of {world} (simulated)" if cfg.get("simulate_world_size")
           else f"{world} {'NCCL' if cfg['device'].startswith('cuda') else 'gloo'} ranks")
    fig.suptitle(f"zerokit timeline: stage {cfg['stage']}, model {cfg['model']} (Ψ = {cfg['num_params']:,}), "
                 f"{cfg['precision']} + AdamW, {how}, batch {cfg['batch_size']} x {cfg['seq_len']} tokens per rank, "
                 f"device {cfg['device']}", fontsize=10)
    # One legend for every panel, right of them: categories top-down as stacked, then the formula's lines.
    handles = [Patch(color=colors[c], label=LABELS.get(c, c)) for c in reversed(shown)]
    handles += [plt.Line2D([], [], color="black", linestyle=style, linewidth=1.0, label=text)
                for _, text, style in lines]
    if any("cuda_allocated" in e for r in ranks for e in r["events"]):
        handles.append(plt.Line2D([], [], color="#d62728", linewidth=1.2, label="torch.cuda.memory_allocated()"))
    fig.legend(handles=handles, loc="outside right center", fontsize=8, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- the command
def render(record: dict) -> list[str]:
    """Per rank: the peak of each category and of the total, in the plot's unit."""
    cats = [c for c in record["categories"] if any(r["peak"]["by_category"].get(c) for r in record["ranks"])]
    unit, scale = _unit_for(max(r["peak"]["total"] for r in record["ranks"]))
    headers = ["rank"] + cats + ["peak total", "at"]
    rows = [[str(r["rank"])] + [f"{r['peak']['by_category'][c] / scale:.3f}" for c in cats]
            + [f"{r['peak']['total'] / scale:.3f}", r["peak"]["total_at"]["label"]] for r in record["ranks"]]
    widths = [max(len(row[i]) for row in [headers] + rows) for i in range(len(headers))]
    fmt = lambda row: "  ".join(c.ljust(w) if i in (0, len(row) - 1) else c.rjust(w)  # noqa: E731
                                for i, (c, w) in enumerate(zip(row, widths)))
    return [f"peak bytes per category over the step, {unit} ({scale:,.0f} bytes)", fmt(headers),
            "  ".join("-" * w for w in widths)] + [fmt(row) for row in rows]


def run(args: argparse.Namespace) -> int:
    import torch

    from zerokit.launch import run_ranks
    from zerokit.models import PRESETS

    if args.model not in PRESETS:
        raise ValueError(f"unknown --model {args.model!r}; presets: {', '.join(PRESETS)}")
    if args.simulate_world_size is not None and args.nproc is not None:
        raise ValueError("--nproc and --simulate-world-size exclude each other: spawn ranks, or simulate one")
    nproc = 1 if args.simulate_world_size is not None else (args.nproc or 2)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available")
    cfg = {"stage": args.stage, "nproc": nproc, "simulate_world_size": args.simulate_world_size,
           "precision": args.precision, "model": args.model, "batch_size": args.batch_size,
           "seq_len": PRESETS[args.model].block_size, "bucket_numel": args.bucket_numel, "device": device,
           "seed": args.seed}
    start = time.perf_counter()
    if args.simulate_world_size is not None:
        if device == "cuda":
            torch.cuda.set_device(0)
        per_rank = [timeline_rank(0, 1, cfg)]
    else:
        per_rank = run_ranks(timeline_rank, nproc, cfg, timeout_s=args.timeout,
                             backend="nccl" if device == "cuda" else "gloo")
    record = build_record(per_rank, cfg, command_of(args))
    record["seconds"] = round(time.perf_counter() - start, 2)
    for line in render(record):
        print(line)
    f = record["formula"]
    print(f"formula (zk.estimate), model states: {f['model_states']:,} bytes per rank ({f['text']}); "
          f"{len(record['ranks'][0]['events'])} events on rank 0")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / "timeline.json", args.out / "timeline.png"
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    plot(json.loads(json_path.read_text()), png_path)  # the picture is drawn from what was written
    print(f"wrote {json_path} and {png_path} ({record['seconds']:.0f} s)")
    return 0

