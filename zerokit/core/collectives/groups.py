"""Shard groups: how many ranks one shard group spans (hybrid sharding), checked without torch.

`resolve_shard_group_size` is pure arithmetic on the group size S and the world size N, shared by
the collectives that build the groups (core/collectives/hybrid.py) and the torch-free memory formulas
(core/accounting/estimate.py), which both import it from here.
"""
from __future__ import annotations

from numbers import Integral


def resolve_shard_group_size(shard_group_size: int | None, world_size: int) -> int:
    """S, the ranks one shard group spans: `shard_group_size`, or world_size when it is None (flat sharding).

    Shard groups tile the world, so S must be an int >= 1 dividing world_size; anything else is a
    ValueError naming both numbers and the divisors to choose from. core/collectives/hybrid.py checks it when it
    builds the groups, core/accounting/estimate.py in its formulas (which stay free of torch: so does this module).
    """
    if shard_group_size is None:
        return world_size
    if isinstance(shard_group_size, bool) or not isinstance(shard_group_size, Integral) or shard_group_size < 1:
        raise ValueError(f"shard_group_size must be an int >= 1 (or None: the world size), got {shard_group_size!r}")
    if world_size % shard_group_size:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise ValueError(f"shard_group_size={shard_group_size} does not divide world_size={world_size}: shard groups "
                         f"tile the world, so pick a divisor of {world_size} ({divisors}), usually the GPUs per node")
    return int(shard_group_size)
