r"""`reduction="tree"`: gradient bits that do not depend on the world size.

[Note: world-size-independent bits]
A step's gradient is the sum of M micro-batch gradients g_0 ... g_{M-1} (each from a loss
already divided by the micro-batch count). Floating-point addition is not associative, so
the bits of that sum depend on how the additions are grouped, and the default grouping
depends on the world size W: a rank adds its k = M / W micro-batches one after another
(autograd accumulating into `.grad`), then the ranks' sums are added in rank order. One
process with M = 4 computes ((g0 + g1) + g2) + g3; four ranks compute the same four terms
grouped by rank, and two ranks compute (g0 + g1) + (g2 + g3). Three different numbers.

`reduction="tree"` fixes one grouping for every W: the perfect binary tree over the M
micro-batches in order. Rank r holds micro-batches r·k ... (r+1)·k - 1, a contiguous run
of leaves, so its local sum is a whole subtree and the cross-rank sum is the tree's upper
levels. For M = 4:

    W = 1:  rank 0 sums the whole tree     W = 2: each rank a pair     W = 4: each rank a leaf

              (g0+g1)+(g2+g3)                  (g0+g1)+(g2+g3)             (g0+g1)+(g2+g3)
             /               \                /    ranks    \             /    ranks    \
         g0+g1               g2+g3        g0+g1             g2+g3     g0+g1             g2+g3
        /     \             /     \       rank 0            rank 1    ranks            ranks
      g0      g1          g2      g3     /     \           /     \    /   \            /   \
      ----------- rank 0 ----------      g0    g1         g2     g3   g0  g1           g2  g3
                                                                      r0  r1           r2  r3

Every addition in the three pictures adds the same two numbers, so the results are the
same bits. Two pieces make it so:

* locally, `PartialSums` adds a rank's micro-batch gradients as a binary counter: after the
  j-th micro-batch it holds one partial sum per set bit of j, each the sum of an aligned
  run of 2^level leaves, and a new leaf carries upward like a binary increment. After k
  (a power of two) leaves one partial remains: the subtree. At most log2(k) partials are
  alive at once (`engine.memory()["tree_partials"]`);
* across ranks, the reduction's local sum (core/collectives/ordered.py [Note: ordered reduction] already
  receives every rank's contribution to its range) adds them pairwise, `pairwise_sum_`:
  (r0 + r1) + (r2 + r3) instead of ((r0 + r1) + r2) + r3.

The scalings are exact: the user divides the loss by k, the engine the gradient by W, and
a power of two moves only the exponent (away from overflow and subnormals), so
g/4 + g'/4 == (g + g')/4 bit for bit, and the gradient of loss/4 is the gradient of loss
divided by 4. Hence the power-of-two requirement on W and on k. The leaves are cast to the
reduce dtype before the first addition, so every level of the tree adds in one dtype.

The norm for clipping must not depend on W either, but each rank sums squares over its own
range, and ranges move with W. `exact_square_sum` removes the question of order entirely:
a float x = m·2^e has an integer mantissa of at most 24 bits, so x² = m²·2^(2e-48) with an
integer m² < 2^48. Those integers are added exactly, in int64, in one bin per exponent
(split into 24-bit halves so no bin overflows); ranks add their bins (integers: any order
gives the same total); the exact total becomes one float at the end. The norm is then a
function of the multiset of gradient values alone, at any W and any layout.

What it costs: log2(k) full-size partial sums per bucket during accumulation, one extra
pass over the gradient per micro-batch (the add), and the integer norm (a few passes over
the gradient instead of one dot product). Measured in benchmarks/investigations/tree_cost.py.
"""
from __future__ import annotations

import math

import torch

__all__ = ["REDUCTIONS", "PartialSums", "pairwise_sum_", "exact_square_sum", "norm_from_square_sum",
           "is_power_of_two"]

REDUCTIONS = ("linear", "tree")  # zk.shard(reduction=...): the default grouping, or the fixed binary tree


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


class PartialSums:
    """One bucket's micro-batch gradients on this rank, summed pairwise (a binary counter).

    `add(grad)` after each `no_sync()` backward, `total(grad)` after the synced one: it adds
    the last leaf and returns the subtree's sum (the bucket itself when k = 1).
    """

    def __init__(self, dtype: torch.dtype, label: str):
        self.dtype = dtype  # the reduce dtype: every level of the tree adds in it
        self.label = label  # the bucket in words, for errors
        self.levels: list[torch.Tensor | None] = []  # levels[l]: the sum of 2^l leaves, or None
        self.count = 0  # leaves added since clear()
        self.sent = False  # total() was taken: the step's one synced backward has run

    def add(self, grad: torch.Tensor, reuse: bool) -> None:
        """Add one micro-batch's gradient (padded_numel,). `reuse`: the caller zeroes and refills `grad`
        (stages 0-1), so it is copied if kept; otherwise (stages 2-3) it may be kept as it is."""
        carry = self._push(grad, own=not reuse)
        if carry is grad and reuse:
            carry = grad.clone()  # (padded_numel,) reduce dtype: a new partial
        self._store(carry)

    def total(self, grad: torch.Tensor) -> torch.Tensor:
        """Add the last micro-batch's gradient; return this rank's sum over its k micro-batches.

        The sum is formed in `grad` itself (when it is in the reduce dtype), so the stage reduces
        its own gradient buffer as it does without the tree.
        """
        carry = self._push(grad, own=True)
        if not is_power_of_two(self.count) or any(t is not None for t in self.levels):
            count, self.levels, self.count = self.count, [], 0
            raise ValueError(
                f"reduction='tree' sums a power-of-two number of micro-batches per rank, but {self.label} had "
                f"{count} backwards ({count - 1} inside no_sync() and this synced one) since zero_grad(): use "
                "1, 2, 4, 8, ... micro-batches per step")
        self.sent, self.count = True, 0
        return carry

    def _push(self, grad: torch.Tensor, own: bool) -> torch.Tensor:
        """Carry one leaf up the counter. `own`: the sums may be formed in `grad` (a + b == b + a, bit for bit)."""
        if self.sent:
            raise RuntimeError(
                f"reduction='tree': a backward after the step's synced backward, for {self.label}. A step is "
                "k - 1 backwards inside engine.no_sync() and one synced backward; call engine.step() and "
                "engine.zero_grad() (or model.zero_grad()) before the next micro-batch")
        self.count += 1
        carry = grad if grad.dtype == self.dtype else grad.to(self.dtype)  # a leaf, in the reduce dtype
        level = 0
        while level < len(self.levels) and self.levels[level] is not None:
            partial = self.levels[level]
            if own:
                carry.add_(partial)  # the later run of 2^level leaves + the earlier one, in the carry's buffer
            else:
                carry = partial.add_(carry)  # the same sum (a + b == b + a), in the partial's buffer
            self.levels[level] = None
            level += 1
        return carry

    def _store(self, carry: torch.Tensor) -> None:
        level = int(math.log2(self.count & -self.count))  # the lowest set bit of count: the run carry sums
        while len(self.levels) <= level:
            self.levels.append(None)
        self.levels[level] = carry

    def tensors(self) -> list[torch.Tensor]:
        """The partial sums alive (for engine.memory())."""
        return [t for t in self.levels if t is not None]

    def clear(self) -> None:
        self.levels, self.count, self.sent = [], 0, False


def pairwise_sum_(rows: torch.Tensor) -> torch.Tensor:
    """Sum the rows of `rows` (n, m), n a power of two, as a binary tree: (r0 + r1) + (r2 + r3) ...

    Works in place (rows' contents are destroyed); returns the (m,) sum, a view of row 0.
    """
    n = rows.shape[0]
    assert is_power_of_two(n), n
    while n > 1:
        rows[0:n:2].add_(rows[1:n:2])  # level by level: each pair's left member becomes the pair's sum
        rows, n = rows[0:n:2], n // 2
    return rows[0]


_EXP_MIN, _EXP_MAX = -148, 128  # torch.frexp exponents of finite float32 values (subnormals included)
_BINS = _EXP_MAX - _EXP_MIN + 1
_LOW = (1 << 24) - 1
_CHUNK = 1 << 18  # elements at a time: the int64 temporaries stay a few MiB


def exact_square_sum(shards: list[torch.Tensor]) -> torch.Tensor:
    """Σ x² over every element of `shards`, exactly, as integer bins: (2 * bins + 2,) int64.

    Row layout: [high 24 bits of Σ m² per exponent | low 24 bits per exponent | #nan | #inf],
    where x = m · 2^(e-24) with an integer |m| < 2^24 (`torch.frexp`). Bins of several ranks
    add as integers (exact in any order); `norm_from_square_sum` turns them into the norm.
    Values are read as float32: fp32, bf16 and fp16 all convert to it exactly.
    """
    device = shards[0].device if shards else torch.device("cpu")
    bins = torch.zeros(2 * _BINS + 2, dtype=torch.int64, device=device)
    high, low = bins[:_BINS], bins[_BINS:2 * _BINS]
    for g in shards:
        for chunk in g.split(_CHUNK):
            x = chunk.float()
            finite = torch.isfinite(x)
            if not bool(finite.all()):
                bins[-2] += int(torch.isnan(x).sum())
                bins[-1] += int(torch.isinf(x).sum())
                x = torch.where(finite, x, 0.0)
            mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, |mantissa| in [0.5, 1) or 0
            m = (mantissa * (1 << 24)).to(torch.int64)  # exact: at most 24 significant bits
            square = m * m  # < 2**48: exact in int64
            index = exponent.to(torch.int64) - _EXP_MIN  # zeros have exponent 0 and square 0: harmless
            high.index_add_(0, index, square >> 24)  # each < 2**24: 2**39 of them fit in a bin
            low.index_add_(0, index, square & _LOW)
    return bins


def norm_from_square_sum(bins: torch.Tensor) -> torch.Tensor:
    """The L2 norm (0-dim fp32) from `exact_square_sum` bins (summed over ranks): one rounding of the exact sum."""
    values = bins.tolist()
    nans, infs = values[-2], values[-1]
    if nans:
        return torch.tensor(float("nan"))
    if infs:
        return torch.tensor(float("inf"))
    total = 0  # Σ over exponents of (Σ m²) · 2^(2·index): a Python int, exact
    for index in range(_BINS - 1, -1, -1):
        total = (total << 2) + (values[index] << 24) + values[_BINS + index]
    # x² = m² · 2^(2e - 48) and e = index + _EXP_MIN: scale the integer once, then one rounding each
    # for float(), sqrt and the cast to fp32 — a deterministic function of the exact sum.
    squared = math.ldexp(float(total), 2 * _EXP_MIN - 48) if total < (1 << 1000) else math.inf
    return torch.tensor(math.sqrt(squared), dtype=torch.float64).float()
