"""torch.compile at every stage, at world size 1 and 2 (core/params/unit.py [Note: torch.compile]).

Two habits, both FSDP2 users': compiling each Block (`block.compile()`, torchtitan's) and compiling
the whole model (`model.compile()`, after `zk.shard`, so `engine(...)` runs the compiled call). Each
trains the tiny GPT for a few steps and must match eager bit for bit: losses and the full state_dict.
Stage 3 is checked at world size 1 too (its sharded parameters are the same objects there).
The backend is "aot_eager": dynamo and AOTAutograd trace the model exactly as for inductor (graph
breaks at zerokit's hooks, the sharded parameters' metadata, functionalised backward), without
inductor's C++ compilation, which would cost minutes per graph on the test machines' CPUs; inductor
changes the kernels, not what zerokit sees. One spawn per world size; compiling is the time (about
a minute per spawn on 2 shared cores).
"""
from __future__ import annotations

import pytest
import torch

import zerokit as zk
from common import fixed_corpus
from zerokit.launch import run_ranks
from zerokit.models import Block, build_model

STEPS = 3
BACKEND = "aot_eager"


def _train(rank, world_size, stage, how):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("tiny")
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, wrap=(Block,), lr=1e-3)
    if how == "whole":
        model.compile(backend=BACKEND)
    elif how == "blocks":
        for block in model.blocks:
            block.compile(backend=BACKEND)
    losses, graphs = [], []
    for step in range(STEPS):
        x, y = fixed_corpus().batch(2, model.cfg.block_size, step, rank, world_size)
        _, loss = engine(x, y)
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.detach())
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return torch.stack(losses), engine.state_dict(full=True), graphs[-1] - graphs[1]


def _compiled_vs_eager(rank, world_size, stages):
    """Per stage and way of compiling: (losses equal, max |state difference|) against the eager run, and the graphs
    compiled after the second step (the first two may compile: `.grad` appears in the second)."""
    out = {}
    for stage in stages:
        eager_losses, eager_state, _ = _train(rank, world_size, stage, "eager")
        for how in ("whole", "blocks"):
            losses, state, recompiled = _train(rank, world_size, stage, how)
            diff = max((state[k].float() - eager_state[k].float()).abs().max().item() for k in eager_state)
            out[(stage, how)] = (torch.equal(losses, eager_losses), diff, recompiled)
    return out


@pytest.mark.parametrize("world_size, stages", [(2, (0, 1, 2, 3)), (1, (3,))])
def test_compiled_model_and_blocks_train_bitwise_like_eager(tmp_path, world_size, stages):
    """`model.compile()` and `block.compile()` for every Block, stages 0-3 at 2 ranks (and stage 3 alone at 1): the
    losses of 3 steps and the full state_dict after them equal eager's bit for bit, and the third step compiles
    nothing new. Dynamo reads metadata a sharded parameter or gradient refuses unless let through: stage 3's whole
    model would die inside dynamo ("parameter 'wte.weight' ... is sharded ... is_conj() is not supported on it"),
    stage 2's whole model and blocks from the second step on ("param.grad of 'wte.weight' is a ShardedGrad ...
    _is_view() is not supported on it")."""
    results = run_ranks(_compiled_vs_eager, world_size, stages, store_dir=str(tmp_path), timeout_s=600)
    for rank, result in enumerate(results):
        for (stage, how), (losses_equal, diff, recompiled) in result.items():
            assert losses_equal and diff == 0.0, (rank, stage, how, losses_equal, diff)
            assert recompiled == 0, (rank, stage, how, recompiled)
