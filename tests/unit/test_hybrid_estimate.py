"""Hybrid sharding in the analytic formulas (core/accounting/estimate.py), `zerokit memory --shard-group-size` and
`zerokit plan --nodes`.

No process group. A hybrid rank (shard groups of S ranks, R = N / S replicas) holds what a rank of a
world of S holds; the bytes it sends split into its shard group's and its replicate group's
(core/accounting/estimate.py [Note: hybrid sharding bytes]).
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zerokit.core.accounting.estimate as estimate_module
from zerokit.core.accounting.estimate import (
    comm_bytes_by_group,
    comm_bytes_per_step,
    estimate,
    resolve_shard_group_size,
)

fast = settings(max_examples=200, deadline=None)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def hybrid_worlds(draw) -> tuple[int, int]:
    """(N, S) with S dividing N: S ranks per shard group, N / S groups."""
    shard_ranks = draw(st.integers(min_value=1, max_value=64))
    replicas = draw(st.integers(min_value=1, max_value=64))
    return shard_ranks * replicas, shard_ranks


# ----------------------------------------------------------------------------- memory

@fast
@given(psi=st.integers(min_value=0, max_value=10**13), world=hybrid_worlds(),
       precision=st.sampled_from(["fp32", "bf16", "fp16"]), optimizer=st.sampled_from(["adam", "sgd_momentum"]))
def test_hybrid_rank_holds_what_a_rank_of_a_world_of_s_holds(psi, world, precision, optimizer):
    """estimate(Ψ, N, k, shard_group_size=S) == estimate(Ψ, S, k) at stages 1-3; stage 0 is what it was at N."""
    n, s = world
    for stage in (1, 2, 3):
        assert estimate(psi, n, stage, precision, optimizer, shard_group_size=s) == \
            estimate(psi, s, stage, precision, optimizer), (stage, n, s)
    assert estimate(psi, n, 0, precision, optimizer, shard_group_size=s) == estimate(psi, n, 0, precision, optimizer)


def test_hybrid_stage_3_row_by_hand():
    """Ψ = 1000 at N = 4, S = 2, bf16 + Adam, stage 3: each category holds ceil(1000/2) = 500 elements."""
    est = estimate(1000, 4, 3, shard_group_size=2)
    assert (est.params, est.grads, est.master_params, est.optimizer_states) == (2 * 500, 2 * 500, 4 * 500, 8 * 500)
    flat = estimate(1000, 4, 3)
    assert flat.total == 16 * 250 and est.total == 2 * flat.total  # half the group, twice the shard


def test_hybrid_keeps_frozen_params_and_reduce_dtype_rules():
    """With LoRA-style frozen params and an fp32 reduce dtype, hybrid still equals the flat run at N = S."""
    for stage in range(1, 4):
        kwargs = dict(trainable_params=300, reduce_precision="fp32")
        assert estimate(1000, 8, stage, **kwargs, shard_group_size=4) == estimate(1000, 4, stage, **kwargs)


def test_shard_group_size_none_or_n_is_flat():
    """None and S = N both mean flat sharding over all N ranks."""
    for stage in range(4):
        assert estimate(7.5e9, 64, stage, shard_group_size=None) == estimate(7.5e9, 64, stage) == \
            estimate(7.5e9, 64, stage, shard_group_size=64)


@pytest.mark.parametrize("bad, fragment", [
    (3, "shard_group_size=3 does not divide world_size=8"),
    (16, "shard_group_size=16 does not divide world_size=8"),
    (0, "shard_group_size must be an int >= 1"),
    (-2, "shard_group_size must be an int >= 1"),
    (2.0, "shard_group_size must be an int >= 1"),
    (True, "shard_group_size must be an int >= 1"),
])
def test_bad_shard_group_size_is_refused_naming_both_numbers_and_the_fix(bad, fragment):
    """An S that is not an int >= 1 dividing N is a ValueError; a non-divisor's message lists the divisors of N."""
    for call in (lambda: estimate(1000, 8, 2, shard_group_size=bad),
                 lambda: comm_bytes_by_group(1000, 2, 2, 2, 8, shard_group_size=bad)):
        with pytest.raises(ValueError) as info:
            call()
        assert fragment in str(info.value)
        if "divide" in fragment:
            assert "pick a divisor of 8 (1, 2, 4, 8)" in str(info.value)


def test_resolve_shard_group_size_returns_s():
    """resolve_shard_group_size(S, N): None -> N, a divisor -> itself (the argument order of core/collectives/hybrid.py's check)."""
    assert resolve_shard_group_size(None, 16) == 16
    assert resolve_shard_group_size(8, 16) == 8 and resolve_shard_group_size(1, 16) == 1
    with pytest.raises(ValueError, match="shard_group_size=16 does not divide world_size=8"):
        resolve_shard_group_size(16, 8)


# ----------------------------------------------------------------------------- bytes per step

@pytest.mark.parametrize("g", [2, 4])
def test_comm_by_group_small_case_by_hand(g):
    """Ψ = 1000, N = 4, S = 2: stages 1-2 send 2Ψg within the pair, stage 3 3Ψg; all send 2·500·g across."""
    by_stage = [comm_bytes_by_group(1000, stage, g, g, 4, 2) for stage in range(4)]
    assert by_stage[0] == {"shard_group": 2 * 1000 * g, "replicate_group": 0}  # DDP: one world-wide all-reduce
    assert by_stage[1] == by_stage[2] == {"shard_group": 2 * 1000 * g, "replicate_group": 2 * 500 * g}
    assert by_stage[3] == {"shard_group": 3 * 1000 * g, "replicate_group": 2 * 500 * g}


def test_comm_by_group_pads_the_grad_shard_and_counts_only_trainable():
    """Ψ_t = 1001 trainable of 5000 at S = 4: the replicated shard is ceil(1001/4) = 251 elements."""
    sent = comm_bytes_by_group(5000, 3, 2, 4, 8, 4, trainable_params=1001)
    assert sent == {"shard_group": 2 * 5000 * 2 + 1001 * 4, "replicate_group": 2 * 251 * 4}
    assert comm_bytes_by_group(5000, 0, 2, 4, 8, 4, trainable_params=1001) == \
        {"shard_group": 2 * 1001 * 4, "replicate_group": 0}


@fast
@given(psi=st.integers(min_value=0, max_value=10**12), n=st.integers(min_value=2, max_value=4096),
       stage=st.sampled_from([0, 1, 2, 3]), p=st.sampled_from([2, 4]), g=st.sampled_from([2, 4]))
def test_comm_by_group_at_s_equal_n_is_the_flat_formula(psi, n, stage, p, g):
    """At S = N (or None) nothing is replicated and the shard group sends comm_bytes_per_step."""
    expected = {"shard_group": comm_bytes_per_step(psi, stage, p, g), "replicate_group": 0}
    assert comm_bytes_by_group(psi, stage, p, g, n, n) == expected
    assert comm_bytes_by_group(psi, stage, p, g, n) == expected


def test_comm_by_group_in_groups_of_one_or_a_world_of_one():
    """S = 1 shards nothing: nothing within, the whole gradient all-reduced across; N = 1 sends nothing."""
    for stage in (1, 2, 3):
        assert comm_bytes_by_group(1000, stage, 2, 2, 4, 1) == {"shard_group": 0, "replicate_group": 2 * 1000 * 2}
    for stage in range(4):
        assert comm_bytes_by_group(1000, stage, 2, 2, 1) == {"shard_group": 0, "replicate_group": 0}


def test_worked_example_in_the_note_is_what_the_functions_give():
    """[Note: hybrid sharding bytes]: Ψ = 1.5e9 bf16, N = 16, S = 8, stage 3; the numbers it prints are computed."""
    psi = 1_500_000_000
    flat = comm_bytes_by_group(psi, 3, 2, 2, 16)
    hybrid = comm_bytes_by_group(psi, 3, 2, 2, 16, 8)
    assert flat["replicate_group"] == 0 and hybrid["shard_group"] == flat["shard_group"]
    flat_states, hybrid_states = estimate(psi, 16, 3).total, estimate(psi, 16, 3, shard_group_size=8).total
    doc = " ".join(estimate_module.__doc__.split())
    assert f"flat, S = 16 {flat['shard_group'] / 1e9:.1f} GB, in collectives that span both nodes" in doc
    assert f"{hybrid['shard_group'] / 1e9:.1f} GB within the node + {hybrid['replicate_group'] / 1e9:.2f} GB " \
           f"across nodes" in doc
    assert f"16Ψ/16 = {flat_states / 1e9:.1f} GB" in doc and f"16Ψ/8 = {hybrid_states / 1e9:.1f} GB" in doc
    # "1/12 of flat stage 3's bytes": 2·ceil(Ψ/S)·g / 3Ψg = 2/(3·8) exactly here (8 divides Ψ)
    assert hybrid["replicate_group"] * 12 == flat["shard_group"] and "= 1/12 of flat stage 3's bytes" in doc


# ----------------------------------------------------------------------------- zerokit memory --shard-group-size

def _memory_rows(out: str) -> dict[int, list[str]]:
    """Stage number -> the cells of its row in `zerokit memory`'s table."""
    import re

    rows = {}
    for line in out.splitlines():
        if re.match(r"^[0-3]\s{2,}", line):
            cells = re.split(r"\s{2,}", line.strip())
            rows[int(cells[0])] = cells
    return rows


def test_memory_command_with_shard_group_size_uses_s_and_prints_bytes_by_group(capsys, tmp_path):
    """--world-size 16 --shard-group-size 8: rows are a rank of 8's, the group line and both byte figures appear."""
    import json

    from zerokit.cli import main

    path = tmp_path / "memory.json"
    assert main(["memory", "--params", "1.5e9", "--world-size", "16", "--shard-group-size", "8", "--unit", "B",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "shard group of S = 8 ranks; replicated R = 2 times" in out
    rows = _memory_rows(out)
    assert [rows[s][-1] for s in range(4)] == \
        [f"{estimate(1.5e9, 8 if s else 16, s).total:,}" for s in range(4)]  # N = S for stages 1-3
    assert [rows[s][2] for s in range(4)] == ["16Ψ", "4Ψ+12Ψ/S", "2Ψ+14Ψ/S", "16Ψ/S"]
    sent = [comm_bytes_by_group(1_500_000_000, s, 2, 2, 16, 8) for s in range(4)]
    assert f"  stage 3: {sent[3]['shard_group'] / 1e9:.1f} GB / {sent[3]['replicate_group'] / 1e6:.1f} MB\n" in out
    assert "stage 0:" in out and "spans all 16 ranks" in out

    record = json.loads(path.read_text())
    assert (record["world_size"], record["shard_group_size"], record["replicate_groups"]) == (16, 8, 2)
    for row, s in zip(record["stages"], range(4)):
        assert row["total"] == estimate(1.5e9, 16, s, shard_group_size=8).total
        assert (row["comm_bytes_shard_group"], row["comm_bytes_replicate_group"]) == \
            (sent[s]["shard_group"], sent[s]["replicate_group"])


def test_memory_command_without_shard_group_size_is_flat(capsys, tmp_path):
    """No --shard-group-size: no hybrid line, the N formulas, JSON says S = N and nothing crosses replicas."""
    import json

    from zerokit.cli import main

    path = tmp_path / "memory.json"
    assert main(["memory", "--params", "7.5e9", "--world-size", "64", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Hybrid" not in out and "Ψ/S" not in out and "ceil(Ψ/N)" in out
    sent = [comm_bytes_per_step(7_500_000_000, s, 2, 2) for s in range(4)]
    assert f"stage 3 {sent[3] / 1e9:.1f} GB" in out
    record = json.loads(path.read_text())
    assert (record["shard_group_size"], record["replicate_groups"]) == (64, 1)
    assert [r["comm_bytes_shard_group"] for r in record["stages"]] == sent
    assert [r["comm_bytes_replicate_group"] for r in record["stages"]] == [0] * 4


def test_memory_command_refuses_a_shard_group_size_that_does_not_divide(capsys):
    """--shard-group-size 3 with --world-size 8 exits with one line naming both and the divisors; 0 is argparse's."""
    from zerokit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["memory", "--params", "1e9", "--world-size", "8", "--shard-group-size", "3"])
    assert "--shard-group-size 3 does not divide --world-size 8" in str(info.value.code)
    assert "(1, 2, 4, 8)" in str(info.value.code)
    with pytest.raises(SystemExit) as info:
        main(["memory", "--params", "1e9", "--world-size", "8", "--shard-group-size", "0"])
    assert info.value.code == 2 and "argument --shard-group-size" in capsys.readouterr().err


def test_memory_simulate_with_shard_group_size_plays_a_rank_of_s(capsys, tmp_path):
    """--simulate --world-size 4 --shard-group-size 2 --stage 3 measures rank 0 of 2 and matches estimate at S."""
    import json

    from zerokit.cli import main
    from zerokit.models import num_params, preset

    path = tmp_path / "sim.json"
    assert main(["memory", "--simulate", "--model", "tiny", "--world-size", "4", "--shard-group-size", "2",
                 "--stage", "3", "--device", "cpu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "shard group of 2 ranks; replicated 2 times" in out and "playing rank 0 of N = 2" in out
    result = json.loads(path.read_text())
    psi = num_params(preset("tiny"))
    assert result["config"]["world_size"] == 2
    assert result["hybrid"]["comm_bytes_per_step"] == comm_bytes_by_group(psi, 3, 2, 2, 4, 2)
    predicted = estimate(psi, 4, 3, shard_group_size=2)
    for c in ("params", "grads", "master_params", "optimizer_states"):
        assert result["predicted"][c] == getattr(predicted, c)
        assert result["measured"][c] == getattr(predicted, c), c  # tiny: one flat buffer per unit, padding included


# ----------------------------------------------------------------------------- zerokit plan --nodes

GB = 10**9


def act_1gb_per_sample(batch_size: int, checkpointing: bool) -> int:
    """Hand-made activations: 1 GB per sample, 0.1 GB with checkpointing."""
    return batch_size * (GB // 10 if checkpointing else GB)


def _plan(*args, **kwargs):
    from zerokit.commands.plan import plan

    return plan(*args, **kwargs)


def test_plan_on_two_nodes_proposes_hybrid_when_a_node_holds_the_model():
    """1e9 params, 2 nodes of 8 GPUs of 40 GB: ZeRO-2 fits sharded 8 ways too (3.75 GB + 1 GB): hybrid, S = 8."""
    p = _plan(1e9, 16, 40 * GB, activation_bytes=act_1gb_per_sample, num_nodes=2)
    assert (p.decision, p.stage, p.nodes, p.shard_group_size) == ("zero2", 2, 2, 8)
    hybrid_states = estimate(1e9, 16, 2, shard_group_size=8).total
    assert hybrid_states == estimate(1e9, 8, 2).total
    assert p.bytes_per_gpu == hybrid_states + GB  # the hybrid figure, not the flat one
    assert p.max_batch_size == (40 * GB - hybrid_states) // GB  # and the batch limit is hybrid's
    assert p.max_batch_size < (40 * GB - estimate(1e9, 16, 2).total) // GB
    assert p.bytes_across_nodes_per_step == comm_bytes_by_group(10**9, 2, 2, 2, 16, 8)["replicate_group"] \
        == 2 * ceil_div(10**9, 8) * 2
    assert p.flat_bytes_across_nodes_per_step == comm_bytes_by_group(10**9, 2, 2, 2, 16)["shard_group"]
    text = "\n".join(p.reasons)
    assert "shard_group_size=8" in text and "at most" in text and "upper bound" in text
    assert f"{p.bytes_across_nodes_per_step / GB:.2f} GB per step hybrid" in text
    assert f"at most {p.flat_bytes_across_nodes_per_step / GB:.2f} GB flat over all 16 GPUs" in text


def test_plan_on_two_nodes_stays_flat_when_a_node_cannot_hold_the_model():
    """2.5 GB GPUs: flat ZeRO-3 fits (16Ψ/16 + 1 GB = 2 GB), sharded within 8 GPUs it would need 3 GB: flat."""
    p = _plan(1e9, 16, 2.5 * GB, activation_bytes=act_1gb_per_sample, num_nodes=2)
    assert (p.decision, p.stage, p.checkpointing, p.shard_group_size) == ("zero3", 3, False, None)
    assert p.bytes_per_gpu == estimate(1e9, 16, 3).total + GB
    flat = comm_bytes_by_group(10**9, 3, 2, 2, 16)["shard_group"]
    assert flat == comm_bytes_per_step(10**9, 3, 2, 2)
    assert p.bytes_across_nodes_per_step == p.flat_bytes_across_nodes_per_step == flat
    hybrid_need = estimate(1e9, 16, 3, shard_group_size=8).total + GB
    assert hybrid_need > 2.5 * GB
    text = "\n".join(p.reasons)
    assert f"cannot hold it ({hybrid_need / GB:.2f} GB > 2.50 GB)" in text
    assert f"at most {flat / GB:.2f} GB per step" in text and "does not fit" in text


def test_plan_hybrid_lora_counts_only_the_adapters_across_nodes():
    """1.05 GB GPUs on 2 nodes of 8: LoRA + ZeRO-3 + checkpointing, hybrid; only the 1e6 adapters' shard crosses."""
    p = _plan(1e9, 16, 1.05 * GB, activation_bytes=act_1gb_per_sample, lora_trainable_params=10**6, num_nodes=2)
    assert (p.decision, p.lora, p.stage, p.checkpointing, p.shard_group_size) == ("lora", True, 3, True, 8)
    assert p.bytes_across_nodes_per_step == 2 * (10**6 // 8) * 2 == comm_bytes_by_group(
        10**9 + 10**6, 3, 2, 2, 16, 8, trainable_params=10**6)["replicate_group"]
    states = estimate(10**9 + 10**6, 16, 3, trainable_params=10**6, shard_group_size=8).total
    assert p.bytes_per_gpu == states + GB // 10


def test_plan_with_one_gpu_per_node_has_no_hybrid_option():
    """4 nodes of 1 GPU: a shard group of one shards nothing, so the plan stays flat and says why."""
    p = _plan(1e9, 4, 40 * GB, activation_bytes=act_1gb_per_sample, num_nodes=4)
    assert (p.decision, p.shard_group_size) == ("zero2", None)
    assert p.bytes_across_nodes_per_step == comm_bytes_per_step(10**9, 2, 2, 2)
    assert any("1 GPU per node" in line for line in p.reasons)


def test_plan_on_one_node_has_no_cross_node_fields_and_nothing_fits_has_none():
    """num_nodes=1 (the default) leaves the new fields empty; a plan where nothing fits names no bytes across."""
    p = _plan(1e9, 8, 40 * GB, activation_bytes=act_1gb_per_sample)
    assert (p.nodes, p.shard_group_size, p.bytes_across_nodes_per_step, p.flat_bytes_across_nodes_per_step) == \
        (1, None, None, None)
    assert not any("node" in line for line in p.reasons)
    p = _plan(1e9, 16, 0.1 * GB, activation_bytes=act_1gb_per_sample, lora_trainable_params=10**6, num_nodes=2)
    assert (p.decision, p.nodes, p.shard_group_size, p.bytes_across_nodes_per_step) == ("does_not_fit", 2, None, None)


@pytest.mark.parametrize("nodes, fragment", [
    (3, "num_nodes=3 does not divide num_gpus=16"), (0, "num_nodes must be"), (1.5, "num_nodes must be")])
def test_plan_refuses_nodes_that_do_not_divide_the_gpus(nodes, fragment):
    """num_nodes must be an int >= 1 dividing num_gpus."""
    with pytest.raises(ValueError, match=fragment):
        _plan(1e9, 16, 40 * GB, num_nodes=nodes)


def test_plan_command_on_two_nodes_prints_and_writes_the_hybrid_choice(capsys, tmp_path):
    """`zerokit plan --params 1.5e9 --gpus 16 --nodes 2 --gpu-memory 80`: hybrid S = 8, bytes across nodes in JSON."""
    import json

    from zerokit.cli import main

    path = tmp_path / "plan.json"
    assert main(["plan", "--params", "1.5e9", "--gpus", "16", "--nodes", "2", "--gpu-memory", "80",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    record = json.loads(path.read_text())
    across = comm_bytes_by_group(1_500_000_000, 2, 2, 2, 16, 8)["replicate_group"]
    flat = comm_bytes_by_group(1_500_000_000, 2, 2, 2, 16)["shard_group"]
    assert (record["decision"], record["nodes"], record["gpus_per_node"], record["shard_group_size"]) == \
        ("zero2", 2, 8, 8)
    assert (record["bytes_across_nodes_per_step"], record["flat_bytes_across_nodes_per_step"]) == (across, flat)
    assert "(2 nodes of 8)" in out
    assert out.rstrip().splitlines()[-2] == (f"decision: zero2, hybrid sharding with shard_group_size=8: "
                                             f"{across / GB:.2f} GB across nodes per GPU per step (flat: at most "
                                             f"{flat / GB:.2f} GB)")


def test_plan_command_refuses_nodes_that_do_not_divide_gpus(capsys):
    """--nodes 3 --gpus 16: one line naming both options; --nodes 0 is refused by argparse."""
    from zerokit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["plan", "--params", "1e9", "--gpus", "16", "--nodes", "3", "--gpu-memory", "80"])
    assert "--nodes 3 does not divide --gpus 16" in str(info.value.code)
    with pytest.raises(SystemExit) as info:
        main(["plan", "--params", "1e9", "--gpus", "16", "--nodes", "0", "--gpu-memory", "80"])
    assert info.value.code == 2 and "argument --nodes" in capsys.readouterr().err
