"""Per-group hyperparameters against torch: stage 0 with `param_groups` equals torch's DDP and optimizer built
over the same param groups, bit for bit, at world size 2.

The per-group tests of test_zero12.py compare zerokit's stages with each other; they share the sharded
optimizer (zerokit/optim/sharded.py), so a mistake in how a group's options reach torch's optimizer
(weight decay scaled by lr in all but the first group, say) moves every stage alike and passes them.
Here the reference is torch's own. The groups are the usual no-decay group, first in zerokit's
optimizer, then two groups with different non-zero weight decays, one of them with its own lr (and,
for SGD, each group with its own momentum).
"""
import pytest
import torch

from common import train_torch_ddp, train_zerokit
from zerokit.launch import run_ranks

STEPS, BATCH = 4, 3


# zerokit's optimizer groups come in the order of its flat buffers: by each buffer's earliest-registered
# parameter, descending (core/params/flat_param.py). `gain` is the odd model's first parameter, so it is kept
# out of the no-decay group (it decays at 0.2), which then comes first.
def _no_decay(name, p):
    return p.ndim < 2 and name != "gain"


def _adamw_groups(name, p):
    if _no_decay(name, p):
        return {"weight_decay": 0.0}
    if name.startswith("blocks.0."):
        return {"weight_decay": 0.05, "lr": 3e-3}
    return {"weight_decay": 0.2}


def _sgd_groups(name, p):
    if _no_decay(name, p):
        return {"weight_decay": 0.0, "momentum": 0.5}
    if name.startswith("blocks.0."):
        return {"weight_decay": 0.05, "lr": 0.03, "momentum": 0.9}
    return {"weight_decay": 0.2}


CASES = {"adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), _adamw_groups),
         "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.8), _sgd_groups)}


def _torch_param_groups(model, param_groups):
    """torch's param groups for `model`: parameters with equal overrides together, in registration order."""
    groups: dict[tuple, list] = {}
    for name, p in model.named_parameters():  # a tied parameter once, under its first name (as zerokit)
        if p.requires_grad:
            groups.setdefault(tuple(sorted(param_groups(name, p).items())), []).append(p)
    return [{"params": ps, **dict(key)} for key, ps in groups.items()]


def _cases(rank, world_size):
    out = {}
    for name, (cls, kw, param_groups) in CASES.items():
        ref_losses, ref_params = train_torch_ddp(rank, world_size, cls, kw, STEPS, BATCH,
                                               param_groups=lambda m: _torch_param_groups(m, param_groups))
        # The default bucket size: one flat buffer per group, the no-decay one first (see _no_decay).
        losses, params, engine = train_zerokit(rank, world_size, 0, cls, kw, STEPS, BATCH, param_groups=param_groups)
        groups = [{k: g[k] for k in ("lr", "weight_decay", "momentum") if k in g}
                  for g in engine.optimizer.param_groups]
        out[name] = dict(ref_losses=ref_losses, losses=losses, ref_params=ref_params, params=params, groups=groups)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_cases, 2, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=120)


@pytest.mark.parametrize("case", list(CASES))
def test_stage0_with_param_groups_trains_like_torch_ddp_with_the_same_groups_bitwise(results, case):
    """AdamW (weight decay 0.0, 0.05 with lr 3e-3, 0.2) and SGD (each group its own momentum too) over the
    same groups: every loss and every parameter equal torch DDP + torch's optimizer bit for bit."""
    expected_groups = {
        "adamw": [{"lr": 1e-2, "weight_decay": 0.0}, {"lr": 3e-3, "weight_decay": 0.05},
                  {"lr": 1e-2, "weight_decay": 0.2}],
        "sgd_momentum": [{"lr": 0.1, "weight_decay": 0.0, "momentum": 0.5},
                         {"lr": 0.03, "weight_decay": 0.05, "momentum": 0.9},
                         {"lr": 0.1, "weight_decay": 0.2, "momentum": 0.8}]}[case]
    for rank, out in enumerate(results):
        r = out[case]
        assert r["params"].keys() == r["ref_params"].keys()
        differ = [k for k in r["ref_params"] if not torch.equal(r["params"][k], r["ref_params"][k])]
        assert differ == [], (rank, differ)
        assert torch.equal(r["losses"], r["ref_losses"]), (rank, r["losses"], r["ref_losses"])
        assert r["groups"] == expected_groups, (rank, r["groups"])  # the case is the one described
