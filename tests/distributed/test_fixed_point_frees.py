"""A collective's temporaries are freed by zerokit once it has completed (core/collectives/gather.py [Note: frees at a
fixed point]), not whenever the process group's worker thread lets go of the Work.

One spawn of 3 gloo ranks (3: an ordered all-reduce is not the native one there: an all-to-all, a
sum, an all-gather; core/collectives/ordered.py [Note: ordered reduction]). Each case captures the temporary as the
collective is issued and checks, right after the wait, that its storage is 0 bytes while the result
is right. Freed only when its last reference goes, the captured tensor would keep its bytes and each
check fail deterministically. The same spawn checks where the ordered all-reduce's all-gather
halves go in a rank's sequence of collectives: after the step's last all-to-all, together.
"""
import time

import pytest
import torch
import torch.distributed as dist

import zerokit as zk
from common import (OddBlock, allocations_while, assert_callers_buffers_freed, callers_buffers_cases, odd_batch,
                    odd_model)
import zerokit.core.collectives.gather as gather_module
from zerokit.core.collectives.comm import Comm
from zerokit.core.grads.grad_reduce import GradReduction
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
    out["in_place"] = {}
    # 4-5. stages 1 and 2: the post-step all-gather is in place, no temporary at all (core/collectives/gather.py
    # [Note: in-place gathers]): each input is this rank's own row of its output
    for stage in (1, 2):
        engine = zk.shard(odd_model(), torch.optim.AdamW, stage=stage, lr=1e-2)
        pairs = []
        gather_many = engine.comm.all_gather_many

        def keeping_inputs(outputs, inputs, *args, **kwargs):
            pairs.extend(zip(outputs, inputs))
            return gather_many(outputs, inputs, *args, **kwargs)

        engine.comm.all_gather_many = keeping_inputs
        x, y = odd_batch(0, 3, rank, world_size)
        engine.backward(engine(x, y))
        engine.step()
        params = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
        everyone = [torch.empty_like(params) for _ in range(world_size)]
        dist.all_gather(everyone, params)
        out["in_place"][stage] = (all(torch.equal(everyone[0], p) for p in everyone),
                                  [i.data_ptr() == o.view(world_size, -1)[rank].data_ptr() for o, i in pairs])
    out["sequences"] = _all_reduce_sequences(rank, world_size)
    out["gathers"] = _gather_allocations(rank, world_size)
    out["arrived"] = _finishing_what_has_arrived(rank, world_size)
    out["callers"] = _callers_buffers(rank, world_size)
    out["packed"] = _packed_gathers(rank, world_size)
    return out


def _packed_gathers(rank, world_size):
    """core/collectives/gather.py [Note: gloo's all-gather temporary], several outputs in one group: packed into a staging
    buffer per dtype, a broadcast from each rank, copied out. Mixed dtypes, inputs that are the own rows of
    their outputs and inputs of their own. Returns (right rows, every allocation of at least a row's bytes
    while it ran, the staging buffers' sizes expected, bytes the staging holds after the wait)."""
    comm = Comm()
    sizes, dtypes = (700, 1500, 300, 200), (torch.float32, torch.bfloat16, torch.float32, torch.float16)
    expected = [torch.cat([(torch.arange(k, dtype=torch.float32) + 10 * r).to(dt) for r in range(world_size)])
                for k, dt in zip(sizes, dtypes)]
    outputs = [torch.full((world_size * k,), float("nan"), dtype=dt) for k, dt in zip(sizes, dtypes)]
    inputs = []
    for j, (out, k, dt) in enumerate(zip(outputs, sizes, dtypes)):
        mine = (torch.arange(k, dtype=torch.float32) + 10 * rank).to(dt)
        if j % 2 == 0:  # own row, in place
            out.view(world_size, -1)[rank].copy_(mine)
            mine = out.view(world_size, -1)[rank]
        inputs.append(mine)
    staged = []
    original = dist.broadcast

    def keeping(tensor, *args, **kwargs):
        staged.append(tensor)
        return original(tensor, *args, **kwargs)

    dist.broadcast = keeping
    try:
        seen = allocations_while(lambda: comm.all_gather_many(outputs, inputs, coalesce=True).wait())
    finally:
        dist.broadcast = original
    per_dtype = {}
    for k, dt in zip(sizes, dtypes):
        per_dtype[dt] = per_dtype.get(dt, 0) + world_size * k * torch.empty((), dtype=dt).element_size()
    right = all(torch.equal(o, e) for o, e in zip(outputs, expected))
    min_row = 200 * 2  # the smallest row, 200 fp16 elements (TORCH_DISTRIBUTED_DEBUG=DETAIL's checks allocate less)
    return (right, sorted(n for n, _ in seen if n >= min_row), sorted(per_dtype.values()),
            [t.untyped_storage().nbytes() for t in staged], len(staged))


def _callers_buffers(rank, world_size):
    return callers_buffers_cases(rank, world_size)  # tests/common.py


def _train_one_step(stage: int, rank: int, world_size: int, force_arrival: bool):
    """One step of the odd model at `stage` (small buckets: several reduce-scatters in backward); with
    `force_arrival`, each finish_arrived first waits until every queued reduce-scatter has completed, so that
    it finds them all arrived. Returns (the params after the step, each reduce-scatter's count of earlier
    receive buffers still holding bytes when it was issued)."""
    engine = zk.shard(odd_model(), torch.optim.AdamW, stage=stage, lr=1e-2, bucket_numel=64,
                      wrap=(OddBlock,) if stage == 3 else None, ordered_reduction=True)
    if force_arrival:
        in_flight, finish_arrived = engine.in_flight, engine.in_flight.finish_arrived

        def wait_then_finish():
            deadline = time.monotonic() + 10
            while not all(r.arrived() for r, _ in in_flight._queue) and time.monotonic() < deadline:
                time.sleep(0.001)
            finish_arrived()

        in_flight.finish_arrived = wait_then_finish
    received, alive = [], []
    original = dist.all_to_all_single

    def counting(output, *args, **kwargs):
        alive.append(sum(_nbytes(t) > 0 for t in received))
        received.append(output)
        return original(output, *args, **kwargs)

    dist.all_to_all_single = counting
    try:
        x, y = odd_batch(0, 3, rank, world_size)
        engine.backward(engine(x, y))
        engine.step()
    finally:
        dist.all_to_all_single = original
    return torch.cat([t.reshape(-1) for t in engine.state_dict(full=True).values()]), alive


def _finishing_what_has_arrived(rank, world_size):
    """core/collectives/comm.py [Note: finishing what has arrived], stages 1-3: (bitwise the same params as without
    forcing, the live-buffer counts)."""
    out = {}
    for stage in (1, 2, 3):
        forced, alive = _train_one_step(stage, rank, world_size, force_arrival=True)
        plain, _ = _train_one_step(stage, rank, world_size, force_arrival=False)
        out[stage] = (torch.equal(forced, plain), alive)
    return out


def _gather_allocations(rank, world_size):
    """core/collectives/gather.py [Note: gloo's all-gather temporary]: a gather that is not coalesced, or coalesced but
    larger than GLOO_COALESCE_NUMEL, allocates nothing on gloo, however it is called (one output, several, in
    place, any float dtype), and gathers the right rows."""
    comm = Comm()
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        shard = torch.arange(1000, dtype=torch.float32).to(dtype) + 1000 * rank
        expected = torch.cat([torch.arange(1000, dtype=torch.float32).to(dtype) + 1000 * r for r in range(world_size)])
        full = torch.empty(1000 * world_size, dtype=dtype)
        seen = allocations_while(lambda: comm.all_gather(full, shard, async_op=True).wait())
        in_place = torch.zeros(1000 * world_size, dtype=dtype)
        mine = in_place[rank * 1000:(rank + 1) * 1000]
        mine.copy_(shard)
        seen += allocations_while(lambda: comm.all_gather(in_place, mine))
        outputs = [torch.empty(world_size * k, dtype=dtype) for k in (700, 1500)]
        inputs = [torch.full((k,), float(rank), dtype=dtype) for k in (700, 1500)]
        seen += allocations_while(lambda: comm.all_gather_many(outputs, inputs, coalesce=False).wait())
        # coalesced, each output above the group limit: broadcasts too (the limit made small for the test)
        limit, gather_module.GLOO_COALESCE_NUMEL = gather_module.GLOO_COALESCE_NUMEL, 1000
        try:
            big = [torch.empty(world_size * k, dtype=dtype) for k in (700, 1500)]
            seen += allocations_while(lambda: comm.all_gather_many(big, inputs, coalesce=True).wait())
        finally:
            gather_module.GLOO_COALESCE_NUMEL = limit
        right = (torch.equal(full, expected) and torch.equal(in_place, expected)
                 and all(torch.equal(o, torch.arange(world_size, dtype=dtype).repeat_interleave(o.numel() // world_size))
                         for o in outputs + big))
        row_bytes = 700 * shard.element_size()  # the smallest row; TORCH_DISTRIBUTED_DEBUG=DETAIL's checks allocate less
        out[str(dtype)] = (right, [(n, op) for n, op in seen if n >= row_bytes])
    # stage 3's units in forward and backward, prefetching
    engine = zk.shard(odd_model(), torch.optim.AdamW, stage=3, wrap=(OddBlock,), lr=1e-2)
    x, y = odd_batch(0, 3, rank, world_size)
    engine.backward(engine(x, y))
    unit_bytes = min(flat.numel() * flat.element_size() for unit in engine.units for flat in unit.flat_data)
    seen = allocations_while(lambda: engine.backward(engine(x, y)))
    out["stage 3"] = (True, [(n, op) for n, op in seen if "gather" in op and n >= unit_bytes])
    return out


def _logging(calls: list):
    """Log this rank's all-to-alls, all-gathers and broadcasts ("a2a", "ag", "bc") of float tensors as
    torch.distributed sees them issued (not debug mode's int64 checks), with their outputs and sizes; returns a
    function that puts torch's back."""
    # torch before 2.13 names its all-gather into one tensor all_gather_into_tensor (core/collectives/gather.py)
    ag = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    originals = {name: getattr(dist, name) for name in ("all_to_all_single", ag, "broadcast")}

    def log(name, tag):
        def wrapper(*args, **kwargs):
            if args[0].is_floating_point():
                calls.append((tag, args[0], args[0].numel()))  # numel now: a lent alias is emptied after
            return originals[name](*args, **kwargs)
        return wrapper

    dist.all_to_all_single = log("all_to_all_single", "a2a")
    setattr(dist, ag, log(ag, "ag"))
    dist.broadcast = log("broadcast", "bc")
    return lambda: [setattr(dist, name, f) for name, f in originals.items()]


def _all_reduce_sequences(rank, world_size):
    """Where the all-gather halves of ordered all-reduces are issued, and what they give."""
    out = {}
    n, total = world_size, float(sum(range(1, world_size + 1)))
    # stage 0's backward: an all-reduce group's all-to-all as it is ready, every all-gather after the last one
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
    buckets = len(engine.groups)  # one all-reduce per group of buckets (core/grads/grad_reduce.py [Note: all-reduce groups])
    out["stage0"] = dict(buckets=buckets, tags=[tag for tag, _, _ in calls], in_backward=in_backward,
                         received=[_nbytes(t) for tag, t, _ in calls if tag == "a2a"])
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
            and norm.item() == n, calls=[(tag, numel) for tag, _, numel in calls])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_cases, WORLD_SIZE, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=120)


def test_temporaries_are_freed_when_their_collective_completes(results):
    for rank, out in enumerate(results):
        for case, (correct, nbytes) in ((c, v) for c, v in out.items()
                                        if c not in ("sequences", "gathers", "in_place", "arrived", "callers",
                                                     "packed")):
            assert correct, (rank, case)
            assert nbytes, (rank, case, "nothing captured")
            assert nbytes == [0] * len(nbytes), (rank, case, nbytes)


def test_a_completed_collective_holds_none_of_the_callers_bytes(results):
    """Stages 2 and 3 drop a full-size gradient once its reduce-scatter has completed; its bytes go then, on
    this thread, not when gloo's worker lets go of the Work (a clean-clone CI run once counted stage 3's root
    gradient alive at the step boundary). Left to the Work, 11 of the 16 cases fail here (2 or 3 references
    left: the Work keeps the input; in the others gloo's native reduce-scatter keeps no reference to it, or the
    worker has let go by then)."""
    assert_callers_buffers_freed(results)


def test_a_completed_reduce_scatter_frees_its_buffer_before_the_next_is_issued(results):
    """core/collectives/comm.py [Note: finishing what has arrived]: with every earlier reduce-scatter completed, none of
    their receive buffers is alive when the next is issued, at stages 1-3 (finished only at the end of backward,
    they would all be alive: this fails); the parameters after the step are bitwise those of a run where
    the finishes happen whenever they happen."""
    for rank, out in enumerate(results):
        assert sorted(out["arrived"]) == [1, 2, 3]
        for stage, (same_bits, alive) in out["arrived"].items():
            assert same_bits, (rank, stage)
            assert len(alive) > 2 and alive == [0] * len(alive), (rank, stage, alive)


def test_stages_1_and_2_gather_their_updated_shards_in_place(results):
    """The post-step all-gather's inputs are this rank's own rows of the flat buffers (no clone to free), and
    every rank ends the step with the same parameters. A cloned input fails it."""
    for rank, out in enumerate(results):
        assert sorted(out["in_place"]) == [1, 2]
        for stage, (same_params, own_rows) in out["in_place"].items():
            assert same_params, (rank, stage)
            assert own_rows and all(own_rows), (rank, stage, own_rows)


def test_the_all_gather_halves_of_stage0_go_out_together_after_the_last_all_to_all(results):
    """Stage 0 at 3 ranks: each all-reduce group's all-to-all in backward as the group fills, then the groups'
    all-gathers together, still in backward: on gloo one packed gather, a broadcast from each rank (core/collectives/gather.py
    [Note: gloo's all-gather temporary]); every receive buffer freed by then."""
    for rank, out in enumerate(results):
        seq = out["sequences"]["stage0"]
        buckets = seq["buckets"]
        assert buckets > 3, "the case must exercise several all-reduce groups"
        # the first all-gather after the all-to-alls; torch's coalescing may add its own calls, never an all-to-all
        assert seq["tags"][:buckets] == ["a2a"] * buckets, (rank, seq["tags"])
        assert seq["tags"][buckets:seq["in_backward"]] == ["bc"] * len(results), (rank, seq["tags"])
        assert seq["received"] == [0] * buckets, (rank, seq["received"])
        assert results[0]["sequences"]["stage0"]["tags"] == seq["tags"], "every rank issues the same sequence"


@pytest.mark.parametrize("debug", [False, True])
def test_another_collective_issues_the_waiting_all_gathers_first(results, debug):
    """Two ordered all-reduces in flight (their all-to-alls issued, no all-gather yet), then a scalar
    reduction: the halves go out before it; waited for in the other order, both are right."""
    for rank, out in enumerate(results):
        case = out["sequences"][("interleaved", debug)]
        n = len(results)
        # all-to-alls (N·3 and N·2 elements in), the halves' gathers packed (N broadcasts of 3 + 2 elements),
        # then the scalars' (N,) gather
        assert case["calls"] == [("a2a", 3 * n), ("a2a", 2 * n)] + [("bc", 5)] * n + [("ag", n)], (rank, case)
        assert case["right"], (rank, case)


def test_several_gathers_go_packed_with_one_staging_buffer_per_dtype(results):
    """Several outputs in one group on gloo: one (N, Σ m) staging buffer per dtype, nothing else of a row's size
    allocated (gloo's coalesced gather also concatenated the inputs and received into a buffer of its own), a
    broadcast from each rank per buffer, right rows (in place or not), and the staging freed by the wait."""
    for rank, out in enumerate(results):
        right, allocated, staging, after, broadcasts = out["packed"]
        assert right, rank
        assert allocated == staging, (rank, allocated, staging)  # fp32 (700 + 300), bf16, fp16 rows
        assert broadcasts == 3 * len(results), (rank, broadcasts)
        assert after == [0] * broadcasts, (rank, after)


def test_gathers_on_gloo_allocate_no_temporary(results):
    """An all-gather that is not coalesced goes out as broadcasts into the output's rows: no buffer of
    gloo's own (the output's size) while it runs, none from torch's wrapper; right rows at every dtype,
    in place or not. A gather that allocates a buffer of the output's size fails each case."""
    for rank, out in enumerate(results):
        for case, (right, allocated) in out["gathers"].items():
            assert right, (rank, case)
            assert allocated == [], (rank, case, allocated)
