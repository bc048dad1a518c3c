"""Gradient-ready hooks: when is a flat param's gradient complete (`on_grads_ready`), and when is backward over.

`GradReadyTracker` registers, on every trainable parameter,

* a post-accumulate-grad hook (`Tensor.register_post_accumulate_grad_hook`): fires once
  per backward after autograd has *accumulated* the parameter's gradient into `.grad`
  (which is a view into the bucket's flat gradient buffer), so the bucket knows one more
  of its members is final;
* optionally a gradient pre-hook (`Tensor.register_hook`): fires just before that
  accumulation, once per bucket and backward (`on_first_grad`), the last moment to give
  the parameters `.grad` views into storage that is allocated only when needed (stage 2
  frees full-size gradients between backwards) and to take over what user code did to
  `.grad` since the last backward (core/grads/user_grads.py [Note: param.grad belongs to the user]).

With `in_order=True` (stages 0-2) buckets are released to the stage strictly in bucket
order (`FlatParamLayout.index`), as DDP does: a bucket that fills early waits for the ones
before it. That keeps the sequence of collectives identical on every rank even when ranks
see their gradients in different orders, or when a parameter gets no gradient on some rank
(an unused branch): such buckets are released at the end of backward, in order, with the
zeros they hold for the missing gradients. With `in_order=False` (stage 3, whose flat params
follow the units, not the order gradients arrive in) a flat param is released the moment
it is complete; like torch FSDP this assumes every rank runs the same graph, so every rank
completes them in the same order. Flat params still incomplete at the end of backward are
released then, in index order, under both policies.

[Note: unused parameters]
A trainable parameter whose hook did not fire by the end of backward got no gradient on this
rank: its place in the bucket keeps the zeros it was cleared to, the bucket is released and
reduced with the others, so a parameter used on some ranks only gets the average as under
DDP's `find_unused_parameters=True`. A parameter no rank used is the one difference: torch
DDP leaves its `.grad` None and a torch optimizer skips it, while zerokit's optimizer steps
whole flat buffers, so it takes a step with a zero gradient. The tracker names such
parameters once (a warning) so that the user can freeze them.

The end of backward is detected with autograd's queue_callback (the mechanism torch's
DDP and FSDP use): the first hook of a backward (or the stage, through `begin_backward`,
when something of its own runs first in backward) queues `_end_of_backward`, which runs
once the autograd engine has finished the whole graph.

[Note: hooks hold the engine weakly]
A tensor hook is kept by the tensor's C++ side, out of the garbage collector's sight, so a hook
that held the tracker (and through its callbacks the engine, the model and every buffer) would
keep them all alive for good once the user dropped the engine: a cycle gc cannot break. Building
engines one after another (a sweep, a benchmark's runs, a test suite) then grew the process by
every engine's model states. The hooks therefore hold the tracker through a weak reference and do
nothing once it is gone; `tests/unit/test_engine_lifetime.py` drops an engine of every stage and
checks that it and its buffers are freed.

[Note: a backward that raised]
autograd runs a backward's queued callbacks only when the whole graph finished: a backward
that raised (a user hook, an op) never reaches `_end_of_backward`, and its bookkeeping (the
parameters seen, the buckets released, `in_backward`) would make the next backward's first
gradient look like a second one. `discard()`, called by every stage's `zero_grad` through
`Engine.discard_unfinished_pass`, forgets it; the buckets it released have their collectives
in the stage's in-flight queue, which that call waits for (core/engine.py [Note: recovery
after an exception]).

[Note: which backward was scaled]
Under fp16 the step divides gradients by the loss scale, which is right only when the loss
was multiplied by it, i.e. when the backward ran inside `engine.backward`. That sets
`engine_backward` while it runs; the first hook of a backward (`begin_backward`, once per
backward whatever runs first: a gradient hook, or stage 3's unit hooks) counts a backward
begun without it in `plain_backwards`. Activation checkpointing's recompute and the hooks of
later buckets run inside the same backward, so they count nothing; `discard()` (zero_grad)
forgets the count with the gradients it described.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Callable

import torch

from zerokit.core.params.flat_param import FlatParamLayout


class GradReadyTracker:
    def __init__(self, flat_params: list[FlatParamLayout], on_grads_ready: Callable[[FlatParamLayout], None],
                 on_backward_end: Callable[[], None],
                 on_first_grad: Callable[[FlatParamLayout], None] | None = None, in_order: bool = True):
        self.flat_params = [fp for fp in flat_params if fp.requires_grad]
        assert [fp.index for fp in self.flat_params] == sorted(fp.index for fp in self.flat_params)
        self.in_order = in_order
        self.on_grads_ready = on_grads_ready
        self.on_backward_end = on_backward_end
        self.on_first_grad = on_first_grad
        self.in_backward = False
        self._warned: set[str] = set()  # parameters already named by _warn_unused
        self.engine_backward = False  # True while Engine.backward runs: [Note: which backward was scaled]
        self.plain_backwards = 0  # backwards begun outside Engine.backward since `discard`
        self._handles = []
        self._reset()
        for k, fp in enumerate(self.flat_params):
            for j, p in enumerate(fp.params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._make_ready_hook(k, j)))
                if on_first_grad is not None:
                    self._handles.append(p.register_hook(self._make_pre_hook(k)))

    def _reset(self) -> None:
        self._pending = [len(fp.params) for fp in self.flat_params]
        self._seen = [[False] * len(fp.params) for fp in self.flat_params]
        self._started = [False] * len(self.flat_params)
        self._released = [False] * len(self.flat_params)
        self._next = 0  # in_order: first bucket not yet released

    # Both hooks reach the tracker through a weak reference: [Note: hooks hold the engine weakly]
    def _make_pre_hook(self, k: int):
        tracker = weakref.ref(self)

        def pre_hook(grad: torch.Tensor) -> torch.Tensor:
            self = tracker()
            if self is None:  # the engine is gone: the model is the user's again
                return grad
            self.begin_backward()
            if not self._started[k]:
                self._started[k] = True
                self.on_first_grad(self.flat_params[k])
            return grad
        return pre_hook

    def _make_ready_hook(self, k: int, j: int):
        tracker = weakref.ref(self)

        def ready_hook(param: torch.Tensor) -> None:
            self = tracker()
            if self is None:
                return
            if self._seen[k][j]:
                fp = self.flat_params[k]
                raise RuntimeError(
                    f"gradient hook fired twice in one backward for parameter {fp.names[j][0]!r}. Either a "
                    "reentrant activation checkpoint recomputed it (use torch.utils.checkpoint with "
                    "use_reentrant=False, and engine.no_sync() for accumulation), or an earlier backward raised "
                    "and engine.zero_grad() was not called after it (catch the exception, call "
                    "engine.zero_grad() on every rank, and run the step again)")
            self._seen[k][j] = True
            self.begin_backward()
            self._pending[k] -= 1
            if not self.in_order:
                if self._pending[k] == 0:
                    self._release(k)
                return
            while self._next < len(self.flat_params) and self._pending[self._next] == 0:
                self._release(self._next)
        return ready_hook

    def begin_backward(self) -> None:
        """A backward is running: make sure `_end_of_backward` runs once autograd has finished it."""
        if not self.in_backward:
            self.in_backward = True
            if not self.engine_backward:
                self.plain_backwards += 1
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_completed_backward)

    def _release(self, k: int) -> None:
        if self._released[k]:
            return
        self._released[k] = True
        if k == self._next:
            while self._next < len(self.flat_params) and self._released[self._next]:
                self._next += 1
        fp = self.flat_params[k]
        if self.on_first_grad is not None and not self._started[k]:
            self._started[k] = True
            self.on_first_grad(fp)  # storage must exist (zeros) before its collective
        self.on_grads_ready(fp)

    def _end_of_completed_backward(self) -> None:
        """Autograd finished the whole graph (not a backward cut short by an exception)."""
        self._warn_unused()
        self._end_of_backward()

    def _end_of_backward(self) -> None:
        # Buckets with a parameter that got no gradient this time: release them in order.
        for k in range(len(self.flat_params)):
            self._release(k)
        self._reset()
        self.in_backward = False
        self.on_backward_end()

    def _warn_unused(self) -> None:
        """Name, once per engine, trainable parameters this backward gave no gradient ([Note: unused parameters])."""
        if not any(self._pending):  # the usual case: every parameter got its gradient
            return
        unused = [fp.names[j][0] for k, fp in enumerate(self.flat_params) for j in range(len(fp.params))
                  if not self._seen[k][j] and fp.names[j][0] not in self._warned]
        if not unused:
            return
        self._warned.update(unused)
        warnings.warn(
            f"zerokit: {len(unused)} trainable parameter(s) got no gradient on this rank in this backward "
            f"({', '.join(repr(n) for n in unused[:4])}{', ...' if len(unused) > 4 else ''}). zerokit steps them with "
            "the rest of their flat buffer, with the gradient the other ranks gave them or zeros: a parameter no rank "
            "uses still takes a zero-gradient step (weight decay, momentum move it), where torch DDP leaves its .grad "
            "None and a torch optimizer skips it. Freeze parameters the model never uses (p.requires_grad_(False)) "
            "before zk.shard", stacklevel=2)

    def finish_if_pending(self) -> bool:
        """Run the end-of-backward logic now if a backward is half-done; True if it ran."""
        if self.in_backward:
            self._end_of_backward()
            return True
        return False

    def discard(self) -> bool:
        """Forget a backward that raised, and the plain-backward count: [Note: a backward that raised].
        True when a backward had begun and not reached its end."""
        cut_short = self.in_backward
        self._reset()
        self.in_backward = False
        self.plain_backwards = 0
        return cut_short

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
