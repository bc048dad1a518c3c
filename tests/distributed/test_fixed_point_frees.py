"""A collective's temporaries are freed by zerokit once it has completed (core/comm.py [Note: frees at a
fixed point]), not whenever the process group's worker thread lets go of the Work.

One spawn of 3 gloo ranks (3: the ordered all-reduce is the gathered recipe there, and the ordered
reduce-scatter an all-to-all). Each case captures the temporary as the collective is issued and
checks, right after the wait, that its storage is 0 bytes while the result is right. On the old
code each check fails deterministically: the captured tensor kept its bytes until its last
reference went.
"""
import torch
import torch.distributed as dist

import zerokit as zk
from common import odd_batch, odd_model
from zerokit.core.comm import Comm
from zerokit.core.grad_reduce import GradReduction
from zerokit.launch import run_ranks

WORLD_SIZE = 3


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _capturing(name: str, captured: list, arg: int):
    """Replace torch.distributed.`name` in this rank by a wrapper that keeps its argument `arg`."""
    original = getattr(dist, name)

    def wrapper(*args, **kwargs):
        captured.append(args[arg])
        return original(*args, **kwargs)

    setattr(dist, name, wrapper)
    return original


def _cases(rank, world_size):
    out = {}
    comm = Comm(ordered=True)
    n = world_size
    # 1. the ordered reduce-scatter's receive buffer (all-to-all output)
    received = []
    original = _capturing("all_to_all_single", received, 0)
    try:
        full = torch.arange(4 * n, dtype=torch.float32) * (rank + 1)
        shard = torch.empty(4)
        comm.reduce_scatter(shard, full, async_op=True).wait()
    finally:
        dist.all_to_all_single = original
    expected = (torch.arange(4 * n, dtype=torch.float32) * sum(range(1, n + 1)))[rank * 4:(rank + 1) * 4]
    out["reduce_scatter"] = (torch.equal(shard, expected), [_nbytes(t) for t in received])
    # 2. the gathered all-reduce's (N·B,) rows
    rows = []
    original = _capturing("all_gather_single", rows, 0)
    try:
        t = torch.full((6,), float(rank + 1))
        comm.all_reduce(t, async_op=True).wait()
    finally:
        dist.all_gather_single = original
    out["all_reduce"] = (torch.equal(t, torch.full((6,), float(sum(range(1, n + 1))))), [_nbytes(r) for r in rows])
    # 3. a reduce-dtype copy (bf16 gradient reduced in fp32)
    grad = torch.full((3 * n,), 0.5, dtype=torch.bfloat16)
    reduction = GradReduction(comm, grad, torch.float32, "a bucket")
    send = reduction.send
    grad_shard = torch.empty(3, dtype=torch.float32)
    reduction.reduce_scatter(grad_shard).wait()
    out["reduce_dtype_copy"] = (torch.equal(grad_shard, torch.full((3,), 0.5)), [_nbytes(send)])
    # 4-5. stages 1 and 2: the post-step all-gather's input clones
    for stage in (1, 2):
        engine = zk.shard(odd_model(), torch.optim.AdamW, stage=stage, lr=1e-2)
        clones = []
        gather_many = engine.comm.all_gather_many

        def keeping_inputs(outputs, inputs, *args, **kwargs):
            clones.extend(inputs)
            return gather_many(outputs, inputs, *args, **kwargs)

        engine.comm.all_gather_many = keeping_inputs
        x, y = odd_batch(0, 3, rank, world_size)
        engine.backward(engine(x, y))
        engine.step()
        params = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
        everyone = [torch.empty_like(params) for _ in range(world_size)]
        dist.all_gather(everyone, params)
        out[f"stage{stage}_gather_inputs"] = (all(torch.equal(everyone[0], p) for p in everyone),
                                              [_nbytes(c) for c in clones])
    return out


def test_temporaries_are_freed_when_their_collective_completes(tmp_path):
    results = run_ranks(_cases, WORLD_SIZE, store_dir=str(tmp_path), timeout_s=120)
    for rank, out in enumerate(results):
        for case, (correct, nbytes) in out.items():
            assert correct, (rank, case)
            assert nbytes, (rank, case, "nothing captured")
            assert nbytes == [0] * len(nbytes), (rank, case, nbytes)
