"""A model built on the meta device gets an eager build's bits (core/params/materialize.py), on one process.

Each case seeds, builds the model eagerly and reads its state and the generator afterwards; seeds again,
builds it under `torch.device("meta")`, wraps it with zk.shard (no process group) and compares
`engine.state_dict()` and the next random draw: both must be bitwise equal, at every stage. The 2-rank
cases (training after a meta build, rank 0's values on every rank) are tests/distributed/test_meta_init_ranks.py.
"""
import pytest
import torch
from torch import nn

import zerokit as zk
from zerokit.models import GPT, Block, preset

from common import TorchModules, train_on_tokens


class TiedAfterInit(nn.Module):
    """A head tied to the embedding after both were initialized: the embedding's values stay (the head's
    draws are discarded, in eager and in the replay alike)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx))))


class OwnReset(nn.Module):
    """A custom module following torch's convention: parameters made empty, values in reset_parameters."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(5))
        self.register_buffer("count", torch.empty((), dtype=torch.long))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.uniform_(self.scale, 0.5, 1.5)
        self.count.zero_()

    def forward(self, x):
        return x * self.scale


class WithOwnReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.own = OwnReset()
        self.b = nn.Linear(5, 5)

    def forward(self, x):
        return self.b(self.own(self.a(x)))


def _gpt():
    return GPT(preset("tiny"))


def _init_block(m):
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)


CASES = {  # name: (build, param_init_fn, applied after an eager build; wrap)
    "torch modules": (TorchModules, None, None),
    "tied after init": (TiedAfterInit, None, None),
    "own reset_parameters": (WithOwnReset, None, None),
    "zerokit GPT (nanoGPT pattern)": (_gpt, GPT._init_weights, (Block,)),
    "param_init_fn after construction": (TorchModules, _init_block, None),
}


def _eager(build, fn, in_constructor):
    torch.manual_seed(3)
    model = build()
    if fn is not None and not in_constructor:
        model.apply(fn)
    return {k: v.clone() for k, v in model.state_dict().items()}, torch.rand(4)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_build_equals_eager(case, stage):
    build, fn, wrap = CASES[case]
    in_constructor = build is _gpt  # GPT's constructor ends in self.apply(self._init_weights)
    reference, next_draw = _eager(build, fn, in_constructor)
    torch.manual_seed(3)
    with torch.device("meta"):
        model = build()
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, lr=1e-3, param_init_fn=fn, wrap=wrap)
    assert torch.equal(torch.rand(4), next_draw), "the generator must be left where an eager build leaves it"
    got = engine.state_dict()
    assert sorted(got) == sorted(reference)
    for name, value in reference.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    for p in model.parameters():  # every placeholder replaced by a view of the engine's storage
        assert not p.is_meta


def test_meta_build_trains_as_eager():
    """k steps of a meta-built GPT equal k steps of the eager one, bit for bit (stage 3, bf16)."""
    losses = []
    for meta in (False, True):
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            model = _gpt()
        engine = zk.shard(model, torch.optim.AdamW, stage=3, precision="bf16", wrap=(Block,), lr=1e-3,
                          param_init_fn=GPT._init_weights if meta else None)
        run = train_on_tokens(engine, 3, seed=1, vocab=model.cfg.vocab_size)
        losses.append((run, {k: v.clone() for k, v in engine.state_dict().items()}))
    assert losses[0][0] == losses[1][0]
    for k, v in losses[0][1].items():
        assert torch.equal(v, losses[1][1][k]), k


class BareParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bias = nn.Parameter(torch.randn(4))  # on meta: nothing gives it values


class MaskInInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)


@pytest.mark.parametrize("build, named", [(BareParameter, "parameter 'bias'"), (MaskInInit, "buffer 'mask'")])
def test_uninitialized_is_refused_naming_it(build, named):
    with torch.device("meta"):
        model = build()
    with pytest.raises(ValueError, match=f"{named} was built on the meta device.*reset_parameters"):
        zk.shard(model, torch.optim.SGD, stage=3, lr=0.1)


def test_uninitialized_fixed_by_param_init_fn_or_a_real_buffer():
    def init(m):
        if isinstance(m, BareParameter):
            nn.init.zeros_(m.bias)
    with torch.device("meta"):
        model = BareParameter()
    engine = zk.shard(model, torch.optim.SGD, stage=3, lr=0.1, param_init_fn=init)
    assert torch.equal(engine.state_dict()["bias"], torch.zeros(4))
    with torch.device("meta"):
        model = MaskInInit()
        model.mask = torch.tril(torch.ones(4, 4, device="cpu"))  # the documented fix: a real buffer
    engine = zk.shard(model, torch.optim.SGD, stage=0, lr=0.1)
    assert torch.equal(engine.module.mask, torch.tril(torch.ones(4, 4)))


def test_param_init_fn_on_a_real_model_is_refused():
    with pytest.raises(ValueError, match="no parameter or buffer of this model is on meta"):
        zk.shard(nn.Linear(3, 3), torch.optim.SGD, lr=0.1, param_init_fn=_init_block)


def test_lora_on_a_meta_model_is_refused_naming_the_fix():
    with torch.device("meta"):
        model = _gpt()
    zk.lora.inject(model, targets=("q", "v"), rank=2)
    with pytest.raises(ValueError, match="lora_A.*inject them into a model built eagerly"):
        zk.shard(model, torch.optim.SGD, stage=3, wrap=(Block,), lr=0.1, param_init_fn=GPT._init_weights)
