"""benchmarks/speed_vs_torch.py: a 2-step run writes a complete, honest JSON and table."""
import json
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # spawned ranks inherit sys.path, so they can import it too

import speed_vs_torch  # noqa: E402

PEERS = {0: "torch DDP", 1: "torch ZeroRedundancyOptimizer", 2: "torch DDP", 3: "torch FSDP"}


@pytest.mark.timeout(60)
def test_two_step_run_writes_every_pair_with_times_losses_and_bytes(tmp_path):
    """2 gloo ranks, tiny model, 2 steps: one pair per stage with positive times, finite losses and bytes."""
    argv = ["--nproc", "2", "--model", "tiny", "--steps", "2", "--warmup", "1", "--rounds", "1",
            "--out", str(tmp_path)]
    assert speed_vs_torch.main(argv) == 0
    record = json.loads((tmp_path / "speed_vs_torch_cpu.json").read_text())
    md = (tmp_path / "speed_vs_torch_cpu.md").read_text()

    meta = record["meta"]
    assert meta["command"].endswith(" ".join(argv)) and meta["command"].startswith("python benchmarks/")
    for key in ("date", "torch", "python", "cpu_count", "cpu_model"):
        assert key in meta, key
    assert [p["stage"] for p in record["pairs"]] == [0, 1, 2, 3]
    for pair in record["pairs"]:
        assert pair["peer"].startswith(PEERS[pair["stage"]]), pair["peer"]
        assert pair["zerokit_ms"] > 0 and pair["zerokit_tokens_per_s"] > 0
        if pair["peer_error"]:  # a peer that cannot run is reported with its error, never a number
            assert pair["peer_ms"] is None and pair["ratio"] is None
            continue
        assert pair["ratio"] == pytest.approx(pair["zerokit_ms"] / pair["peer_ms"])
        assert pair["peer_tokens_per_s"] == pytest.approx(2 * 8 * 32 / (pair["peer_ms"] / 1e3))
        # fp32 at 2 ranks: each pair reduces a sum of two values, so the runs share every bit;
        # the stated tolerance is what the record must report as met
        assert pair["max_abs_loss_diff"] <= pair["loss_tolerance"] and pair["loss_within_tolerance"] is True
        # the sharding peers hold about half of DDP's Adam state at 2 ranks (torch's ZeRO shards whole
        # params, so not exactly half); the DDP peer holds all 8 bytes/param
        ddp_states = record["runs"]["torch DDP"]["memory"][0]["optimizer_states"]
        if pair["stage"] in (1, 3):
            assert 0.4 * ddp_states < pair["peer_memory"]["optimizer_states"] < 0.6 * ddp_states
        else:
            assert pair["peer_memory"]["optimizer_states"] == ddp_states
    for name, run in record["runs"].items():
        if "error" in run:
            continue
        assert len(run["step_ms"]) == 2 and all(len(r) == 1 and len(r[0]) == 2 for r in run["step_ms"]), name
        assert all(math.isfinite(v) for rank in run["losses"] for rnd in rank for v in rnd), name
    ddp, zk0 = record["runs"]["torch DDP"], record["runs"]["zerokit stage 0"]
    assert zk0["memory"][0]["optimizer_states"] == ddp["memory"][0]["optimizer_states"]  # both 8Ψ, fp32 Adam
    assert "| zerokit stage 3 |" in md and "Python overhead" in md and meta["command"] in md


def test_a_peer_that_fails_gets_its_error_in_the_table_and_no_number():
    """summarize/table: an FSDP run that raised is shown as its error, with no time, ratio or loss."""
    def result(ms: float) -> list[dict]:
        memory = {"params": 4, "grads": 4, "master_params": 0, "optimizer_states": 8}
        return [{"losses": [3.0, 2.5], "step_ms": [50.0, ms], "peak_bytes": None, "memory": memory}]

    cfg = {"stages": [0, 3], "batch_size": 2, "block_size": 4, "nproc": 2, "warmup": 1, "precision": "fp32"}
    error = "FSDP2 fully_shard: RuntimeError: boom; FSDP1 FullyShardedDataParallel: RuntimeError: no accelerator"
    per_rank = [{"zerokit stage 0": result(10.0), "torch DDP": result(8.0), "zerokit stage 3": result(20.0),
                 "torch FSDP": [{"error": error}]} for _ in range(2)]
    out = speed_vs_torch.summarize(per_rank, cfg)
    ddp_pair, fsdp_pair = out["pairs"]
    assert ddp_pair["ratio"] == pytest.approx(10.0 / 8.0) and ddp_pair["max_abs_loss_diff"] == 0.0
    assert fsdp_pair["peer_error"] == error and fsdp_pair["peer_ms"] is None and fsdp_pair["ratio"] is None
    rows = speed_vs_torch.table(out["pairs"])
    fsdp_row = [cell.strip() for cell in rows[-1].split("|")[1:-1]]
    assert fsdp_row[0] == "zerokit stage 3" and fsdp_row[2] == "20.0" and fsdp_row[3:5] == ["-", "-"]


@pytest.mark.timeout(60)
def test_plain_peers_run_in_process_at_world_size_1_and_write_through_the_results_helper(tmp_path):
    """--peers plain: each stage beside plain torch in this process; fp32 at N=1 trains bit for bit like it."""
    argv = ["--peers", "plain", "--nproc", "1", "--model", "tiny", "--precision", "fp32", "--steps", "2",
            "--warmup", "1", "--rounds", "1", "--out", str(tmp_path)]
    assert speed_vs_torch.main(argv) == 0
    record = json.loads((tmp_path / "speed_vs_torch_plain_cpu.json").read_text())
    md = (tmp_path / "speed_vs_torch_plain_cpu.md").read_text()
    prov = record["provenance"]  # benchmarks/_results.py's record: command, date, commit, machine, versions
    assert set(prov) == {"command", "date", "commit", "machine", "versions"}
    assert prov["command"] == "python benchmarks/speed_vs_torch.py " + " ".join(argv)
    assert [(p["stage"], p["peer"]) for p in record["pairs"]] == [(s, "torch fp32") for s in range(4)]
    for pair in record["pairs"]:
        assert pair["ratio"] == pytest.approx(pair["zerokit_ms"] / pair["peer_ms"])
        assert pair["max_abs_loss_diff"] == 0.0, pair  # one process, fp32, the same AdamW math
        assert pair["zerokit_memory"] == pair["peer_memory"], pair  # 4 + 4 + 8 bytes per parameter both
    assert prov["command"] in md and prov["commit"] in md and "| zerokit stage 3 | torch fp32 |" in md


def test_plain_peers_under_bf16_are_autocast_and_bf16_params():
    """Under bf16 every stage gets two plain peers, each a pair of its own; the default peers are unchanged."""
    cfg = {"peers": "plain", "precision": "bf16"}
    assert [p for p, _ in speed_vs_torch.peers_for(2, cfg)] == ["torch autocast bf16", "torch bf16 params"]
    assert speed_vs_torch.peers_for(3, {"precision": "bf16"}) == [speed_vs_torch.PEERS[3]]
