"""`zerokit compare`: every ZeRO stage and torch's DDP on the same model and data, side by side.

    python -m zerokit compare --nproc 2            # what scripts/demo.sh runs

One spawn of `--nproc` gloo ranks trains, in turn, zerokit's stages 0-3 (those whose module
imports) and torch's `DistributedDataParallel` (the reference), each from the same initial
weights on the same batches, with the same loop body. It reports per run:

* loss: the final loss and the largest |loss - torch DDP's loss| over all steps (rank 0's
  local loss, step by step; at fp32 on 2 ranks every stage matches DDP bit for bit unless
  `--clip` is on: zerokit sums the squared norm over shards, torch per tensor, so the clip
  coefficients differ in the last bit and the runs drift apart by ~1e-5 over 30 steps);
* memory: this rank's bytes by category after the last step, measured (`engine.memory()`,
  core/accounting/ledger.py `ledger`) beside the formula (`zk.estimate`), plus activations measured
  around the first forward+backward (saved-tensor hooks on CPU);
* communication: logical bytes per step (ZeRO accounting: all-reduce 2B, reduce-scatter and
  all-gather B each) measured from the engine's counters beside the formula: 2Ψg for stages
  0-2, 3Ψg (1.5x) for stage 3; for torch DDP a counting communication hook measures the same;
* time: median step time in ms after `WARMUP_STEPS` warm-up steps.

It prints one table, writes `compare.json` (every number, per rank, with hardware, versions,
command and date) and `compare.png`, drawn from that JSON by `plot()`: per run, the formula's
stacked bar (params / grads / master / optimizer states, hatched) beside the measured one, the
shape of the ZeRO paper's figure 1, and logical bytes per step beside their formula.

zerokit's step is `zerokit train`'s: `train_step` (commands/step.py: zero_grad, forward,
backward, clip, step), without train's progress bar, checkpointing and LoRA switches; torch's
DDP (zerokit/bench.py's `torch_ddp`, with a byte-counting hook) makes the same calls in torch's own
API. `_timed_steps`, one loop for both around zerokit/bench.py's `timed_step`, adds a communication
delta per step.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

from zerokit.bench import decay_groups, median_after, no_decay, timed_step, torch_ddp, unique_bytes
from zerokit.provenance import git_commit, machine, versions

CPU = torch.device("cpu")
WARMUP_STEPS = 2
MODEL_STATES = ("params", "grads", "master_params", "optimizer_states")
LABELS = {"params": "params", "grads": "grads", "master_params": "fp32 master", "optimizer_states": "optimizer states"}


def stage_list(text: str) -> list[int]:
    """An argparse `type=` for --stages: comma-separated stages, each 0-3, e.g. "0,2,3"."""
    import zerokit as zk

    try:
        stages = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 0,2,3, got {text!r}") from None
    bad = [s for s in stages if s not in zk.STAGES]
    if bad or not stages:
        raise argparse.ArgumentTypeError(f"each stage must be between {min(zk.STAGES)} and {max(zk.STAGES)}, "
                                         f"got {text!r}")
    return list(dict.fromkeys(stages))  # in the order given, once each


def add_arguments(p: argparse.ArgumentParser) -> None:
    from zerokit.cli import non_negative_float, positive_float, positive_int

    p.add_argument("--nproc", type=positive_int, default=2, help="gloo ranks to spawn (>= 1, default 2)")
    p.add_argument("--steps", type=positive_int, default=50, help="optimizer steps per run (>= 1, default 50)")
    p.add_argument("--model", default="small", help="model preset: tiny or small (default small)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="precision of zerokit's stages; torch DDP always runs fp32 (default fp32)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per rank per step (>= 1, default 8)")
    p.add_argument("--lr", type=non_negative_float, default=3e-3)
    p.add_argument("--clip", type=non_negative_float, default=0.0,
                   help="global gradient-norm clip, 0 = off (default off: zerokit and torch compute the norm in "
                        "different orders, so clipping alone makes them differ in the last bits)")
    p.add_argument("--bucket-numel", type=positive_int, default=1 << 16,
                   help="elements per gradient bucket (default 65536: several buckets for the small model)")
    p.add_argument("--stages", type=stage_list, default=[0, 1, 2, 3],
                   help="comma-separated stages to run, each 0-3 (default 0,1,2,3); torch DDP always runs")
    p.add_argument("--out", type=Path, default=Path("out/compare"), help="directory for compare.json and compare.png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=positive_float, default=1800, help="seconds before the ranks are killed")


def available_stages(wanted: list[int]) -> tuple[list[int], dict[int, str]]:
    """The wanted stages whose engine class imports, and why each other one was skipped."""
    import zerokit as zk

    ok, skipped = [], {}
    for stage in wanted:
        if stage not in zk.STAGES:
            skipped[stage] = "not a stage"
            continue
        module_name, class_name = zk.STAGES[stage].split(":")
        try:
            getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            skipped[stage] = f"{type(exc).__name__}: {exc}"
            continue
        ok.append(stage)
    return ok, skipped


# ----------------------------------------------------------------------------- one rank
def _timed_steps(cfg: dict, rank: int, world_size: int, train_one, comm_total, model) -> dict:
    """The shared loop: `train_one(x, y)` is one whole optimizer step and returns its loss.

    Returns losses, step times, the comm bytes of the last step and the activations of the first.
    """
    from zerokit.core.accounting.ledger import ActivationMeter
    from zerokit.models import CharCorpus

    corpus = CharCorpus.load()
    block = model.cfg.block_size
    losses, times, activation_bytes = [], [], None
    comm_last = 0

    def measured_first(x, y):  # activations on a warm-up step (the hooks cost time)
        nonlocal activation_bytes
        with ActivationMeter(exclude=model, use_cuda_allocator=False) as meter:
            loss = train_one(x, y)  # autograd saves tensors in forward only, not in clip or step
        activation_bytes = meter.peak_bytes
        return loss

    for i in range(cfg["steps"]):
        x, y = corpus.batch(cfg["batch_size"], block, i, rank, world_size)
        before = comm_total()
        ms, loss_value = timed_step(measured_first if i == 0 else train_one, lambda: None, x, y, CPU)
        times.append(ms)
        comm_last = comm_total() - before
        losses.append(loss_value)
    return {"losses": losses, "step_ms": times, "step_ms_median": median_after(times, WARMUP_STEPS),
            "comm_bytes_per_step": comm_last, "activation_bytes": activation_bytes}


def _run_zerokit(rank: int, world_size: int, cfg: dict, stage: int) -> dict:
    import zerokit as zk
    from zerokit.commands.step import train_step
    from zerokit.core.accounting.estimate import activation_bytes_estimate, comm_bytes_per_step
    from zerokit.core.accounting.ledger import ledger
    from zerokit.models import Block, build_model

    model = build_model(cfg["model"], seed=cfg["seed"])
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=cfg["precision"], lr=cfg["lr"],
                      weight_decay=0.1, bucket_numel=cfg["bucket_numel"], wrap=(Block,), param_groups=no_decay)

    def train_one(x, y):
        return train_step(engine, [(x, y)], lambda batch: engine(*batch)[1],
                          clip=cfg["clip"] if cfg["clip"] > 0 else None).loss

    out = _timed_steps(cfg, rank, world_size, train_one, lambda: sum(engine.comm_stats().values()), model)
    psi = out["num_params"] = sum(p.numel() for p in model.parameters())
    out["ledger"] = ledger(engine, activation_bytes=out["activation_bytes"],
                           predicted_activations=activation_bytes_estimate(model.cfg, cfg["batch_size"],
                                                                           cfg["precision"]))
    g = torch.empty((), dtype=engine.policy.reduce_dtype).element_size()
    p = torch.empty((), dtype=engine.policy.param_dtype).element_size()
    out["comm_formula_per_step"] = comm_bytes_per_step(psi, stage, p, g) if world_size > 1 else 0
    out["comm_by_kind_total"] = engine.comm_stats()
    out["name"], out["stage"] = f"zerokit {stage}", stage
    return out


def _run_torch_ddp(rank: int, world_size: int, cfg: dict) -> dict:
    from zerokit.core.accounting.estimate import activation_bytes_estimate, comm_bytes_per_step, estimate
    from zerokit.models import build_model

    model = build_model(cfg["model"], seed=cfg["seed"])
    ddp, sent = torch_ddp(model, cfg["bucket_numel"], count_comm=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(decay_groups(model.named_parameters()), lr=cfg["lr"], weight_decay=0.1)

    def train_one(x, y):
        _, loss = ddp(x, y)
        loss.backward()
        if cfg["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg["clip"])
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep .grad allocated, as zerokit's flat buffers are
        return loss

    out = _timed_steps(cfg, rank, world_size, train_one, lambda: sent[0], model)
    psi = out["num_params"] = sum(p.numel() for p in model.parameters())
    measured = {
        "params": unique_bytes(model.parameters()),
        "grads": unique_bytes(p.grad for p in model.parameters() if p.grad is not None),
        "master_params": 0,
        "optimizer_states": unique_bytes(t for s in opt.state.values() for t in s.values()
                                          if torch.is_tensor(t) and t.dim() > 0),
        "comm_buffers": None,  # DDP's reducer buckets are not reachable through public API
        "activations": out["activation_bytes"],
    }
    est = estimate(psi, world_size, 0, "fp32", "adam")
    predicted = {c: getattr(est, c) for c in MODEL_STATES}
    predicted.update(comm_buffers=None, activations=activation_bytes_estimate(model.cfg, cfg["batch_size"], "fp32"))
    out["ledger"] = {"measured": measured, "predicted": predicted,
                     "relative_error": {c: _rel(measured[c], predicted[c]) for c in measured},
                     "config": {"stage": 0, "world_size": world_size, "rank": rank, "precision": "fp32",
                                "optimizer": "adam", "num_params": psi, "trainable_params": psi}}
    out["comm_formula_per_step"] = comm_bytes_per_step(psi, 0, 4, 4) if world_size > 1 else 0
    out["name"], out["stage"] = "torch DDP", None
    return out



def _rel(measured: int | None, predicted: int | None) -> float | None:
    if measured is None or predicted is None:
        return None
    if predicted == 0:
        return 0.0 if measured == 0 else float("inf")
    return (measured - predicted) / predicted


def compare_rank(rank: int, world_size: int, cfg: dict) -> list[dict]:
    """Every run on this rank, in order: zerokit stages, then torch DDP."""
    runs = [_run_zerokit(rank, world_size, cfg, stage) for stage in cfg["stages"]]
    runs.append(_run_torch_ddp(rank, world_size, cfg))
    return runs


# ----------------------------------------------------------------------------- the parent
def combine(per_rank: list[list[dict]], cfg: dict, skipped: dict[int, str]) -> dict:
    """The JSON record: one entry per run, rank 0's losses, every rank's ledger."""
    reference = per_rank[0][-1]["losses"]  # torch DDP, rank 0
    runs = []
    for k, first in enumerate(per_rank[0]):
        losses = first["losses"]
        stage0 = next((r["losses"] for r in per_rank[0] if r["stage"] == 0), None)
        runs.append({
            "name": first["name"], "stage": first["stage"], "num_params": first["num_params"],
            "losses": losses, "final_loss": losses[-1],
            "max_abs_loss_diff_vs_torch_ddp": max(abs(a - b) for a, b in zip(losses, reference)),
            "max_abs_loss_diff_vs_stage0": (max(abs(a - b) for a, b in zip(losses, stage0))
                                            if stage0 is not None else None),
            "step_ms_median": max(r[k]["step_ms_median"] for r in per_rank),  # the slowest rank sets the pace
            "step_ms": [r[k]["step_ms"] for r in per_rank],
            "comm_bytes_per_step": [r[k]["comm_bytes_per_step"] for r in per_rank],
            "comm_formula_per_step": first["comm_formula_per_step"],
            "memory": [r[k]["ledger"] for r in per_rank],
        })
    return {"meta": environment(cfg), "config": {k: v for k, v in cfg.items() if k != "out"},
            "skipped_stages": {str(k): v for k, v in skipped.items()}, "runs": runs}


def environment(cfg: dict | None = None) -> dict:
    """Hardware, versions, exact command and date, for every results file (zerokit/provenance.py's facts)."""
    m, v = machine(), versions()
    return {
        "command": " ".join([Path(sys.executable).name, "-m", "zerokit"] + sys.argv[1:])
        if sys.argv and sys.argv[0].endswith(("__main__.py", "zerokit")) else " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": m["hostname"], "platform": m["platform"], "processor": platform.processor(),
        "cpu_count": m["cpu_count"], "python": v["python"], "torch": v["torch"],
        "cuda": m["gpus"][0] if m["gpus"] else None,
        "commit": git_commit(),
    }


def _kb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e3:,.1f}"


def render(record: dict) -> list[str]:
    """The table: one row per run; bytes are rank 0's, KB = 1000 bytes, 'measured/formula'."""
    headers = ["run", "final loss", "max|Δ| vs DDP", "params KB", "grads KB", "master KB", "opt states KB",
               "act KB", "comm/step KB", "x DDP", "step ms"]
    rows = []
    ddp_comm = next(r["comm_formula_per_step"] for r in record["runs"] if r["stage"] == 0 or r["stage"] is None)
    for run in record["runs"]:
        m, p = run["memory"][0]["measured"], run["memory"][0]["predicted"]
        comm = run["comm_bytes_per_step"][0]
        rows.append([run["name"], f"{run['final_loss']:.4f}", f"{run['max_abs_loss_diff_vs_torch_ddp']:.1e}"]
                    + [f"{_kb(m[c])}/{_kb(p[c])}" for c in MODEL_STATES]
                    + [_kb(m["activations"]), f"{_kb(comm)}/{_kb(run['comm_formula_per_step'])}",
                       f"{comm / ddp_comm:.2f}" if ddp_comm else "-", f"{run['step_ms_median']:.1f}"])
    widths = [max(len(r[i]) for r in [headers] + rows) for i in range(len(headers))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]


def plot(record: dict, path: Path) -> None:
    """The PNG: per run, formula (hatched) and measured stacked bars by category; comm per step beside its formula."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = record["runs"]
    colors = {"params": "#4c72b0", "grads": "#dd8452", "master_params": "#55a868", "optimizer_states": "#c44e52"}
    fig, (ax_mem, ax_comm) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.38
    for i, run in enumerate(runs):
        ledger = run["memory"][0]
        for offset, source, hatch in ((-width / 2, "predicted", "//"), (width / 2, "measured", None)):
            bottom = 0.0
            for c in MODEL_STATES:
                value = ledger[source][c] / 1e6
                ax_mem.bar(i + offset, value, width, bottom=bottom, color=colors[c], hatch=hatch,
                           alpha=0.55 if hatch else 1.0, edgecolor="black", linewidth=0.5,
                           label=LABELS[c] if i == 0 and source == "measured" else None)
                bottom += value
    names = [r["name"] for r in runs]
    cfg = record["config"]
    ax_mem.set_xticks(range(len(runs)), names)
    ax_mem.set_ylabel("MB per rank (10^6 bytes)")
    ax_mem.set_title(f"Model states per rank: {cfg['model']} (Ψ = {runs[0]['num_params']:,}), "
                     f"N = {cfg['nproc']}, {cfg['precision']} + AdamW\nleft bar: formula (hatched), right: measured",
                     fontsize=10)
    ax_mem.legend(loc="upper center", ncol=4, fontsize=8)
    ax_mem.set_ylim(0, 1.2 * ax_mem.get_ylim()[1])
    xs = range(len(runs))
    ax_comm.bar([x - width / 2 for x in xs], [r["comm_formula_per_step"] / 1e6 for r in runs], width,
                color="#8c8c8c", hatch="//", alpha=0.55, edgecolor="black", linewidth=0.5, label="formula")
    ax_comm.bar([x + width / 2 for x in xs], [r["comm_bytes_per_step"][0] / 1e6 for r in runs], width,
                color="#8172b2", edgecolor="black", linewidth=0.5, label="measured")
    ax_comm.set_xticks(list(xs), names)
    ax_comm.set_ylabel("MB per step per rank (logical, ZeRO accounting)")
    ax_comm.set_title("Logical bytes sent per step\nformula: 2Ψg for stages 0-2, 3Ψg for stage 3", fontsize=10)
    ax_comm.legend(loc="upper left", fontsize=8)
    ax_comm.set_ylim(0, 1.2 * ax_comm.get_ylim()[1])
    for ax in (ax_mem, ax_comm):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from zerokit.launch import run_ranks
    from zerokit.models import PRESETS

    if args.model not in PRESETS:
        raise ValueError(f"unknown --model {args.model!r}; presets: {', '.join(PRESETS)}")
    stages, skipped = available_stages(args.stages)
    for stage, why in skipped.items():
        print(f"stage {stage} skipped: {why}")
    cfg = {"model": args.model, "nproc": args.nproc, "steps": args.steps, "precision": args.precision,
           "batch_size": args.batch_size, "lr": args.lr, "clip": args.clip, "bucket_numel": args.bucket_numel, "seed": args.seed,
           "stages": stages}
    start = time.perf_counter()
    per_rank = run_ranks(compare_rank, args.nproc, cfg, timeout_s=args.timeout)
    record = combine(per_rank, cfg, skipped)
    record["meta"]["seconds"] = time.perf_counter() - start
    print(f"{args.nproc} gloo rank(s), model {args.model} (Ψ = {record['runs'][0]['num_params']:,}), "
          f"{args.steps} steps of {args.batch_size} sequences per rank, {args.precision} (torch DDP: fp32), AdamW; "
          f"bytes are rank 0's, measured/formula")
    for line in render(record):
        print(line)
    print("loss: rank 0's local loss; max|Δ| over all steps against torch DDP on the same batches. "
          f"step ms: median after {WARMUP_STEPS} warm-up steps, slowest rank. "
          "act: saved-for-backward peak of the first step.")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / "compare.json", args.out / "compare.png"
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    plot(json.loads(json_path.read_text()), png_path)  # the plot reads what was written
    print(f"wrote {json_path} and {png_path} ({record['meta']['seconds']:.0f} s)")
    return 0
