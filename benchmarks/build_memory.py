"""Per-phase peak memory of one simulated rank (build, step), a model built on the meta device or eagerly.

    python benchmarks/build_memory.py                      # gpt2-xl at N = 8 and 64, stages 1-3; gpt3-6.7b at 64
    python benchmarks/build_memory.py --quick              # gpt2-small only (a smoke run, a minute)

Each configuration is one fresh process running `zerokit memory --simulate ... --json`, so every peak is
that process's own (commands/memory.py `simulate_rank`: the resident set's high-water mark per phase, beside
the bound = process baseline + model states + stage-3 working set + activations). `--build eager` rows
build the whole model first, as zk.shard required before core/materialize.py. Results, with the commands,
date and commit: benchmarks/results/build_memory.{json,md}.
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


def run_one(model: str, world_size: int, stage: int, build: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "zerokit", "memory", "--simulate", "--model", model, "--world-size",
               str(world_size), "--stage", str(stage), "--precision", "bf16", "--build", build, "--json", str(out)]
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
            "peaks": phases["peaks"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="gpt2-small only")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "build_memory")
    args = p.parse_args(argv)
    prov = provenance(command_line(__file__, argv))
    rows = []
    for model, n, stage, build in (QUICK if args.quick else FULL):
        rows.append(run_one(model, n, stage, build))
        r = rows[-1]
        print(f"{model} N={n} stage {stage} {build}: " + ", ".join(
            f"{k} {v['peak_bytes'] / 1e9:.2f} GB ({v['ratio_to_bound']:.2f} x bound)" for k, v in r["peaks"].items()))
    lines = ["# Peak memory per phase of one simulated rank: built on the meta device or eagerly", "",
             *provenance_lines(prov), "",
             "One process plays rank 0 of N (`Comm(simulate=Simulated(0, N))`), bf16 + AdamW, one step on 1 x 8 "
             "tokens. Peak: the resident set's high-water mark (VmHWM) in each phase; bound: process baseline + "
             "model states (formula) + stage-3 working set + activations (zerokit/commands/memory.py "
             "`phase_bound`). GB = 10^9 bytes.", "",
             "| model | N | stage | build | model states GB | bound GB | build peak GB (x bound, s) | "
             "step peak GB (x bound, s) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['peaks'][k]['peak_bytes'] / 1e9:.2f} ({r['peaks'][k]['ratio_to_bound']:.2f}x, "
                 f"{r['peaks'][k]['seconds']:.0f} s)" for k in ("build", "step")]
        lines.append(f"| {r['model']} | {r['world_size']} | {r['stage']} | {r['build']} | "
                     f"{r['model_states_bytes'] / 1e9:.2f} | {r['bound_bytes'] / 1e9:.2f} | {cells[0]} | {cells[1]} |")
    lines += ["", "Each row's command: `" + "`, `".join(r["command"] for r in rows) + "`", ""]
    write_pair(args.out, {"provenance": prov, "rows": rows}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
