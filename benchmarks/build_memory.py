"""Per-phase peak memory of one simulated rank (build, step, save, load), a model built on meta, deferred or eagerly.

    python benchmarks/build_memory.py                      # gpt2-xl at N = 8 and 64, stages 1-3; gpt3-6.7b at 64
    python benchmarks/build_memory.py --quick              # gpt2-small only (a smoke run, a minute)
    python benchmarks/build_memory.py --deferred           # the same rows recorded by zk.deferred_init()
    python benchmarks/build_memory.py --ranks              # 4 real gloo ranks, every phase, resumed at 2 and 8
    python benchmarks/build_memory.py --gpu --device cuda  # gpt2-xl at N = 64 (stage 3) and 8 (stages 3, 2, 1)
                                                           # on one GPU: the allocator's peak (scripts/gpu_check.sh)

Each configuration is one fresh process running `zerokit memory --simulate ... --json`, so every peak is
that process's own (commands/memory.py `simulate_rank`: the resident set's high-water mark per phase, build,
step, save and load (this rank's part of engine.save / engine.load, `simulated_save_and_load`), beside
the bound = process baseline + model states + stage-3 working set + activations). `--build eager` rows
build the whole model first, as zk.shard required before core/params/materialize.py. Results, with the commands,
date and commit: benchmarks/results/build_memory.{json,md}. `--deferred` runs gpt2-xl at N = 64 (stages
1-3) and gpt3-6.7b built under zk.deferred_init() (core/params/deferred.py) instead: results in
benchmarks/results/build_memory_deferred.{json,md}.

`--ranks` runs real gloo ranks instead (zerokit.launch.run_ranks): 4 ranks build gpt2-small on the meta
device at stage 3 (bf16 + AdamW), `engine.load_weights` an eager model's safetensors file, train 2 steps,
`engine.save`; then 2 and 8 ranks each build on meta and `engine.load` that checkpoint (resume) and step.
Every rank reports its peak resident set per phase beside the same bound; the checkpoint's model file is
read back with plain `safetensors.torch.load_file` and compared with `engine.state_dict()`. Results:
benchmarks/results/build_memory_ranks.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402

FULL = [("gpt2-xl", 8, 1, "meta"), ("gpt2-xl", 8, 2, "meta"), ("gpt2-xl", 8, 3, "meta"),
        ("gpt2-xl", 64, 1, "meta"), ("gpt2-xl", 64, 2, "meta"), ("gpt2-xl", 64, 3, "meta"),
        ("gpt2-xl", 64, 3, "eager"), ("gpt3-6.7b", 64, 3, "meta")]
QUICK = [("gpt2-small", 8, 3, "meta"), ("gpt2-small", 8, 3, "eager")]
GPU = [("gpt2-xl", 64, 3, "meta"), ("gpt2-xl", 8, 3, "meta"), ("gpt2-xl", 8, 2, "meta"), ("gpt2-xl", 8, 1, "meta")]
DEFERRED = [("gpt2-xl", 64, 1, "deferred"), ("gpt2-xl", 64, 2, "deferred"), ("gpt2-xl", 64, 3, "deferred"),
            ("gpt3-6.7b", 64, 3, "deferred")]


def run_one(model: str, world_size: int, stage: int, build: str, device: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "zerokit", "memory", "--simulate", "--model", model, "--world-size",
               str(world_size), "--stage", str(stage), "--precision", "bf16", "--build", build,
               *(["--device", device] if device else []), "--json", str(out)]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    phases = result["phases"]
    return {"model": model, "world_size": world_size, "stage": stage, "build": build,
            "command": " ".join(["zerokit"] + cmd[3:-2]), "seconds": round(time.perf_counter() - start, 1),
            "num_params": result["config"]["num_params"],
            "model_states_bytes": sum(result["measured"][c] for c in ("params", "grads", "master_params",
                                                                       "optimizer_states")),
            "baseline_bytes": phases["baseline_bytes"], "bound_bytes": phases["bound_bytes"],
            "device": result["device"], "measured_by": phases["measured_by"],
            "peaks": phases["peaks"], "saved_bytes": result.get("saved_bytes")}


PHASES = ("build", "step", "save", "load")


RANKS_MODEL = "gpt2-small"


def _meta_engine(model: str):
    import torch

    import zerokit as zk
    from zerokit.models import GPT, Block, preset

    torch.manual_seed(0)
    with torch.device("meta"):
        net = GPT(preset(model))
    return zk.shard(net, torch.optim.AdamW, stage=3, precision="bf16", wrap=(Block,), lr=1e-4,
                    param_init_fn=GPT._init_weights)


def _steps(engine, rank: int, steps: int, vocab: int) -> None:
    import torch
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        idx = torch.randint(vocab, (1, 64), generator=g)
        _, loss = engine(idx, idx)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()


def _rank_run(rank: int, world_size: int, model: str, weights: str, checkpoint: str, resume: bool) -> dict:
    from zerokit.commands.memory import phase_bound
    from zerokit.core.accounting.estimate import activation_bytes_estimate
    from zerokit.core.accounting.ledger import PeakMeter, ledger
    from zerokit.models import preset

    cfg = preset(model)
    meter = PeakMeter()
    with meter.phase("build"):
        engine = _meta_engine(model)
    if resume:
        with meter.phase("resume"):
            engine.load(checkpoint)
    else:
        with meter.phase("load_weights"):
            engine.load_weights(weights)
    with meter.phase("step"):
        _steps(engine, rank, 2, cfg.vocab_size)
    out = ledger(engine, predicted_activations=activation_bytes_estimate(cfg, 1, "bf16", seq_len=64))
    if not resume:
        with meter.phase("save"):
            engine.save(checkpoint)
    state = engine.state_dict()  # a collective; rank 0 compares it with the file plain safetensors reads
    plain_equal = None
    if rank == 0 and not resume:
        import os

        import torch
        from safetensors.torch import load_file

        from zerokit.checkpoint import MODEL_FILE, committed_snapshot
        saved = load_file(os.path.join(committed_snapshot(checkpoint), MODEL_FILE))
        plain_equal = all(torch.equal(saved[k], v) for k, v in state.items() if k in saved) and \
            all(k in saved or k == "lm_head.weight" for k in state)
    bound = phase_bound(out, cfg, 3, "bf16", meter.baseline)
    return {"baseline_bytes": meter.baseline, "bound_bytes": bound, "plain_safetensors_equal": plain_equal,
            "peaks": {k: {"peak_bytes": v, "ratio_to_bound": v / bound, "seconds": round(meter.seconds[k], 1)}
                      for k, v in meter.peaks.items()}}


def run_ranks_mode(args, prov) -> int:
    import torch
    from safetensors.torch import save_file

    from zerokit.launch import run_ranks
    from zerokit.models import build_model

    with tempfile.TemporaryDirectory() as tmp:
        weights = str(Path(tmp) / "weights.safetensors")
        state = build_model(RANKS_MODEL, seed=5).state_dict()
        save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, weights)  # a tie, once
        del state
        checkpoint = str(Path(tmp) / "ckpt")
        runs = {}
        for label, n, resume in (("train on 4 ranks", 4, False), ("resume on 2 ranks", 2, True),
                                 ("resume on 8 ranks", 8, True)):
            runs[label] = run_ranks(_rank_run, n, RANKS_MODEL, weights, checkpoint, resume, timeout_s=1800)
            worst = {ph: max(r["peaks"][ph]["ratio_to_bound"] for r in runs[label]) for ph in runs[label][0]["peaks"]}
            print(f"{label}: worst rank per phase (x bound): " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()))
    lines = ["# Every phase on real gloo ranks: meta build, load_weights, train, save, resume at 2 and 8 ranks", "",
             *provenance_lines(prov), "",
             f"{RANKS_MODEL}, stage 3, bf16 + AdamW, 1 x 64 tokens per rank and step. Peak: each rank's resident "
             "set high-water mark (VmHWM) in the phase; bound: that rank's process baseline + model states "
             "(formula) + stage-3 working set + activations (zerokit/commands/memory.py `phase_bound`). "
             "MB = 10^6 bytes.", "",
             "| run | rank | bound MB | " + " | ".join(f"{ph} MB (x bound)" for ph in
                                                       ("build", "load_weights", "resume", "step", "save")) + " |",
             "|---|---|---|---|---|---|---|---|"]
    for label, results in runs.items():
        for r, res in enumerate(results):
            cells = [f"{res['peaks'][ph]['peak_bytes'] / 1e6:.0f} ({res['peaks'][ph]['ratio_to_bound']:.2f}x)"
                     if ph in res["peaks"] else "-" for ph in ("build", "load_weights", "resume", "step", "save")]
            lines.append(f"| {label} | {r} | {res['bound_bytes'] / 1e6:.0f} | " + " | ".join(cells) + " |")
    equal = runs["train on 4 ranks"][0]["plain_safetensors_equal"]
    lines += ["", f"The checkpoint's model.safetensors read by plain `safetensors.torch.load_file` equals "
              f"`engine.state_dict()` (rank 0, after the save): {equal}.", ""]
    write_pair(args.out.with_name(args.out.name + "_ranks"), {"provenance": prov, "runs": runs}, "\n".join(lines))
    return 0 if equal else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="gpt2-small only")
    p.add_argument("--ranks", action="store_true", help="real gloo ranks: every phase, resumed at 2 and 8 ranks")
    p.add_argument("--deferred", action="store_true", help="gpt2-xl and gpt3-6.7b recorded by zk.deferred_init()")
    p.add_argument("--gpu", action="store_true", help="the rows for one GPU: gpt2-xl at N = 64 (stage 3), 8 (3, 2, 1)")
    p.add_argument("--device", default=None, help="where the model lives (default: cuda if available, else cpu)")
    p.add_argument("--model", default=None, help="every row with this model instead (scripts/gpu_check.sh "
                                                  "--dry-run: tiny)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "build_memory")
    args = p.parse_args(argv)
    prov = provenance(command_line(__file__, argv))
    if args.ranks:
        return run_ranks_mode(args, prov)
    rows = []
    if args.out.name == "build_memory" and (args.deferred or args.gpu):
        args.out = args.out.with_name("build_memory_deferred" if args.deferred else "build_memory_gpu")
    for model, n, stage, build in (QUICK if args.quick else DEFERRED if args.deferred else GPU if args.gpu else FULL):
        model = args.model or model
        rows.append(run_one(model, n, stage, build, args.device))
        r = rows[-1]
        print(f"{model} N={n} stage {stage} {build}: " + ", ".join(
            f"{k} {v['peak_bytes'] / 1e9:.2f} GB ({v['ratio_to_bound']:.2f} x bound)" for k, v in r["peaks"].items()))
        _write(args, prov, rows)  # after every row: a run cut short keeps the rows it finished
    return 0


def _write(args, prov: dict, rows: list[dict]) -> None:
    title = "recorded by zk.deferred_init()" if args.deferred else "built on the meta device or eagerly"
    measured_by = sorted({f"{r['measured_by']} on {r['device']}" for r in rows})
    lines = [f"# Peak memory per phase of one simulated rank: {title}", "",
             *provenance_lines(prov), "",
             "One process plays rank 0 of N (`Comm(simulate=Simulated(0, N))`), bf16 + AdamW, one step on 1 x 8 "
             "tokens. Peak: " + "; ".join(measured_by) + ", in each phase; bound: process baseline + "
             "model states (formula) + gradients in flight (stage 3: the working set of gathered units; stage 2: "
             "the max_in_flight + 2 largest full-size buckets) + the tied head's two (V, d) autograd gradients + "
             "activations (zerokit/commands/memory.py `phase_bound`, terms derived in core/accounting/estimate.py). "
             "GB = 10^9 bytes.", "",
             "Save and load are this rank's part of engine.save and engine.load (zerokit/commands/memory.py "
             "[Note: save and resume on a simulated rank]: the consolidated model file streamed one flat param at a "
             "time and this rank's rank file; then engine.load's install: this rank's range of each flat param read "
             "from the model file and installed one flat param at a time, then each master's values and states "
             "from its rank file, one master at a time; the commit and the other N - 1 ranks' files cannot exist "
             "in a simulated world).", "",
             "| model | N | stage | build | model states GB | bound GB | "
             + " | ".join(f"{k} peak GB (x bound, s)" for k in PHASES) + " | files written GB |",
             "|---|---|---|---|---|---|" + "---|" * len(PHASES) + "---|"]
    for r in rows:
        cells = [f"{r['peaks'][k]['peak_bytes'] / 1e9:.2f} ({r['peaks'][k]['ratio_to_bound']:.2f}x, "
                 f"{r['peaks'][k]['seconds']:.0f} s)" if k in r["peaks"] else "-" for k in PHASES]
        written = f"{sum(r['saved_bytes'].values()) / 1e9:.2f}" if r.get("saved_bytes") else "-"
        lines.append(f"| {r['model']} | {r['world_size']} | {r['stage']} | {r['build']} | "
                     f"{r['model_states_bytes'] / 1e9:.2f} | {r['bound_bytes'] / 1e9:.2f} | " + " | ".join(cells)
                     + f" | {written} |")
    lines += ["", "Each row's command: `" + "`, `".join(r["command"] for r in rows) + "`", ""]
    write_pair(args.out, {"provenance": prov, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
