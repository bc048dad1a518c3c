"""Per-rank memory of every ZeRO stage, measured, beside the formula that predicts it.

    python benchmarks/memory_per_stage.py                 # everything this machine can run
    python benchmarks/memory_per_stage.py --quick         # small model only (a minute on 2 CPU cores)

Three kinds of configuration, each one training step (forward, backward, optimizer step) and
then `core.ledger.ledger(engine)`:

* gloo: `--nproc` real ranks on CPU (spawned once for every stage and precision), model "small";
* simulated: one process playing rank 0 of N (8, 64) — `zerokit memory --simulate`'s
  `simulate_rank` — for "small" and, unless --quick, gpt2-small (124M parameters) at N = 64:
  the lecture's claim that a rank of 64 holds 16Ψ/64 at stage 3, with real allocations;
* cuda (only when CUDA is available): NCCL ranks, one per GPU, and a simulated rank of 64 on
  GPU 0; activations there come from `torch.cuda.max_memory_allocated`.

Writes benchmarks/results/memory_per_stage_<cpu | gpu name>.json and .md, each with the
hardware, versions, exact command and date, and prints one row per configuration: bytes per
category, measured / formula, and the relative error of the model-state total.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from zerokit.commands.compare import available_stages  # noqa: E402
from zerokit.commands.memory import simulate_rank  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from _results import git_commit  # noqa: E402  (benchmarks/_results.py, beside this script)

MODEL_STATES = ("params", "grads", "master_params", "optimizer_states")
COLUMNS = MODEL_STATES + ("comm_buffers", "activations")


def _real_rank(rank: int, world_size: int, jobs: list[tuple[int, str]], model_name: str, device_kind: str) -> list:
    """One step per (stage, precision) on this real rank; the ledger of each."""
    import zerokit as zk
    from zerokit.commands.memory import optimizer_for
    from zerokit.core.estimate import activation_bytes_estimate
    from zerokit.core.ledger import ActivationMeter, ledger
    from zerokit.models import Block, build_model, preset

    device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = preset(model_name)
    out = []
    for stage, precision in jobs:
        model = build_model(cfg).to(device)
        optimizer_cls, kwargs = optimizer_for("adam")
        scaler = {"init_scale": 16.0} if precision == "fp16" else None  # take the first step
        engine = zk.shard(model, optimizer_cls, stage=stage, precision=precision, wrap=(Block,),
                          loss_scaler=scaler, **kwargs)
        gen = torch.Generator().manual_seed(rank)
        x, y = (torch.randint(cfg.vocab_size, (1, 8), generator=gen).to(device) for _ in range(2))
        with ActivationMeter(exclude=model) as meter:
            _, loss = engine(x, y)
            engine.backward(loss)
        engine.step()
        result = ledger(engine, meter.peak_bytes, activation_bytes_estimate(cfg, 1, precision, seq_len=8))
        result["config"].update(model=model_name, mode=f"{device_kind} ranks", device=str(device))
        out.append(result)
        del engine, model
    return out


def hardware() -> dict:
    info = {"hostname": socket.gethostname(), "platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu_model"] = names[0] if names else None
    except OSError:
        info["cpu_model"] = None
    return info


def row_text(r: dict) -> str:
    c = r["config"]
    cells = []
    for k in COLUMNS:
        m, p = r["measured"].get(k), r["predicted"].get(k)
        cells.append(f"{'-' if m is None else f'{m / 1e6:.3f}'}/{'-' if p is None else f'{p / 1e6:.3f}'}")
    total_m = sum(r["measured"][k] for k in MODEL_STATES)
    total_p = sum(r["predicted"][k] for k in MODEL_STATES)
    err = f"{100 * (total_m - total_p) / total_p:+.3f}%"
    return (f"| {c['mode']} | {c['model']} | {c['world_size']} | {c['stage']} | {c['precision']} | "
            + " | ".join(cells) + f" | {err} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="model 'small' only (no gpt2-small)")
    parser.add_argument("--nproc", type=int, default=2, help="real gloo ranks on CPU (default 2)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()

    commit = git_commit()  # taken before the run: the code that produced the numbers
    stages, skipped = available_stages([0, 1, 2, 3])
    precisions = ("fp32", "bf16")
    rows: list[dict] = []
    start = time.perf_counter()
    header = ("| mode | model | N | stage | precision | " + " | ".join(f"{k} MB" for k in COLUMNS)
              + " | model-state error |")
    print("bytes per rank, measured/formula (MB = 10^6 bytes)")
    print(header)

    def emit(result: dict) -> None:
        rows.append(result)
        print(row_text(result), flush=True)

    jobs = [(s, p) for s in stages for p in precisions]
    for result in run_ranks(_real_rank, args.nproc, jobs, "small", "cpu", timeout_s=900)[0]:
        emit(result)
    simulated = [("small", n, s, p) for n in (8, 64) for s in stages for p in precisions]
    if not args.quick:
        simulated += [("gpt2-small", 64, s, "bf16") for s in stages]
    for model, n, stage, precision in simulated:
        result = simulate_rank(model, n, stage, precision, device="cpu")
        result["config"]["mode"] = "simulated (cpu)"
        emit(result)
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        for result in run_ranks(_real_rank, n, jobs, "small", "cuda", backend="nccl", timeout_s=900)[0]:
            emit(result)
        for stage in stages:
            result = simulate_rank("gpt2-small", 64, stage, "bf16", device="cuda")
            result["config"]["mode"] = "simulated (cuda)"
            emit(result)

    tag = "cpu"
    if torch.cuda.is_available():
        tag = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")
    meta = {"command": " ".join([Path(sys.executable).name] + sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "seconds": round(time.perf_counter() - start, 1), "hardware": hardware(),
            "skipped_stages": {str(k): v for k, v in skipped.items()},
            "notes": "one training step (batch 1 x 8 tokens), AdamW; measured = core.ledger.ledger after step(); "
                     "formula = zk.estimate (model states) and activation_bytes_estimate (activations)"}
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.out / f"memory_per_stage_{tag}.json", args.out / f"memory_per_stage_{tag}.md"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    hw = meta["hardware"]
    md = [f"# Per-rank memory per ZeRO stage, measured vs formula ({tag})", "",
          f"- command: `{meta['command']}`", f"- date: {meta['date']} ({meta['seconds']} s)",
          f"- commit: {meta['commit']}",
          f"- hardware: {hw['cpu_model'] or hw['processor']}, {hw['cpu_count']} CPUs"
          + (f", GPUs: {', '.join(hw['cuda_devices'])}" if hw["cuda_devices"] else ""),
          f"- versions: Python {hw['python']}, torch {hw['torch']}", f"- {meta['notes']}",
          "- each cell: measured/formula in MB (10^6 bytes); comm_buffers has no formula; activations on CPU are "
          "the saved-for-backward peak, on CUDA the allocator's peak during forward+backward", "",
          header, "|" + "---|" * (5 + len(COLUMNS) + 1)] + [row_text(r) for r in rows]
    md_path.write_text("\n".join(md) + "\n")
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
