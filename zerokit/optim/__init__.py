"""The sharded optimizer over flat fp32 master shards."""
from zerokit.optim.sharded import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
