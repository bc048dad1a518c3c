"""reduction="tree": one process reproduces a 2-, 4- or 8-rank run bit for bit (core/collectives/tree.py).

The loop is the one a user writes once for every world size W: a global batch of M
micro-batches of a fixed size; rank r takes micro-batches r*k ... (r+1)*k - 1 (k = M / W),
each `engine.backward(loss / k)`, all but the last inside `engine.no_sync()`; then
`engine.clip_grad_norm_` (active: the clip is below the norm), `engine.step()`,
`engine.zero_grad()`. AdamW with weight decay, 10 steps. One spawn per world size runs
every stage and precision; the test compares the full state_dicts across W and stage.

Every rank runs with one intra-op thread at every W: a CPU matmul's blocking (and so its
bits) may depend on the thread count, and the claim is about the reduction, not the kernels.
"""
import contextlib

import pytest
import torch

import zerokit as zk
from zerokit.core.collectives.comm import Comm, Simulated
from zerokit.launch import run_ranks

# 0.3 is below the GPTs' gradient norms (~1-2): clipping scales every step. 5 steps (the runs' spawns took 83 s
# of the suite at 10 steps, 62 s at 5): every step's norm and the final state are compared bit for bit.
STEPS, CLIP = 5, 0.3
STAGES = (0, 1, 2, 3)
# (model preset, micro-batches per step M, world sizes, precision, stages): the cases, M = 4 on the small
# GPT at W = 1, 2, 4 and M = 8 on the tiny one at W = 1 and 8, every stage, fp32 and bf16; and fp16 (whose 1/N
# rides in the loss scale) on the tiny one, stages 0 and 3 (time: 8 ranks share 2 cores).
CASES = [("small", 4, (1, 2, 4), p, STAGES) for p in ("fp32", "bf16")] + \
        [("tiny", 8, (1, 8), p, STAGES) for p in ("fp32", "bf16")] + [("tiny", 8, (1, 2), "fp16", (0, 3))]
BATCH, SEQ = 2, 32  # a micro-batch: 2 sequences of 32 characters


def _train(rank, world_size, model_name, M, stage, precision, reduction="tree", probe_memory=False):
    from zerokit.models import Block, build_model
    from common import fixed_corpus
    corpus = fixed_corpus()
    k = M // world_size
    model = build_model(model_name, seed=0)
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, lr=3e-3, weight_decay=0.1,
                      wrap=(Block,), bucket_numel=1 << 15, reduction=reduction)
    norms, partial_bytes = [], []
    for step in range(STEPS):
        for j in range(k):
            x, y = corpus.batch(BATCH, SEQ, step * M + rank * k + j)  # global micro-batch r*k + j
            if j < k - 1:
                with engine.no_sync():
                    engine.backward(engine(x, y)[1] / k)
                if probe_memory and step == 0:
                    partial_bytes.append(engine.memory()["tree_partials"])
            else:
                engine.backward(engine(x, y)[1] / k)
        norms.append(engine.clip_grad_norm_(CLIP))
        engine.step()
        engine.zero_grad()
    out = {"norms": torch.stack(norms), "state": engine.state_dict(full=True)}
    if probe_memory:
        out["partial_bytes"] = partial_bytes
        out["bucket_bytes"] = sum(fp.padded_numel * torch.empty((), dtype=engine.policy.reduce_dtype).element_size()
                                  for fp in engine.trainable)
    return out


def _runs(rank, world_size):
    torch.manual_seed(0)
    out = {}
    for model_name, M, world_sizes, precision, stages in CASES:
        if world_size not in world_sizes:
            continue
        for stage in stages:
            probe = model_name == "small" and world_size == 1 and precision == "fp32"
            out[(model_name, precision, stage)] = _train(rank, world_size, model_name, M, stage, precision,
                                                         probe_memory=probe)
    if world_size in (1, 2):  # the control: the default grouping depends on W (at W = 2 it pairs micro-batches)
        out["linear"] = _train(rank, world_size, "tiny", 4, 0, "fp32", reduction="linear")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("rdzv"))
    return {w: run_ranks(_runs, w, threads_per_rank=1, timeout_s=400, store_dir=store) for w in (1, 2, 4, 8)}


def _assert_same(a, b, what):
    assert torch.equal(a["norms"], b["norms"]), (what, a["norms"] - b["norms"])
    assert a["state"].keys() == b["state"].keys()
    bad = [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]
    assert not bad, (what, bad[:5])


@pytest.mark.parametrize("model_name, world_sizes, precision, stages", [c[:1] + c[2:] for c in CASES])
def test_state_dict_is_bitwise_equal_across_world_sizes_and_stages(runs, model_name, world_sizes, precision, stages):
    """Every W (powers of two up to M) and every stage: the same norms and the same state_dict, bit for bit."""
    reference = runs[1][0][(model_name, precision, 0)]
    assert (reference["norms"] > CLIP).all(), "clipping must be active at every step"
    for world_size in world_sizes:
        for rank, res in enumerate(runs[world_size]):
            for stage in stages:
                _assert_same(res[(model_name, precision, stage)], reference,
                             f"{model_name} {precision} W={world_size} rank {rank} stage {stage}")


def test_the_default_reduction_does_depend_on_the_world_size(runs):
    """The control that shows the test above can fail: reduction="linear" at W = 2 groups (g0+g1)+(g2+g3),
    one process ((g0+g1)+g2)+g3, and the weights differ."""
    one, two = runs[1][0]["linear"], runs[2][0]["linear"]
    assert any(not torch.equal(one["state"][k], two["state"][k]) for k in one["state"])


def test_partial_sums_hold_log2_k_buffers(runs):
    """k = 4 at stage 0: after micro-batch 1, 2, 3 the partial sums hold 1, 1, 2 gradient-sized buffers."""
    res = runs[1][0][("small", "fp32", 0)]
    assert res["partial_bytes"] == [res["bucket_bytes"], res["bucket_bytes"], 2 * res["bucket_bytes"]]


# -- mistakes, in one process (world size 1) ---------------------------------------------------------

def _engine(stage=0, **kw):
    from zerokit.models import Block, build_model
    return zk.shard(build_model("tiny", seed=0), torch.optim.AdamW, stage=stage, wrap=(Block,), reduction="tree",
                    **kw)


def _backward(engine, step=0):
    from common import fixed_corpus
    x, y = fixed_corpus().batch(2, 32, step)
    engine.backward(engine(x, y)[1])


@pytest.mark.parametrize("stage", STAGES)
def test_three_micro_batches_are_refused(stage):
    engine = _engine(stage)
    for step in range(2):
        with engine.no_sync():
            _backward(engine, step)
    with pytest.raises(ValueError, match="power-of-two number of micro-batches"):
        _backward(engine, 2)


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_with_every_backward_under_no_sync_is_refused(stage):
    engine = _engine(stage)
    with engine.no_sync():
        _backward(engine)
    with pytest.raises(RuntimeError, match="outside engine.no_sync"):
        engine.step()


@pytest.mark.parametrize("stage", STAGES)
def test_a_second_synced_backward_is_refused(stage):
    engine = _engine(stage)
    _backward(engine)
    with pytest.raises(RuntimeError, match="after the step's synced backward|a second synced backward"):
        _backward(engine, 1)


def test_a_world_size_that_is_not_a_power_of_two_is_refused():
    from zerokit.models import build_model
    with pytest.raises(ValueError, match="power-of-two world size"):
        zk.shard(build_model("tiny"), torch.optim.AdamW, stage=1, reduction="tree",
                 comm=Comm(simulate=Simulated(0, 3)))


def test_accumulating_by_reduce_scatter_is_refused():
    with pytest.raises(ValueError, match="drop accumulate="):
        _engine(2, accumulate="reduce_scatter")
    assert _engine(2).config.accumulate == "local"
    with pytest.raises(ValueError, match="reduction must be one of"):
        zk.shard(torch.nn.Linear(2, 2), stage=0, reduction="pairwise")


@pytest.mark.parametrize("stage", STAGES)
def test_a_loop_clearing_with_model_zero_grad_trains_like_engine_zero_grad(stage):
    """The loop users write (model.zero_grad() before the forward, plain loss.backward()) starts a new tree each
    step and trains bitwise like engine.zero_grad() + engine.backward (one process, k = 2, 3 steps)."""
    from zerokit.models import Block, build_model
    from common import fixed_corpus
    corpus = fixed_corpus()
    states = []
    for user_loop in (False, True):
        model = build_model("tiny", seed=0)
        engine = zk.shard(model, torch.optim.AdamW, stage=stage, wrap=(Block,), reduction="tree", lr=1e-2)
        for step in range(3):
            if user_loop:
                model.zero_grad()
            for j in range(2):
                x, y = corpus.batch(2, 32, 2 * step + j)
                with engine.no_sync() if j == 0 else contextlib.nullcontext():
                    loss = engine(x, y)[1] / 2
                    loss.backward() if user_loop else engine.backward(loss)
            engine.clip_grad_norm_(0.3)
            engine.step()
            if not user_loop:
                engine.zero_grad()
        states.append(engine.state_dict(full=True))
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
