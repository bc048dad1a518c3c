"""core/collectives/tree.py on its own: the binary-counter partial sums, the pairwise row sum, the exact norm.

No process group: the pieces are checked against the additions they claim to perform
(written out by hand here, in the tree's grouping) and against fp64 arithmetic.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerokit.core.collectives.tree import (PartialSums, exact_square_sum, is_power_of_two, norm_from_square_sum,
                               pairwise_sum_)


def _tree(leaves):
    """The perfect binary tree over `leaves` (a power-of-two count), written recursively."""
    if len(leaves) == 1:
        return leaves[0].clone()
    half = len(leaves) // 2
    return _tree(leaves[:half]) + _tree(leaves[half:])


def _leaves(n, numel=257, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Spread exponents widely, so that a different grouping of the additions would show in the bits.
    return [(torch.randn(numel, generator=g) * 10.0 ** torch.randint(-4, 5, (numel,), generator=g)).to(dtype)
            for _ in range(n)]


def test_is_power_of_two():
    assert [n for n in range(0, 20) if is_power_of_two(n)] == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("reuse", [True, False])
def test_partial_sums_add_the_leaves_as_a_perfect_binary_tree(k, reuse):
    leaves = _leaves(k)
    partials = PartialSums(torch.float32, "bucket 0")
    grad = torch.empty_like(leaves[0])
    for leaf in leaves[:-1]:
        grad.copy_(leaf)  # stages 0-1 refill one bucket (reuse=True); stages 2-3 hand over a fresh one
        partials.add(grad if reuse else leaf.clone(), reuse=reuse)
        if reuse:
            grad.zero_()
    total = partials.total(leaves[-1].clone())
    assert torch.equal(total, _tree(leaves))
    # ... and not the left-to-right sum (the default grouping), for k >= 4 with these values
    if k >= 4:
        linear = leaves[0].clone()
        for leaf in leaves[1:]:
            linear += leaf
        assert not torch.equal(total, linear)


def test_partial_sums_keep_one_partial_per_set_bit():
    partials = PartialSums(torch.float32, "bucket 0")
    alive = []
    for leaf in _leaves(7):
        partials.add(leaf.clone(), reuse=False)
        alive.append(len(partials.tensors()))
    assert alive == [bin(j).count("1") for j in range(1, 8)]  # 1, 1, 2, 1, 2, 2, 3


def test_partial_sums_cast_leaves_to_the_reduce_dtype_before_adding():
    leaves = _leaves(4, dtype=torch.bfloat16)
    partials = PartialSums(torch.float32, "bucket 0")
    for leaf in leaves[:-1]:
        partials.add(leaf, reuse=True)
    total = partials.total(leaves[-1])
    assert total.dtype == torch.float32
    assert torch.equal(total, _tree([leaf.float() for leaf in leaves]))


@pytest.mark.parametrize("k", [3, 5, 6])
def test_a_count_that_is_not_a_power_of_two_is_refused_and_forgotten(k):
    partials = PartialSums(torch.float32, "bucket 2 (blocks.1.*)")
    for leaf in _leaves(k)[:-1]:
        partials.add(leaf, reuse=False)
    with pytest.raises(ValueError, match=rf"bucket 2 \(blocks.1.\*\) had {k} backwards"):
        partials.total(torch.zeros(257))
    assert partials.count == 0 and partials.tensors() == []


def test_a_leaf_after_the_total_is_refused_until_clear():
    partials = PartialSums(torch.float32, "bucket 0")
    partials.total(torch.ones(4))
    with pytest.raises(RuntimeError, match="after the step's synced backward"):
        partials.add(torch.ones(4), reuse=False)
    partials.clear()
    assert torch.equal(partials.total(torch.ones(4)), torch.ones(4))


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_pairwise_sum_groups_rows_as_the_tree(n):
    leaves = _leaves(n, numel=64, seed=1)
    rows = torch.stack(leaves)
    assert torch.equal(pairwise_sum_(rows), _tree(leaves))


def test_pairwise_sum_refuses_a_row_count_that_is_not_a_power_of_two():
    with pytest.raises(AssertionError):
        pairwise_sum_(torch.zeros(3, 4))


# -- the exact sum of squares -------------------------------------------------------------------

def _norm(shards):
    return norm_from_square_sum(exact_square_sum(shards))


def _fp64_norm(values):
    return math.sqrt(sum(float(v) ** 2 for v in values))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-(2.0 ** 60), max_value=2.0 ** 60),
                min_size=1, max_size=200),
       st.randoms(use_true_random=False))
def test_the_norm_depends_only_on_the_multiset_of_values(values, rnd):
    """Any order, any cut into shards (a rank's range moves with W): the same bits."""
    x = torch.tensor(values, dtype=torch.float32)
    reference = _norm([x])
    perm = list(range(len(values)))
    rnd.shuffle(perm)
    y = x[torch.tensor(perm)]
    cuts = sorted(rnd.sample(range(len(values) + 1), k=min(3, len(values) + 1)))
    shards = [y[a:b] for a, b in zip([0] + cuts, cuts + [len(values)])]
    assert torch.equal(_norm(shards), reference)
    # bins of separate "ranks" add as integers
    assert torch.equal(norm_from_square_sum(sum(exact_square_sum([s]) for s in shards)), reference)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-(2.0 ** 60), max_value=2.0 ** 60),
                min_size=1, max_size=200))
def test_the_norm_is_the_correctly_rounded_fp64_norm(values):
    """Exact sum, then float64 (one rounding), sqrt, fp32: within one fp32 ulp of an fp64 reference."""
    got = float(_norm([torch.tensor(values, dtype=torch.float32)]))
    want = _fp64_norm(torch.tensor(values, dtype=torch.float32).tolist())
    assert got == pytest.approx(want, rel=2 ** -23, abs=1e-45)


def test_the_norm_covers_subnormals_and_the_largest_floats():
    tiny = torch.tensor([2.0 ** -149, -(2.0 ** -149), 2.0 ** -130], dtype=torch.float32)
    assert float(_norm([tiny])) == pytest.approx(_fp64_norm(tiny.tolist()), rel=2 ** -23)
    big = torch.tensor([3.0e38, -3.0e38], dtype=torch.float32)
    assert float(_norm([big])) == math.inf  # sqrt(2) * 3e38 overflows fp32, as torch's norm would
    assert float(_norm([torch.tensor([1.0e38])])) == pytest.approx(1.0e38, rel=2 ** -23)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_norm_reads_low_precision_values_exactly(dtype):
    x = _leaves(1, numel=1000, dtype=dtype, seed=3)[0]
    x = torch.where(x.float().isfinite(), x, torch.zeros_like(x))
    assert float(_norm([x])) == pytest.approx(_fp64_norm(x.float().tolist()), rel=2 ** -23)


def test_nan_and_inf_are_reported_as_such():
    assert math.isnan(float(_norm([torch.tensor([1.0, float("nan"), float("inf")])])))
    assert float(_norm([torch.tensor([1.0]), torch.tensor([float("-inf")])])) == math.inf
    assert float(_norm([])) == 0.0
    assert float(_norm([torch.zeros(5)])) == 0.0
