"""Hybrid sharding (core/collectives/hybrid.py): 4 ranks as two "nodes" of 2, stages 1-3 sharded inside each node.

One 4-rank spawn builds the groups once (`zk.hybrid_groups(2)`) and runs every case:
- stages 1-3 with `shard_group_size=2` bitwise equal to stage 0 at 4 ranks, 10 steps of AdamW
  (weight decay) with an active clip, fp32 and bf16, on the odd model (tied, frozen, odd sizes);
- a hybrid rank's memory equal to a flat engine's on a world of 2 (the same shard group used as
  a plain group: the formulas with N = 2), and its bytes per step: within the node as that flat
  engine's, across nodes one all-reduce of each grad shard (2 x shard bytes, ZeRO accounting);
- fp16 (the overflow flag agreed inside the node) and bf16 reduced in fp32, equal to stage 0;
- reduction="tree" (pairwise per node, then across) equal to stage 0 under the tree; the native
  recipe (ordered_reduction=False) close to it; S = 1 (sharded over one rank, replicated 4 times);
- a checkpoint saved at (4 ranks, S = 2, stage 3) loaded at (4, S = 4, stage 2) here and at
  (2, S = 2, stage 1) in a second spawn, both continuing within 1e-5 of the uninterrupted run.
"""
import pytest
import torch

import zerokit as zk
from tests.common import OddBlock, odd_batch, odd_model, train_zerokit
from zerokit.core.accounting.estimate import comm_bytes_by_group
from zerokit.launch import run_ranks

STEPS, BATCH, CLIP = 10, 2, 0.05  # the odd model's gradient norm is ~1: the clip is active at every step
OPT = dict(lr=3e-3, weight_decay=0.1)


def _grad_bytes(engine) -> int:
    """Bytes of one trainable buffer's grad shard, summed: what one step sends across nodes, halved."""
    size = torch.empty((), dtype=engine.policy.reduce_dtype).element_size()
    return sum(fp.shard_numel * size for fp in engine.trainable)


def _step_bytes(engine, batch_rows):
    """comm_stats(by_group=True) of one more training step."""
    before = engine.comm_stats(by_group=True)
    train_more(engine, batch_rows, 1, first_step=STEPS)
    after = engine.comm_stats(by_group=True)
    return {g: {k: after[g][k] - before[g][k] for k in after[g]} for g in after}


def train_more(engine, rows, steps, first_step, rank=None, world_size=None):
    """`steps` more steps from global step `first_step` (batch: `rows` per rank of the same global batch)."""
    import torch.distributed as dist
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    for step in range(first_step, first_step + steps):
        engine.zero_grad()
        engine.backward(engine(*odd_batch(step, rows, rank, world_size)))
        engine.clip_grad_norm_(CLIP)
        engine.step()


def _four_ranks(rank, world_size, ckpt_dir):
    groups = zk.hybrid_groups(2)
    out = {"rank": rank}
    for precision in ("fp32", "bf16"):
        for stage in (0, 1, 2, 3):
            losses, state, engine = train_zerokit(rank, world_size, stage, torch.optim.AdamW, OPT, STEPS, BATCH,
                                                  clip=CLIP, precision=precision, group=groups, bucket_numel=200)
            out[("state", precision, stage)] = state
            out[("ranks", stage)] = (engine.rank, engine.world_size, engine.data_parallel_rank,
                                     engine.data_parallel_size)
            out[("losses", precision, stage)] = losses
            if stage > 0 and precision == "bf16":
                flat = zk.shard(odd_model(), torch.optim.AdamW, stage=stage, precision=precision, group=groups[0],
                                wrap=(OddBlock,), bucket_numel=200, **OPT)  # a plain world of the node's 2 ranks
                train_more(flat, BATCH, 1, 0, rank % 2, 2)
                out[("memory", stage)] = (engine.memory(), flat.memory())
                out[("bytes", stage)] = (_step_bytes(engine, BATCH), _step_bytes(flat, BATCH), _grad_bytes(engine))
                params = {id(p): p for p in engine.module.parameters()}.values()
                out[("psi", stage)] = (sum(p.numel() for p in params),
                                       sum(p.numel() for p in params if p.requires_grad), len(engine.flat_params))
            del engine
    # fp16 (the overflow flag agreed in the node) and bf16 reduced in fp32: stage 0 vs hybrid
    for name, stage, kwargs in [(p, st, dict(precision="fp16", group=groups)) for p in ["fp16"] for st in (0, 3)] + \
            [("bf16+fp32", st, dict(precision="bf16", reduce_dtype=torch.float32, group=groups)) for st in (0, 2)]:
        out[(name, stage)] = train_zerokit(rank, world_size, stage, torch.optim.AdamW, OPT, 4, BATCH, clip=CLIP,
                                           bucket_numel=200, **kwargs)[1]
    # reduction="tree": stage 0 vs hybrid stage 3; the native recipe; one rank per shard group
    for name, stage, kwargs in [("tree", 0, dict(reduction="tree")), ("tree", 3, dict(reduction="tree", group=groups)),
                                ("native", 3, dict(ordered_reduction=False, group=groups)),
                                ("s1", 2, dict(shard_group_size=1))]:
        _, state, _ = train_zerokit(rank, world_size, stage, torch.optim.AdamW, OPT, 3, BATCH, clip=CLIP, **kwargs)
        out[(name, stage)] = state
    _, out[("short", 0)], _ = train_zerokit(rank, world_size, 0, torch.optim.AdamW, OPT, 3, BATCH, clip=CLIP)

    # mistakes: groups that are not a grid (the node's group as its replicate group too)
    try:
        zk.shard(odd_model(), torch.optim.AdamW, stage=2, group=(groups[0], groups[0]), **OPT)
        out["bad groups"] = "accepted"
    except ValueError as exc:
        out["bad groups"] = str(exc)
    # under torchrun, a shard group that is not a node is said (LOCAL_WORLD_SIZE: ranks per node)
    import os
    import warnings
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zk.shard(odd_model(), torch.optim.AdamW, stage=1, group=groups, **OPT)
        out["span warning"] = [str(w.message) for w in caught if "LOCAL_WORLD_SIZE" in str(w.message)]
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    # checkpoint: save after 5 steps at (4, S=2, stage 3), the uninterrupted run goes on to 10
    _, _, engine = train_zerokit(rank, world_size, 3, torch.optim.AdamW, OPT, 5, BATCH, clip=CLIP, group=groups)
    engine.save(ckpt_dir)
    train_more(engine, BATCH, 5, 5)
    out["uninterrupted"] = engine.state_dict(full=True)
    resumed = zk.shard(odd_model(seed=1), torch.optim.AdamW, stage=2, shard_group_size=4, **OPT)
    resumed.load(ckpt_dir)
    train_more(resumed, BATCH, 5, 5)
    out["resumed S=4 stage 2"] = resumed.state_dict(full=True)
    return out


def _two_ranks(rank, world_size, ckpt_dir):
    engine = zk.shard(odd_model(seed=2), torch.optim.AdamW, stage=1, shard_group_size=2, **OPT)
    engine.load(ckpt_dir)
    train_more(engine, 2 * BATCH, 5, 5)  # the same global batch: 2 ranks x 4 rows = 4 ranks x 2 rows
    return engine.state_dict(full=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("hybrid_ckpt"))
    four = run_ranks(_four_ranks, 4, ckpt, timeout_s=400)
    two = run_ranks(_two_ranks, 2, ckpt, timeout_s=120)
    return four, two


def _assert_equal(a: dict, b: dict, what: str):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs (max |diff| {(a[k].float() - b[k].float()).abs().max()})"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_stages_bitwise_equal_to_stage0(runs, precision, stage):
    four, _ = runs
    for out in four:
        assert torch.equal(out[("losses", precision, stage)], out[("losses", precision, 0)])
        _assert_equal(out[("state", precision, stage)], out[("state", precision, 0)],
                      f"rank {out['rank']} {precision} stage {stage} (S=2) vs stage 0")
    # every rank holds the same model: replicas agree, and so do the two shard groups
    for out in four[1:]:
        _assert_equal(out[("state", precision, stage)], four[0][("state", precision, stage)], "rank vs rank 0")


def test_hybrid_engine_ranks(runs):
    """engine.rank / world_size: the position in the shard group; data_parallel_rank / size: every rank's."""
    for out in runs[0]:
        r = out["rank"]
        assert out[("ranks", 0)] == (r, 4, r, 4)  # stage 0 ignores S
        for stage in (1, 2, 3):
            assert out[("ranks", stage)] == (r % 2, 2, r, 4)


def test_hybrid_steps_really_move_the_weights(runs):
    """A control: ten steps change every trainable weight, so equality above compares trained models."""
    out = runs[0][0]
    start = odd_model().state_dict()
    trained = out[("state", "fp32", 3)]
    assert not torch.equal(trained["blocks.0.fc1.weight"], start["blocks.0.fc1.weight"])
    assert torch.equal(trained["blocks.0.frozen.weight"], start["blocks.0.frozen.weight"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_memory_is_a_world_of_the_shard_group(runs, stage):
    for out in runs[0]:
        hybrid, flat = out[("memory", stage)]
        assert hybrid == flat, (hybrid, flat)
        # and the formula with N = S = 2 (bf16 + AdamW), up to padding: < S elements of <= 8 bytes per flat buffer
        psi, psi_t, buffers = out[("psi", stage)]
        formula = zk.estimate(psi, 4, stage, "bf16", optimizer="adamw", trainable_params=psi_t, shard_group_size=2)
        for category in ("params", "grads", "master_params", "optimizer_states"):
            assert 0 <= hybrid[category] - getattr(formula, category) <= buffers * 2 * 8, (category, hybrid, formula)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_bytes_per_step(runs, stage):
    for out in runs[0]:
        hybrid, flat, grad_shard_bytes = out[("bytes", stage)]
        assert hybrid["shard_group"] == flat["shard_group"]  # inside the node: a flat world of 2
        assert hybrid["replicate_group"] == {"all_reduce": 2 * grad_shard_bytes, "reduce_scatter": 0,
                                             "all_gather": 0, "broadcast": 0}
        assert flat["replicate_group"]["all_reduce"] == 0
        assert sum(hybrid["world"].values()) == 0  # nothing else crosses: the world only at init
        # the formula (core/accounting/estimate.py), up to padding: < S elements per flat buffer, in each collective
        psi, psi_t, buffers = out[("psi", stage)]
        formula = comm_bytes_by_group(psi, stage, 2, 2, world_size=4, shard_group_size=2, trainable_params=psi_t)
        assert formula["replicate_group"] == 2 * -(-psi_t // 2) * 2
        assert 0 <= sum(hybrid["replicate_group"].values()) - formula["replicate_group"] <= 2 * 2 * buffers
        within = sum(hybrid["shard_group"].values())
        if stage < 3:
            assert 0 <= within - formula["shard_group"] <= 2 * 2 * buffers
        else:  # the formula gathers every unit twice; the root unit stays gathered from forward to backward
            assert within < formula["shard_group"]


def test_hybrid_fp16_and_fp32_reductions_equal_stage0(runs):
    for out in runs[0]:
        _assert_equal(out[("fp16", 3)], out[("fp16", 0)], f"rank {out['rank']} fp16: hybrid stage 3 vs stage 0")
        _assert_equal(out[("bf16+fp32", 2)], out[("bf16+fp32", 0)],
                      f"rank {out['rank']} bf16 reduced in fp32: hybrid stage 2 vs stage 0")


def test_hybrid_tree_native_and_one_rank_per_node(runs):
    for out in runs[0]:
        _assert_equal(out[("tree", 3)], out[("tree", 0)], f"rank {out['rank']} tree: hybrid stage 3 vs stage 0")
        _assert_equal(out[("s1", 2)], out[("short", 0)], f"rank {out['rank']} S=1 stage 2 vs stage 0")
        for k, v in out[("native", 3)].items():
            torch.testing.assert_close(v, out[("short", 0)][k], rtol=1e-5, atol=1e-6)


def test_hybrid_checkpoint_loads_across_world_size_shard_group_and_stage(runs):
    four, two = runs
    reference = four[0]["uninterrupted"]
    for name, state in [("4 ranks, S=4, stage 2", four[0]["resumed S=4 stage 2"]), ("2 ranks, S=2, stage 1", two[0])]:
        for k, v in reference.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {k}: {m}")


def test_hybrid_refuses_groups_that_are_not_a_grid(runs):
    for out in runs[0]:
        assert "do not form a grid" in out["bad groups"] and "zk.hybrid_groups" in out["bad groups"], out["bad groups"]


def test_hybrid_refusals_without_a_process_group():
    """Bad shard group sizes are refused before anything is wrapped, naming the fix."""
    with pytest.raises(ValueError, match="does not divide"):
        zk.shard(odd_model(), torch.optim.AdamW, stage=1, shard_group_size=2, lr=1e-3)
    with pytest.raises(ValueError, match="int >= 1"):
        zk.shard(odd_model(), torch.optim.AdamW, stage=3, shard_group_size=0, lr=1e-3)
    with pytest.raises(ValueError, match="comm= replaces"):
        zk.shard(odd_model(), torch.optim.AdamW, stage=1, shard_group_size=1, comm=zk.Comm(), lr=1e-3)
    engine = zk.shard(odd_model(), torch.optim.AdamW, stage=3, shard_group_size=1, lr=1e-3, wrap=(OddBlock,))
    assert type(engine.comm) is zk.Comm and engine.world_size == 1  # S = N = 1: one flat group


def test_hybrid_warns_when_shard_groups_are_not_nodes(runs):
    four, _ = runs
    assert len(four[0]["span warning"]) == 1 and "pass shard_group_size=1" in four[0]["span warning"][0]
    assert all(out["span warning"] == [] for out in four[1:])  # said once, on rank 0
