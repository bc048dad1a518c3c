"""Collectives: the process group and everything that moves tensors between ranks.

`comm.py` (`Comm`, the one object a stage talks to), `hybrid.py` (shard groups x replica groups),
`ordered.py` (rank-ordered reductions), `tree.py` (pairwise sums with world-size-independent bits),
`gather.py` (all-gather and storage helpers), `recorder.py` (the collective recorder), `groups.py`
(the shard group size, torch-free). The lowest layer of core/: it imports nothing else of zerokit.
"""
