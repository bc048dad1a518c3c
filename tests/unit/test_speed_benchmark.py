"""benchmarks/speed.py: a 2-step run writes a complete, honest JSON and tables."""
import ctypes
import json
import math
import sys
import threading
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # spawned ranks inherit sys.path, so they can import it too

import speed  # noqa: E402
from speed import DDP, FSDP1_FULL, FSDP1_GRAD_OP, FSDP2, ZERO  # noqa: E402

# (stage, torch run, role), in the order of the pairs
PAIRS = [(0, DDP, "peer"), (1, ZERO, "peer"), (2, FSDP1_GRAD_OP, "peer"), (2, DDP, "reference"),
         (3, FSDP1_FULL, "peer"), (3, FSDP2, "peer")]


@pytest.mark.timeout(90)
def test_two_step_run_writes_every_pair_with_times_losses_and_bytes(tmp_path):
    """2 gloo ranks, tiny model, 2 timed steps and a 1-step allocator pass: every pair, every stage line, every byte."""
    argv = ["--nproc", "2", "--model", "tiny", "--steps", "2", "--warmup", "1", "--rounds", "1",
            "--memory-warmup", "1", "--memory-steps", "1", "--out", str(tmp_path)]
    assert speed.main(argv) == 0
    record = json.loads((tmp_path / "speed_vs_torch_cpu.json").read_text())
    md = (tmp_path / "speed_vs_torch_cpu.md").read_text()

    prov = record["provenance"]  # zerokit/provenance.py's record: command, date, commit, machine, versions
    assert set(prov) == {"command", "date", "commit", "machine", "versions"}
    assert prov["command"] == "python benchmarks/speed.py " + " ".join(argv)
    assert record["meta"]["command"].endswith(" ".join(argv))
    assert [(p["stage"], p["peer"], p["role"]) for p in record["pairs"]] == PAIRS
    ddp_states = record["runs"][DDP]["memory"][0]["optimizer_states"]
    for pair in record["pairs"]:
        assert pair["zerokit_ms"] > 0 and pair["zerokit_tokens_per_s"] > 0
        assert pair["zerokit_peak_step_bytes"] >= pair["zerokit_between_steps_bytes"] > 0
        if pair["peer_error"]:  # a peer that cannot run here is reported with its error, never a number
            assert pair["peer_ms"] is None and pair["ratio"] is None
            continue
        assert pair["ratio"] == pytest.approx(pair["zerokit_ms"] / pair["peer_ms"])
        assert pair["peer_tokens_per_s"] == pytest.approx(2 * 8 * 32 / (pair["peer_ms"] / 1e3))
        # fp32 at 2 ranks: each pair reduces a sum of two values, so the runs share every bit;
        # the stated tolerance is what the record must report as met
        assert pair["max_abs_loss_diff"] <= pair["loss_tolerance"] and pair["loss_within_tolerance"] is True
        assert pair["peer_peak_step_bytes"] >= pair["peer_between_steps_bytes"] > 0
        # the sharding peers hold about half of DDP's Adam state at 2 ranks (torch's ZeRO shards whole
        # params, so not exactly half); DDP holds all 8 bytes/param
        states = pair["peer_memory"]["optimizer_states"]
        assert states == ddp_states if pair["peer"] == DDP else 0.4 * ddp_states < states < 0.6 * ddp_states

    # zerokit's four stages share every bit with each other at any world size; the spread is reported with the pair
    spread = record["loss_spread"]
    assert spread["zerokit"]["max_abs_loss_diff"] == 0 and len(set(spread["zerokit"]["between"])) == 2
    assert "- losses among themselves: zerokit's runs differ by at most 0.0e+00" in md

    for line in record["stages"]:  # each stage against its fastest peer; the DDP reference never chosen
        pairs = [p for p in record["pairs"] if p["stage"] == line["stage"]]
        ran = [p for p in pairs if p["role"] == "peer" and p["peer_ms"] is not None]
        assert set(line["ratios"]) == {p["peer"] for p in pairs}
        if ran:
            fastest = min(ran, key=lambda p: p["peer_ms"])
            assert line["fastest_peer"] == fastest["peer"] and line["ratio_vs_fastest"] == fastest["ratio"]
            assert line["lowest_peer_peak_step_bytes"] == min(p["peer_peak_step_bytes"] for p in ran)
    assert [line["stage"] for line in record["stages"]] == [0, 1, 2, 3]

    for name, run in record["runs"].items():
        if "error" in run:
            continue
        assert len(run["step_ms"]) == 2 and all(len(r) == 1 and len(r[0]) == 2 for r in run["step_ms"]), name
        assert all(math.isfinite(v) for rank in run["losses"] for rnd in rank for v in rnd), name
        # the allocator pass: one measured step, two boundaries, on each of the 2 ranks
        alloc = run["allocator"]
        assert alloc["method"] == speed.ALLOCATOR_CPU, alloc["method"]  # the all-threads counter
        assert [(len(r["peak_step_bytes"]), len(r["between_steps_bytes"])) for r in alloc["per_rank"]] == [(1, 2)] * 2
    # between steps a replicated run holds its model states and little else: params + grads + Adam's
    # two states, 16 bytes/param (zerokit's flat buffers, DDP's bucket-view grads), counted by the allocator
    for name in ("zerokit stage 0", DDP):
        run = record["runs"][name]
        states = sum(run["memory"][0].values())
        assert states <= run["allocator"]["between_steps_bytes"] < 1.05 * states, name
    ddp, zk0 = record["runs"][DDP], record["runs"]["zerokit stage 0"]
    assert zk0["memory"][0]["optimizer_states"] == ddp["memory"][0]["optimizer_states"]  # both 8Ψ, fp32 Adam
    assert "## Each stage against its fastest peer" in md and "| zerokit stage 3 | torch FSDP2 fully_shard |" in md
    assert "caffe2_report_cpu_memory_usage" in md and "Python overhead" in md and prov["command"] in md


def test_a_peer_that_fails_gets_its_error_in_the_table_and_no_number():
    """summarize/tables: a peer that raised shows its error and no number; a reference is never the fastest."""
    def result(ms: float, peak: int) -> list[dict]:
        memory = {"params": 4, "grads": 4, "master_params": 0, "optimizer_states": 8}
        alloc = {"method": "m", "peak_step_bytes": [peak], "between_steps_bytes": [16, 16], "unseen_free_bytes": 0}
        return [{"losses": [3.0, 2.5], "step_ms": [50.0, ms], "peak_bytes": None, "memory": memory,
                 "allocator": alloc}]

    cfg = {"stages": [2, 3], "batch_size": 2, "block_size": 4, "nproc": 2, "warmup": 1, "precision": "fp32"}
    error = "RuntimeError: FSDP needs a non-CPU accelerator device, but no accelerator device is detected."
    per_rank = [{"zerokit stage 2": result(10.0, 90), FSDP1_GRAD_OP: result(12.0, 80), DDP: result(8.0, 70),
                 "zerokit stage 3": result(20.0, 50), FSDP1_FULL: [{"error": error}], FSDP2: result(25.0, 60)}
                for _ in range(2)]
    out = speed.summarize(per_rank, cfg)
    grad_op, ddp, full, fsdp2 = out["pairs"]
    assert ddp["role"] == "reference" and ddp["ratio"] == pytest.approx(10.0 / 8.0)
    assert full["peer_error"] == error and full["peer_ms"] is None and full["ratio"] is None
    assert fsdp2["ratio"] == pytest.approx(20.0 / 25.0) and fsdp2["max_abs_loss_diff"] == 0.0
    two, three = out["stages"]
    # DDP is faster and lower than FSDP1 SHARD_GRAD_OP, but a reference: stage 2's peer is FSDP1
    assert two["fastest_peer"] == FSDP1_GRAD_OP and two["ratio_vs_fastest"] == pytest.approx(10.0 / 12.0)
    assert two["lowest_peak_peer"] == FSDP1_GRAD_OP and two["peak_at_most_lowest_peer"] is False
    assert three["fastest_peer"] == FSDP2 and three["ratios"] == {FSDP1_FULL: None, FSDP2: pytest.approx(0.8)}
    assert three["zerokit_peak_step_bytes"] == 50 and three["peak_at_most_lowest_peer"] is True
    rows = speed.table(out["pairs"])
    full_row = [cell.strip() for cell in rows[4].split("|")[1:-1]]
    assert full_row[:2] == ["zerokit stage 3", FSDP1_FULL] and full_row[2] == "20.0" and full_row[3:5] == ["-", "-"]
    assert rows[3].split("|")[2].strip() == "torch DDP (reference)"
    summary = speed.stage_table(out["stages"])
    assert "| FSDP1 FULL_SHARD -, FSDP2 fully_shard 0.80 |" in summary[-1]


def test_ratio_by_round_is_each_rounds_own_ratio_and_the_summary_shows_its_spread():
    """Each round's median (slowest rank) over the peer's in that round; the stage line shows lowest-highest."""
    def rounds(*timed: float) -> list[dict]:  # one round per value: a warm-up step, then the timed one
        memory = {"params": 4, "grads": 4, "master_params": 0, "optimizer_states": 8}
        return [{"losses": [3.0, 2.5], "step_ms": [50.0, ms], "peak_bytes": None, "memory": memory} for ms in timed]

    cfg = {"stages": [1], "batch_size": 2, "block_size": 4, "nproc": 2, "warmup": 1, "precision": "fp32"}
    per_rank = [{"zerokit stage 1": rounds(10.0, 12.0), ZERO: rounds(10.0, 10.0)},
                {"zerokit stage 1": rounds(11.0, 9.0), ZERO: rounds(10.0, 12.0)}]
    out = speed.summarize(per_rank, cfg)
    (pair,) = out["pairs"]
    # rounds, slowest rank: zerokit 11 and 12, the peer 10 and 12; over all rounds each rank's median: 11 and 11
    assert pair["ratio_by_round"] == [pytest.approx(1.1), pytest.approx(1.0)]
    assert pair["ratio"] == pytest.approx(1.0)
    assert out["stages"][0]["ratio_by_round_vs_fastest"] == pair["ratio_by_round"]
    assert "| 1.00 (1.00-1.10) |" in speed.stage_table(out["stages"])[-1]


def test_cpu_allocator_pass_counts_a_free_made_on_another_thread():
    """On CPU a tensor freed on another thread leaves c10's all-threads counter, not the main-thread ledger."""
    from torch.profiler import ProfilerActivity, profile

    box = []
    with speed._all_threads_counter() as all_threads, \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        speed._probe(speed.BASE)
        box.append(torch.empty(1 << 18))  # 1 MiB, allocated here
        speed._probe(speed.MARK)
        worker = threading.Thread(target=box.clear)  # and freed on another thread, as gloo's threads do
        worker.start()
        worker.join()
        speed._probe(speed.MARK)
    out = speed._allocator_from_profile(prof, all_threads)
    assert all_threads, "libc10's FLAGS_caffe2_report_cpu_memory_usage not found"
    assert out["between_steps_bytes"] == [1 << 20, 0] and out["peak_step_bytes"] == [1 << 20]
    assert out["main_thread"]["between_steps_bytes"] == [1 << 20, 1 << 20]  # the free it never saw
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    assert ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value is False  # put back


@pytest.mark.timeout(60)
def test_plain_peers_run_in_process_at_world_size_1_and_write_through_the_results_helper(tmp_path):
    """--peers plain: each stage beside plain torch in this process; fp32 at N=1 trains bit for bit like it."""
    argv = ["--peers", "plain", "--nproc", "1", "--model", "tiny", "--precision", "fp32", "--steps", "2",
            "--warmup", "1", "--rounds", "1", "--out", str(tmp_path)]
    assert speed.main(argv) == 0
    record = json.loads((tmp_path / "speed_vs_torch_plain_cpu.json").read_text())
    md = (tmp_path / "speed_vs_torch_plain_cpu.md").read_text()
    prov = record["provenance"]  # zerokit/provenance.py's record: command, date, commit, machine, versions
    assert set(prov) == {"command", "date", "commit", "machine", "versions"}
    assert prov["command"] == "python benchmarks/speed.py " + " ".join(argv)
    assert [(p["stage"], p["peer"]) for p in record["pairs"]] == [(s, "torch fp32") for s in range(4)]
    for pair in record["pairs"]:
        assert pair["ratio"] == pytest.approx(pair["zerokit_ms"] / pair["peer_ms"])
        assert pair["max_abs_loss_diff"] == 0.0, pair  # one process, fp32, the same AdamW math
        assert pair["zerokit_memory"] == pair["peer_memory"], pair  # 4 + 4 + 8 bytes per parameter both
    # the allocator pass is off by default here: the plain runs take the time they always did
    assert record["config"]["memory_steps"] == 0 and all(r["allocator"] is None for r in record["runs"].values())
    assert prov["command"] in md and prov["commit"] in md and "| zerokit stage 3 | torch fp32 |" in md
    assert "peak MB" not in md


def test_plain_peers_under_bf16_are_autocast_and_bf16_params():
    """Under bf16 every stage gets two plain peers, each a pair of its own; the default peers are unchanged."""
    cfg = {"peers": "plain", "precision": "bf16"}
    assert [p for p, _ in speed.peers_for(2, cfg)] == ["torch autocast bf16", "torch bf16 params"]
    assert speed.peers_for(3, {"precision": "bf16"}) == speed.PEERS[3]
    assert [p for p, _ in speed.PEERS[3]] == [FSDP1_FULL, FSDP2]


def test_four_ranks_and_the_memory_options_parse():
    """--nproc 4 (the second target world size) and the allocator pass's options; the old CLI unchanged."""
    args = speed.parse_args(["--nproc", "4", "--steps", "20", "--warmup", "5"])
    assert (args.nproc, args.memory_steps, args.memory_warmup, args.peers) == (4, 3, 2, "default")
    assert speed.parse_args(["--memory-steps", "0"]).memory_steps == 0
    # one results file per target world size: 2 keeps its old name, 4 gets its own
    names = [speed.results_name("default", "cpu", n) for n in (2, 4)]
    assert names == ["speed_vs_torch_cpu", "speed_vs_torch_cpu_n4"]
    assert speed.results_name("plain", "cuda", 1) == "speed_vs_torch_plain_cuda"
    with pytest.raises(SystemExit):
        speed.parse_args(["--memory-steps", "-1"])
