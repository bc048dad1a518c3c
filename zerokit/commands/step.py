"""One optimizer step of a zerokit engine: the loop body that train, compare, the benchmarks and the tests share.

    for step in range(steps):
        batches = [corpus.batch(...) for micro in range(accumulate)]
        result = train_step(engine, batches, lambda batch: engine(*batch)[1], clip=1.0)
        losses.append(float(result.loss))

In order:

1. `engine.zero_grad()`: the step starts from cleared gradients, so that when it returns its
   gradients are still there to be measured (`engine.memory()`, core/accounting/ledger.py `ledger`).
2. For each of the n micro-batches, `loss = loss_fn(batch)` and `engine.backward(loss / n)`
   (divided only when n > 1): the first n - 1 inside `engine.no_sync()`, which accumulates
   without communicating (how each stage does it: `zk.shard(accumulate=...)`), the last one
   synced.
3. `engine.clip_grad_norm_(clip)` unless `clip` is None.
4. `engine.step()`: False when fp16's loss scaler skipped the step (an inf or NaN gradient).

Loops that do something between these calls (inspect gradients after backward, poison a
shard, hold saved-tensor hooks) and those that test users' own idioms (`loss.backward()`,
`model.zero_grad()`, torch's clip) write the calls out themselves.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch


class StepResult(NamedTuple):
    loss: torch.Tensor  # the last micro-batch's loss, detached: neither divided by n nor loss-scaled
    stepped: bool  # False when fp16's loss scaler skipped the step
    grad_norm: torch.Tensor | None  # what clip_grad_norm_ returned (the norm before clipping); None without clip


def train_step(engine: Any, micro_batches: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor],
               clip: float | None = None) -> StepResult:
    """zero_grad, forward and backward of every micro-batch (all but the last under no_sync), clip, step."""
    n = len(micro_batches)
    if n < 1:
        raise ValueError("train_step needs at least one micro-batch")
    engine.zero_grad()
    for i, batch in enumerate(micro_batches):
        if i < n - 1:
            with engine.no_sync():  # accumulate locally; communicate on the last micro-batch
                loss = loss_fn(batch)
                engine.backward(loss / n)
        else:
            loss = loss_fn(batch)
            engine.backward(loss / n if n > 1 else loss)
    grad_norm = engine.clip_grad_norm_(clip) if clip is not None else None
    stepped = engine.step()  # a bool from every stage
    return StepResult(loss.detach(), stepped, grad_norm)
