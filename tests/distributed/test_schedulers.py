"""torch's LR schedulers on `engine.optimizer`, beside torch DDP with the same scheduler, on 2 gloo ranks.

`engine.optimizer` is a torch.optim.Optimizer (optim/sharded.py [Note: engine.optimizer is a torch
optimizer]). The loop is written as a torch user writes it: `opt.zero_grad()`, `loss.backward()`,
`opt.step()`, `scheduler.step()` (ReduceLROnPlateau: `scheduler.step(loss)`), holding only the optimizer.
After 6 AdamW steps every stage's parameters and learning rates equal DDP's bit for bit. A run saved after
3 steps (`engine.save(extra={"scheduler": sched.state_dict()})`, or `engine.optimizer.state_dict()` beside
the model's weights in a file read back by `engine.load_weights`) and resumed into a fresh engine and scheduler ends with the uninterrupted run's bits.
"""
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.optim import lr_scheduler as S

import zerokit as zk
from zerokit.launch import run_ranks

from common import OddBlock, _build_ddp, odd_batch, odd_model, params_of

STEPS = 6
SCHEDULERS = {
    "LambdaLR": lambda opt: S.LambdaLR(opt, lambda s: 0.8 ** s),
    "StepLR": lambda opt: S.StepLR(opt, step_size=2, gamma=0.5),
    "OneCycleLR": lambda opt: S.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS),
    "CosineAnnealingWarmRestarts": lambda opt: S.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=2),
    "SequentialLR": lambda opt: S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.1, total_iters=2),
                                                     S.ExponentialLR(opt, gamma=0.9)], milestones=[2]),
    "ChainedScheduler": lambda opt: S.ChainedScheduler([S.ConstantLR(opt, factor=0.5, total_iters=2),
                                                        S.ExponentialLR(opt, gamma=0.9)]),
    "ReduceLROnPlateau": lambda opt: S.ReduceLROnPlateau(opt, factor=0.5, patience=0),
}
OPT = dict(lr=1e-2, weight_decay=0.1)


def _loop(model, opt, sched, steps, rank, world_size, first=0):
    lrs = []
    for step in range(first, first + steps):
        x, y = odd_batch(step, 4, rank, world_size)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        if isinstance(sched, S.ReduceLROnPlateau):  # a metric every rank agrees on (each rank's own loss would
            metric = loss.detach().clone()         # give each its own lr, under DDP too)
            dist.all_reduce(metric)
            sched.step(metric.item() / world_size)
        else:
            sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return lrs


def _ddp(name, rank, world_size):
    model = odd_model(0)
    ddp = _build_ddp(model)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    lrs = _loop(ddp, opt, SCHEDULERS[name](opt), STEPS, rank, world_size)
    return lrs, params_of(model)


def _engine(stage, precision="fp32"):
    return zk.shard(odd_model(0), torch.optim.AdamW, stage=stage, wrap=(OddBlock,), precision=precision, **OPT)


def _zerokit(name, stage, rank, world_size):
    engine = _engine(stage)
    lrs = _loop(engine, engine.optimizer, SCHEDULERS[name](engine.optimizer), STEPS, rank, world_size)
    return lrs, engine.state_dict(full=True)


def _resumed(stage, rank, world_size, directory, how, precision):
    """3 steps, save, a fresh engine + scheduler loaded, 3 more: (the resumed run's params, the uninterrupted's)."""
    build = SCHEDULERS["OneCycleLR"]
    engine = _engine(stage, precision)
    sched = build(engine.optimizer)
    _loop(engine, engine.optimizer, sched, 3, rank, world_size)
    if how == "engine.save":
        engine.save(directory, extra={"scheduler": sched.state_dict()})
    else:  # torch-style: the model's weights in a file, the optimizer's and the scheduler's state_dicts
        weights = f"{directory}-rank{rank}.safetensors"
        save_file(engine.state_dict(full=True), weights)
        torch.save(engine.optimizer.state_dict(), f"{directory}-rank{rank}.optim.pt")  # references: save them now
        saved = (weights, f"{directory}-rank{rank}.optim.pt", sched.state_dict())
    _loop(engine, engine.optimizer, sched, 3, rank, world_size, first=3)
    straight = engine.state_dict(full=True)
    fresh = _engine(stage, precision)
    sched2 = build(fresh.optimizer)
    if how == "engine.save":
        meta = fresh.load(directory)
        sched2.load_state_dict(meta["extra"]["scheduler"])
    else:
        fresh.load_weights(saved[0])  # resets the masters and the optimizer state, as for a fresh model
        fresh.optimizer.load_state_dict(torch.load(saved[1]))  # then this rank's shard state and exact fp32 masters
        sched2.load_state_dict(saved[2])
    _loop(fresh, fresh.optimizer, sched2, 3, rank, world_size, first=3)
    got = fresh.state_dict(full=True)
    return all(torch.equal(got[k], straight[k]) for k in straight)


def _cases(rank, world_size, directory):
    out = {}
    for name in SCHEDULERS:
        ref_lrs, ref = _ddp(name, rank, world_size)
        for stage in (0, 1, 2, 3):
            lrs, got = _zerokit(name, stage, rank, world_size)
            diff = max((got[k].float() - v).abs().max().item() for k, v in ref.items())
            out[name, stage] = (lrs == ref_lrs, diff)
    for stage in (0, 1, 2, 3):
        for how in ("engine.save", "optimizer.state_dict"):
            out["resume", stage, how] = _resumed(stage, rank, world_size, f"{directory}/s{stage}", how, "bf16")
    engine = _engine(1)
    other = engine.optimizer.state_dict()
    other["zerokit"] = dict(other["zerokit"], rank=1 - rank)
    try:
        engine.optimizer.load_state_dict(other)
        out["wrong rank"] = "not refused"
    except ValueError as exc:
        out["wrong rank"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    return run_ranks(_cases, 2, directory, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=400)


def test_engine_optimizer_is_a_torch_optimizer():
    engine = _engine(1)
    assert isinstance(engine.optimizer, torch.optim.Optimizer)
    assert engine.optimizer.param_groups is engine.optimizer.optimizer.param_groups
    with pytest.raises(NotImplementedError, match="param_groups=fn"):
        engine.optimizer.add_param_group({"params": []})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_equals_ddp_bitwise(results, name, stage):
    for rank, result in enumerate(results):
        same_lrs, diff = result[name, stage]
        assert same_lrs and diff == 0.0, (rank, name, stage, diff)


@pytest.mark.parametrize("how", ["engine.save", "optimizer.state_dict"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_scheduler_resume_is_bitwise(results, stage, how):
    assert [r["resume", stage, how] for r in results] == [True, True]


def test_another_ranks_optimizer_state_is_refused(results):
    for result in results:
        assert "each rank loads its own" in result["wrong rank"], result["wrong rank"]


def test_torchs_grad_scaler_on_engine_optimizer_is_refused_naming_engine_scaler():
    """torch.amp.GradScaler would unscale `.grad`s the optimizer does not step (this rank's master shards
    have none): refused by name, before any step, whatever its scale."""
    engine = _engine(1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    x, y = odd_batch(0, 4)
    before = engine.state_dict(full=True)
    scaler.scale(engine(x, y)).backward()
    with pytest.warns(FutureWarning), pytest.raises(TypeError, match="engine.scaler.scale"):
        scaler.step(engine.optimizer)
    after = engine.state_dict(full=True)
    assert all(torch.equal(before[k], after[k]) for k in before)
