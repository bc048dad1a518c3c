"""benchmarks/speed.py --paired: CPU time beside wall time, the sweep's sizes, one rank beside plain torch."""
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # spawned ranks inherit sys.path, so they can import it too

import speed  # noqa: E402


@pytest.mark.timeout(120)
def test_paired_one_rank_beside_plain_torch_reports_cpu_time(tmp_path):
    """--nproc 1 --peers plain: each stage beside plain torch fp32, bit for bit (no collective at one rank),
    a CPU-time ratio inside its interval and in the table, each library's default buckets recorded."""
    argv = ["--nproc", "1", "--peers", "plain", "--model", "tiny", "--stages", "0", "3", "--steps", "6",
            "--warmup", "1", "--bucket-numel", "default", "--out", str(tmp_path / "p1")]
    assert speed.main(["--paired", *argv]) == 0
    record = json.loads((tmp_path / "p1.json").read_text())
    md = (tmp_path / "p1.md").read_text()
    assert [(r["stage"], r["peer"]) for r in record["rows"]] == [(0, "torch fp32"), (3, "torch fp32")]
    assert record["config"]["bucket_numel"] is None and "each library's default bucket size" in md
    for r in record["rows"]:
        assert r["zerokit_cpu_ms"] > 0 and r["peer_cpu_ms"] > 0
        assert r["cpu_ci95"][0] <= r["cpu_median_ratio"] <= r["cpu_ci95"][1]
        assert f"| {r['cpu_median_ratio']:.3f} | {r['cpu_ci95'][0]:.3f}-{r['cpu_ci95'][1]:.3f} |" in md
        assert r["max_abs_dloss"] == 0.0, r


def test_paired_takes_the_sweeps_sizes_and_refuses_plain_peers_on_two_ranks():
    import scaling
    assert speed.model_config("4M") == scaling.config("4M")
    assert speed.model_config("tiny").n_layer >= 1
    with pytest.raises(SystemExit):
        speed.main(["--paired", "--nproc", "2", "--peers", "plain"])
