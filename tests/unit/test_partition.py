"""Pure index math: flatten -> pad -> shard -> gather -> unflatten, and bucket plans."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerokit.core.params.bucketing import plan_all_reduce_groups, plan_buckets
from zerokit.core.params.partition import FlatLayout, padded_numel, shard_range

shapes = st.lists(st.lists(st.integers(0, 12), min_size=0, max_size=3).map(tuple), min_size=1, max_size=8)


@given(numel=st.integers(0, 10_000), world_size=st.integers(1, 8))
def test_padding_is_the_smallest_multiple_of_world_size(numel, world_size):
    """Padded size is a positive multiple of N, at least numel, and pads by less than N (one row when empty)."""
    padded = padded_numel(numel, world_size)
    assert padded % world_size == 0 and padded >= numel
    assert padded - numel < world_size or numel == 0
    shards = [shard_range(padded, world_size, r) for r in range(world_size)]
    assert len({hi - lo for lo, hi in shards}) == 1, "shards are equal-sized"
    assert shards[0][0] == 0 and shards[-1][1] == padded
    assert all(a[1] == b[0] for a, b in zip(shards, shards[1:])), "shards tile the buffer"


@settings(deadline=None, max_examples=60)
@given(shapes=shapes, world_size=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_flatten_shard_gather_unflatten_round_trips_exactly(shapes, world_size, seed):
    """Every element survives flatten -> pad -> shard -> gather -> unflatten bit for bit; padding stays zero."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(s, generator=g) for s in shapes]
    layout = FlatLayout.build(shapes, world_size)
    flat = torch.zeros(layout.padded_numel)
    for t, o in zip(tensors, layout.offsets):
        flat[o:o + t.numel()] = t.flatten()
    shards = [flat[lo:hi].clone() for lo, hi in (layout.shard_range(r) for r in range(world_size))]
    gathered = torch.cat(shards)
    assert gathered.numel() == layout.padded_numel
    assert torch.count_nonzero(gathered[layout.numel:]) == 0
    for t, o, s in zip(tensors, layout.offsets, layout.shapes):
        assert torch.equal(gathered[o:o + math.prod(s)].view(s), t)
    # pieces: each rank's view of each parameter covers every element exactly once
    covered = [torch.zeros(t.numel(), dtype=torch.int32) for t in tensors]
    for r in range(world_size):
        for piece in layout.pieces(r):
            covered[piece.index][piece.start:piece.end] += 1
            assert torch.equal(shards[r][piece.shard_offset:piece.shard_offset + piece.numel],
                               tensors[piece.index].flatten()[piece.start:piece.end])
    assert all(bool((c == 1).all()) for c in covered)


@given(numels=st.lists(st.integers(0, 500), min_size=0, max_size=40), cap=st.integers(1, 800))
def test_bucket_plan_covers_every_parameter_once_in_reverse_order(numels, cap):
    """Buckets are contiguous runs, filled from the last parameter backwards, each within the cap unless one param."""
    buckets = plan_buckets(numels, cap)
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(numels)))
    for b in buckets:
        assert b == list(range(b[0], b[-1] + 1)), "a bucket is a contiguous run"
        assert len(b) == 1 or sum(numels[i] for i in b) <= cap
    assert [b[-1] for b in buckets] == sorted((b[-1] for b in buckets), reverse=True), "last params first"


@given(numels=st.lists(st.integers(0, 500), min_size=0, max_size=40), cap=st.integers(1, 800))
def test_bucket_plan_closing_when_full_follows_ddps_rule(numels, cap):
    """Stage 1's plan (close_when_full): contiguous runs from the last parameter backwards covering every index once;
    every bucket but the one holding parameter 0 reaches the cap, and without its earliest parameter each would be
    below it; without empty parameters the capped plan never makes fewer buckets (a 0-element parameter after a
    full bucket opens a new one under DDP's rule, where the capped plan adds it to the bucket before)."""
    buckets = plan_buckets(numels, cap, close_when_full=True)
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(numels)))
    for b in buckets:
        assert b == list(range(b[0], b[-1] + 1)), "a bucket is a contiguous run"
        assert sum(numels[i] for i in b[1:]) < cap, "it closed as soon as it reached the cap"
        if b[0] != 0:
            assert sum(numels[i] for i in b) >= cap, "only the last bucket may be below the cap"
    assert [b[-1] for b in buckets] == sorted((b[-1] for b in buckets), reverse=True), "last params first"
    if 0 not in numels:
        assert len(buckets) <= len(plan_buckets(numels, cap))


@given(numels=st.lists(st.integers(0, 500), min_size=0, max_size=40), cap=st.integers(1, 800),
       keys=st.lists(st.sampled_from("ab"), min_size=40, max_size=40))
def test_all_reduce_groups_close_once_they_reach_the_cap(numels, cap, keys):
    """Stage 0's all-reduce groups: contiguous runs in order covering every bucket once, one key each; a group
    closes once it holds `cap` elements (DDP's rule), so only the last of a key run is below it, and no group
    is larger than it needs to be (without its last bucket it would be below the cap)."""
    keys = keys[:len(numels)]
    groups = plan_all_reduce_groups(numels, keys, cap)
    assert [i for g in groups for i in g] == list(range(len(numels))), "contiguous runs, in order, each once"
    for k, g in enumerate(groups):
        total = sum(numels[i] for i in g)
        assert len({keys[i] for i in g}) == 1, "dtypes never mix"
        assert sum(numels[i] for i in g[:-1]) < cap, "no bucket is added after the group reached the cap"
        last_of_run = k == len(groups) - 1 or keys[groups[k + 1][0]] != keys[g[-1]]
        assert total >= cap or last_of_run, (groups, numels, cap)


def test_stage0_all_reduces_the_small_gpts_buckets_in_groups():
    """The case that motivated the groups (core/grads/grad_reduce.py [Note: all-reduce groups]): the small GPT at 65,536 elements
    with the no-decay split has 10 buckets, which stage 0 all-reduces as 5 groups; each bucket's gradient is a view
    into its group's buffer, back to back in bucket order (tests/distributed/test_stage0.py counts the collectives)."""
    import torch
    import zerokit as zk
    from zerokit.bench import no_decay as _no_decay
    from zerokit.models import build_model

    model = build_model("small", seed=0)
    engine = zk.shard(model, torch.optim.AdamW, stage=0, lr=1e-3, bucket_numel=65536, param_groups=_no_decay)
    assert len(engine.trainable) == 10 and [len(g.members) for g in engine.groups] == [2, 2, 2, 2, 2]
    assert all(sum(fp.padded_numel for fp in g.members) >= 65536 for g in engine.groups[:-1])
    for g in engine.groups:
        ptr, size = g.flat_grad.untyped_storage().data_ptr(), g.flat_grad.element_size()
        assert [engine.flat_grads[fp.index].data_ptr() for fp in g.members] == [
            ptr + g.offsets[fp.index] * size for fp in g.members]
        assert list(g.offsets.values()) == [sum(fp.padded_numel for fp in g.members[:j]) for j in range(len(g.members))]
    assert engine.groups[-1].label.startswith("buckets 8, 9 (")


def test_zero_size_and_one_element_parameters_get_a_place():
    """A (0,)-shaped and a 1-element parameter still get offsets; an all-empty buffer pads to one row per rank."""
    layout = FlatLayout.build([(0,), (1,), (7, 15)], 4)
    assert layout.offsets == (0, 0, 1) and layout.numel == 106 and layout.padded_numel == 108
    assert FlatLayout.build([(0,)], 3).padded_numel == 3


def test_a_bucket_spanning_the_model_does_not_hold_back_the_others():
    """With param_groups, the no-decay biases and LayerNorms of every block share one small bucket. Stages 0-2
    release buckets in index order, so that bucket must come after every bucket that completes before it:
    each bucket's collective is issued during backward, as soon as it and the ones before it are complete
    (first, it would make every collective wait for the end of backward)."""
    import torch
    import zerokit as zk
    from zerokit.models import build_model
    from common import fixed_corpus

    def no_decay(name, p):
        return {"weight_decay": 0.0} if p.dim() < 2 else {}

    model = build_model("tiny", seed=0)
    engine = zk.shard(model, torch.optim.AdamW, stage=0, lr=1e-3, bucket_numel=4096, param_groups=no_decay)
    spans = [fp for fp in engine.flat_params if len({n[0].split(".")[1] for n in fp.names if n[0].startswith("blocks.")}) > 1]
    assert spans, "the no-decay bucket spans every block"
    events = []
    first_block = [p for n, p in model.named_parameters() if n.startswith("blocks.0.")]
    for p in first_block:  # blocks.0's gradients arrive last but for the embeddings'
        p.register_post_accumulate_grad_hook(lambda p: events.append("blocks.0 grad"))
    release = engine.tracker.on_grads_ready
    engine.tracker.on_grads_ready = lambda fp: (events.append(f"release {fp.index}"), release(fp))
    x, y = fixed_corpus().batch(2, model.cfg.block_size, 0)
    engine.backward(engine(x, y)[1])
    released_before_block0 = [e for e in events[:events.index("blocks.0 grad")] if e.startswith("release")]
    decay_buckets = [fp for fp in engine.flat_params if fp not in spans and fp.names[0][0].startswith("blocks.")
                     and not fp.names[0][0].startswith("blocks.0.")]
    assert len(released_before_block0) >= len(decay_buckets) >= 1, events


@pytest.mark.parametrize("stage", [2, 3])
def test_freed_gradient_buffers_are_really_freed(stage):
    """Stages 2-3 drop each full-size gradient buffer once its reduce-scatter is done: nothing of zerokit's may keep
    it alive (a cache of `.grad` views once did, invisibly to engine.memory(), which counts what a stage lists)."""
    import gc
    import weakref

    import torch
    import zerokit as zk
    from zerokit.models import Block, build_model
    from common import fixed_corpus

    model = build_model("tiny", seed=0)
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, lr=1e-3, bucket_numel=4096, wrap=(Block,))
    x, y = fixed_corpus().batch(2, model.cfg.block_size, 0)
    for _ in range(2):
        refs = []
        hooks = [p.register_post_accumulate_grad_hook(
            lambda p: refs.append(weakref.ref(p.grad._base if p.grad._base is not None else p.grad)))
            for p in model.parameters()]
        engine.backward(engine(x, y)[1])
        engine.step()
        engine.zero_grad()
        for h in hooks:
            h.remove()
        gc.collect()
        assert refs and all(r() is None for r in refs), sum(r() is not None for r in refs)


@given(st.lists(st.integers(1, 50), min_size=0, max_size=30), st.integers(0, 120))
def test_gloo_gathers_coalesce_in_consecutive_groups_under_the_limit(numels, limit):
    """core/collectives/gather.py [Note: gloo's all-gather temporary]: every output in exactly one group, in order; a group of
    two or more holds at most `limit` elements; a group closes only when the next output would not fit."""
    from zerokit.core.collectives.gather import coalesce_groups

    groups = coalesce_groups(numels, limit)
    assert [i for g in groups for i in g] == list(range(len(numels)))
    for g, nxt in zip(groups, groups[1:] + [None]):
        total = sum(numels[i] for i in g)
        assert len(g) == 1 or total <= limit
        if nxt is not None:
            assert total + numels[nxt[0]] > limit
