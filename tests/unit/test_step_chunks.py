"""The optimizer step in chunks under a cast (zerokit/optim/sharded.py [Note: a step in chunks]).

Under bf16/fp16 the fp32 copies of the gradient shards exist one chunk at a time, each at most
1/CAST_CHUNK of the whole (or the largest shard), and the update is the same to the bit as one
optimizer.step() over every shard.
"""
import pytest
import torch

import zerokit as zk
import zerokit.optim.sharded as sharded
from zerokit.models import Block, GPTConfig, build_model

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)


def _train(stage: int, precision: str, optimizer_cls, steps: int = 3, **kwargs):
    """A few steps on one rank; what every optimizer.step() call held, and the final weights."""
    engine = zk.shard(build_model(CONFIG, seed=0), optimizer_cls, stage=stage, precision=precision, lr=1e-2,
                      bucket_numel=1024, wrap=(Block,), **kwargs)
    masters = engine.optimizer.master_shards
    calls = []  # per optimizer.step() call: the numel of the fp32 gradients alive in it
    engine.optimizer.optimizer.register_step_pre_hook(
        lambda opt, args, kw: calls.append(sum(m.grad.numel() for m in masters if m.grad is not None)))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size), generator=gen)
        engine.zero_grad()
        engine.backward(engine(x, x)[1])
        assert engine.step()
    weights = [m.detach().clone() for m in masters]
    return calls, weights, sum(m.numel() for m in masters), max(m.numel() for m in masters)


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("optimizer_cls,kwargs", [(torch.optim.AdamW, {}), (torch.optim.AdamW, {"foreach": True}),
                                                   (torch.optim.SGD, {"momentum": 0.9})])
def test_bf16_steps_in_bounded_chunks_to_the_same_bits_as_one_call(stage, optimizer_cls, kwargs, monkeypatch):
    calls, chunked, total, largest = _train(stage, "bf16", optimizer_cls, **kwargs)
    steps = 3
    assert len(calls) > steps, "under bf16 the step must run in more than one chunk"
    budget = max(largest, -(-total // sharded.CAST_CHUNK))
    assert max(calls) <= budget, (max(calls), budget, total)
    assert sum(calls) == steps * total, "every master must get its gradient exactly once per step"
    monkeypatch.setattr(sharded, "CAST_CHUNK", 1)  # one chunk: the whole fp32 gradient at once
    whole_calls, whole, _, _ = _train(stage, "bf16", optimizer_cls, **kwargs)
    assert whole_calls == [total] * steps
    for a, b in zip(chunked, whole):
        assert torch.equal(a, b)


def test_fp32_steps_in_one_call():
    calls, _, total, _ = _train(2, "fp32", torch.optim.AdamW)
    assert calls == [total] * 3


def test_step_chunks_are_consecutive_and_cover_every_shard():
    engine = zk.shard(build_model(CONFIG, seed=0), torch.optim.AdamW, stage=1, precision="bf16", lr=1e-3,
                      bucket_numel=1024)
    opt = engine.optimizer
    grads = [torch.zeros(m.numel(), dtype=torch.bfloat16) for m in opt.master_shards]
    chunks = opt.step_chunks(grads)
    assert [i for c in chunks for i in c] == list(range(len(opt.master_shards)))
    assert all(c for c in chunks)
    assert opt.step_chunks([g.float() for g in grads]) == [list(range(len(grads)))]
