"""Optimizers of every kind beside torch DDP with the same optimizer, 2 gloo ranks, stages 0-3.

zerokit decides by class whether a 1-D shard steps like the parameters it holds (optim/whole_params.py
[Note: elementwise or whole parameters]): torch's elementwise optimizers take the flat path, every other
class the whole-parameter path, where each parameter is stepped whole, in its module shape, by one owner.
Either way 4 steps end with DDP's bits. The classes below that are not torch's read what a shard cannot
give: a Muon-like orthogonalized 2-D update (shape, matmuls), a LAMB-like trust ratio (norms over the
parameter), a Lion-like sign update (elementwise: declared so, it takes the flat path; undeclared, the
whole-parameter path, and both are exact).
"""
import copy

import pytest
import torch

import zerokit as zk
from zerokit.launch import run_ranks
from zerokit.optim.whole_params import is_elementwise, step_cost

from common import OddBlock, _build_ddp, odd_batch, odd_model, params_of
from shaped_optimizers import LambLike, MuonLike  # examples/shaped_optimizers.py
from transformers.optimization import Adafactor as HFAdafactor
from test_dtypes_and_layouts import conv_batch, conv_model

STEPS = 4


class LionLike(torch.optim.Optimizer):
    """sign(interpolated momentum): elementwise, but zerokit cannot know that without being told."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


class DeclaredLion(LionLike):
    elementwise = True


OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "SGD nesterov": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, nesterov=True)),
    "Adam amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "Adafactor": (torch.optim.Adafactor, dict(lr=1e-2)),
    "HF Adafactor": (HFAdafactor, dict(lr=1e-2, scale_parameter=False, relative_step=False, warmup_init=False)),
    "MuonLike": (MuonLike, dict(lr=2e-2)),
    "LambLike": (LambLike, dict(lr=1e-2)),
    "LionLike": (LionLike, dict(lr=1e-3)),
    "DeclaredLion": (DeclaredLion, dict(lr=1e-3)),
}


def _train(model, opt, rank, world_size, steps=range(STEPS)):
    for step in steps:
        x, y = odd_batch(step, 4, rank, world_size)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()


def _ddp(name, rank, world_size):
    cls, kwargs = OPTIMIZERS[name]
    model = odd_model(0)
    ddp = _build_ddp(model)
    _train(ddp, cls(model.parameters(), **kwargs), rank, world_size)
    return params_of(model)


def _zerokit(name, stage, rank, world_size, precision="fp32"):
    cls, kwargs = OPTIMIZERS[name]
    engine = zk.shard(odd_model(0), cls, stage=stage, wrap=(OddBlock,), precision=precision, **kwargs)
    engine.comm.reset_stats()
    _train(engine, engine.optimizer, rank, world_size)
    stats = engine.comm.stats_by_phase().get("step", {})
    cost = step_cost([fp.layout for fp in engine.flat_params if fp.requires_grad], world_size)
    return engine.state_dict(full=True), (sum(stats.values()), cost), engine.optimizer.whole is not None


def _cases(rank, world_size, directory):
    out = {}
    for name in OPTIMIZERS:
        ref = _ddp(name, rank, world_size)
        for stage in (0, 1, 2, 3):
            got, step_bytes, whole = _zerokit(name, stage, rank, world_size)
            out[name, stage] = (max((got[k] - v).abs().max().item() for k, v in ref.items()),
                                all(torch.equal(got[k], v) for k, v in ref.items()), step_bytes, whole)
    for name in ("Adafactor", "MuonLike"):  # mixed precision: every stage takes stage 0's bits
        runs = [_zerokit(name, stage, rank, world_size, "bf16")[0] for stage in (0, 1, 2, 3)]
        out[name, "bf16"] = all(torch.equal(run[k], runs[0][k]) for run in runs[1:] for k in runs[0])
    for stage in (0, 1, 3):  # per-parameter hyperparameters (no decay below 2-D), as torch param groups
        out["groups", stage] = _groups(stage, rank, world_size)
    for name in ("Adafactor", "MuonLike"):  # channels_last conv weights: stepped with the module's strides
        ref = _conv(name, None, rank, world_size)
        for stage in (0, 1, 2, 3):
            got = _conv(name, stage, rank, world_size)
            out[name, "channels_last", stage] = all(torch.equal(got[k], v) for k, v in ref.items())
    for name in ("Adafactor", "LambLike", "HF Adafactor"):  # HF's counts its steps in a Python int
        for saved, loaded in ((1, 3), (3, 0), (2, 2)):
            out[name, "resume", saved, loaded] = _resumed(name, saved, loaded, rank, world_size,
                                                          f"{directory}/{name}-{saved}-{loaded}")
    return out


def _groups(stage, rank, world_size):
    """LambLike with weight decay 0.1 on matrices and 0 below 2-D: zk.shard's param_groups= against DDP with
    the same two torch param groups."""
    from zerokit.bench import decay_groups, no_decay

    model = odd_model(0)
    reference = odd_model(0)
    ddp = _build_ddp(reference)
    _train(ddp, LambLike(decay_groups(reference.named_parameters()), lr=1e-2, weight_decay=0.1), rank,
           world_size)
    engine = zk.shard(model, LambLike, stage=stage, wrap=(OddBlock,), param_groups=no_decay, lr=1e-2,
                      weight_decay=0.1)
    _train(engine, engine.optimizer, rank, world_size)
    got, want = engine.state_dict(full=True), params_of(reference)
    return all(torch.equal(got[k], v) for k, v in want.items())


def _conv(name, stage, rank, world_size):
    """A channels_last conv net (tests/distributed/test_dtypes_and_layouts.py), 4 steps; stage None: DDP."""
    cls, kwargs = OPTIMIZERS[name]
    model = conv_model(0)
    if stage is None:
        wrapped, opt = _build_ddp(model), cls(model.parameters(), **kwargs)
    else:
        wrapped = opt = zk.shard(model, cls, stage=stage, bucket_numel=100, **kwargs)
    _train_on(wrapped, opt, lambda step: conv_batch(step, rank, world_size))
    return params_of(model) if stage is None else wrapped.state_dict(full=True)


def _train_on(model, opt, batch):
    for step in range(STEPS):
        opt.zero_grad()
        model(*batch(step)).backward()
        opt.step()


def _resumed(name, saved, loaded, rank, world_size, directory):
    """2 steps at stage `saved`, engine.save, a fresh engine at stage `loaded` loads it, 2 more steps: equal to 4
    uninterrupted steps at stage `loaded`? And engine.optimizer.state_dict() round-trips on the same stage."""
    cls, kwargs = OPTIMIZERS[name]

    def build(stage):
        return zk.shard(odd_model(0), cls, stage=stage, wrap=(OddBlock,), precision="bf16", **kwargs)

    first = build(saved)
    _train(first, first.optimizer, rank, world_size, range(2))
    first.save(directory)
    torch_style = copy.deepcopy(first.optimizer.state_dict())  # torch returns references to the live state
    straight = build(loaded)
    _train(straight, straight.optimizer, rank, world_size)
    fresh = build(loaded)
    fresh.load(directory)
    _train(fresh, fresh.optimizer, rank, world_size, range(2, STEPS))
    want, got = straight.state_dict(full=True), fresh.state_dict(full=True)
    again = build(saved)
    again.load(directory)
    again.optimizer.load_state_dict(torch_style)
    _train(first, first.optimizer, rank, world_size, range(2, STEPS))
    _train(again, again.optimizer, rank, world_size, range(2, STEPS))
    a, b = first.state_dict(full=True), again.state_dict(full=True)
    return all(torch.equal(got[k], want[k]) for k in want), all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    return run_ranks(_cases, 2, directory, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=400)


def test_the_path_is_decided_by_class():
    for cls in (torch.optim.SGD, torch.optim.AdamW, torch.optim.Adam, DeclaredLion):
        assert is_elementwise(cls), cls
    for cls in (torch.optim.Adafactor, HFAdafactor, MuonLike, LambLike, LionLike):
        assert not is_elementwise(cls), cls

    class AdamWWithOwnStep(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    class PlainAdamW(torch.optim.AdamW):
        pass

    assert not is_elementwise(AdamWWithOwnStep)  # a step zerokit has not seen: whole parameters
    assert is_elementwise(PlainAdamW)


@pytest.mark.parametrize("cls", [torch.optim.LBFGS, torch.optim.SparseAdam])
def test_optimizers_without_a_sharded_form_are_refused_naming_the_fix(cls):
    with pytest.raises(TypeError, match="use"):
        zk.shard(odd_model(0), cls, stage=1, lr=1e-2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_equals_ddp_bitwise(results, name, stage):
    for rank, result in enumerate(results):
        diff, equal, _bytes, whole = result[name, stage]
        assert equal, f"rank {rank}: {name} at stage {stage} differs from DDP by {diff}"
        assert whole == (not is_elementwise(OPTIMIZERS[name][0]))


def test_whole_parameters_move_the_bytes_step_cost_counts(results):
    """What the whole-parameter path adds to a step is what `step_cost` (and `zerokit explain`) say: nothing at
    stage 0, the all-gathers and broadcasts it counts at stages 1-3."""
    for result in results:
        for name in OPTIMIZERS:
            whole = result[name, 1][3]
            for stage in (0, 1, 2, 3):
                (moved, cost), (flat, _) = result[name, stage][2], result["AdamW", stage][2]
                extra = cost["all_gather_bytes"] + cost["broadcast_bytes"] if whole and stage > 0 else 0
                assert moved - flat == STEPS * extra, (name, stage, moved, flat, cost)
            assert result[name, 1][2][1]["buffers_gathered"] > 0  # the odd model has straddlers at 2 ranks


@pytest.mark.parametrize("name", ["Adafactor", "MuonLike"])
def test_whole_parameter_path_under_bf16_gives_stage0s_bits(results, name):
    assert all(result[name, "bf16"] for result in results)


@pytest.mark.parametrize("name", ["Adafactor", "LambLike", "HF Adafactor"])
def test_whole_parameter_states_resume_bitwise_at_another_stage(results, name):
    for rank, result in enumerate(results):
        for saved, loaded in ((1, 3), (3, 0), (2, 2)):
            resumed, torch_style = result[name, "resume", saved, loaded]
            assert resumed, f"rank {rank}: {name} saved at stage {saved}, loaded at stage {loaded}"
            assert torch_style, f"rank {rank}: engine.optimizer.state_dict() of {name} at stage {saved}"


def _hybrid_cases(rank, world_size):
    """4 ranks, shard groups of 2: the whole-parameter path's broadcasts stay inside a shard group. Against
    stage 0 on the same 4 ranks (hybrid sharding sums a gradient in another order than DDP's ring at 4 ranks:
    docs/hybrid.md; stage 0 steps whole parameters with no communication at all)."""
    out = {}
    for name in ("Adafactor", "MuonLike"):
        cls, kwargs = OPTIMIZERS[name]
        ref = _zerokit(name, 0, rank, world_size)[0]
        for stage in (1, 3):
            engine = zk.shard(odd_model(0), cls, stage=stage, wrap=(OddBlock,), shard_group_size=2, **kwargs)
            _train(engine, engine.optimizer, rank, world_size)
            got = engine.state_dict(full=True)
            out[name, stage] = all(torch.equal(got[k], v) for k, v in ref.items())
    return out


def test_whole_parameter_path_under_hybrid_sharding_equals_ddp_bitwise(tmp_path):
    results = run_ranks(_hybrid_cases, 4, store_dir=str(tmp_path), timeout_s=300)
    for rank, result in enumerate(results):
        assert all(result.values()), (rank, result)


@pytest.mark.parametrize("name", ["Adafactor", "MuonLike"])
def test_whole_parameters_keep_channels_last_and_equal_ddp_bitwise(results, name):
    for rank, result in enumerate(results):
        assert all(result[name, "channels_last", stage] for stage in (0, 1, 2, 3)), rank


def test_param_groups_on_the_whole_parameter_path_equal_ddps_groups(results):
    for rank, result in enumerate(results):
        assert all(result["groups", stage] for stage in (0, 1, 3)), rank
