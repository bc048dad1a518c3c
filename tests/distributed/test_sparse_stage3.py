"""`nn.Embedding(..., sparse=True)` at every stage, stage 3 included, against torch DDP with the same sparse
embedding (core/params/unit.py `packed_grads`: a sparse `.grad` is added into the unit's zeroed flat gradient, the add
autograd itself does into the `.grad` views of stages 0-2).

2 gloo ranks, 4 steps of SGD on a model whose embedding is sparse (tokens repeat inside a batch, so the
sparse gradient has duplicate rows), at stages 0-3; stage 3 with the embedding in the root unit and in a unit
of its own: each equals torch DDP's parameters bit for bit. With no_sync accumulation of 2 micro-batches
stage 3 equals stage 0 bit for bit, and both are within NO_SYNC_ATOL of DDP: DDP keeps the accumulated
gradient sparse (both micro-batches' rows, uncoalesced) and sums every rank's rows in one coalesce after its
sparse all-reduce, zerokit sums each rank's rows densely first and then across ranks, another association of
the same fp32 sum (last bits). The optimizer sees the dense gradient, so zk.shard refuses torch's SparseAdam,
naming Adam (optim/whole_params.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerokit as zk
from tests.common import DIM, VOCAB, OddBlock, _build_ddp, odd_batch
from zerokit.launch import run_ranks

STEPS, BATCH, LR = 4, 3, 0.5
NO_SYNC_ATOL = 1e-6


class SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.blocks = nn.ModuleList(OddBlock() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx, targets):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))


def sparse_net() -> SparseNet:
    torch.manual_seed(5)
    return SparseNet()


def _batches(step, accumulate, rank, world_size):
    return [odd_batch(step * accumulate + m, BATCH, rank, world_size) for m in range(accumulate)]


def _ddp(rank, world_size, accumulate):
    model = sparse_net()
    ddp = _build_ddp(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        batches = _batches(step, accumulate, rank, world_size)
        for m, (x, y) in enumerate(batches):
            if m < accumulate - 1:
                with ddp.no_sync():
                    (ddp(x, y) / accumulate).backward()
            else:
                (ddp(x, y) / accumulate if accumulate > 1 else ddp(x, y)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zk(rank, world_size, stage, wrap, accumulate):
    model = sparse_net()
    engine = zk.shard(model, torch.optim.SGD, stage=stage, wrap=wrap, lr=LR)
    for step in range(STEPS):
        model.zero_grad()
        batches = _batches(step, accumulate, rank, world_size)
        for m, (x, y) in enumerate(batches):
            if m < accumulate - 1:
                with engine.no_sync():
                    (engine(x, y) / accumulate).backward()
            else:
                (engine(x, y) / accumulate if accumulate > 1 else engine(x, y)).backward()
        engine.step()
    return engine.state_dict(full=True)


CASES = {  # name -> (stage, wrap, micro-batches per step)
    **{f"stage {s}": (s, None, 1) for s in (0, 1, 2)},
    "stage 3, embedding in the root unit": (3, (OddBlock,), 1),
    "stage 3, embedding a unit of its own": (3, (nn.Embedding, OddBlock), 1),
    "stage 0, no_sync x2": (0, None, 2),
    "stage 3, no_sync x2": (3, (nn.Embedding, OddBlock), 2),
}


def _ranks(rank, world_size):
    refs = {a: _ddp(rank, world_size, a) for a in (1, 2)}
    out, states = {}, {}
    for name, (stage, wrap, accumulate) in CASES.items():
        got = states[name] = _zk(rank, world_size, stage, wrap, accumulate)
        ref = refs[accumulate] if accumulate == 1 else states["stage 0, no_sync x2"]
        out[name] = {"differ": [k for k in ref if not torch.equal(got[k], ref[k])],
                     "max diff vs ddp": max((got[k] - refs[accumulate][k]).abs().max().item() for k in ref),
                     "moved": not torch.equal(got["emb.weight"], sparse_net().emb.weight.detach())}
    for stage in (0, 3):  # the optimizer would see a dense gradient: refused at zk.shard, naming Adam
        try:
            zk.shard(sparse_net(), torch.optim.SparseAdam, stage=stage, wrap=(OddBlock,), lr=1e-2)
            out["SparseAdam", stage] = "accepted"
        except TypeError as exc:
            out["SparseAdam", stage] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_ranks, 2, store_dir=str(tmp_path_factory.mktemp("sparse")), timeout_s=300)


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_embedding_trains_like_torch_ddp_at_every_stage(runs, case):
    for rank, out in enumerate(runs):
        result = out[case]
        assert result["moved"], (rank, case)
        assert result["differ"] == [], (rank, case, result)  # DDP's, or (no_sync) stage 0's, bit for bit
        assert result["max diff vs ddp"] <= (0 if "no_sync" not in case else NO_SYNC_ATOL), (rank, case, result)


def test_sparse_adam_is_refused_at_zk_shard_naming_adam(runs):
    for out in runs:
        for stage in (0, 3):
            assert "SparseAdam accepts only sparse gradients" in out["SparseAdam", stage], out["SparseAdam", stage]
            assert "torch.optim.Adam" in out["SparseAdam", stage]
