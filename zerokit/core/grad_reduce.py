"""The one recipe by which every stage turns a gradient buffer into a collective's input.

[Note: reduce dtype]
Gradients come out of backward in the param dtype, because that is what autograd
accumulates into (a flat bucket at stages 0-2, a unit's unsharded gradient at stage 3).
`PrecisionPolicy.reduce_dtype` says in which dtype they are summed across ranks. When it
equals the param dtype, the buffer itself is scaled by 1/N in place and handed to the
collective, as before. When it differs (say bf16 params, fp32 reductions), the buffer is
copied into a new reduce-dtype buffer first and the 1/N pre-division happens *after* that
cast, in the reduce dtype, so no low-precision rounding sits between the local gradient
and the sum. The sum runs in the reduce dtype (communication bytes scale with its element
size: 2x for fp32 reductions of bf16 gradients), and its result, the grad shard, stays in
the reduce dtype, so the optimizer forms its fp32 master gradient from it without a second
rounding.

Every stage calls `grad_reduce_input` and nothing else for this, which is what keeps the
stages bitwise equal to each other under any reduce dtype: cast and scale are elementwise,
and the rank-ordered reduction (core/comm.py [Note: ordered reduction]) makes the sum of an
element independent of the buffer it sits in.

The returned buffer is the caller's to keep alive until its collective has completed (and,
at stage 0, until the optimizer has read it); stages report it through
`comm_buffer_tensors()` so the measured ledger (core/memory.py) attributes its bytes.
"""
from __future__ import annotations

import torch

__all__ = ["grad_reduce_input", "needs_reduce_buffer"]


def needs_reduce_buffer(param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> bool:
    """True when gradients are reduced in a dtype other than the one autograd accumulates in."""
    return param_dtype != reduce_dtype


def grad_reduce_input(grad: torch.Tensor, world_size: int, reduce_dtype: torch.dtype) -> torch.Tensor:
    """The tensor to hand a gradient reduction: `grad` cast to `reduce_dtype`, then divided by N.

    Same dtype: `grad` itself, scaled in place (no extra memory). Different dtype: a new
    buffer of `grad`'s shape in `reduce_dtype` ((padded_numel,) for a flat bucket), scaled
    after the cast; `grad` is left untouched. See [Note: reduce dtype].
    """
    if grad.dtype == reduce_dtype:
        return grad.mul_(1.0 / world_size)  # pre-divide, as torch DDP does
    send = torch.empty(grad.shape, dtype=reduce_dtype, device=grad.device)  # transient, reduce dtype
    send.copy_(grad)
    return send.mul_(1.0 / world_size)
