"""Pure index math for flat, padded, sharded buffers. No process group, no tensors.

A *flat buffer* concatenates some parameters (in registration order) into one 1-D
range and pads it with zeros to a multiple of the world size N, so it splits into N
equal shards:

    flat:   | p0 ........ | p1 .. | p2 ....... | pad |      (padded_numel,)
    shards: |  rank 0    |   rank 1   |   rank 2     |      (padded_numel // N,) each

Rank r owns elements [r * shard_numel, (r + 1) * shard_numel). A parameter may straddle
a shard boundary; `FlatLayout.pieces(rank)` says which part of which parameter a rank
owns. Padding is always < N elements and always zero, so it never changes a norm,
a checkpoint or a loss.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest positive multiple of `world_size` that is >= numel.

    An empty buffer still gets one element per rank, so every rank has a shard and
    every collective has a non-empty, equal-sized input.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return max(1, math.ceil(numel / world_size)) * world_size


def shard_range(padded: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of `rank`'s shard in a flat buffer of `padded` elements."""
    assert padded % world_size == 0, f"{padded} is not a multiple of {world_size}"
    assert 0 <= rank < world_size, f"rank {rank} not in [0, {world_size})"
    size = padded // world_size
    return rank * size, (rank + 1) * size


@dataclass(frozen=True)
class Piece:
    """Part of parameter `index` owned by a rank: param elements [start, end) sit at shard offset `shard_offset`."""

    index: int
    start: int
    end: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter sits in one flat buffer, for one world size."""

    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # start of each parameter in the flat buffer
    numel: int  # sum of parameter numels (no padding)
    padded_numel: int  # numel rounded up to a multiple of world_size
    world_size: int

    @classmethod
    def build(cls, shapes: list[tuple[int, ...]] | tuple, world_size: int) -> "FlatLayout":
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += math.prod(shape)
        return cls(shapes, tuple(offsets), total, padded_numel(total, world_size), world_size)

    @functools.cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        return shard_range(self.padded_numel, self.world_size, rank)

    def pieces(self, rank: int) -> list[Piece]:
        """The parts of parameters that fall in `rank`'s shard, in flat order."""
        lo, hi = self.shard_range(rank)
        out = []
        for i, (offset, n) in enumerate(zip(self.offsets, self.numels)):
            start, end = max(lo, offset), min(hi, offset + n)
            if start < end:
                out.append(Piece(i, start - offset, end - offset, start - lo))
        return out
