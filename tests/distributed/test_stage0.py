"""Stage 0 (zerokit's hand-written DDP) against torch's DistributedDataParallel, on gloo.

One spawn per world size runs every case; each rank asserts, and returns what it saw
so the parent asserts too.
"""
import warnings

import pytest
import torch

import zerokit as zk
from common import OddModel, odd_batch, odd_model, params_of, train_torch_ddp, train_zerokit
from zerokit.launch import RankFailed, run_ranks

STEPS, BATCH = 6, 3
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "sgd": (torch.optim.SGD, dict(lr=0.1)),  # the update is lr x gradient: see DDP_ATOL
}
# At world size >= 3 torch DDP's ring all-reduce adds the ranks' contributions in an order
# that depends on the element's position, zerokit in rank order; each averaged gradient may
# differ in its last bit (~6e-8 relative). After 6 steps on O(1) weights that is a few 1e-7
# (observed <= 2.4e-7 against DDP, <= 4.8e-7 against one process on the global batch).
# 1e-5 is 20x above that. What it catches depends on the optimizer: AdamW divides each
# update by the gradient's own running RMS, so it is nearly blind to a gradient-scale bug.
# Measured by injecting a 1/(N+1) averaging bug (every stage's GradReduction dividing by
# N + 1), 6 steps: AdamW moves weights by only 3.6e-7 (N = 3) and 5.1e-6 (N = 4), inside
# DDP_ATOL; plain SGD at lr 0.1 by 7.7e-2 and 5.0e-2 (5,000x DDP_ATOL), SGD with momentum
# by 0.34 and 0.35. So the SGD variants carry the averaging check; AdamW checks the rest.
DDP_ATOL = 1e-5


def _stage0_cases(rank, world_size):
    # zerokit must use torch's non-deprecated collective names: any FutureWarning fails the case.
    warnings.simplefilter("error", FutureWarning)
    out = {}
    for name, (cls, kw) in OPTIMIZERS.items():
        ref_losses, ref_params = train_torch_ddp(rank, world_size, cls, kw, STEPS, BATCH)
        losses, params, engine = train_zerokit(rank, world_size, 0, cls, kw, STEPS, BATCH, bucket_numel=40)
        assert len(engine.flat_params) > 3, "the case must exercise several buckets"
        out[name] = dict(ref_losses=ref_losses, losses=losses, ref_params=ref_params, params=params)
    # ledgers: one more step, measured
    model = odd_model()
    engine = zk.shard(model, torch.optim.AdamW, stage=0, bucket_numel=40, lr=1e-3)
    x, y = odd_batch(0, BATCH, rank, world_size)
    engine.backward(engine(x, y))
    before = engine.comm_stats()
    engine.zero_grad()
    seq = engine.comm.recorder.seq
    engine.backward(engine(x, y))
    out["backward_collectives"] = [(r.op, r.label, r.numel) for r in engine.comm.recorder.records if r.seq >= seq]
    out["groups"] = [(g.label, sum(fp.padded_numel for fp in g.members), len(g.members)) for g in engine.groups]
    engine.step()
    after = engine.comm_stats()
    out["comm_per_step"] = {k: after[k] - before[k] for k in after}
    out["memory"] = engine.memory()
    trainable = [p for p in model.parameters() if p.requires_grad]
    out["psi_trainable"] = sum(p.numel() for p in trainable)
    out["psi_all"] = sum(p.numel() for p in model.parameters())
    out["padding"] = sum(fp.padded_numel - fp.numel for fp in engine.flat_params)
    out["padding_trainable"] = sum(fp.padded_numel - fp.numel for fp in engine.flat_params if fp.requires_grad)
    return out


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def stage0_results(request, tmp_path_factory):
    world_size = request.param
    return world_size, run_ranks(_stage0_cases, world_size, store_dir=str(tmp_path_factory.mktemp("rdzv")))


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_stage0_trains_like_torch_ddp(stage0_results, opt):
    """Stage 0 equals torch DDP every step: bitwise at world size 1 and 2, within DDP_ATOL at 3 and 4."""
    world_size, results = stage0_results
    for rank, res in enumerate(results):
        r = res[opt]
        if world_size <= 2:
            assert torch.equal(r["losses"], r["ref_losses"]), (rank, r["losses"], r["ref_losses"])
            for k in r["ref_params"]:
                assert torch.equal(r["params"][k], r["ref_params"][k]), (rank, k)
        else:
            torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=0, atol=DDP_ATOL)
            for k in r["ref_params"]:
                torch.testing.assert_close(r["params"][k], r["ref_params"][k], rtol=0, atol=DDP_ATOL, msg=k)
    # replicas agree bit for bit with each other
    for res in results[1:]:
        for k in res[opt]["params"]:
            assert torch.equal(res[opt]["params"][k], results[0][opt]["params"][k]), k


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_stage0_matches_one_process_on_the_global_batch(stage0_results, opt):
    """Training N ranks on B rows each ends where one process on the N*B-row batch ends (fp rounding only)."""
    world_size, results = stage0_results
    cls, kw = OPTIMIZERS[opt]
    model = odd_model()
    optimizer = cls([p for p in model.parameters() if p.requires_grad], **kw)
    for step in range(STEPS):
        x, y = odd_batch(step, BATCH * world_size)
        optimizer.zero_grad()
        model(x, y).backward()
        optimizer.step()
    # The global mean loss and the mean of per-rank means are the same number computed in
    # a different order (~1e-7 relative per gradient element); same reasoning as DDP_ATOL.
    for k, v in params_of(model).items():
        torch.testing.assert_close(results[0][opt]["params"][k], v, rtol=0, atol=DDP_ATOL, msg=k)


def test_stage0_comm_is_one_all_reduce_of_the_gradients(stage0_results):
    """comm_stats() per step = 2 x gradient bytes (ZeRO accounting), nothing else; 0 at world size 1."""
    world_size, results = stage0_results
    for res in results:
        grad_bytes = 4 * (res["psi_trainable"] + res["padding_trainable"])
        expected = 2 * grad_bytes if world_size > 1 else 0
        assert res["comm_per_step"] == {"all_reduce": expected, "reduce_scatter": 0, "all_gather": 0, "broadcast": 0}


def test_stage0_all_reduces_each_group_of_buckets_once(stage0_results):
    """Backward issues one all-reduce per group of consecutive buckets (core/grads/grad_reduce.py [Note: all-reduce groups]),
    in order, labelled by the group and as large as its buckets together; fewer than the buckets (the case has
    buckets below the cap of 40 elements), every group but the last holding at least the cap."""
    _, results = stage0_results
    for res in results:
        groups = res["groups"]
        assert 3 < len(groups) < sum(n for _, _, n in groups), groups
        assert all(numel >= 40 for _, numel, _ in groups[:-1]), groups
        expected = [("all_reduce", label, numel) for label, numel, _ in groups]  # recorded at world size 1 too
        assert res["backward_collectives"] == expected, (res["backward_collectives"], groups)


def test_stage0_memory_is_16_bytes_per_param_in_fp32_adamw(stage0_results):
    """memory(): params 4Ψ, grads 4Ψ (trainable), optimizer_states 8Ψ (trainable), no master copy; exact up to padding."""
    _, results = stage0_results
    for res in results:
        mem, psi, psi_t = res["memory"], res["psi_all"], res["psi_trainable"]
        pad, pad_t = res["padding"], res["padding_trainable"]
        assert mem["params"] == 4 * (psi + pad)
        assert mem["grads"] == 4 * (psi_t + pad_t)
        assert mem["optimizer_states"] == 8 * (psi_t + pad_t)
        assert mem["master_params"] == 0


# ----------------------------------------------------------------------------- bad input
def _bad_input_cases(rank, world_size):
    errors = {}

    def attempt(name, build):
        try:
            zk.shard(build(), torch.optim.SGD, stage=0, lr=0.1)
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)

    def shapes_differ():
        m = odd_model()
        if rank == 1:
            m.blocks[0].fc1 = torch.nn.Linear(7, 16)  # only rank 1 builds a different model
        return m

    def integer_param():
        m = odd_model()
        if rank == world_size - 1:
            m.count = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
        return m

    def two_devices():
        m = odd_model()
        if rank == 0:
            m.blocks[1].fc2.to("meta")
        return m

    attempt("shapes_differ", shapes_differ)
    attempt("integer_param", integer_param)
    attempt("two_devices", two_devices)
    # after three refused models the group must still work: a good model trains a step
    engine = zk.shard(odd_model(), torch.optim.SGD, stage=0, lr=0.1)
    x, y = odd_batch(0, 2, rank, world_size)
    engine.backward(engine(x, y))
    engine.step()
    return errors


def test_bad_input_raises_on_every_rank_naming_the_parameter(tmp_path):
    """Mismatched shapes, an integer parameter or two devices on ONE rank: every rank raises, naming it; no hang."""
    results = run_ranks(_bad_input_cases, 2, store_dir=str(tmp_path), timeout_s=60)
    for rank, errors in enumerate(results):
        assert errors["shapes_differ"] and "blocks.0.fc1.weight" in errors["shapes_differ"], errors
        assert "rank 1" in errors["shapes_differ"]
        assert errors["integer_param"] and "'count'" in errors["integer_param"], errors
        assert "int64" in errors["integer_param"]
        assert errors["two_devices"] and "meta" in errors["two_devices"], errors
        assert "blocks.1.fc2" in errors["two_devices"]


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ArithmeticError("boom on rank one")
    torch.distributed.barrier()


def test_harness_reraises_the_failing_ranks_traceback(tmp_path):
    """A rank that raises surfaces its traceback in the parent instead of hanging the others."""
    with pytest.raises(RankFailed, match="boom on rank one"):
        run_ranks(_raise_on_rank_one, 2, store_dir=str(tmp_path), timeout_s=60)


def test_odd_model_has_every_awkward_shape():
    """The odd model really has a tie, a frozen parameter, a 1-element parameter and (7, 15) shapes."""
    m = OddModel()
    assert m.head.weight is m.emb.weight
    assert any(not p.requires_grad for p in m.parameters())
    assert any(p.numel() == 1 for p in m.parameters())
    assert {(15, 7), (7, 15)} <= {tuple(p.shape) for p in m.parameters()}
