"""DDP's `find_unused_parameters=True` row of docs/contract.md: parameters that get no gradient.

A branch that runs on one rank only (rank-dependent control flow) and a parameter that no
rank uses: torch DDP needs `find_unused_parameters=True` for both; zerokit needs nothing, at
stages 0-2 and at stage 3 when the branch lies inside a unit that runs on every rank (a unit
that itself runs on one rank only is tests/distributed/test_stage3_divergence.py's case).
Each stage must train bit for bit like DDP at 2 ranks, with SGD (whose update is the gradient
itself, so a wrong average shows) and AdamW.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerokit as zk
from zerokit.launch import run_ranks

STEPS, BATCH, DIM = 4, 3, 6
OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.1)), "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))}


class Branchy(nn.Module):
    """`extra` runs on rank 1 only; `never` runs nowhere."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.inp = nn.Linear(DIM, DIM)
        self.extra = nn.Linear(DIM, DIM)
        self.never = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.rank == 1:
            h = h + torch.tanh(self.extra(h))
        return self.out(h).squeeze(-1)


def _model(rank: int) -> Branchy:
    torch.manual_seed(0)
    return Branchy(rank)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, generator=g)


def _cases(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from common import _build_ddp

    out = {}
    for opt_name, (cls, kw) in OPTIMIZERS.items():
        model = _model(rank)
        import torch.distributed as dist
        if dist.get_debug_level() == dist.DebugLevel.DETAIL:
            ddp = _build_ddp(model)  # its own group without DETAIL's wrapper (see tests/common.py)
            ddp = DDP(model, process_group=ddp.process_group, find_unused_parameters=True)
        else:
            ddp = DDP(model, find_unused_parameters=True)
        opt = cls(model.parameters(), **kw)
        for step in range(STEPS):
            x, y = _batch(step, rank)
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()
        reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # `never` as a torch optimizer steps it with a zero gradient (zerokit's rule; DDP would skip it)
        never = [p.detach().clone().requires_grad_() for p in _model(rank).never.parameters()]
        zero_stepped = cls(never, **kw)
        for p in never:
            p.grad = torch.zeros_like(p)
        for step in range(STEPS):
            zero_stepped.step()
        for stage in range(4):
            model = _model(rank)
            engine = zk.shard(model, cls, stage=stage, bucket_numel=40, **kw)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for step in range(STEPS):
                    x, y = _batch(step, rank)
                    engine.zero_grad()
                    F.mse_loss(engine(x), y).backward()
                    engine.step()
            out[(opt_name, stage, "warnings")] = [str(w.message) for w in caught if "no gradient" in str(w.message)]
            got = engine.state_dict(full=True)
            out[(opt_name, stage)] = max((got[k] - reference[k]).abs().max().item() for k in reference
                                         if not k.startswith("never."))
            out[(opt_name, stage, "never vs ddp")] = (got["never.weight"] - reference["never.weight"]).abs().max().item()
            out[(opt_name, stage, "never zero-stepped")] = (torch.equal(got["never.weight"], never[0].detach())
                                                            and torch.equal(got["never.bias"], never[1].detach()))
            moved = (got["extra.weight"] - _model(rank).extra.weight.detach()).abs().max().item()
            out[(opt_name, stage, "extra moved")] = moved
            out[(opt_name, stage, "never")] = torch.equal(got["never.weight"], _model(rank).never.weight.detach())
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_cases, 2, store_dir=str(tmp_path_factory.mktemp("rdzv")))


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_parameters_unused_on_some_ranks_train_bitwise_like_ddp_find_unused(results, stage, opt):
    for rank, out in enumerate(results):
        assert out[(opt, stage)] == 0.0, (rank, out[(opt, stage)])
        # the branch rank 1 ran moved on both ranks (its gradient, averaged, reached rank 0 too)
        assert out[(opt, stage, "extra moved")] > 0, rank
        if opt == "sgd":  # no gradient anywhere: SGD leaves it exactly (AdamW's decay still moves it, as DDP's)
            assert out[(opt, stage, "never")], rank


@pytest.mark.parametrize("stage", range(4))
def test_a_parameter_no_rank_uses_is_stepped_with_a_zero_gradient_and_named(results, stage):
    """torch DDP leaves such a parameter's .grad None and a torch optimizer skips it; zerokit steps its flat
    buffer whole, so the parameter takes a zero-gradient step (weight decay moves it), and says so once."""
    for rank, out in enumerate(results):
        assert out[("adamw", stage, "never zero-stepped")], rank
        assert out[("adamw", stage, "never vs ddp")] > 0, rank  # the documented difference from DDP
        assert out[("sgd", stage, "never vs ddp")] == 0, rank
        named = out[("adamw", stage, "warnings")]
        assert len(named) == 1 and "never.weight" in named[0] and "requires_grad_(False)" in named[0], (rank, named)
