"""zerokit on a torch without `all_gather_single` / `reduce_scatter_single` (before 2.13), and without the
deprecation warnings of their old names on one that has them (core/collectives/gather.py [Note: the tensor
collectives' names]).

One spawn of 2 gloo ranks. Each rank trains stages 0-3 with torch's native reduction (the path NCCL
takes, where those two collectives are issued) and clipping (the scalars' all-gather): once as this torch
is, with every FutureWarning an error, and once with the new names removed from torch.distributed, as on
torch 2.11 (the GPU machine's). Both must train to the same bits, and the second must really have gone
through the old names.
"""
import warnings

import torch
import torch.distributed as dist

import zerokit as zk
from common import OddBlock, odd_batch, odd_model
from zerokit.launch import run_ranks

NEW_TO_OLD = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def _train(stage: int, rank: int, world_size: int) -> dict:
    engine = zk.shard(odd_model(), torch.optim.AdamW, stage=stage, wrap=(OddBlock,), bucket_numel=64,
                      ordered_reduction=False, lr=1e-2)
    for step in range(2):
        x, y = odd_batch(step, 3, rank, world_size)
        engine.zero_grad()
        engine(x, y).backward()
        engine.clip_grad_norm_(0.5)
        engine.step()
    return {k: v.detach().clone() for k, v in engine.state_dict(full=True).items()}


def _as_older_torch():
    """Remove the new names from torch.distributed and count the calls of the old ones; returns (counts, undo)."""
    saved = {new: getattr(dist, new) for new in NEW_TO_OLD}
    olds = {old: getattr(dist, old) for old in NEW_TO_OLD.values()}
    counts = dict.fromkeys(olds, 0)

    def counting(old):
        def call(*args, **kwargs):
            counts[old] += 1
            return olds[old](*args, **kwargs)
        return call

    for new, old in NEW_TO_OLD.items():
        delattr(dist, new)
        setattr(dist, old, counting(old))

    def undo():
        for new, fn in saved.items():
            setattr(dist, new, fn)
        for old, fn in olds.items():
            setattr(dist, old, fn)

    return counts, undo


def _rank(rank: int, world_size: int):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the old names warn on torch 2.13
        today = {stage: _train(stage, rank, world_size) for stage in range(4)}
    counts, undo = _as_older_torch()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            older = {stage: _train(stage, rank, world_size) for stage in range(4)}
    finally:
        undo()
    for stage in range(4):
        assert today[stage].keys() == older[stage].keys()
        for k in today[stage]:
            assert torch.equal(today[stage][k], older[stage][k]), (stage, k)
    assert all(n > 0 for n in counts.values()), counts  # both old names were really called
    return counts


def test_older_torch_names_train_to_the_same_bits_and_new_names_do_not_warn(tmp_path):
    counts = run_ranks(_rank, 2, store_dir=str(tmp_path))
    assert counts[0] == counts[1]
