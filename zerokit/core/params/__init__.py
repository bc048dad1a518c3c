"""Parameter layout: how a model's parameters become flat buffers, shards and stage-3 units.

`partition.py` (shard ranges), `bucketing.py` (which parameters share a flat buffer), `flat_param.py`
(`FlatParamLayout`), `unit.py` and `prefetch.py` (stage 3's units and their gather order),
`sharded_tensors.py` (`ShardedGrad`, the sharded parameter class: the tensors that refuse misuse),
`model_guard.py` (checks on the user's model), `materialize.py` and `deferred.py` (meta-device and
deferred initialisation). Imports core/collectives and core/'s nest, precision and config only.
"""
