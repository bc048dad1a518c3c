"""benchmarks/collectives.py (both modes), memory.py --sweep and --checkpoint, speed.py --paired and
investigations/stage0_phases.py, stage1_phases.py, buffer_broadcast.py: a short run writes complete records and
tables."""
import json
import sys
from pathlib import Path

import pytest
import torch

from zerokit.bench import no_decay

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # spawned ranks inherit sys.path, so they can import them too
sys.path.insert(0, str(BENCHMARKS / "investigations"))

import collectives  # noqa: E402
import memory  # noqa: E402
import speed  # noqa: E402
import stage0_phases  # noqa: E402
import stage1_phases  # noqa: E402

PROVENANCE = {"command", "date", "commit", "machine", "versions"}


@pytest.mark.timeout(120)
def test_gather_cost_times_every_way_and_counts_what_they_allocate(tmp_path):
    """2 and 3 ranks, two sizes: a row per (ranks, size), the size rounded to a multiple of the ranks; the rows the
    ways gather are checked equal inside the run; zerokit's gathers allocate nothing in flight, torch's at least its
    output (gloo's buffer); the ratio is the times' ratio; the broadcasts zerokit used at 2 ranks before are timed
    there only (at 3 ranks they are zerokit's way). Then three outputs at once."""
    argv = ["--nproc", "2", "3", "--numel", "100", "30000", "--calls", "3", "--rounds", "1",
            "--many", "600", "1200", "3000", "--out", str(tmp_path / "gc")]
    assert collectives.main(argv) == 0
    record = json.loads((tmp_path / "gc.json").read_text())
    md = (tmp_path / "gc.md").read_text()
    assert PROVENANCE <= set(record) and record["command"] == "python benchmarks/collectives.py " + " ".join(argv)
    assert [(r["world_size"], r["numel"]) for r in record["rows"]] == [(2, 100), (2, 30000), (3, 99), (3, 30000)]
    torch_way, zk_way, before = collectives.WAYS
    for row in record["rows"]:
        assert row["output_bytes"] == 4 * row["numel"]
        assert row["ms"][torch_way] > 0 and row["ms"][zk_way] > 0
        assert (before in row["ms"]) == (row["world_size"] == 2), row
        assert row["ratio"] == pytest.approx(row["ms"][zk_way] / row["ms"][torch_way])
        assert row["allocated"][zk_way] == 0, row
        assert row["allocated"].get(before, 0) == 0, row
        assert row["allocated"][torch_way] >= row["output_bytes"], row
    assert "| 3 | 30,000 |" in md and "(zerokit's way)" in md and record["commit"] in md
    # several outputs at once: zerokit's packed gather allocates its staging buffer (the outputs' bytes) and
    # nothing else, by all-to-all or by broadcasts; torch's coalesced one at least that and the concatenated inputs
    torch_many, zk_many, before_many = collectives.MANY_WAYS
    assert [(r["world_size"], r["outputs"], r["output_bytes"]) for r in record["many"]] == [(2, 3, 19200),
                                                                                           (3, 3, 19200)]
    for row in record["many"]:
        assert row["allocated"][zk_many] == row["output_bytes"], row
        assert row["allocated"].get(before_many, row["output_bytes"]) == row["output_bytes"], row
        assert (before_many in row["ms"]) == (row["world_size"] == 2), row
        assert row["allocated"][torch_many] >= row["output_bytes"] * (1 + 1 / row["world_size"]), row
        assert row["ratio"] == pytest.approx(row["ms"][zk_many] / row["ms"][torch_many])
    assert "## Several outputs at once (3: 600, 1,200, 3,000 fp32 elements)" in md


@pytest.mark.timeout(120)
def test_reduce_scatter_cost_times_three_ways_with_the_same_bits(tmp_path):
    """2 ranks, two sizes (the odd one rounded down to even): every way timed, their outputs equal bit for bit; the
    exchange of halves allocates half the N-row recipe's receive buffer in flight (B/2 against B, 4-byte elements)."""
    argv = ["--numel", "101", "30000", "--calls", "3", "--rounds", "1", "--out", str(tmp_path / "rs")]
    assert collectives.main(["--reduce-scatter", *argv]) == 0
    record = json.loads((tmp_path / "rs.json").read_text())
    md = (tmp_path / "rs.md").read_text()
    assert PROVENANCE <= set(record) and record["command"] == "python benchmarks/collectives.py --reduce-scatter " + " ".join(argv)
    assert [r["numel"] for r in record["rows"]] == [100, 30000]
    torch_way, rows_way, halves_way = collectives.RS_WAYS
    for row in record["rows"]:
        assert row["same_bits"] is True and all(row["ms"][way] > 0 for way in collectives.RS_WAYS)
        assert row["halves_vs_rows"] == pytest.approx(row["ms"][halves_way] / row["ms"][rows_way])
        assert row["allocated"][rows_way] == row["input_bytes"] == 4 * row["numel"], row
        assert row["allocated"][halves_way] == row["input_bytes"] // 2, row
    assert "| 30,000 |" in md and record["commit"] in md


@pytest.mark.timeout(120)
def test_stage0_phases_counts_fewer_all_reduces_with_groups_than_per_bucket(tmp_path):
    """2 ranks, tiny model, small buckets: zerokit stage 0 and DDP, every phase timed; zerokit's all-reduce groups
    make fewer collectives than one per trainable bucket (counted on the same engine built here as rank 0 of 2),
    DDP's count read from DDP itself; the ratios are against DDP's sum."""
    import zerokit as zk
    from zerokit.core.collectives.comm import Comm, Simulated
    from zerokit.models import Block, build_model

    argv = ["--nproc", "2", "--model", "tiny", "--steps", "3", "--warmup", "1", "--rounds", "1",
            "--bucket-numel", "2000", "--out", str(tmp_path / "s0")]
    assert stage0_phases.main(argv) == 0
    record = json.loads((tmp_path / "s0.json").read_text())
    md = (tmp_path / "s0.md").read_text()
    assert PROVENANCE <= set(record) and record["command"] == "python benchmarks/investigations/stage0_phases.py " + " ".join(argv)
    rows = {r["run"]: r for r in record["rows"]}
    assert list(rows) == list(stage0_phases.RUNS)
    grouped, ddp = (rows[name] for name in stage0_phases.RUNS)
    engine = zk.shard(build_model("tiny", seed=0), torch.optim.AdamW, stage=0, bucket_numel=2000, wrap=(Block,),
                      param_groups=no_decay, comm=Comm(simulate=Simulated(0, 2)))
    assert 1 <= grouped["all_reduces"] < len(engine.trainable), rows
    assert ddp["all_reduces"] >= 1
    for row in rows.values():
        assert set(row["ms"]) == set(stage0_phases.PHASES) and all(v > 0 for v in row["ms"].values())
        assert row["total_ms"] == pytest.approx(sum(row["ms"].values()))
        assert row["whole_ms"] > 0 and f"| {row['whole_ms']:.2f} | {row['whole_ms'] / ddp['whole_ms']:.2f} |" in md
        assert f"| {row['run']} | {row['all_reduces']} |" in md
    assert f"| {ddp['total_ms'] / ddp['total_ms']:.2f} |" in md


@pytest.mark.timeout(120)
def test_stage1_phases_times_stage1_beside_zero_redundancy_optimizer(tmp_path):
    """2 ranks, tiny model, small buckets: all three runs, every phase timed; zerokit's count is one reduce-scatter per
    trainable bucket, torch's read from its DDP; the sums' ratios are against ZeroRedundancyOptimizer's."""
    import zerokit as zk
    from zerokit.core.collectives.comm import Comm, Simulated
    from zerokit.models import Block, build_model

    argv = ["--nproc", "2", "--model", "tiny", "--steps", "3", "--warmup", "1", "--rounds", "1",
            "--bucket-numel", "2000", "--out", str(tmp_path / "s1")]
    assert stage1_phases.main(argv) == 0
    record = json.loads((tmp_path / "s1.json").read_text())
    md = (tmp_path / "s1.md").read_text()
    assert PROVENANCE <= set(record) and record["command"] == "python benchmarks/investigations/stage1_phases.py " + " ".join(argv)
    rows = {r["run"]: r for r in record["rows"]}
    assert list(rows) == list(stage1_phases.RUNS)
    zk_row, zero = rows[stage1_phases.ZK], rows[stage1_phases.ZERO]
    # the same model and buckets, built here as rank 0 of 2: its trainable buckets are the reduce-scatters
    engine = zk.shard(build_model("tiny", seed=0), torch.optim.AdamW, stage=1, bucket_numel=2000, wrap=(Block,),
                      param_groups=no_decay, comm=Comm(simulate=Simulated(0, 2)))
    assert zk_row["all_reduces"] == len(engine.trainable) > 1
    assert zero["all_reduces"] >= 1
    # capped buckets never exceed 2000 elements, so there are at least as many as when they close once full
    assert rows[stage1_phases.CAPPED]["all_reduces"] >= zk_row["all_reduces"]
    for row in rows.values():
        assert set(row["ms"]) == set(stage0_phases.PHASES) and all(v > 0 for v in row["ms"].values())
        assert f"| {row['run']} | {row['all_reduces']} |" in md
    assert "| run | gradient collectives per step |" in md and "sum / ZeroRedundancyOptimizer's |" in md
    assert "| whole step ms | whole / ZeroRedundancyOptimizer's |" in md
    assert all(row["whole_ms"] > 0 for row in rows.values())
    assert f"| {zk_row['total_ms'] / zero['total_ms']:.2f} |" in md


@pytest.mark.timeout(180)
def test_sweep_records_time_ledger_and_allocator_bytes_per_stage(tmp_path):
    """The smallest size at N = 1 and 2: a row per (N, stage) with a step time, the ledger's bytes and the allocator
    pass's; after a step the allocator holds the model states (within 1 KiB of scalars the ledger leaves out); at
    N = 2 the stages' model states follow fp32 AdamW's 16, 8+8/N, 4+12/N, 16/N bytes per parameter, and stage 3 peaks
    lowest."""
    argv = ["--sizes", "1", "--world-sizes", "1", "2", "--steps", "1", "--warmup", "1", "--out", str(tmp_path / "sw")]
    assert memory.main(["--sweep", *argv]) == 0
    record = json.loads((tmp_path / "sw.json").read_text())
    md = (tmp_path / "sw.md").read_text()
    assert PROVENANCE <= set(record) and record["command"] == "python benchmarks/memory.py --sweep " + " ".join(argv)
    rows = {(r["world_size"], r["stage"]): r for r in record["rows"]}
    assert sorted(rows) == [(n, s) for n in (1, 2) for s in memory.STAGES]
    for row in rows.values():
        assert row["step_ms"] > 0 and row["activations"] > 0
        assert row["total"] == row["model_states"] + row["activations"]
        assert 0 <= row["after"] - row["model_states"] < 1024, row
        assert row["peak"] > row["after"], row
    psi = rows[(1, 0)]["params"]
    assert [rows[(1, s)]["model_states"] for s in memory.STAGES] == [16 * psi] * 4
    per_param = [rows[(2, s)]["model_states"] / psi for s in memory.STAGES]
    assert per_param == pytest.approx([16, 8 + 8 / 2, 4 + 12 / 2, 16 / 2], rel=0.01)  # shards padded to N
    assert min(memory.STAGES, key=lambda s: rows[(2, s)]["peak"]) == 3
    assert "| allocator peak MiB | live after the step MiB | peak vs stage 0 |" in md and record["commit"] in md
    assert (tmp_path / "sw.png").stat().st_size > 0


@pytest.mark.timeout(120)
def test_checkpoint_mode_records_each_ranks_peak_growth_of_save_and_load(tmp_path):
    """Two 1 MiB units on 2 ranks: a row per rank with the save's and the load's peak RSS growth (non-negative, read
    from /proc/self/status) and time, the loaded shards bitwise equal to the saved ones, and the snapshot's files."""
    argv = ["--units", "2", "--unit-mib", "1", "--out", str(tmp_path / "ck")]
    assert memory.main(["--checkpoint", *argv]) == 0
    record = json.loads((tmp_path / "ck.json").read_text())
    md = (tmp_path / "ck.md").read_text()
    assert PROVENANCE <= set(record) and record["command"] == "python benchmarks/memory.py --checkpoint " + " ".join(argv)
    assert [r["rank"] for r in record["ranks"]] == [0, 1]
    for row in record["ranks"]:
        assert row["bitwise"] is True and row["params"] == 2 * (512 * 512 + 512)
        for call in ("save", "load"):
            assert row[call]["growth"] >= 0 and row[call]["peak"] >= row[call]["rss_before"] and row[call]["seconds"] > 0
    assert set(record["files"]) == {"meta.json", "model.safetensors", "rank0-of-2.safetensors",
                                    "rank1-of-2.safetensors"}
    assert record["files"]["model.safetensors"] > 4 * record["ranks"][0]["params"]
    assert "| rank | save: growth MiB |" in md and record["commit"] in md


def test_paired_steps_median_interval_is_the_binomial_order_statistics():
    """The 95% interval of a median from n values: x_(j) and x_(n+1-j), j the largest with P(Bin(n, 1/2) < j) <=
    2.5%: j = 6 at n = 20 (P(B <= 5) = 2.07%, P(B <= 6) = 5.77%), j = 40 at n = 100 (textbook tables); too few
    values (n = 5: P(B = 0) = 3.1% > 2.5%) give the whole range."""
    values = [float(v) for v in range(1, 21)]  # x_(k) == k
    assert speed.median_interval(values) == (6.0, 15.0)
    assert speed.median_interval([float(v) for v in range(100, 0, -1)]) == (40.0, 61.0)
    assert speed.median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)


@pytest.mark.timeout(120)
def test_paired_steps_times_each_stage_beside_its_peers_in_turns(tmp_path):
    """2 ranks, tiny model, stages 0 and 3: a row per (stage, peer) from speed.py's peers (FSDP1 and
    FSDP2 beside stage 3), every pair timed, the losses bit for bit at 2 ranks, the table in the Markdown."""
    argv = ["--nproc", "2", "--model", "tiny", "--stages", "0", "3", "--steps", "6", "--warmup", "1",
            "--out", str(tmp_path / "ps")]
    assert speed.main(["--paired", *argv]) == 0
    record = json.loads((tmp_path / "ps.json").read_text())
    md = (tmp_path / "ps.md").read_text()
    assert PROVENANCE <= set(record) and record["command"] == "python benchmarks/speed.py --paired " + " ".join(argv)
    assert [(r["stage"], r["peer"]) for r in record["rows"]] == [
        (0, "torch DDP"), (3, "torch FSDP1 FULL_SHARD"), (3, "torch FSDP2 fully_shard")]
    for r in record["rows"]:
        assert r["pairs"] == 5 and r["zerokit_ms"] > 0 and r["peer_ms"] > 0
        assert r["ci95"][0] <= r["median_ratio"] <= r["ci95"][1]
        assert r["max_abs_dloss"] == 0.0, r  # 2 ranks: one addition per element, any order
        assert f"| {r['median_ratio']:.3f} | {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f} |" in md


@pytest.mark.timeout(120)
def test_buffer_broadcast_costs_nothing_without_buffers_and_counts_bytes_with(tmp_path):
    """2 ranks, tiny GPT and a one-block CNN: the GPT (no buffers) sends 0 buffer bytes in 0 broadcasts with
    broadcast_buffers=True; the CNN sends its buffers' bytes in one broadcast per dtype; without, nothing."""
    import buffer_broadcast
    argv = ["--nproc", "2", "--gpt", "tiny", "--cnn-width", "8", "--cnn-depth", "1", "--steps", "2", "--warmup", "1",
            "--out", str(tmp_path / "bb")]
    assert buffer_broadcast.main(argv) == 0
    record = json.loads((tmp_path / "bb.json").read_text())
    assert PROVENANCE <= set(record) and record["command"] == "python benchmarks/investigations/buffer_broadcast.py " + " ".join(argv)
    gpt, cnn = record["rows"]
    assert gpt["buffers"] == 0 and gpt["with"]["collectives_per_step"] == 0 and gpt["with"]["bytes_per_step"] == 0
    assert cnn["with"]["collectives_per_step"] == 2 and cnn["with"]["bytes_per_step"] == cnn["buffer_bytes"] > 0
    assert gpt["without"]["bytes_per_step"] == cnn["without"]["bytes_per_step"] == 0
    assert all(r[k]["step_ms"] > 0 for r in (gpt, cnn) for k in ("with", "without"))
    assert "| cnn |" in (tmp_path / "bb.md").read_text()


def test_scaling_fits_recover_known_exponents_and_rows_carry_the_formula():
    """benchmarks/scaling.py's growth fits on synthetic cells: time ∝ Ψ^0.9 and bytes = zk.estimate's model
    states (∝ Ψ, and at stage 3 ∝ 1/N) come back as those exponents; each row's efficiency is compute-only
    time over step time, with the optimizer over Ψ at stage 0 and Ψ/N above."""
    import scaling
    from zerokit.core.accounting.estimate import estimate
    from zerokit.provenance import provenance

    cells = []
    for psi in (1e6, 4e6, 16e6):
        for n in (1, 2, 4):
            lines = []
            for stage in (0, 3):
                between = estimate(int(psi), n, stage, precision="fp32").total
                ms = 2e-4 * psi ** 0.9 * (1 + stage)
                lines.append({"stage": stage, "zerokit_ms": ms, "fastest_peer": "torch DDP", "fastest_peer_ms": 2 * ms,
                              "ratio_vs_fastest": 0.5, "zerokit_peak_step_bytes": 2 * between,
                              "lowest_peak_peer": "torch DDP", "lowest_peer_peak_step_bytes": 4 * between,
                              "zerokit_between_steps_bytes": between, "max_abs_loss_diff": 0.0})
            cells.append({"size": f"{psi:.0e}", "params": int(psi), "world_size": n, "precision": "fp32",
                          "compute_only": {"forward_backward_ms": 10.0, "optimizer_ms": 4.0},
                          "result": {"stages": lines}})
    rows = scaling.rows_of(cells)
    assert len(rows) == 18 and all(r["between_over_formula"] == 1 and r["peak_ratio"] == 0.5 for r in rows)
    row = next(r for r in rows if r["stage"] == 3 and r["world_size"] == 4)
    assert row["compute_only_ms"] == 11.0 and row["zerokit_efficiency"] == pytest.approx(11.0 / row["zerokit_ms"])
    assert next(r for r in rows if r["stage"] == 0 and r["world_size"] == 4)["compute_only_ms"] == 14.0
    fits = {f["stage"]: f for f in scaling.fits(rows)}
    for stage in (0, 3):
        assert all(v == pytest.approx(0.9) for v in fits[stage]["time_vs_params"].values())
        assert fits[stage]["between_vs_params_and_n"] == pytest.approx(fits[stage]["formula_vs_params_and_n"])
    assert fits[0]["between_vs_params_and_n"] == pytest.approx([1.0, 0.0], abs=1e-6)
    assert fits[3]["between_vs_params_and_n"] == pytest.approx([1.0, -1.0], abs=2e-3)  # up to padding
    md = scaling.markdown({"rows": rows, "fits": scaling.fits(rows), "settings": {"batch_size": 1},
                           "seconds": 1.0, "cut": "nothing",
                           "provenance": provenance("python benchmarks/scaling.py")})
    assert md.count("\n| 4e+06 (4.0M) |") == 6 and "Growth exponents" in md
