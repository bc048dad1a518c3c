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

    python benchmarks/memory_per_stage.py --device cuda --model gpt2-xl --world-sizes 8 64
    python benchmarks/memory_per_stage.py --device cpu --model tiny --world-sizes 8 --steps 1   # a dry run

`--device` selects a fourth kind instead of the three above: simulated ranks only (one process
as rank 0 of each N in --world-sizes, `Comm(simulate=Simulated(0, N))` passed to `zk.shard`),
each stage of --stages, the model built directly on the device (`with torch.device(...)`, so a
1.5B-parameter gpt2-xl takes no CPU initialisation), --steps training steps of --batch-size x
--seq-len tokens. After the last step it takes the ledger (model states by category beside
`zk.estimate`) and, on CUDA, the allocator: `torch.cuda.memory_allocated()` after the step,
and `torch.cuda.max_memory_allocated()` during the step (forward, backward, optimizer step),
each minus what was allocated before the model was built, beside the formula's model states
(+ `activation_bytes_estimate`, + at stage 3 `zero3_working_set_bytes`). Results go through
zerokit/provenance.py (`provenance`, `write_pair`) to memory_per_stage_<device>_<model>.json
and .md; the default run above and its files are unchanged.
"""
from __future__ import annotations

import argparse
import datetime
import gc
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
from zerokit.provenance import command_line, git_commit, provenance, provenance_lines, write_pair  # noqa: E402

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
    device = parser.add_argument_group(
        "simulated ranks on one device (only with --device; replaces the default run)")
    device.add_argument("--device", choices=("cpu", "cuda"),
                        help="measure simulated ranks on this device, with the allocator's numbers on cuda")
    defaults = {"model": "gpt2-xl", "world_sizes": [8, 64], "stages": [0, 1, 2, 3], "precision": "bf16",
                "batch_size": 1, "seq_len": 1024, "steps": 2, "prefetch": 1}
    device.add_argument("--model", help="models.py preset (default gpt2-xl, 1.56e9 parameters)")
    device.add_argument("--world-sizes", type=_positive, nargs="+", metavar="N",
                        help="simulated world sizes; this process is rank 0 of each (default 8 64)")
    device.add_argument("--stages", type=int, nargs="+", choices=(0, 1, 2, 3), help="default 0 1 2 3")
    device.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default bf16")
    device.add_argument("--batch-size", type=_positive, help="sequences per step (default 1)")
    device.add_argument("--seq-len", type=_positive, help="tokens per sequence (default 1024)")
    device.add_argument("--steps", type=_positive,
                        help="training steps; the last is measured (default 2: the first creates the optimizer "
                             "states)")
    device.add_argument("--prefetch", type=int, help="stage 3's gather-ahead depth (default 1)")
    args = parser.parse_args()
    given = [k for k in defaults if getattr(args, k) is not None]
    if args.device is None and given:
        parser.error(f"--{given[0].replace('_', '-')} is an option of --device (simulated ranks); pass --device too")
    if args.device is not None:
        for key, value in defaults.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        return device_main(args)

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


# ----------------------------------------------------------------------------- --device: simulated ranks
def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _cuda_allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def measure_simulated(model_name: str, world_size: int, stage: int, precision: str, device: torch.device,
                      batch_size: int = 1, seq_len: int = 1024, steps: int = 2, prefetch: int = 1) -> dict:
    """One process as rank 0 of `world_size`: build on `device`, shard, train `steps` steps, measure the last.

    Returns `core.ledger.ledger(...)` (model states by category beside `zk.estimate`; activations
    from `ActivationMeter`, which on CUDA is the allocator's peak during forward + backward above
    what was allocated when forward began) plus, under "cuda" (None on CPU), bytes from the
    allocator relative to `baseline` (allocated before the model was built): `after_step`
    (allocated after the last step), `peak_step` (max allocated during the last step: forward,
    backward, optimizer step), `peak_first_step` (the first, which also creates the optimizer
    states), `peak_build` (building and sharding the model) and `leftover` (allocated after the
    engine and model are deleted: a leak would show here and in the next row's baseline).
    """
    import zerokit as zk
    from zerokit.commands.memory import optimizer_for
    from zerokit.core.estimate import activation_bytes_estimate, zero3_working_set_bytes
    from zerokit.core.ledger import ActivationMeter, ledger
    from zerokit.models import Block, build_model, preset

    cfg = preset(model_name)
    if not 1 <= seq_len <= cfg.block_size:
        raise SystemExit(f"--seq-len must be in [1, {cfg.block_size}] for {model_name}, got {seq_len}")
    cuda = device.type == "cuda"
    start = time.perf_counter()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    baseline = _cuda_allocated(device)
    with device:  # parameters created on the device: no CPU init, no host-to-device copy
        net = build_model(cfg)
    optimizer_cls, kwargs = optimizer_for("adam")
    engine = zk.shard(net, optimizer_cls, stage=stage, precision=precision, wrap=(Block,), prefetch=prefetch,
                      comm=zk.Comm(simulate=zk.Simulated(0, world_size)),
                      loss_scaler={"init_scale": 16.0} if precision == "fp16" else None, **kwargs)
    peak_build = torch.cuda.max_memory_allocated(device) if cuda else None
    gen = torch.Generator().manual_seed(0)
    peaks, meter = [], None
    for _ in range(steps):
        x, y = (torch.randint(cfg.vocab_size, (batch_size, seq_len), generator=gen).to(device) for _ in range(2))
        engine.zero_grad()
        # ActivationMeter resets the CUDA peak on entry; the peak then runs on through step(). On CUDA it
        # reads the allocator, so the per-saved-tensor exclusion of the model's ~600 parameters (CPU's
        # measure) is skipped: it would cost seconds per gpt2-xl step.
        with ActivationMeter(exclude=() if cuda else net, use_cuda_allocator=cuda) as meter:
            _, loss = engine(x, y)
            engine.backward(loss)
        engine.step()
        del loss
        if cuda:
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device) - baseline)
    after_step = _cuda_allocated(device)
    result = ledger(engine, meter.peak_bytes,
                    activation_bytes_estimate(cfg, batch_size, precision, seq_len=seq_len))
    result["config"].update(model=model_name, mode=f"simulated ({device.type})", device=str(device),
                            batch_size=batch_size, seq_len=seq_len, steps=steps, prefetch=prefetch, simulated=True)
    result["saved_tensor_peak_bytes"] = None if cuda else meter.saved_peak_bytes
    result["working_set_estimate"] = zero3_working_set_bytes(cfg, precision, prefetch) if stage == 3 else 0
    result["unsharded_param_bytes_after_step"] = (engine.unsharded_param_bytes()
                                                  if hasattr(engine, "unsharded_param_bytes") else 0)
    del engine, net, meter
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        result["cuda"] = {"baseline": baseline, "after_step": after_step - baseline, "peak_step": peaks[-1],
                          "peak_first_step": peaks[0], "peak_build": peak_build - baseline,
                          "leftover": _cuda_allocated(device) - baseline}
    else:
        result["cuda"] = None
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


UNIT_BYTES = {"GB": 10**9, "MB": 10**6}


def _in(num_bytes: int | None, unit: str) -> str:
    return "-" if num_bytes is None else f"{num_bytes / UNIT_BYTES[unit]:.3f}"


def _pct(measured: int | None, predicted: int | None) -> str:
    if measured is None or not predicted:
        return "-"
    return f"{100 * (measured - predicted) / predicted:+.2f}%"


def device_header(unit: str) -> str:
    return (f"| N | stage | formula | model states {unit} (ledger / formula) | ledger error "
            f"| allocated after step {unit} | vs formula | peak during step {unit} "
            f"| formula + activations (+ working set) {unit} | peak / that | activations {unit} (measured / estimate) "
            f"| first-step peak {unit} | build peak {unit} | s |")


def device_row(r: dict, unit: str) -> str:
    """One Markdown row: the ledger against the formula, then the allocator against it."""
    from zerokit.core.estimate import per_rank_formula

    c = r["config"]
    states_m = sum(r["measured"][k] for k in MODEL_STATES)
    states_p = sum(r["predicted"][k] for k in MODEL_STATES)
    act_p = r["predicted"]["activations"] or 0
    budget = states_p + act_p + r["working_set_estimate"]
    cu = r["cuda"] or {}
    peak = cu.get("peak_step")
    ratio = "-" if peak is None else f"{peak / budget:.3f}"
    formula = per_rank_formula(c["stage"], c["precision"], c["optimizer"])
    def b(num_bytes):
        return _in(num_bytes, unit)
    return (f"| {c['world_size']} | {c['stage']} | {formula} | {b(states_m)} / {b(states_p)} "
            f"| {_pct(states_m, states_p)} | {b(cu.get('after_step'))} | {_pct(cu.get('after_step'), states_p)} "
            f"| {b(peak)} | {b(budget)} | {ratio} | {b(r['measured']['activations'])} / {b(act_p)} "
            f"| {b(cu.get('peak_first_step'))} | {b(cu.get('peak_build'))} | {r['seconds']:.1f} |")


def device_main(args: argparse.Namespace) -> int:
    """--device: simulated ranks of every --world-sizes x --stages, results through zerokit/provenance.py."""
    from zerokit.models import num_params, preset

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("memory_per_stage.py --device cuda: torch.cuda.is_available() is False here")
        device = torch.device("cuda", torch.cuda.current_device())
    prov = provenance(command_line(__file__))  # before the run: the code that produced the numbers
    stages, skipped = available_stages(sorted(set(args.stages)))
    cfg = preset(args.model)
    psi = num_params(cfg)
    unit = "GB" if 16 * psi >= 10**10 else "MB"  # 16 bytes per parameter: stage 0's model states under Adam
    print(f"{args.model} (Ψ = {psi:,}), {args.precision} + AdamW, simulated rank 0 of N, on {device}; "
          f"{args.steps} step(s) of {args.batch_size} x {args.seq_len} tokens; {unit} = {UNIT_BYTES[unit]:.0e} bytes")
    print(device_header(unit))
    rows, start = [], time.perf_counter()
    for world_size in args.world_sizes:
        for stage in stages:
            r = measure_simulated(args.model, world_size, stage, args.precision, device, args.batch_size,
                                  args.seq_len, args.steps, args.prefetch)
            rows.append(r)
            print(device_row(r, unit), flush=True)
    tag = "cpu"
    if device.type == "cuda":
        tag = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    model_tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", args.model)
    record = {"provenance": prov, "seconds": round(time.perf_counter() - start, 1),
              "config": {"model": args.model, "num_params": psi, "precision": args.precision, "optimizer": "adam",
                         "world_sizes": args.world_sizes, "stages": stages, "batch_size": args.batch_size,
                         "seq_len": args.seq_len, "steps": args.steps, "prefetch": args.prefetch,
                         "device": str(device)},
              "skipped_stages": {str(k): v for k, v in skipped.items()}, "rows": rows}
    md = [f"# Per-rank memory per ZeRO stage on {tag}: {args.model}, simulated ranks", "",
          *provenance_lines(prov), f"- total: {record['seconds']} s", "",
          f"{args.model}: Ψ = {psi:,} parameters, {args.precision} + AdamW"
          + (" (fp32 master and states)" if args.precision != "fp32" else "") + ", one process "
          f"playing rank 0 of N (`Comm(simulate=Simulated(0, N))`: collectives return correctly shaped local "
          f"results, so the allocations are a real rank's), model built on {device.type}, {args.steps} training "
          f"step(s) of {args.batch_size} x {args.seq_len} tokens, the last one measured"
          + (f", stage 3 prefetch {args.prefetch}" if 3 in stages else "")
          + f". {unit} = 10^{len(str(UNIT_BYTES[unit])) - 1} bytes.", "",
          device_header(unit), "|" + "---|" * (device_header(unit).count("|") - 1)]
    md += [device_row(r, unit) for r in rows]
    md += ["", "- model states (ledger): `engine.memory()` after the last step, params + grads + fp32 master + "
           "optimizer states, each storage once; formula: `zk.estimate` for the same Ψ, N, stage, precision.",
           "- allocated after step: `torch.cuda.memory_allocated()` after the last step minus what was allocated "
           "before the model was built; beyond the model states it holds whatever else is alive (cuBLAS "
           "workspace, token ids, communication buffers if a stage kept any).",
           "- peak during step: `torch.cuda.max_memory_allocated()` over the last step's forward, backward and "
           "optimizer step, minus the same baseline; compared with the formula's model states + "
           "`activation_bytes_estimate` + at stage 3 `zero3_working_set_bytes` (root + (1 + prefetch) units, "
           "params and grads). The estimate leaves out gradient buffers alive during backward, the logits' "
           "gradient, optimizer temporaries and allocator rounding, so a ratio above 1 is expected.",
           "- activations measured: the allocator's peak during forward + backward above what was allocated when "
           "forward began (core/ledger.py `ActivationMeter`); on CPU the saved-tensor peak.",
           "- first-step peak: the first step, which also creates Adam's states; build peak: building the model "
           "in fp32 on the device and `zk.shard` (flattening, casting, master copies)."]
    if skipped:
        md.append(f"- skipped stages: {record['skipped_stages']}")
    leftovers = [r["cuda"]["leftover"] for r in rows if r["cuda"]]
    if leftovers and max(leftovers) > 0:
        md.append(f"- bytes still allocated after a row's engine and model were deleted (largest): "
                  f"{max(leftovers):,}")
    write_pair(args.out / f"memory_per_stage_{tag}_{model_tag}", record, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
