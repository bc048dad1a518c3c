"""The sharded optimizer: a torch optimizer that only ever sees this rank's fp32 master shards.

For each trainable flat buffer the stage hands over, once, at construction:

    param_shard (shard_numel,)  this rank's range of the low-precision (or fp32) params

and at every `step(grad_shards, clip_coef)`:

    grad_shard  (shard_numel,)  the averaged gradient for exactly that range
    clip_coef   0-dim fp32      max_norm / (norm + 1e-6) capped at 1 (engine.clip_grad_norm_), or None

(At stage 0 the "shard" is the whole buffer: every rank updates everything.)

The wrapped optimizer (any elementwise torch optimizer: AdamW, Adam, SGD with momentum)
is built over `master_shard`s, so its states (Adam's exp_avg, exp_avg_sq) exist only for
the shard — that is ZeRO-1's whole memory saving. Under fp32 the master shard *is* the
param shard (a view: no copy, 0 extra bytes); under bf16/fp16 it is a separate fp32 copy
(4 bytes/param) and the update happens there, then the low-precision params are refreshed.
An optimizer that is not elementwise (Adafactor, Muon, LAMB: its update reads a parameter's shape or
norms) would compute something else on a shard; for it the wrapped optimizer is built over whole
parameters instead, each stepped by one owner rank (optim/whole_params.py [Note: elementwise or whole
parameters]), while the master shards, and phases 1, 2 and 4 below, stay as they are.

Buffers with the same hyperparameter overrides share one optimizer param group, so each
`step` runs the wrapped optimizer over a few whole shards (torch's for-loop implementation on
CPU unless the caller passes `foreach=True`, its foreach kernels on CUDA), never over every
module parameter.

step() in numbered phases:
  1. fp16 only: inf/nan check on the local grad shards; one all-reduce(MAX) so that every
     rank agrees; on overflow every rank skips the step and the scaler backs off.
  2. form master gradients in fp32: grad * (clip_coef / loss_scale)  (unscale + clip once).
     A grad shard already in the master dtype (fp32 training, or gradients reduced in fp32:
     see core/grads/grad_reduce.py [Note: reduce dtype]) is used as it is, scaled in place: no copy
     and no second rounding; any other dtype is cast into a transient fp32 copy.
  3. optimizer.step() on the master shards.
  4. copy master -> param shard (cast to the param dtype); drop transient fp32 grads.
  (2-4 run once over every shard, or chunk by chunk under a cast: [Note: a step in chunks].)
The all-gather that brings the updated shards back into full buffers is the stage's job.

[Note: a step in chunks]
Under bf16/fp16 the grad shards stay in the low-precision reduce dtype (2 bytes/param) and the
optimizer needs fp32 gradients. Casting every shard at once holds 2 + 4 bytes/param of gradient
during the step, where FSDP (which casts the reduced shard to fp32 and keeps only that) holds 4
and DDP under autocast 4: the step would be the peak, above the peers'. So the cast shards are
stepped in chunks of consecutive shards whose fp32 copies add up to at most 1/CAST_CHUNK of the
whole fp32 gradient (or the largest shard, if more): the wrapped optimizer's step() runs once
per chunk, with `.grad` set only on that chunk's masters (torch's optimizers skip a parameter
whose grad is None), and the transient is 2 + 4/CAST_CHUNK bytes/param. DeepSpeed's ZeRO-1/2
steps its flat partitions group by group for the same reason. Every per-parameter optimizer
(torch's Adam, AdamW, SGD, ... keep their step count per parameter) updates to the same bits
as in one call; what changes is that its step hooks fire once per chunk, and an optimizer that
keeps a count of its own across parameters would count chunks. Without a cast (fp32, or
gradients reduced in fp32) there is one call, as before.

[Note: engine.optimizer is a torch optimizer]
`engine.optimizer` is a torch.optim.Optimizer (isinstance holds), so torch's LR schedulers and code
written against the Optimizer interface take it unchanged: its `param_groups` are the wrapped
optimizer's, the very dicts the step reads (a scheduler's new `lr` is the next step's), and so are
`state` and `defaults`. Its `step()` and `zero_grad()` are the engine's (a loop holding only the
optimizer trains the whole engine); the stages call `apply(grad_shards, clip_coef)` instead, which
marks the step as taken for a scheduler's check. `state_dict()` / `load_state_dict()` are torch's,
over this rank's master shards (plus the masters themselves under bf16/fp16): each rank saves and
loads its own, at the same layout; the sharded checkpoint (engine.save / engine.load) resumes
anywhere. Groups are fixed by zk.shard (`add_param_group` is refused) and hooks belong on
`engine.optimizer.optimizer`.

The stage passes the grad shards to every step rather than once: stage 0 under a distinct
reduce dtype hands over the reduce-dtype buffer its all-reduce filled, for that step only.
Checkpoints (zerokit/checkpoint/) read and write states through `state_of` / `set_state`
and the hyperparameters through `param_groups`.
"""
from __future__ import annotations

import torch

from zerokit.core.precision import LossScaler, PrecisionPolicy, has_inf_or_nan
from zerokit.optim.whole_params import WholeParams, is_elementwise


# Under a cast (bf16/fp16 gradients, fp32 masters) one optimizer.step() updates at most about this
# fraction of the masters: [Note: a step in chunks]
CAST_CHUNK = 8


class ShardedOptimizer(torch.optim.Optimizer):
    """[Note: engine.optimizer is a torch optimizer]: schedulers read and write `param_groups`; `step()` and
    `zero_grad()` are the engine's; the stages call `apply(grad_shards, clip_coef)`."""

    def __init__(self, optimizer_cls: type[torch.optim.Optimizer], optimizer_kwargs: dict,
                 param_shards: list[torch.Tensor], options: list[dict],
                 policy: PrecisionPolicy, comm, scaler: LossScaler | None = None,
                 master_init: list[torch.Tensor] | None = None, layouts: list | None = None):
        """`master_init`: fp32 values the master shards start from (aligned with param_shards);
        by default the param shards themselves, which under bf16/fp16 are already rounded.
        `layouts`: each shard's FlatParamLayout, for an optimizer that needs whole parameters
        (optim/whole_params.py [Note: elementwise or whole parameters])."""
        assert len(param_shards) == len(options)
        self.policy, self.comm, self.scaler = policy, comm, scaler
        self.steps_called = 0  # step() calls, skipped ones included: the same on every rank
        self.param_shards = param_shards
        if policy.needs_master:
            # (shard_numel,) fp32 each: the weights the optimizer really updates.
            sources = param_shards if master_init is None else master_init
            self.master_shards = [m.detach().to(policy.master_dtype).clone() for m in sources]
        else:
            self.master_shards = param_shards  # fp32 training: the shard itself, a view
        # The flat path steps the master shards; the whole-parameter path the parameters each rank owns, in
        # their module shapes ([Note: elementwise or whole parameters]).
        self.whole = None
        if not is_elementwise(optimizer_cls):
            assert layouts is not None and len(layouts) == len(param_shards)
            self.whole = WholeParams(layouts, self.master_shards, comm)
        groups: dict[tuple, list[torch.Tensor]] = {}
        shards_of: dict[tuple, list[int]] = {}
        for k, (master, opts) in enumerate(zip(self.master_shards, options)):
            params = [master] if self.whole is None else self.whole.params(k)
            groups.setdefault(tuple(sorted(opts.items())), []).extend(params)
            shards_of.setdefault(tuple(sorted(opts.items())), []).append(k)
        param_groups = [{"params": masters, **dict(key)} for key, masters in groups.items()]
        # group_shards[g]: which shards param group g steps (the same on every rank, whichever path)
        self.group_shards: list[list[int]] = list(shards_of.values())
        if not param_groups:  # nothing trainable: keep a valid (empty-shard) optimizer
            param_groups = [{"params": [torch.zeros(0, dtype=policy.master_dtype)]}]
        try:
            self.optimizer = optimizer_cls(param_groups, **optimizer_kwargs)
        except TypeError as exc:
            raise TypeError(f"could not build {optimizer_cls.__name__} with {optimizer_kwargs}: {exc}") from exc
        self._engine = None  # the engine whose step() and zero_grad() the torch-facing methods run (attach)

    # torch.optim.Optimizer's face ([Note: engine.optimizer is a torch optimizer]) ------------------
    # Optimizer.__init__ is not called: the groups, state and defaults are the wrapped optimizer's.
    def attach(self, engine) -> None:
        self._engine = engine

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @property
    def state(self):
        """The wrapped optimizer's state: keyed by this rank's master shards (the whole-parameter path: by the
        parameters this rank owns, `owned()`)."""
        return self.optimizer.state

    # torch.amp.GradScaler hands an optimizer that says so the scaler itself (`step(grad_scaler=)`) instead of
    # unscaling and inf-checking its `.grad`s: here, so that it is refused by name rather than failing inside
    # torch ("No inf checks were recorded") or, with a scale and no fp16, stepping scaled gradients.
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        """`engine.step()`, for code holding the optimizer (a training loop, an LR scheduler's wrapper)."""
        if grad_scaler is not None:
            raise TypeError(
                "torch.amp.GradScaler cannot drive engine.optimizer: zerokit reduces and shards the gradients and "
                "keeps the loss scale itself. Use engine.scaler, which has GradScaler's methods: "
                "engine.scaler.scale(loss).backward(), engine.scaler.step(engine.optimizer), "
                "engine.scaler.update() (fp16: zk.shard(..., precision='fp16'); under fp32/bf16 it passes the loss "
                "through unscaled)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """`engine.zero_grad()`: the model's gradients (and the stage's buffers), not only the masters'."""
        self._engine.zero_grad()

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("engine.optimizer's groups are fixed by zk.shard (one per flat buffer's "
                                  "hyperparameters): pass param_groups=fn(name, param) to zk.shard instead")

    def _no_hooks(self, *args, **kwargs):
        raise NotImplementedError("optimizer hooks on engine.optimizer are not run: register them on "
                                  "engine.optimizer.optimizer, the wrapped optimizer over this rank's shards (its "
                                  "step runs once per chunk of shards under a cast: [Note: a step in chunks])")

    register_step_pre_hook = register_step_post_hook = _no_hooks
    register_state_dict_pre_hook = register_state_dict_post_hook = _no_hooks
    register_load_state_dict_pre_hook = register_load_state_dict_post_hook = _no_hooks

    def state_dict(self) -> dict:
        """torch-style: the wrapped optimizer's state_dict over this rank's shards, plus the fp32 master
        shards when they are separate (bf16/fp16), so a load resumes bit for bit. Each rank's own: the
        sharded checkpoint (engine.save) is the way to resume at another world size or stage."""
        out = self.optimizer.state_dict()
        out["zerokit"] = {"rank": self.comm.rank, "world_size": self.comm.world_size,
                          "shard_numels": [m.numel() for m in self.master_shards]}
        if self.policy.needs_master:
            out["zerokit"]["masters"] = [m.detach().clone() for m in self.master_shards]
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """The inverse of `state_dict()` on the same rank of the same layout; load the model's weights first
        (they reset the masters), then this (it restores the masters' exact fp32 values)."""
        state_dict = dict(state_dict)
        info = state_dict.pop("zerokit", None)
        if info is None:
            raise ValueError("engine.optimizer.load_state_dict: this state_dict was not written by "
                             "engine.optimizer.state_dict() (no 'zerokit' entry); a plain torch optimizer's is "
                             "keyed by the model's parameters, not by this rank's shards: resume with engine.load")
        mine = {"rank": self.comm.rank, "world_size": self.comm.world_size,
                "shard_numels": [m.numel() for m in self.master_shards]}
        theirs = {k: info.get(k) for k in mine}
        if theirs != mine:
            raise ValueError(f"engine.optimizer.load_state_dict: written by rank {theirs['rank']} of "
                             f"{theirs['world_size']} with shards {theirs['shard_numels']}, loaded on rank "
                             f"{mine['rank']} of {mine['world_size']} with shards {mine['shard_numels']}: each "
                             "rank loads its own, at the same layout; resume elsewhere with engine.load")
        self.optimizer.load_state_dict(state_dict)
        if self.policy.needs_master:
            with torch.no_grad():
                for master, saved in zip(self.master_shards, info["masters"]):
                    master.copy_(saved)

    def found_overflow(self, grad_shards: list[torch.Tensor]) -> bool:
        """Phase 1: every rank learns whether any rank's gradient holds inf/nan. A CPU sync point."""
        local = has_inf_or_nan(grad_shards)
        return bool(self.comm.all_reduce_scalars(local.reshape(1), op="max", label="the fp16 overflow flag").item() > 0)

    def apply(self, grad_shards: list[torch.Tensor], clip_coef: torch.Tensor | None = None) -> bool:
        """Update the master shards from `grad_shards` (aligned with param_shards); False if fp16 skipped it.

        A grad shard in the master dtype is scaled in place (by the clip coefficient and the
        inverse loss scale): the stage clears it before the next backward anyway.
        """
        assert len(grad_shards) == len(self.master_shards), (len(grad_shards), len(self.master_shards))
        # Debug mode: a rank that skipped its backward's reductions meets the others here (core/collectives/recorder.py
        # [Note: debug mode]); nothing otherwise.
        self.steps_called += 1
        self._opt_called = True  # what an LR scheduler's step() checks was called before it
        self.comm.sync_point(f"optimizer step {self.steps_called}")
        # 1. overflow (fp16 only)
        if self.scaler is not None and self.found_overflow(grad_shards):
            self.scaler.update(True)
            return False
        # 2. master gradients: unscale and clip in one multiply, in fp32
        multiplier = clip_coef
        if self.scaler is not None:
            inv_scale = torch.tensor(1.0 / self.scaler.scale, dtype=torch.float32)
            multiplier = inv_scale if multiplier is None else multiplier * inv_scale
        # 2-4 over the chunks of `step_chunks` (one chunk when no gradient needs a cast): [Note: a step
        # in chunks]
        for chunk in self.step_chunks(grad_shards):
            for i in chunk:
                master, grad = self.master_shards[i], grad_shards[i]
                if grad.dtype == master.dtype:
                    if multiplier is not None:
                        grad.mul_(multiplier)
                    master.grad = grad  # the optimizer reads the grad shard in place
                else:
                    master.grad = grad.to(master.dtype)  # (shard_numel,) fp32, transient
                    if multiplier is not None:
                        master.grad.mul_(multiplier)
            # 3. update (the masters outside the chunk have no .grad: the optimizer skips them); an optimizer
            #    that needs whole parameters steps each owned parameter in its shape: optim/whole_params.py
            if self.whole is None:
                self.optimizer.step()
            else:
                held = self.whole.prepare(chunk)
                self.optimizer.step()
                self.whole.finish(chunk, held)
                del held
            # 4. refresh low-precision params; let go of the master gradients (transient copies,
            #    or references that would keep a stage's transient reduce buffer alive)
            for i in chunk:
                master = self.master_shards[i]
                if self.policy.needs_master:
                    self.param_shards[i].copy_(master)
                master.grad = None
        if self.scaler is not None:
            self.scaler.update(False)
        return True

    def step_chunks(self, grad_shards: list[torch.Tensor]) -> list[list[int]]:
        """The master shards one `optimizer.step()` updates together, as lists of indices in order.

        One chunk of every shard when no gradient needs a cast to the master dtype; otherwise
        consecutive shards whose fp32 copies together stay within `CAST_CHUNK` of the whole
        fp32 gradient, or the largest single shard where that is more. [Note: a step in chunks]
        """
        if self.whole is not None and any(self.whole.gathers(k) for k in range(len(self.master_shards))):
            # one buffer per call: its gathered transients are the only ones alive, and a cast's fp32 copy is
            # one buffer's, within the chunk budget below ([Note: elementwise or whole parameters])
            return [[k] for k in range(len(self.master_shards))]
        casts = {i for i, (m, g) in enumerate(zip(self.master_shards, grad_shards)) if g.dtype != m.dtype}
        if not casts:
            return [list(range(len(self.master_shards)))]
        sizes = [self.master_shards[i].numel() for i in sorted(casts)]
        budget = max(max(sizes), -(-sum(sizes) // CAST_CHUNK))
        chunks: list[list[int]] = [[]]
        held = 0
        for i in range(len(self.master_shards)):
            n = self.master_shards[i].numel() if i in casts else 0
            if chunks[-1] and held + n > budget:
                chunks.append([])
                held = 0
            chunks[-1].append(i)
            held += n
        return chunks

    # checkpoints ---------------------------------------------------------
    @property
    def name(self) -> str:
        """The wrapped optimizer's class, as a checkpoint records it (module.QualName)."""
        cls = type(self.optimizer)
        return f"{cls.__module__}.{cls.__qualname__}"

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's param groups (their "params" are master shards); hyperparameters may be set."""
        return self.optimizer.param_groups

    def state_of(self, master: torch.Tensor) -> dict:
        """The optimizer state of one master shard (empty before its first step)."""
        return self.optimizer.state.get(master, {})

    def set_state(self, master: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        """Replace one master shard's optimizer state (an empty dict: as before its first step)."""
        self.optimizer.state.pop(master, None)
        if states:
            self.optimizer.state[master] = states

    def owned(self) -> list:
        """The whole-parameter path's parameters this rank steps (optim/whole_params.py `Owned`), in shard
        order; [] on the flat path."""
        return [] if self.whole is None else [own for owned in self.whole.owned for own in owned]

    def clear_states(self) -> None:
        """Every optimizer state forgotten: as before a first step (new weights were loaded)."""
        self.optimizer.state.clear()

    def first_step_count(self) -> int | None:
        """The "step" state of the first parameter this rank steps that has one (None before a first step)."""
        for state in self.optimizer.state.values():
            if "step" in state:
                return int(float(state["step"]))
        return None

    # ledgers -------------------------------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        """Every optimizer state tensor (0-dim step counters excluded)."""
        out = []
        for state in self.optimizer.state.values():
            out += [t for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
        return out

    def master_tensors(self) -> list[torch.Tensor]:
        """Separate fp32 master copies (none under fp32: the params are the master)."""
        return list(self.master_shards) if self.policy.needs_master else []
