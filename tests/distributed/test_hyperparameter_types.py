"""Optimizer hyperparameters keep their type and value through a save and a load
(zerokit/checkpoint/format.py [Note: hyperparameter types]), and the next step is the uninterrupted run's.

One 2-rank gloo spawn, stages 0-3, the odd model (tests/common.py), torch's AdamW built the way torch allows:

* "tensor lr": lr=torch.tensor(1e-2) (a 0-dim float32 tensor), betas=(tensor(0.9), tensor(0.99)),
  maximize=True, foreach=False;
* "flags": fused=True, amsgrad=True;
* "differentiable": differentiable=True;
* "capturable": capturable=True (torch steps it on CUDA only: saved and loaded before any step).

Each run trains 2 steps, saves (engine.save, and the torch-style pair engine.state_dict(full=True) +
engine.optimizer.state_dict()), trains a 3rd; a fresh engine built with plain defaults (lr=1e-3, no flags)
loads either form: every param group entry has the saved type (a tensor stays a tensor of its dtype, a tuple a
tuple) and value, and its 3rd step equals the uninterrupted run's bit for bit. A group entry meta.json cannot
hold (an object) is refused at load, naming it.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import zerokit as zk
from tests.common import OddBlock, odd_batch, odd_model
from zerokit.launch import run_ranks

CASES = {
    "tensor lr": dict(lr=torch.tensor(1e-2), betas=(torch.tensor(0.9), torch.tensor(0.99)), weight_decay=0.1,
                      maximize=True, foreach=False),
    "flags": dict(lr=1e-2, fused=True, amsgrad=True),
    "differentiable": dict(lr=1e-2, differentiable=True),
    "capturable": dict(lr=torch.tensor(1e-2), capturable=True),
}
STAGES = (0, 1, 2, 3)


def _engine(stage, **kwargs):
    return zk.shard(odd_model(seed=4), torch.optim.AdamW, stage=stage, wrap=(OddBlock,), **kwargs)


def _step(engine, step, rank, world_size):
    engine.zero_grad()
    engine.backward(engine(*odd_batch(step, 2, rank, world_size)))
    engine.step()


def _groups(engine) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]


def _same(a, b) -> bool:
    """Same type and value: tensors of one dtype and equal, tuples of such, or equal plain values."""
    if type(a) is not type(b):
        return False
    if torch.is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _differences(got: list[dict], want: list[dict]) -> list[str]:
    out = [f"{len(got)} groups, want {len(want)}"] if len(got) != len(want) else []
    for g, w in zip(got, want):
        out += [f"{k}: {g.get(k)!r} ({type(g.get(k)).__name__}), want {w[k]!r} ({type(w[k]).__name__})"
                for k in w if not _same(g.get(k), w[k])]
    return out


def _case(stage, name, rank, world_size, directory):
    import warnings
    steps = 0 if name == "capturable" else 2
    engine = _engine(stage, **CASES[name])
    for step in range(steps):
        _step(engine, step, rank, world_size)
    engine.save(directory)
    weights = f"{directory}-rank{rank}.safetensors"
    save_file(engine.state_dict(full=True), weights)
    optim = f"{directory}-rank{rank}.optim.pt"
    torch.save(engine.optimizer.state_dict(), optim)
    want = _groups(engine)
    out = {}
    if steps:
        _step(engine, steps, rank, world_size)
        straight = engine.state_dict(full=True)
    for how in ("engine.load", "optimizer.load_state_dict"):
        fresh = _engine(stage, lr=1e-3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if how == "engine.load":
                fresh.load(directory)
            else:
                fresh.load_weights(weights)
                fresh.optimizer.load_state_dict(torch.load(optim, weights_only=False))
        result = {"types": _differences(_groups(fresh), want),
                  "warned": [str(w.message) for w in caught if "optimizer hyperparameters" in str(w.message)]}
        if steps:
            _step(fresh, steps, rank, world_size)
            got = fresh.state_dict(full=True)
            result["next step"] = [k for k in straight if not torch.equal(got[k], straight[k])]
        out[how] = result
    return out


def _unstorable(rank, world_size, directory):
    engine = _engine(0, lr=1e-2)
    engine.optimizer.param_groups[0]["schedule"] = object()
    _step(engine, 0, rank, world_size)
    engine.save(directory)
    fresh = _engine(0, lr=1e-2)
    fresh.optimizer.param_groups[0]["schedule"] = object()
    try:
        fresh.load(directory)
    except ValueError as exc:
        return str(exc)
    return "not refused"


def _ranks(rank, world_size, root):
    out = {}
    for stage in STAGES:
        for name in CASES:
            out[stage, name] = _case(stage, name, rank, world_size, f"{root}/{name.replace(' ', '_')}-s{stage}")
    out["unstorable"] = _unstorable(rank, world_size, f"{root}/unstorable")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hyper")
    return run_ranks(_ranks, 2, str(root), store_dir=str(root), timeout_s=400)


@pytest.mark.parametrize("how", ["engine.load", "optimizer.load_state_dict"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("stage", STAGES)
def test_hyperparameters_keep_type_and_value_and_the_next_step_is_bitwise(runs, stage, name, how):
    for rank, out in enumerate(runs):
        result = out[stage, name][how]
        assert result["types"] == [], (rank, result["types"])
        assert result.get("next step", []) == [], (rank, result["next step"])
        if how == "engine.load" and rank == 0:  # the fresh engine had lr=1e-3 and no flags: the load says so
            assert len(result["warned"]) == 1 and "lr 0.001 -> " in result["warned"][0], result["warned"]


def test_a_hyperparameter_meta_json_cannot_hold_is_refused_at_load_naming_it(runs):
    for out in runs:
        assert "'schedule'" in out["unstorable"] and "cannot restore it" in out["unstorable"], out["unstorable"]
