"""What `param.grad` shows user code, and noticing what user code did to it.

[Note: param.grad belongs to the user]
Training loops touch `param.grad` behind the engine's back: `model.zero_grad()` (which sets
every `.grad` to None), a torch optimizer built over `model.parameters()` whose
`zero_grad()` the loop calls, `p.grad = None`, `torch.nn.utils.clip_grad_norm_(
model.parameters(), c)`. Each stage keeps its gradients in flat storage of its own, so it
must notice those actions and give them the meaning they have under torch's DDP (stages 0-1)
or FSDP2 (stages 2-3), or refuse them with an error — never let them silently detach
`param.grad` from the storage the reduction reads.

Two pieces do that (both in core/params/, below this module; `UserGrads` here is the engine's side):

* `FlatParamLayout` remembers which tensor it last put in each parameter's `.grad`
  (`FlatParamLayout.use_as_grad_storage` / `show_grads`), and `FlatParamLayout.user_grad_changes()`
  compares: a `.grad` that is now None (or a `ShardedGrad` zeroed in place) was *cleared*
  by the user, any other tensor was *replaced*. The engine asks at the start of each flat
  param's backward (the gradient pre-hook, before autograd accumulates: `UserGrads._on_first_grad`,
  the same for every stage) and at `step` (`UserGrads.check_user_grads_before_step`).

* `ShardedGrad` (core/params/sharded_tensors.py) is what `param.grad` holds at stages 1-3 after a synchronised backward,
  when only this rank's range of the averaged gradient exists (the grad shard). Like an
  FSDP2 gradient (a sharded DTensor) it has the parameter's shape, dtype and device, but
  its values are this rank's part `local` of the averaged gradient (a view into the grad
  shard, possibly empty). It supports what gradient code does with a `.grad` and nothing
  else: norms (reduced over ranks, so `torch.nn.utils.clip_grad_norm_` returns the global
  norm), in-place scaling, clamping and zeroing (applied to the shard, so they reach the
  step). Any other operation raises a RuntimeError that says so. Its own storage is one
  element, expanded: it costs no memory.

Norms are computed lazily, as DTensor does: `torch.linalg.vector_norm(g)` returns a
`PartialNorm` that carries this rank's sum of |x|^p in fp64; `torch.stack` of partial
norms stays partial, and the norm of that stack performs one rank-ordered reduction. So
`clip_grad_norm_` costs one tiny collective in all, and its total equals
`engine.clip_grad_norm_`'s (the same fp64 sums of squares, reduced in the same order, up to
the fp64 rounding of a different summation grouping). Any other use of a partial norm (for
example `.item()`) reduces it on the spot: a collective, so every rank must do it, as with
DTensor's `full_tensor()`.

Under fp16 the grad shards hold loss-scaled gradients; norms are divided by the current
loss scale and clamps multiplied by it, so user code sees unscaled values. (At stage 0,
`param.grad` is the plain averaged gradient; under fp16 it is loss-scaled, as it is with
torch.amp before `GradScaler.unscale_`: clip with `engine.clip_grad_norm_` there.)
"""
from __future__ import annotations

__all__ = ["UserGrads"]


class UserGrads:
    """The engine's side of [Note: param.grad belongs to the user], one implementation for every stage.

    Mixed into core/engine.py's `Engine`; reads the stage's `states` (core/params/flat_param.py
    `FlatParamState`), `flat_params`, `packs_grads` and `adopt_assigned_grads`.
    """

    packs_grads = False  # stage 3: autograd makes each param's own gradient, packed once all are there

    def _on_first_grad(self, fp) -> None:
        """Autograd is about to add this flat param's first gradient of a backward (core/grads/hooks.py): honour
        what user code did to `.grad` since the last one, then give autograd the full gradient's views.

        A cleared `.grad` (None, or zeroed in place) starts again from zero, in the full gradient
        and in the grad shard, as after zero_grad; an assigned tensor is the gradient to accumulate
        onto, as under DDP. Where the stage frees the full gradient between backwards it is allocated
        here (zeros), unless a no_sync micro-step kept it; stage 3 leaves it to be packed
        (`packs_grads`: stages/zero3.py [Note: gradients packed when complete]).
        """
        cleared, replaced = fp.user_grad_changes()
        state = self.states[fp.index]
        self.restart_grad_shard(state, cleared + replaced)
        if state.flat_grad is None and self.packs_grads and not replaced:
            fp.show_grads([None] * len(fp.params))  # autograd makes each parameter's own
            state.unpacked = True
            return
        if state.flat_grad is None:
            state.flat_grad = fp.new_flat()  # (padded_numel,) zeros
        else:
            fp.zero_grad_parts(state.flat_grad, cleared + replaced)
        fp.write_params(state.flat_grad, replaced, [fp.params[j].grad for j in replaced])
        fp.use_as_grad_storage(state.flat_grad)  # plain views: autograd accumulates into the full gradient

    def restart_grad_shard(self, state, js: list[int]) -> None:
        """params[j]'s part of the grad shard starts again from zero (j in js); the next reduce-scatter
        lands directly when that was every param, as after zero_grad (stage 0 has no grad shard).

        Stage 1 (`accumulates_grad_shards` False): once reduce-scattered, the full gradient holds the
        average in this rank's range and local sums elsewhere, and the next backward cannot add onto
        that, so its gradients are cleared all together (then as by zero_grad) or not at all.
        """
        if state.grad_shard_written and not self.accumulates_grad_shards and js and len(js) < len(state.fp.params):
            kept = next(names[0] for j, names in enumerate(state.fp.names) if j not in js)
            raise RuntimeError(
                f"stage {self.stage} (rank {self.rank}): some gradients of the bucket holding {kept!r} were cleared "
                "since the last synced backward and others not; stage 1 cannot accumulate onto an averaged "
                "gradient: clear all of them (model.zero_grad() or engine.zero_grad())")
        if state.grad_shard is not None and state.fp.zero_shard_parts(state.grad_shard, js):
            state.grad_shard_written = False

    def check_user_grads_before_step(self) -> None:
        """Called by every stage's `step`: take over what user code did to `param.grad` since backward.

        A gradient zeroed or scaled in place already reached the storage the optimizer reads.
        A `.grad` set to None after backward cannot be honoured (a torch optimizer would skip
        that parameter; zerokit updates whole flat buffers), so it is refused, as is an
        assigned tensor except at stage 0 (`adopt_assigned_grads`). Under reduction="tree",
        micro-batches still held as partial sums (no synced backward) are refused too, and the
        step's tree is done with: the next backward starts a new one even when the loop clears
        gradients with model.zero_grad() rather than engine.zero_grad(). A model cast or
        moved since zk.shard is refused first (core/params/model_guard.py).
        """
        self.check_last_backward()
        self.guard.before_step(self)  # dtype/device moves of the model: core/params/model_guard.py
        self.check_partials_sent()
        self.clear_partials()
        for fp in self.flat_params:
            if not fp.requires_grad:
                continue
            cleared, replaced = fp.user_grad_changes()
            dropped = [j for j in cleared if fp.params[j].grad is None]
            if dropped:
                raise RuntimeError(
                    f"zerokit stage {self.stage} (rank {self.rank}): param.grad of {fp.names[dropped[0]][0]!r} was set "
                    "to None between backward and engine.step() (model.zero_grad() or optimizer.zero_grad() in the "
                    "wrong place?). zerokit updates whole flat buffers and cannot skip one parameter as a torch "
                    "optimizer would: clear gradients before the forward or after step()")
            if replaced:
                self.adopt_assigned_grads(fp, replaced)

    def adopt_assigned_grads(self, fp, replaced: list[int]) -> None:
        """User code assigned new tensors to params[j].grad (j in `replaced`) after backward (stages 1-3: refused)."""
        raise RuntimeError(
            f"zerokit stage {self.stage} (rank {self.rank}): a tensor was assigned to param.grad of "
            f"{fp.names[replaced[0]][0]!r}; at this stage only this rank's shard of the averaged gradient exists, "
            "so an assigned full gradient cannot be used. Change gradients in place (p.grad.mul_(), clamp_(), "
            "zero_()) or use stage=0")
