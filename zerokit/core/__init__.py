"""Shared machinery, by concern; stages import from here and nothing here imports a stage.

collectives/  the process group and every collective (Comm, hybrid groups, ordered and tree reductions)
params/       parameter layout: flat params, shards, buckets, stage-3 units, model checks, meta init
grads/        gradient reduction, autograd hooks, what `param.grad` shows user code
accounting/   memory and communication: the formulas (estimate) and the measured ledger
nest.py, precision.py, config.py   the options every layer reads; engine.py, preemption.py on top

Imports go downward only: collectives, then nest/precision/config, then params, then grads and
accounting, then the engine (docs/design.md "Layout"; tests/unit/test_layering.py keeps it true).
"""
