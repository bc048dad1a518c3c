"""Hybrid sharding's stop agreement spans the whole world, not the shard group (core/preemption.py
[Note: agreeing to stop], core/collectives/hybrid.py).

4 gloo ranks as two "nodes" of 2 (`zk.hybrid_groups(2)`: shard groups {0, 1} and {2, 3}), stages 1-3 with
`shard_group_size=2`. Rank 3 alone gets SIGTERM during step 1 of the user's loop (train, step, then
`if engine.stop_requested(): break`). Every rank must leave the loop after the same step, 1. An agreement
reduced over the shard group only would stop ranks 2 and 3 there while ranks 0 and 1 train on, and those
wait in step 2's cross-node all-reduce for ranks that left: the collectives time out after COLLECTIVE_S
and the run fails within RUN_S, not a hang.
"""
from __future__ import annotations

import os
import signal

import torch

import zerokit as zk
from tests.common import OddBlock, odd_batch, odd_model
from zerokit.launch import run_ranks

STEPS, SIGNALLED_RANK, SIGNALLED_STEP = 5, 3, 1
COLLECTIVE_S, RUN_S = 20, 90


def _ranks(rank, world_size):
    import torch.distributed as dist

    from zerokit.core import preemption
    groups = zk.hybrid_groups(2)
    out = {"shard group": dist.get_process_group_ranks(groups[0])}
    for stage in (1, 2, 3):
        preemption.SIGNALS.received = None
        engine = zk.shard(odd_model(seed=stage), torch.optim.AdamW, stage=stage, group=groups, lr=1e-3,
                          wrap=(OddBlock,))
        engine.stop_requested()  # installs the handlers (zerokit's loops call it from step 0)
        stopped = None
        for step in range(STEPS):
            engine.zero_grad()
            engine.backward(engine(*odd_batch(step, 2, rank, world_size)))
            engine.step()
            if rank == SIGNALLED_RANK and step == SIGNALLED_STEP:
                os.kill(os.getpid(), signal.SIGTERM)
            if engine.stop_requested():
                stopped = step
                break
        out[stage] = (stopped, preemption.received_signal())
        preemption.SIGNALS.release()
        dist.barrier()
    return out


def test_one_rank_of_one_shard_group_stops_all_four_ranks_at_the_same_step(tmp_path):
    results = run_ranks(_ranks, 4, store_dir=str(tmp_path), timeout_s=RUN_S, collective_timeout_s=COLLECTIVE_S)
    assert [r["shard group"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for stage in (1, 2, 3):
        assert [r[stage] for r in results] == [(SIGNALLED_STEP, None)] * 3 + [(SIGNALLED_STEP, "SIGTERM")], stage
