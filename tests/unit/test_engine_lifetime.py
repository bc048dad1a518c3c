"""An engine the user drops is freed, model states and all, as a dropped torch DDP or FSDP module is.

zerokit/core/grads/hooks.py [Note: hooks hold the engine weakly]: the gradient hooks live on the
parameters' C++ side, where the garbage collector cannot see them; had they held the engine,
every engine ever built would stay in memory (a sweep of runs in one process grew by each
run's whole model states).
"""
import gc
import weakref

import pytest
import torch

import zerokit as zk
from zerokit.models import Block, GPTConfig, build_model

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _trained_engine(stage: int, precision: str):
    engine = zk.shard(build_model(CONFIG, seed=0), torch.optim.AdamW, stage=stage, precision=precision, lr=1e-3,
                      bucket_numel=2048, wrap=(Block,))
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.zero_grad()
        loss = engine(x, x)[1]
        loss.backward()  # a plain backward, as users write it
        engine.step()
    return engine


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_dropped_engine_frees_itself_its_model_and_its_buffers(stage, precision):
    engine = _trained_engine(stage, precision)
    refs = {"engine": weakref.ref(engine), "model": weakref.ref(engine.module),
            "a parameter": weakref.ref(next(engine.module.parameters())),
            "an optimizer master": weakref.ref(engine.optimizer.master_shards[0])}
    del engine
    gc.collect()
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"still alive after the engine was dropped: {alive}"


def test_a_model_kept_after_its_engine_is_dropped_trains_as_plain_torch():
    """The hooks do nothing once the engine is gone: the model's own backward still works."""
    engine = _trained_engine(0, "fp32")
    model = engine.module
    del engine
    gc.collect()
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size))
    model.zero_grad()
    model(x, x)[1].backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
