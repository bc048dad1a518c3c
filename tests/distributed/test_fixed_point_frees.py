"""A collective's temporaries are freed by zerokit once it has completed (core/comm.py [Note: frees at a
fixed point]), not whenever the process group's worker thread lets go of the Work.

One spawn of 3 gloo ranks (3: an ordered all-reduce is not the native one there: an all-to-all, a
sum, an all-gather; core/comm.py [Note: ordered reduction]). Each case captures the temporary as the
collective is issued and checks, right after the wait, that its storage is 0 bytes while the result
is right. On the old code each check fails deterministically: the captured tensor kept its bytes
until its last reference went. The same spawn checks where the ordered all-reduce's all-gather
halves go in a rank's sequence of collectives: after the step's last all-to-all, together.
"""
import pytest
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
    # 2. the ordered all-reduce's all-to-all receive buffer ((N·B/N,): B)
    received = []
    original = _capturing("all_to_all_single", received, 0)
    try:
        t = torch.full((6,), float(rank + 1))
        comm.all_reduce(t, async_op=True).wait()
    finally:
        dist.all_to_all_single = original
    out["all_reduce"] = (torch.equal(t, torch.full((6,), float(sum(range(1, n + 1))))), [_nbytes(r) for r in received])
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
    out["sequences"] = _all_reduce_sequences(rank, world_size)
    return out


def _logging(calls: list):
    """Log this rank's all-to-alls and all-gathers ("a2a", "ag") of float tensors as torch.distributed sees
    them issued (not debug mode's int64 checks), with their outputs; returns a function that puts torch's back."""
    originals = {name: getattr(dist, name) for name in ("all_to_all_single", "all_gather_single")}

    def log(name, tag):
        def wrapper(*args, **kwargs):
            if args[0].is_floating_point():
                calls.append((tag, args[0]))
            return originals[name](*args, **kwargs)
        return wrapper

    dist.all_to_all_single = log("all_to_all_single", "a2a")
    dist.all_gather_single = log("all_gather_single", "ag")
    return lambda: [setattr(dist, name, f) for name, f in originals.items()]


def _all_reduce_sequences(rank, world_size):
    """Where the all-gather halves of ordered all-reduces are issued, and what they give."""
    out = {}
    n, total = world_size, float(sum(range(1, world_size + 1)))
    # stage 0's backward: a bucket's all-to-all as it is ready, every all-gather after the last one
    engine = zk.shard(odd_model(), torch.optim.AdamW, stage=0, bucket_numel=40, lr=1e-2)
    x, y = odd_batch(0, 3, rank, world_size)
    calls = []
    restore = _logging(calls)
    try:
        engine.backward(engine(x, y))
        in_backward = len(calls)
        engine.step()
    finally:
        restore()
    buckets = len(engine.trainable)
    out["stage0"] = dict(buckets=buckets, tags=[tag for tag, _ in calls], in_backward=in_backward,
                         received=[_nbytes(t) for tag, t in calls if tag == "a2a"])
    # another kind of collective issues the waiting halves first; waits in any order; debug mode checks them
    for debug in (False, True):
        comm = Comm(ordered=True, debug=debug)
        calls = []
        restore = _logging(calls)
        try:
            a, b = torch.full((3 * n,), float(rank + 1)), torch.full((2 * n,), 2.0 * (rank + 1))
            ha = comm.all_reduce(a, async_op=True)
            hb = comm.all_reduce(b, async_op=True)
            norm = comm.all_reduce_scalars(torch.tensor([1.0]))
            hb.wait()
            ha.wait()
        finally:
            restore()
        out[("interleaved", debug)] = dict(
            right=torch.equal(a, torch.full((3 * n,), total)) and torch.equal(b, torch.full((2 * n,), 2 * total))
            and norm.item() == n, calls=[(tag, t.numel()) for tag, t in calls])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_cases, WORLD_SIZE, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=120)


def test_temporaries_are_freed_when_their_collective_completes(results):
    for rank, out in enumerate(results):
        for case, (correct, nbytes) in ((c, v) for c, v in out.items() if c != "sequences"):
            assert correct, (rank, case)
            assert nbytes, (rank, case, "nothing captured")
            assert nbytes == [0] * len(nbytes), (rank, case, nbytes)


def test_the_all_gather_halves_of_stage0_go_out_together_after_the_last_all_to_all(results):
    """Stage 0 at 3 ranks: each bucket's all-to-all in backward as the bucket fills, then the buckets'
    all-gathers, one per bucket (coalesced), still in backward; every receive buffer freed by then."""
    for rank, out in enumerate(results):
        seq = out["sequences"]["stage0"]
        buckets = seq["buckets"]
        assert buckets > 3, "the case must exercise several buckets"
        # the first all-gather after the all-to-alls; torch's coalescing may add its own calls, never an all-to-all
        assert seq["tags"][:buckets] == ["a2a"] * buckets, (rank, seq["tags"])
        assert set(seq["tags"][buckets:seq["in_backward"]]) == {"ag"}, (rank, seq["tags"])
        assert seq["tags"][buckets:seq["in_backward"]].count("ag") == buckets, (rank, seq["tags"])
        assert seq["received"] == [0] * buckets, (rank, seq["received"])
        assert results[0]["sequences"]["stage0"]["tags"] == seq["tags"], "every rank issues the same sequence"


@pytest.mark.parametrize("debug", [False, True])
def test_another_collective_issues_the_waiting_all_gathers_first(results, debug):
    """Two ordered all-reduces in flight (their all-to-alls issued, no all-gather yet), then a scalar
    reduction: the halves go out before it; waited for in the other order, both are right."""
    for rank, out in enumerate(results):
        case = out["sequences"][("interleaved", debug)]
        n = len(results)
        # all-to-alls (N·3 and N·2 elements in), the halves' all-gathers, then the scalars' (N,) gather
        assert case["calls"] == [("a2a", 3 * n), ("a2a", 2 * n), ("ag", 3 * n), ("ag", 2 * n), ("ag", n)], (rank, case)
        assert case["right"], (rank, case)
