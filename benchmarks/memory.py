"""Per-rank memory of every ZeRO stage, measured, beside the formula that predicts it.

    python benchmarks/memory.py                 # everything this machine can run
    python benchmarks/memory.py --quick         # small model only (a minute on 2 CPU cores)

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

    python benchmarks/memory.py --device cuda --model gpt2-xl --world-sizes 8 64
    python benchmarks/memory.py --device cpu --model tiny --world-sizes 8 --steps 1   # a dry run

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

LoRA mode (`--lora`): per-rank memory by category: full fine-tuning vs LoRA, at every ZeRO stage.

The question LoRA answers is the lecture's: when the model's weights fit but its training
state does not, freeze the weights and train a low-rank update instead. With Ψ parameters of
which Ψ_t train (LoRA on q and v, r = 8, alpha = 1), AdamW needs gradients, master copies and
two moments for Ψ_t only; the frozen Ψ - Ψ_t cost their weight bytes alone. ZeRO then shards
what is left: stages 1-2 divide the (already small) trainable state by N, and stage 3 also
divides the frozen weights, which become the dominant cost under LoRA.

What is measured. For each precision, stage and mode (full / lora) the built-in GPT is wrapped
with `zk.shard`, trained one warm-up step (AdamW allocates its state lazily) and `--steps`
measured steps on `--nproc` gloo ranks; then every rank reports `engine.memory()`: live bytes
of the engine's own storage by category (params, grads, master_params, optimizer_states, and at
stage 3 any unsharded buffers still alive). Activations are not model state and are not
included. Beside each total stands `zk.estimate(Ψ, N, stage, precision, trainable_params=Ψ_t)`.
Optionally (`--simulate 8 64`) one process plays rank 0 of a larger world through
`Comm(simulate=Simulated(0, N))`: the buffers are allocated exactly as on that rank (the
collectives return correctly shaped local data), so the 1/N columns can be seen shrinking.

Where measured and formula differ: stage 3 may hold a unit's unsharded buffers at the
moment of measurement ("other"); every flat buffer is padded to a multiple of N.

    python benchmarks/memory.py --lora                       # small GPT, 2 ranks, fp32 and bf16
    python benchmarks/memory.py --lora --simulate 8 64       # plus simulated ranks of 8 and 64

Writes <out>.json (every rank's numbers, machine, versions, command, date) and <out>.md.

Sweep mode (`--sweep`): how cost grows: step time and per-rank bytes per stage, over model size and world size.

    python benchmarks/memory.py --sweep                                        # 4 sizes (~1M to ~50M params) x N = 1, 2, 4
    python benchmarks/memory.py --sweep --sizes 1 4 --world-sizes 1 2 --steps 3   # quicker

One spawn per world size trains, for every model size and stage, `--warmup` + `--steps` steps of
the character GPT (fp32, AdamW, clip 1.0, `--batch-size` sequences of 64 tokens per rank) and
records, on every rank:

* the median step time (a step counts at its slowest rank);
* the model states this rank holds after a step (`engine.memory()`: params, grads, master,
  optimizer states) and the peak bytes autograd saved for backward during one step
  (`zerokit.core.accounting.ledger.ActivationMeter`, saved-tensor hooks on CPU), and their sum: the ledger's
  view of what a rank needs beyond temporaries;
* the allocator's view, temporaries included: the engine built afresh and trained `--memory-warmup`
  + 1 more steps under torch.profiler, with c10's counter made to see every thread (gloo's too),
  as benchmarks/speed.py's allocator pass does: the most bytes live inside the measured
  step and those live after it, both counted from just before the build (so the model's own
  weights count, as on a GPU they would), for the sizes in `--memory-sizes` (default all but
  the 50M one, whose profiler pass alone takes about 3.7 GB per rank); `--memory-warmup 0` leaves
  it out.

Model sizes are GPTs of 4-12 layers and widths 128-768 (see SIZES); their exact parameter counts
are in the results. Writes benchmarks/results/sweep.json, sweep.md and sweep.png (step time and
bytes against parameters, one line per stage, one column per world size).

QLoRA mode (`--quantize`): per-rank memory by category with a quantized frozen base (zerokit/quant.py).

    python benchmarks/memory.py --quantize                          # small GPT on 2 gloo ranks + 7B Llama shape
    python benchmarks/memory.py --quantize --llama-layers 0         # the small GPT only

For each base (unquantized LoRA, nf4, int8), precision and stage: the model is frozen, every Linear
but the head quantized, LoRA injected on q and v (r = 8), one warm-up step and one measured step,
then `engine.memory()` (the quantized base as its own category, "quantized_params") beside
`zk.estimate(..., quantize=..., quantized_params=<each weight's element count>)`, category by
category, and stage 3's all-gather bytes of the measured step from the comm ledger. First the
small GPT on `--nproc` gloo ranks (fp32 and bf16), then one process playing rank 0 of
`--llama-world` (8) ranks (`Comm(simulate=Simulated(0, 8))`) of a Llama with 7B's widths (d = 4096,
MLP 11008, 32 heads, vocabulary 32000; transformers' LlamaForCausalLM built locally, bf16, LoRA on
q_proj and v_proj) but `--llama-layers` (2) of its 32 layers, so that it fits this machine; the
formula for all 32 layers is printed beside it. Writes benchmarks/results/qlora_memory.json and .md.

Checkpoint mode (`--checkpoint`): how much each rank's memory grows while it saves and loads at stage 3.

    python benchmarks/memory.py --checkpoint                            # 8 units x 32 MiB, 2 gloo ranks
    python benchmarks/memory.py --checkpoint --units 2 --unit-mib 1     # a dry run

A model of `--units` blocks, each one nn.Linear of about `--unit-mib` MiB (fp32), wrapped one unit
per block at stage 3, fp32, SGD, on `--nproc` gloo ranks; one training step, then `engine.save(dir)`,
then a fresh engine (other initial values) and `engine.load(dir)`. Around each call every rank resets
its peak resident set size (writes "5" to /proc/self/clear_refs, which sets VmHWM to the current RSS)
and reads /proc/self/status after: the growth is VmHWM after minus VmRSS before, every byte the call
made resident at its peak (heap, and the pages of a file read through mmap). The loaded engine's
param shards are checked bitwise against the saved ones. Writes benchmarks/results/checkpoint_memory.json
and .md (`--out`), with Ψ/N and one unit's bytes beside the growth.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import speed as S  # noqa: E402  (its allocator pass, for --sweep: benchmarks/speed.py)
import zerokit as zk  # noqa: E402
from zerokit.checkpoint import committed_snapshot  # noqa: E402
from zerokit.commands.compare import available_stages  # noqa: E402
from zerokit.commands.memory import simulate_rank  # noqa: E402
from zerokit.commands.step import train_step  # noqa: E402
from zerokit.core.collectives.comm import Comm, Simulated  # noqa: E402
from zerokit.core.accounting.ledger import ActivationMeter  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.models import Block, CharCorpus, GPTConfig, build_model  # noqa: E402
from zerokit.provenance import (command_line, git_commit, machine, provenance, provenance_lines,  # noqa: E402
                                 versions, write_pair)  # noqa: E402

MODEL_STATES = ("params", "grads", "master_params", "optimizer_states")
COLUMNS = MODEL_STATES + ("comm_buffers", "activations")


def _real_rank(rank: int, world_size: int, jobs: list[tuple[int, str]], model_name: str, device_kind: str) -> list:
    """One step per (stage, precision) on this real rank; the ledger of each."""
    import zerokit as zk
    from zerokit.commands.memory import optimizer_for
    from zerokit.core.accounting.estimate import activation_bytes_estimate
    from zerokit.core.accounting.ledger import ActivationMeter, ledger
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
    """The machine and versions (zerokit/provenance.py), under this results file's key names."""
    m, v = machine(), versions()
    return {"hostname": m["hostname"], "platform": m["platform"], "processor": platform.processor(),
            "cpu_count": m["cpu_count"], "python": v["python"], "torch": v["torch"], "cuda_devices": m["gpus"],
            "cpu_model": m["cpu_model"]}


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--quantize" in argv:
        return qlora_main(argv)
    if "--lora" in argv:
        return lora_main(argv)
    if "--sweep" in argv:
        return sweep_main(argv)
    if "--checkpoint" in argv:
        return checkpoint_main(argv)
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
    args = parser.parse_args(argv)
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
    from zerokit.core.accounting.estimate import activation_bytes_estimate, zero3_working_set_bytes
    from zerokit.core.accounting.ledger import ActivationMeter, ledger
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
    from zerokit.core.accounting.estimate import per_rank_formula

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
            raise SystemExit("memory.py --device cuda: torch.cuda.is_available() is False here")
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
           "forward began (core/accounting/ledger.py `ActivationMeter`); on CPU the saved-tensor peak.",
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


# ----------------------------------------------------------------------------- --lora
STAGES = (0, 1, 2, 3)
LORA_MODES = ("full", "lora")
BASE_CATEGORIES = ("params", "grads", "master_params", "optimizer_states")


def lora_measure_one(rank: int, world_size: int, cfg: dict, precision: str, stage: int, mode: str,
                comm: Comm | None = None) -> dict:
    """Build, warm up, train `cfg['steps']` steps, and return this rank's memory and step time."""
    torch.manual_seed(0)  # the adapters' A matrices come from the global generator
    model = build_model(cfg["model"], seed=0)
    if mode == "lora":
        zk.lora.inject(model, targets=("q", "v"), rank=8, alpha=1.0)
    num_params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, lr=1e-3,
                      bucket_numel=cfg["bucket_numel"], wrap=(Block,), comm=comm)
    corpus = CharCorpus(cfg["text"])
    block = model.cfg.block_size
    times = []
    for step in range(1 + cfg["steps"]):  # step 0 is the warm-up that allocates optimizer state
        start = time.perf_counter()
        batch = corpus.batch(cfg["batch_size"], block, step, rank if comm is None else 0,
                             world_size if comm is None else 1)
        train_step(engine, [batch], lambda b: engine(*b)[1])
        if step > 0:
            times.append(time.perf_counter() - start)
    memory = engine.memory()  # after the last step, before zero_grad: the steady state
    est = zk.estimate(num_params, engine.world_size, stage, precision, optimizer="adamw",
                      trainable_params=trainable)
    return {"rank": engine.rank, "world_size": engine.world_size, "precision": precision, "stage": stage,
            "mode": mode, "num_params": num_params, "trainable_params": trainable, "memory": memory,
            "formula": {c: getattr(est, c) for c in BASE_CATEGORIES}, "step_s_median": sorted(times)[len(times) // 2]}


def lora_all_configs(rank: int, world_size: int, cfg: dict) -> list[dict]:
    """One rank's measurements of every (precision, stage, mode), in a fixed order on every rank."""
    return [lora_measure_one(rank, world_size, cfg, precision, stage, mode)
            for precision in cfg["precisions"] for stage in STAGES for mode in LORA_MODES]


def lora_merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """One row per config: the largest value over ranks in each category (ranks differ only by padding)."""
    rows = []
    for configs in zip(*per_rank):
        row = dict(configs[0])
        categories = sorted({c for r in configs for c in r["memory"]}, key=_lora_category_order)
        row["memory"] = {c: max(r["memory"].get(c, 0) for r in configs) for c in categories}
        row["per_rank_memory"] = [r["memory"] for r in configs]
        row["step_s_median"] = max(r["step_s_median"] for r in configs)
        rows.append(row)
    return rows


def _lora_category_order(c: str) -> tuple[int, str]:
    return (BASE_CATEGORIES.index(c) if c in BASE_CATEGORIES else len(BASE_CATEGORIES), c)


# ------------------------------------------------------------------------------- output
def _lora_mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.3f}"


def lora_table(rows: list[dict]) -> str:
    """A markdown lora_table: one row per (world, precision, stage, mode), measured beside the formula."""
    head = ("| ranks | precision | stage | mode | trainable Ψ_t | params | grads | master | optim. states "
            "| other | total | formula total | LoRA / full |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    totals = {}
    for r in rows:
        totals[(r["world_label"], r["precision"], r["stage"], r["mode"])] = sum(r["memory"].values())
    for r in rows:
        m = r["memory"]
        other = sum(v for c, v in m.items() if c not in BASE_CATEGORIES)
        total = sum(m.values())
        formula = sum(r["formula"].values())
        ratio = ""
        if r["mode"] == "lora":
            full = totals[(r["world_label"], r["precision"], r["stage"], "full")]
            ratio = f"{total / full:.2f}"
        lines.append(f"| {r['world_label']} | {r['precision']} | {r['stage']} | {r['mode']} | "
                     f"{r['trainable_params']:,} | " + " | ".join(_lora_mb(m.get(c, 0)) for c in BASE_CATEGORIES)
                     + f" | {_lora_mb(other)} | {_lora_mb(total)} | {_lora_mb(formula)} | {ratio} |")
    return "\n".join(lines)


def lora_machine() -> dict:
    """The machine and versions (zerokit/provenance.py), under the LoRA results file's key names."""
    m, v = machine(), versions()
    return {"cpu": m["cpu_model"] or "unknown", "cpu_count": m["cpu_count"], "platform": m["platform"],
            "python": v["python"], "torch": v["torch"]}


def lora_main(argv: list[str]) -> int:
    """--lora: see the module docstring's "LoRA mode"."""
    p = argparse.ArgumentParser(description="per-rank memory: full fine-tuning vs LoRA, per stage")
    p.add_argument("--lora", action="store_true", required=True, help="this mode")
    p.add_argument("--model", default="small", help="GPT preset (tiny, small)")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks")
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    p.add_argument("--simulate", nargs="*", type=int, default=[], help="also simulate rank 0 of these world sizes")
    p.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    p.add_argument("--bucket-numel", type=int, default=1 << 16)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "lora_memory"),
                   help="output path without extension (.json and .md are written)")
    args = p.parse_args(argv)
    command = command_line(__file__, argv)
    commit = git_commit()  # taken before the run: the code that produced the numbers
    # Read the corpus once here and pass the text to the ranks, so every rank trains on the same bytes.
    text = "".join(path.read_text(encoding="utf-8", errors="replace")
                   for path in sorted((REPO / "zerokit").rglob("*.py")))
    cfg = {"model": args.model, "steps": args.steps, "batch_size": args.batch_size,
           "bucket_numel": args.bucket_numel, "precisions": args.precision, "text": text}

    rows = []
    per_rank = run_ranks(lora_all_configs, args.nproc, cfg, timeout_s=3600)
    for row in lora_merge_ranks(per_rank):
        rows.append({**row, "world_label": f"{args.nproc} (gloo)"})
    for n in args.simulate:
        for precision in args.precision:
            for stage in STAGES:
                for mode in LORA_MODES:
                    r = lora_measure_one(0, n, cfg, precision, stage, mode, comm=Comm(simulate=Simulated(0, n)))
                    rows.append({**r, "per_rank_memory": [r["memory"]], "world_label": f"{n} (simulated)"})

    labels = list(dict.fromkeys(r["world_label"] for r in rows))  # first-seen order
    tables = {label: lora_table([r for r in rows if r["world_label"] == label]) for label in labels}
    for label in labels:
        print(f"\n{label} ranks\n{tables[label]}")
    info = lora_machine()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result = {"command": command, "date": date, "commit": commit, "lora_machine": info, "model": args.model,
              "num_params": rows[0]["num_params"], "config": {k: v for k, v in cfg.items() if k != "text"},
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lora_row = next(r for r in rows if r["mode"] == "lora")
    md = [
        "# Per-rank memory: full fine-tuning vs LoRA, per ZeRO stage",
        "",
        f"- command: `{command}`",
        f"- date: {date}",
        f"- lora_machine: {info['cpu']} ({info['cpu_count']} logical CPUs), {info['platform']}",
        f"- commit: {result['commit']}",
        f"- versions: Python {info['python']}, torch {info['torch']}",
        f"- model: GPT preset `{args.model}`, Ψ = {rows[0]['num_params']:,} parameters; LoRA on q and v, "
        f"r = 8, alpha = 1: Ψ_t = {lora_row['trainable_params']:,} trainable adapter parameters "
        f"({100 * lora_row['trainable_params'] / rows[0]['num_params']:.2f}% of the base Ψ; "
        f"Ψ = {lora_row['num_params']:,} with them)",
        f"- optimizer AdamW; {args.steps} measured steps after one warm-up; batch {args.batch_size} "
        f"sequences per rank; bucket_numel {args.bucket_numel}",
        "",
        "MB = 10^6 bytes, per rank, the largest over ranks, measured with `engine.memory()` after a step.",
        "`other` = stage 3's unsharded buffers alive at that moment. `formula total` = "
        "`zk.estimate(Ψ, N, stage, precision, trainable_params=Ψ_t)` (params + grads + master + states).",
        "Largest |measured - formula| / formula over the params+grads+master+states of all rows: "
        f"{max(abs(sum(r['memory'][c] for c in BASE_CATEGORIES) / sum(r['formula'].values()) - 1) for r in rows):.3%}"
        " (padding). Simulated rows: one process allocates exactly what rank 0 of N would.",
    ]
    for label in labels:
        md += ["", f"## {label} ranks", "", tables[label]]
    md.append("")
    out.with_suffix(".md").write_text("\n".join(md))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


# ----------------------------------------------------------------------------- --quantize
QLORA_BASES = (None, "nf4", "int8")  # None: LoRA over the unquantized base
QLORA_CATEGORIES = ("params", "quantized_params", "grads", "master_params", "optimizer_states")
LLAMA_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                num_key_value_heads=32, max_position_embeddings=64, tie_word_embeddings=False)


def qlora_counts(model) -> dict:
    """Ψ (a quantized weight by its elements), Ψ_t, and each quantized weight's element count."""
    from zerokit.quant import quantized_modules
    q = [m.spec.numel for m in {id(m): m for m in quantized_modules(model).values()}.values()]
    floats = [p for p in model.parameters() if p.is_floating_point()]
    return {"num_params": sum(p.numel() for p in floats) + sum(q),
            "trainable_params": sum(p.numel() for p in floats if p.requires_grad), "quantized": q}


def qlora_measure(engine, model, info: dict, base, precision: str, stage: int, step) -> dict:
    """Warm-up step, measured step; memory by category beside the formula, stage 3's gather bytes."""
    step(0)
    before = engine.comm_stats()["all_gather"]
    start = time.perf_counter()
    step(1)
    seconds = time.perf_counter() - start
    est = zk.estimate(info["num_params"], engine.world_size, stage, precision, optimizer="adamw",
                      trainable_params=info["trainable_params"], quantize=base,
                      quantized_params=info["quantized"] or None)
    return {"base": base or "bf16/fp32 (unquantized)", "precision": precision, "stage": stage,
            "world_size": engine.world_size, "num_params": info["num_params"],
            "trainable_params": info["trainable_params"], "memory": engine.memory(),
            "formula": {c: getattr(est, c) for c in QLORA_CATEGORIES},
            "gathered_per_step": engine.comm_stats()["all_gather"] - before, "step_s": seconds}


def _qlora_model(model: torch.nn.Module, base: str | None, targets: tuple[str, ...]) -> torch.nn.Module:
    """QLoRA's recipe on `model`: the base frozen, quantized to `base` ("nf4", "int8"; None keeps it in
    floating point) except lm_head, rank-8 LoRA adapters on `targets` (seeded: the same on every rank)."""
    from zerokit.quant import quantize

    model.requires_grad_(False)
    if base:
        quantize(model, base, skip=("lm_head",))
    torch.manual_seed(1)
    zk.lora.inject(model, targets=targets, rank=8, alpha=1.0)
    return model


def qlora_gpt_rank(rank: int, world_size: int, cfg: dict) -> list[dict]:
    corpus = CharCorpus(cfg["text"])
    rows = []
    for precision in cfg["precisions"]:
        for base in QLORA_BASES:
            for stage in STAGES:
                model = _qlora_model(build_model(cfg["model"], seed=0), base, ("q", "v"))
                info = qlora_counts(model)
                engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, lr=1e-3, wrap=(Block,))
                batch = lambda i: corpus.batch(cfg["batch_size"], model.cfg.block_size, i, rank, world_size)  # noqa
                rows.append(qlora_measure(engine, model, info, base, precision, stage,
                                          lambda i: train_step(engine, [batch(i)], lambda b: engine(*b)[1])))
    return rows


def qlora_llama(world_size: int, layers: int) -> list[dict]:
    """Rank 0 of `world_size`, simulated, for a Llama of 7B's widths and `layers` layers, bf16."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from zerokit.quant import quantized_modules
    rows = []
    config = LlamaConfig(num_hidden_layers=layers, **LLAMA_7B)
    for base in QLORA_BASES:
        torch.manual_seed(0)
        prepared = _qlora_model(LlamaForCausalLM(config), base, ("q_proj", "v_proj"))
        info = qlora_counts(prepared)
        # The same model with all 32 layers, by the formula: every layer is alike.
        layer = prepared.model.layers[0]
        layer_q = [m.spec.numel for m in quantized_modules(layer).values()]
        layer_float = sum(p.numel() for p in layer.parameters() if p.is_floating_point())
        layer_t = sum(p.numel() for p in layer.parameters() if p.requires_grad)
        outside = info["num_params"] - layers * (layer_float + sum(layer_q))
        full = {"num_params": outside + 32 * (layer_float + sum(layer_q)), "trainable_params": 32 * layer_t,
                "quantized": layer_q * 32}
        for stage in STAGES:
            model = prepared if stage == STAGES[-1] else copy.deepcopy(prepared)
            engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision="bf16", lr=1e-4,
                              wrap=(LlamaDecoderLayer,), comm=Comm(simulate=Simulated(0, world_size)))
            ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
            row = qlora_measure(engine, model, info, base, "bf16", stage,
                                lambda i: train_step(engine, [ids], lambda b: engine(input_ids=b, labels=b).loss))
            est = zk.estimate(full["num_params"], world_size, stage, "bf16", optimizer="adamw",
                              trainable_params=full["trainable_params"], quantize=base,
                              quantized_params=full["quantized"] or None)
            row["formula_32_layers"] = {c: getattr(est, c) for c in QLORA_CATEGORIES}
            row["num_params_32_layers"] = full["num_params"]
            rows.append(row)
            del engine, model
            gc.collect()
        del prepared
        gc.collect()
    return rows


def _qlora_table(rows: list[dict], formula_key: str = "formula") -> str:
    head = ("| precision | stage | base | params | quantized | grads | master | optim. states | total | "
            "formula total | max category error | stage-3 gather / step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        m, f = r["memory"], r[formula_key]
        total = sum(m.get(c, 0) for c in QLORA_CATEGORIES)
        err = max(abs(m.get(c, 0) - f[c]) for c in QLORA_CATEGORIES)
        gather = f"{r['gathered_per_step'] / 1e6:.3f}" if r["stage"] == 3 else ""
        lines.append(f"| {r['precision']} | {r['stage']} | {r['base']} | "
                     + " | ".join(f"{m.get(c, 0) / 1e6:.3f}" for c in QLORA_CATEGORIES)
                     + f" | {total / 1e6:.3f} | {sum(f.values()) / 1e6:.3f} | {err:,} B | {gather} |")
    return "\n".join(lines)


def _qlora_formula_table(rows: list[dict]) -> str:
    head = "| stage | base | " + " | ".join(QLORA_CATEGORIES) + " | total |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        f = r["formula_32_layers"]
        lines.append(f"| {r['stage']} | {r['base']} | " + " | ".join(f"{f[c] / 1e6:.1f}" for c in QLORA_CATEGORIES)
                     + f" | {sum(f.values()) / 1e6:.1f} |")
    return "\n".join(lines)


def qlora_main(argv: list[str]) -> int:
    """--quantize: see the module docstring's "QLoRA mode"."""
    p = argparse.ArgumentParser(description="per-rank memory with a quantized frozen base, per stage")
    p.add_argument("--quantize", action="store_true", required=True, help="this mode")
    p.add_argument("--model", default="small", help="GPT preset for the gloo ranks")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks")
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--llama-world", type=int, default=8, help="the simulated world of the Llama rows")
    p.add_argument("--llama-layers", type=int, default=2, help="decoder layers of the 7B shape (0: no Llama rows)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "qlora_memory"))
    args = p.parse_args(argv)
    record = provenance(command_line(__file__, argv))
    text = "".join(path.read_text(encoding="utf-8", errors="replace")
                   for path in sorted((REPO / "zerokit").rglob("*.py")))
    cfg = {"model": args.model, "batch_size": args.batch_size, "precisions": args.precision, "text": text}
    per_rank = run_ranks(qlora_gpt_rank, args.nproc, cfg, timeout_s=3600)
    gpt = []
    for configs in zip(*per_rank):  # the largest over ranks (they differ by padding only)
        row = dict(configs[0])
        row["memory"] = {c: max(r["memory"].get(c, 0) for r in configs) for c in configs[0]["memory"]}
        row["gathered_per_step"] = max(r["gathered_per_step"] for r in configs)
        gpt.append(row)
    llama = qlora_llama(args.llama_world, args.llama_layers) if args.llama_layers else []
    def gather(rows, base, precision):
        return next(r["gathered_per_step"] for r in rows if r["base"].startswith(base) and r["stage"] == 3
                    and r["precision"] == precision)
    summary = {f"gpt {precision}: stage-3 gather bytes/step nf4 / unquantized":
               gather(gpt, "nf4", precision) / gather(gpt, "bf16/fp32", precision) for precision in args.precision}
    if llama:
        summary["llama 7B widths bf16: stage-3 gather bytes/step nf4 / unquantized"] = (
            gather(llama, "nf4", "bf16") / gather(llama, "bf16/fp32", "bf16"))
    md = ["# Per-rank memory with a quantized frozen base (QLoRA), per ZeRO stage", ""]
    md += provenance_lines(record)
    md += ["", "MB = 10^6 bytes per rank (the largest over ranks), `engine.memory()` after a step, beside "
           "`zk.estimate(Ψ, N, stage, precision, trainable_params=Ψ_t, quantize=..., quantized_params=[...])`. "
           "`max category error` = the largest |measured - formula| over the five categories, in bytes (padding: "
           "under N elements per flat buffer). Stage-3 gather = the all-gather bytes of one step in the comm "
           "ledger (every unit in forward, all but the root again in backward).", ""]
    md += [f"- {k}: {v:.3f}" for k, v in summary.items()]
    md += ["", f"## small GPT (`{args.model}`), {args.nproc} gloo ranks, LoRA q, v r = 8; "
           f"Ψ = {gpt[0]['num_params']:,}, Ψ_t = {gpt[0]['trainable_params']:,}", "", _qlora_table(gpt)]
    if llama:
        md += ["", f"## Llama, 7B widths, {args.llama_layers} of 32 layers, bf16, simulated rank 0 of "
               f"{args.llama_world}; LoRA q_proj, v_proj r = 8; Ψ = {llama[0]['num_params']:,}, "
               f"Ψ_t = {llama[0]['trainable_params']:,}", "", _qlora_table(llama),
               "", f"The formula for all 32 layers (Ψ = {llama[0]['num_params_32_layers']:,}), by category, MB:",
               "", _qlora_formula_table(llama)]
    md.append("")
    result = {**record, "summary": summary, "gpt": gpt, "llama": llama,
              "config": {k: v for k, v in vars(args).items()}}
    print("\n".join(md))
    write_pair(Path(args.out), result, "\n".join(md))
    return 0


# ----------------------------------------------------------------------------- --sweep
# nominal millions of parameters -> (layers, heads, width): about 12 * layers * width^2 parameters
SIZES = {1: (4, 4, 128), 4: (6, 6, 240), 15: (8, 8, 384), 50: (12, 12, 576)}
BLOCK = 64


def _sweep_config(size: int) -> GPTConfig:
    layers, heads, width = SIZES[size]
    return GPTConfig(vocab_size=CharCorpus.vocab_size, block_size=BLOCK, n_layer=layers, n_head=heads, n_embd=width)


def _sweep_engine(size: int, stage: int):
    model = build_model(_sweep_config(size), seed=0)
    return model, zk.shard(model, torch.optim.AdamW, stage=stage, lr=1e-3, weight_decay=0.1, wrap=(Block,))


def _sweep_allocator_loop(size: int, stage: int):
    """speed.py's Loop for its allocator pass: (train_step(x, y) -> loss, zero_grad, memory)."""
    _, engine = _sweep_engine(size, stage)

    def step(x, y):  # zero_grad comes first inside train_step (commands/step.py)
        return train_step(engine, [(x, y)], lambda b: engine(*b)[1], clip=1.0).loss

    return step, lambda: None, engine.memory


def sweep_rank(rank: int, world_size: int, cfg: dict) -> dict:
    corpus = CharCorpus.load()
    out = {}
    for size in cfg["sizes"]:
        for stage in STAGES:
            model, engine = _sweep_engine(size, stage)
            times = []
            for s in range(cfg["warmup"] + cfg["steps"]):
                batch = corpus.batch(cfg["batch_size"], BLOCK, s, rank, world_size)
                start = time.perf_counter()
                train_step(engine, [batch], lambda b: engine(*b)[1], clip=1.0)
                if s >= cfg["warmup"]:
                    times.append(1e3 * (time.perf_counter() - start))
            states = engine.memory()
            with ActivationMeter(exclude=model, use_cuda_allocator=False) as meter:  # one more step, measured
                train_step(engine, [corpus.batch(cfg["batch_size"], BLOCK, 10 ** 6, rank, world_size)],
                           lambda b: engine(*b)[1], clip=1.0)
            out[(size, stage)] = {"params": sum(p.numel() for p in model.parameters()), "times_ms": times,
                                  "model_states": sum(states[c] for c in MODEL_STATES),
                                  "activations": meter.saved_peak_bytes}
            del engine, model
            gc.collect()  # hooks make cycles: free this engine before the next one is built
            if cfg["memory_warmup"] > 0 and size in cfg["memory_sizes"]:
                alloc = S._allocator_steps({**cfg, "block_size": BLOCK, "memory_steps": 1}, rank, world_size,
                                           torch.device("cpu"), lambda: _sweep_allocator_loop(size, stage))
                out[(size, stage)].update(peak=alloc["peak_step_bytes"][0], after=alloc["between_steps_bytes"][-1],
                                          allocator=alloc["method"])
                gc.collect()
    return out


def sweep_summarize(runs: dict[int, list[dict]], cfg: dict) -> list[dict]:
    rows = []
    for world_size, per_rank in runs.items():
        for size in cfg["sizes"]:
            for stage in STAGES:
                res = [r[(size, stage)] for r in per_rank]
                slowest = [max(ts) for ts in zip(*(r["times_ms"] for r in res))]
                rows.append({"world_size": world_size, "size": size, "stage": stage, "params": res[0]["params"],
                             "step_ms": statistics.median(slowest),
                             "model_states": max(r["model_states"] for r in res),
                             "activations": max(r["activations"] for r in res),
                             "total": max(r["model_states"] + r["activations"] for r in res),
                             # the allocator pass (absent with --memory-warmup 0): the largest rank's
                             "peak": max(r["peak"] for r in res) if "peak" in res[0] else None,
                             "after": max(r["after"] for r in res) if "after" in res[0] else None})
    return rows


def sweep_plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(2, len(worlds), figsize=(4.2 * len(worlds), 7), squeeze=False)
    for j, n in enumerate(worlds):
        for stage in STAGES:
            pts = sorted((r["params"] / 1e6, r["step_ms"], r["total"] / 2**20, r["peak"]) for r in rows
                         if r["world_size"] == n and r["stage"] == stage)
            xs = [p[0] for p in pts]
            line, = axes[0][j].plot(xs, [p[1] for p in pts], marker="o", label=f"stage {stage}")
            measured = [p for p in pts if p[3] is not None]  # the sizes the allocator pass ran at
            if measured:
                axes[1][j].plot([p[0] for p in measured], [p[3] / 2**20 for p in measured], marker="o",
                                color=line.get_color(), label=f"stage {stage}, allocator peak")
            axes[1][j].plot(xs, [p[2] for p in pts], linestyle="--", marker=".", color=line.get_color(),
                            label=f"stage {stage}, ledger")
        axes[0][j].set_title(f"N = {n}")
        for i, ylabel in enumerate(("step ms (slowest rank, median)",
                                    "MiB per rank: allocator peak in a step;\nledger (model states + activations)")):
            ax = axes[i][j]
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("parameters (millions)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    axes[1][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_main(argv: list[str]) -> int:
    """--sweep: see the module docstring's "Sweep mode"."""
    p = argparse.ArgumentParser(description="step time and per-rank bytes per stage over model and world size")
    p.add_argument("--sweep", action="store_true", required=True, help="this mode")
    p.add_argument("--sizes", type=int, nargs="+", default=sorted(SIZES), choices=sorted(SIZES),
                   help="nominal model sizes, millions of parameters")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch-size", type=int, default=4, help="sequences of 64 tokens per rank per step")
    p.add_argument("--steps", type=int, default=4, help="measured steps per (size, stage)")
    p.add_argument("--warmup", type=int, default=1, help="steps before measuring")
    p.add_argument("--memory-warmup", type=int, default=1,
                   help="steps before the allocator pass's measured step (0: no allocator pass)")
    p.add_argument("--memory-sizes", type=int, nargs="+", default=[1, 4, 15], choices=sorted(SIZES),
                   help="sizes that get the allocator pass (default 1 4 15: at 50 the profiler's own memory, about "
                        "3.7 GB per rank at N = 1, puts 4 ranks past a 24 GiB machine)")
    p.add_argument("--timeout", type=float, default=3600, help="deadline for each spawn (s)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "sweep",
                   help="results path without extension (.json, .md and .png are written)")
    args = p.parse_args(argv)
    record = provenance(command_line(__file__, argv))
    cfg = {"sizes": args.sizes, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
           "memory_warmup": args.memory_warmup, "memory_sizes": args.memory_sizes}
    start = time.perf_counter()
    runs = {n: run_ranks(sweep_rank, n, cfg, timeout_s=args.timeout) for n in args.world_sizes}
    rows = sweep_summarize(runs, cfg)
    result = {**record, "config": cfg, "world_sizes": args.world_sizes, "rows": rows,
              "seconds": round(time.perf_counter() - start, 1)}
    md = _sweep_markdown(result)
    print(md)
    write_pair(args.out, result, md)
    sweep_plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.png')}")
    return 0


def _sweep_markdown(r: dict) -> str:
    c = r["config"]
    mib = 2 ** 20
    alloc = c["memory_warmup"] > 0 and any(x.get("peak") is not None for x in r["rows"])
    lines = ["# Step time and per-rank bytes over model size and world size", "", *provenance_lines(r),
             f"- fp32, AdamW, clip 1.0, {c['batch_size']} x {BLOCK} tokens per rank per step, stage 3 wrapping every "
             f"Block; median of {c['steps']} steps after {c['warmup']}, a step at its slowest rank; gloo ranks "
             f"sharing 2 CPU cores ({r['seconds']:.0f} s in all)",
             "- ledger: model states after a step (`engine.memory()`) + the most bytes autograd saved in a step"]
    if alloc:
        lines.append(f"- allocator (sizes {', '.join(f'{s}M' for s in c['memory_sizes'])} nominal; '-' where it did "
                     f"not run): a fresh engine, {c['memory_warmup']} step(s), then one measured step under "
                     "torch.profiler with every thread's allocations counted (speed.py's allocator pass); "
                     "bytes from just before the engine was built, the largest rank's")
    head = "| N | params | stage | step ms | model states MiB | activations MiB | ledger sum MiB |"
    rule = "|---|---:|---|---:|---:|---:|---:|"
    if alloc:
        head += " allocator peak MiB | live after the step MiB | peak vs stage 0 |"
        rule += "---:|---:|---:|"
    else:
        head += " sum vs stage 0 |"
        rule += "---:|"
    lines += ["", head, rule]
    stage0 = {(x["world_size"], x["size"]): x for x in r["rows"] if x["stage"] == 0}
    for x in r["rows"]:
        line = (f"| {x['world_size']} | {x['params'] / 1e6:.1f}M | {x['stage']} | {x['step_ms']:.0f} | "
                f"{x['model_states'] / mib:.1f} | {x['activations'] / mib:.1f} | {x['total'] / mib:.1f} |")
        base = stage0[(x["world_size"], x["size"])]
        if not alloc:
            line += f" {x['total'] / base['total']:.2f} |"
        elif x.get("peak") is None:
            line += " - | - | - |"
        else:
            line += f" {x['peak'] / mib:.1f} | {x['after'] / mib:.1f} | {x['peak'] / base['peak']:.2f} |"
        lines.append(line)
    lines += ["", "Picture: `sweep.png` beside this file. Step times on 2 shared cores grow with N because the N "
              "ranks share the cores (compute per rank is fixed); compare stages within a column. The allocator "
              "peak adds to the ledger what the ledger leaves out: temporaries (the loss's logits, the "
              "optimizer's foreach intermediates, collective buffers), stage 2's full-size gradient of each bucket "
              "in flight beside its shard, stage 3's gathered units; and it is lower where the ledger counts "
              "something the step does not hold at its peak (stage 3's grad shards, freed by zero_grad and "
              "rebuilt in backward)."]
    return "\n".join(lines) + "\n"



# ----------------------------------------------------------------------------- --checkpoint
class CheckpointBlock(torch.nn.Module):
    """One stage-3 unit: a plain nn.Linear (width x width weight, width bias)."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.fc(x)


class CheckpointModel(torch.nn.Module):
    def __init__(self, units: int, width: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(CheckpointBlock(width) for _ in range(units))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _checkpoint_width(unit_mib: float) -> int:
    """The width whose fp32 width x width weight is closest to `unit_mib` MiB."""
    return max(1, round((unit_mib * 2 ** 20 / 4) ** 0.5))


def _proc_status_kib(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status, in KiB (VmRSS: resident now, VmHWM: the peak since the last reset)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in keys:
                out[name] = int(value.split()[0])
    return out


def _peak_growth(fn) -> dict:
    """Run fn(); this process's peak RSS during it minus its RSS before, in bytes (VmHWM reset first)."""
    gc.collect()
    torch.distributed.barrier()  # every rank measures the same collective call
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _proc_status_kib("VmRSS", "VmHWM")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    after = _proc_status_kib("VmRSS", "VmHWM")
    return {"rss_before": before["VmRSS"] * 1024, "hwm_at_reset": before["VmHWM"] * 1024,
            "peak": after["VmHWM"] * 1024, "rss_after": after["VmRSS"] * 1024,
            "growth": (after["VmHWM"] - before["VmRSS"]) * 1024, "seconds": round(seconds, 3)}


def _shards_digest(engine) -> str:
    h = hashlib.sha256()
    for shard in engine.param_shards:
        h.update(shard.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def checkpoint_rank(rank: int, world_size: int, cfg: dict) -> dict:
    """Save, then load into a fresh engine, each measured by `_peak_growth`. A collective."""
    width = _checkpoint_width(cfg["unit_mib"])

    def engine_of(seed: int):
        torch.manual_seed(seed)
        model = CheckpointModel(cfg["units"], width)
        return zk.shard(model, torch.optim.SGD, stage=3, wrap=(CheckpointBlock,), lr=1e-3)

    engine = engine_of(0)
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))
    train_step(engine, [x], lambda b: engine(b))
    numel = sum(fp.numel for fp in engine.flat_params)
    unit_bytes = max(4 * fp.padded_numel for fp in engine.flat_params)
    save = _peak_growth(lambda: engine.save(cfg["directory"]))
    saved = _shards_digest(engine)
    del engine
    fresh = engine_of(1)
    load = _peak_growth(lambda: fresh.load(cfg["directory"]))
    return {"rank": rank, "save": save, "load": load, "params": numel, "unit_bytes": unit_bytes,
            "width": width, "bitwise": _shards_digest(fresh) == saved}


def checkpoint_main(argv: list[str]) -> int:
    """--checkpoint: see the module docstring's "Checkpoint mode"."""
    p = argparse.ArgumentParser(description="per-rank peak RSS growth of engine.save and engine.load at stage 3")
    p.add_argument("--checkpoint", action="store_true", required=True, help="this mode")
    p.add_argument("--units", type=_positive, default=8, help="stage-3 units (blocks)")
    p.add_argument("--unit-mib", type=float, default=32, help="each unit's fp32 weight, MiB")
    p.add_argument("--nproc", type=_positive, default=2, help="gloo ranks")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "checkpoint_memory",
                   help="results path without extension (.json and .md are written)")
    args = p.parse_args(argv)
    record = provenance(command_line(__file__, argv))  # taken before the run: the code that produced the numbers
    with tempfile.TemporaryDirectory(prefix="zerokit-ckpt-bench-") as tmp:
        cfg = {"units": args.units, "unit_mib": args.unit_mib, "directory": os.path.join(tmp, "ckpt")}
        per_rank = run_ranks(checkpoint_rank, args.nproc, cfg, timeout_s=1800)
        snapshot = committed_snapshot(cfg["directory"])
        files = {name: os.path.getsize(os.path.join(snapshot, name)) for name in sorted(os.listdir(snapshot))}
    cfg = {k: v for k, v in cfg.items() if k != "directory"}
    result = {**record, "config": {**cfg, "nproc": args.nproc, "stage": 3, "precision": "fp32", "optimizer": "SGD"},
              "files": files, "ranks": per_rank}
    md = _checkpoint_markdown(result)
    print(md)
    write_pair(args.out, result, md)
    return 0 if all(r["bitwise"] for r in per_rank) else 1


def _checkpoint_markdown(r: dict) -> str:
    mib = 2 ** 20
    first = r["ranks"][0]
    n = r["config"]["nproc"]
    model_bytes = 4 * first["params"]
    lines = ["# Per-rank peak RSS growth of engine.save and engine.load at stage 3", "", *provenance_lines(r),
             f"- model: {r['config']['units']} units, each one nn.Linear({first['width']}, {first['width']}) "
             f"(one unit {first['unit_bytes'] / mib:.1f} MiB fp32); Ψ = {first['params']:,} parameters, "
             f"4Ψ = {model_bytes / mib:.1f} MiB; 4Ψ/N = {model_bytes / n / mib:.1f} MiB at N = {n}",
             f"- stage 3, fp32, SGD, {n} gloo ranks; one training step, then `engine.save(dir)`; then a fresh engine "
             "and `engine.load(dir)`",
             "- growth = VmHWM after the call minus VmRSS before it, VmHWM reset just before (\"5\" into "
             "/proc/self/clear_refs); MiB = 2^20 bytes",
             "- files: " + ", ".join(f"{name} {size / mib:.1f} MiB" for name, size in r["files"].items()), "",
             "| rank | save: growth MiB | save s | load: growth MiB | load s | loaded shards bitwise equal |",
             "|---|---:|---:|---:|---:|---|"]
    for x in r["ranks"]:
        lines.append(f"| {x['rank']} | {x['save']['growth'] / mib:.1f} | {x['save']['seconds']:.2f} | "
                     f"{x['load']['growth'] / mib:.1f} | {x['load']['seconds']:.2f} | {x['bitwise']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
