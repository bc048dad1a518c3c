"""benchmarks/memory.py --device: simulated ranks on one device, results through zerokit/provenance.py.

On CPU (here) the ledger is checked against zk.estimate; the allocator's columns exist only on CUDA
(scripts/gpu_check.sh runs `--device cuda --model gpt2-xl`).
"""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import memory as memory_per_stage  # noqa: E402


@pytest.mark.timeout(120)
def test_device_mode_measures_every_stage_and_world_size_against_the_formula(tmp_path, monkeypatch):
    argv = ["--device", "cpu", "--model", "tiny", "--world-sizes", "2", "8", "--stages", "0", "1", "2", "3",
            "--seq-len", "16", "--steps", "2", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["memory.py", *argv])
    assert memory_per_stage.main() == 0
    record = json.loads((tmp_path / "memory_per_stage_cpu_tiny.json").read_text())
    md = (tmp_path / "memory_per_stage_cpu_tiny.md").read_text()
    assert set(record["provenance"]) == {"command", "date", "commit", "machine", "versions"}
    assert record["provenance"]["command"] == "python benchmarks/memory.py " + " ".join(argv)
    rows = record["rows"]
    assert [(r["config"]["world_size"], r["config"]["stage"]) for r in rows] == [
        (n, s) for n in (2, 8) for s in range(4)]
    for r in rows:
        states = ("params", "grads", "master_params", "optimizer_states")
        measured = sum(r["measured"][k] for k in states)
        predicted = sum(r["predicted"][k] for k in states)
        # padding: one buffer per unit at stage 3, each padded by < N elements
        assert abs(measured - predicted) <= 0.01 * predicted, r["config"]
        assert r["cuda"] is None and r["measured"]["activations"] > 0
    assert record["provenance"]["commit"] in md and md.count("\n| 8 | ") == 4
