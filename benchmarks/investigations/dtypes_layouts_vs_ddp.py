"""Max difference vs torch DDP after 4 steps, per stage: float64 models and strided (channels_last, transposed)
parameters (core/precision.py [Note: float64 models], core/flat_param.py [Note: parameters keep their strides]).

    PYTHONPATH=. python benchmarks/investigations/dtypes_layouts_vs_ddp.py

Runs the loops of tests/distributed/test_dtypes_and_layouts.py (2 gloo ranks, 4 plain steps, AdamW and SGD
with momentum, each stage beside DDP + the same torch optimizer on the same model) and prints, per case and
stage, the largest |zerokit - DDP| over the losses and every state_dict entry, over both ranks. A table of
zeros is the claim "bitwise"; the test asserts it with torch.equal.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "distributed")]

from test_dtypes_and_layouts import STAGES, _fp64_cases, _layout_cases  # noqa: E402

from zerokit.launch import run_ranks  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fp64 = run_ranks(_fp64_cases, 2, tmp, timeout_s=280)
    with tempfile.TemporaryDirectory() as tmp:
        layouts = run_ranks(_layout_cases, 2, tmp, timeout_s=280)
    rows = [(f"fp64 odd model, {opt}", [max(r[(opt, s)]["max_diff"] for r in fp64) for s in STAGES])
            for opt in ("adamw", "sgd")]
    rows += [(f"{family}, {opt}", [max(r[(family, opt, s)]["max_diff"] for r in layouts) for s in STAGES])
             for family in ("channels_last", "transposed") for opt in ("adamw", "sgd")]
    print("| case | " + " | ".join(f"stage {s}" for s in STAGES) + " |")
    print("|---|" + "---|" * len(STAGES))
    for name, diffs in rows:
        print(f"| {name} | " + " | ".join(f"{d:.3g}" for d in diffs) + " |")


if __name__ == "__main__":
    main()
