"""Stage 3 (ZeRO-3 / FSDP): shard the parameters too. A rank keeps 1/N of everything.

Stage 2 still holds every parameter whole between steps, although a rank updates only its own range.
Stage 3 keeps only the param shards, and gathers a group of modules' parameters whole just for that
group's forward and backward: a *unit* (core/params/unit.py). That is the one idea this file adds to stage 2;
the gradient path is stage 2's, except that a unit's gradients are packed and reduced once the unit's
backward is over (the Notes at "2. gradient hook" below).

`wrap=` splits the model into units (e.g. every GPT `Block`); the root unit holds every parameter no
unit claims (embeddings, final norm, the tied head). Each unit's flat params keep only this rank's
range: param_shard (shard_numel,), persistent, which the optimizer's master covers; grad_shard, from
the first reduce-scatter after zero_grad (core/grads/grad_reduce.py [Note: grad shards]); flat_data
(padded_numel,), whose storage is 0 bytes whenever the unit is sharded (core/params/unit.py [Note: storage,
not .data]).

Per step (differences from stage 2 marked *):
  * construction: as stage 2, *but the param shards are copies and the flat buffers' storage is freed;
  * *forward: the root is gathered when the model is called; a forward pre-hook gathers each unit
    (prefetched: core/params/prefetch.py), and a forward hook frees it (`reshard_after_forward=True`);
  * backward: *a hook on a unit's outputs gathers it again (core/params/unit.py [Note: gather again in
    backward]); once the unit's backward is over it is freed, then its gradients are packed and
    reduce-scattered into its grad shards;
  * step: every rank updates its own shard. *No all-gather after it: the next forward gathers.

Collectives per step: all-gathers of Ψ·p in forward and in backward (the root stays gathered) and a
reduce-scatter of Ψ·g: 3Ψ·g when p = g, 1.5x DDP's. Per-rank memory: 16Ψ/N (fp32 or bf16 with Adam)
plus the working set, root + (1 + prefetch) units. Every rank must run the same units in the same
order (core/collectives/recorder.py [Note: rank-dependent units]); a method that runs the model without calling it
(a PEFT `generate`) is registered with `register_forward_method` (core/params/unit.py [Note: forward methods]).
Collectives, memory and the device-dependent overlap in detail: docs/stages.md, "Stage 3 in detail".
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn

from zerokit.checkpoint import Checkpointing
from zerokit.core.config import ShardConfig
from zerokit.core.engine import Engine
from zerokit.core.params.flat_param import FlatParamLayout, FlatParamState, build_flat_params
from zerokit.core.grads.hooks import GradReadyTracker
from zerokit.core.nest import tensors_in
from zerokit.core.params.prefetch import RecordedOrder, reverse_first_calls
from zerokit.core.params.unit import (Unit, eager, gathered, hand_over_all, keep_shard, packed_grads, prefetch,
                                     reshard_all, split_into_units)
from zerokit.optim.sharded import ShardedOptimizer


class Zero3Engine(Checkpointing, Engine):
    stage = 3
    keeps_flat_grads = False  # a flat param's full gradient is freed once reduce-scattered
    packs_grads = True  # [Note: gradients packed when complete]

    # 1. construct ------------------------------------------------------------------
    def __init__(self, module: nn.Module, optimizer_cls, optimizer_kwargs: dict, *, comm, policy, scaler,
                 config: ShardConfig):
        super().__init__(module, comm, policy, scaler, config)
        self.prefetch = config.prefetch  # units gathered ahead of the one computing
        self.reshard_after_forward = config.reshard_after_forward
        infos = self.guard.params  # checked to agree across ranks, rank 0's values broadcast: core/params/model_guard.py
        unit_members = split_into_units(module, config.wrap, infos)  # raises on a tie across units, on every rank
        self.flat_params: list[FlatParamLayout] = []  # root's first, then each unit's, in registration order
        units_flat_params = []  # per unit: its flat params, one per group, never split (bucket_numel None)
        for _name, _module, members in unit_members:
            units_flat_params.append(build_flat_params(members, self.world_size, self.rank, None,
                                                       first_index=len(self.flat_params), kind="flat param"))
            self.flat_params += units_flat_params[-1]
        self.flat_data: list[torch.Tensor] = []  # (padded_numel,) param dtype; storage 0 bytes when sharded
        self.param_shards: list[torch.Tensor] = []  # (shard_numel,) param dtype, persistent
        self.states = [FlatParamState(fp) for fp in self.flat_params]  # each flat param's gradients, by index
        fp32_values = []  # (shard_numel,) fp32 each, construction only: what the masters start from
        for fp in self.flat_params:
            data, fp32 = fp.flatten_params(policy.param_dtype)  # bf16/fp16 params (frozen too) when mixed
            fp32_values.append(fp.shard_of(fp32).clone())  # (under fp32, data and fp32 are one tensor)
            self.param_shards.append(keep_shard(fp, data))  # and data's storage freed: core/params/unit.py
            self.flat_data.append(data)  # the params stay views of it for good: [Note: storage, not .data] there
        self.trainable = [fp for fp in self.flat_params if fp.requires_grad]
        for fp in self.flat_params:  # (padded_numel,) full gradients: None except while a flat param is
            # accumulated or reduce-scattered (or kept by no_sync); [Note: gradients packed when complete]
            fp.use_as_grad_storage(None)  # grad shards: allocated by the first reduce-scatter (core/grads/grad_reduce.py
            # [Note: grad shards])
        self.optimizer = ShardedOptimizer(
            optimizer_cls, optimizer_kwargs,
            param_shards=[self.param_shards[fp.index] for fp in self.trainable],
            options=[fp.options for fp in self.trainable], policy=policy, comm=comm, scaler=scaler,
            master_init=[fp32_values[fp.index] for fp in self.trainable],  # not their roundings
            layouts=self.trainable)
        del fp32_values
        self.tracker = GradReadyTracker(self.flat_params, self._on_grads_ready, self._on_backward_end,
                                        on_first_grad=self._on_first_grad, in_order=False)
        self._build_units([(name, module) for name, module, _ in unit_members], units_flat_params)

    def _build_units(self, named_modules: list[tuple[str, nn.Module]], units_flat_params) -> None:
        """One Unit per wrapped module (the root first) and the hooks that drive them: stage 3's one idea."""
        # CUDA: gathers run on a side stream so they overlap compute (core/params/unit.py).
        on_cuda = bool(self.flat_params) and self.flat_params[0].device.type == "cuda"
        self.gather_stream = torch.cuda.Stream() if on_cuda else None
        self.units: list[Unit] = []
        for k, ((name, module), fps) in enumerate(zip(named_modules, units_flat_params)):
            self.units.append(Unit(k, name, module, fps, [self.param_shards[fp.index] for fp in fps],
                                   [self.flat_data[fp.index] for fp in fps], self.comm, self.gather_stream,
                                   reduce=self._reduce_unit_grads))
        self.unit_of = {fp.index: unit for unit in self.units for fp in unit.flat_params}
        self.forward_order = RecordedOrder([unit.index for unit in self.units[1:]])  # first guess: registration
        self.backward_order = RecordedOrder(reverse_first_calls(self.forward_order.recorded))
        self._in_forward = False
        self.comm.first_step_checks = True  # until the first step: core/collectives/recorder.py [Note: rank-dependent units]
        self._handles = [self.module.register_forward_pre_hook(eager(self._root_pre_forward)),
                         self.module.register_forward_hook(eager(self._root_post_forward))]
        for unit in self.units[1:]:  # eager: run as they are under torch.compile, core/params/unit.py [Note: torch.compile]
            self._handles += [unit.module.register_forward_pre_hook(self._make_pre_forward(unit), with_kwargs=True),
                              unit.module.register_forward_hook(self._make_post_forward(unit))]

    # -- forward: gather, compute, free ----------------------------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        if self.tracker.in_backward:  # the whole model re-run inside backward (checkpointed): root is whole
            return
        self._in_forward = True
        self.forward_order.begin()
        self.units[0].unshard("forward")
        # the root computes while the first unit's gather flies
        prefetch(self.units, self.forward_order.upcoming(self.prefetch), "forward")

    def _root_post_forward(self, module, args, output) -> None:
        if self.tracker.in_backward:
            return
        self._in_forward = False
        if self.forward_order.end():  # a new order: core/params/prefetch.py [Note: recorded prefetch order]
            self.backward_order = RecordedOrder(reverse_first_calls(self.forward_order.recorded))
        if not any(t.requires_grad for t in tensors_in(output)):  # no backward will follow: free everything now
            reshard_all(self.units)
            return
        self.units[0].post_forward(output, self.tracker.begin_backward, reshard=False)

    def _make_pre_forward(self, unit: Unit):
        def pre_forward(module, args, kwargs):
            if self.tracker.in_backward:  # checkpoint recompute: core/params/unit.py [Note: activation checkpointing]
                unit.unshard("backward")
                return None
            self.forward_order.visit(unit.index)
            watched = unit.pre_forward(args, kwargs)
            prefetch(self.units, self.forward_order.upcoming(self.prefetch), "forward")
            return watched
        return eager(pre_forward)

    def _make_post_forward(self, unit: Unit):
        def post_forward(module, args, output) -> None:
            if self.tracker.in_backward:  # recompute: keep the unit until its backward is done
                return
            reshard = self.reshard_after_forward and not self.forward_order.called_again(unit.index)
            unit.post_forward(output, lambda: self._pre_backward(unit), reshard)
        return eager(post_forward)

    # -- backward: gather again before the unit's backward ops -------------------------------------
    def _pre_backward(self, unit: Unit) -> None:
        self.tracker.begin_backward()
        if unit.pre_backward():  # the first of its outputs' gradients in this backward
            self.backward_order.visit(unit.index)
            prefetch(self.units, self.backward_order.upcoming(self.prefetch), "backward")

    # 2. gradient hook ---------------------------------------------------------------

    # [Note: gradients packed when complete]
    # Stages 0-2 give every parameter a `.grad` view into its bucket's flat gradient before autograd's
    # first accumulation. At stage 3 a unit's whole flat gradient would then be allocated early in its
    # backward, while its activations are all still live and most of its gradients not yet computed
    # (FSDP2 does not allocate it either). Instead `.grad` is None when autograd reaches a flat param
    # (`packs_grads`, core/grads/user_grads.py), autograd makes each parameter's gradient, and when the unit's
    # backward is over (`_reduce_unit_grads`) they are added into a zeroed (padded_numel,) buffer, `.grad`
    # becomes its views, and autograd's tensors go (core/params/unit.py `packed_grads`). Adding onto zeros is
    # what autograd's accumulation into a zeroed view did, so the bits are those of stages 0-2. When a
    # full gradient already exists (kept by no_sync) or user code assigned a `.grad`, autograd
    # accumulates into the full gradient's views, as at stages 0-2.
    #
    # [Note: reduce once the unit's backward is over]
    # A unit has one flat param per dtype / requires_grad / optimizer option set, so a GPT block has two:
    # its weights (decay) and its biases and norms (no decay). The weights' gradients are complete before
    # the block's first LayerNorm has run its backward; reduced then, the weights' full gradient and the
    # reduce-scatter's receive buffer (N rows of a shard: the gradient's size again; gloo's native
    # reduce-scatter clones its input instead) would sit beside the rest of the block's backward, its
    # activations and gathered parameters. So, as FSDP2's post-backward does for its parameter group, a unit's
    # complete gradients wait until its backward is over (every trainable gradient complete, and its
    # inputs' gradient computed: core/params/unit.py [Note: gather again in backward]); then the unit is freed
    # and only then are its gradients packed and reduce-scattered, one after the other. The root, whole
    # until the end of backward, reduces each flat param as it completes.
    #
    # How long they stay in flight depends on the device. On CUDA the collectives run on NCCL's stream and
    # the CPU goes on to the next unit's backward, waiting for the unit before only when the next one is
    # reduced: communication hides behind computation, for one unit's full gradients and receive buffers.
    # On CPU the stage waits for them at once, as torch's FSDP1 does on CPU (a blocking reduce-scatter in
    # its post-backward hook): a gloo collective competes with computation for the same cores, and an
    # overlap would hold a unit's gradient twice over beside the next unit's backward. The measured peaks,
    # beside FSDP1's: benchmarks/results/where_peak_stage3_unit_end.md and docs/scaling.md.
    def _on_grads_ready(self, fp: FlatParamLayout) -> None:
        """A flat param's gradients are all accumulated: its unit holds it until the unit's backward is over
        ([Note: reduce once the unit's backward is over]), then `_reduce_unit_grads` runs."""
        self.unit_of[fp.index].grad_ready(self.states[fp.index])

    def _reduce_unit_grads(self, states: list[FlatParamState]) -> None:
        """A unit's backward is over and its params are freed (the root: one flat param is complete): pack
        ([Note: gradients packed when complete]) and reduce each gradient (or hold it under no_sync:
        core/engine.py); on CUDA leave this unit's reduce-scatters in flight beside the next unit's backward,
        on CPU wait for them here ([Note: reduce once the unit's backward is over])."""
        for state in states:
            if state.unpacked:
                state.flat_grad, state.unpacked = packed_grads(state.fp), False
            self.reduce_or_hold(state)
        self.in_flight.wait_until(len(states) if self.gather_stream is not None else 0)

    def reduce_grads(self, state: FlatParamState) -> None:
        """Reduce-scatter now (into the grad shard, allocated if zero_grad freed it: core/grads/grad_reduce.py [Note: grad
        shards]), free the full buffer when done: core/grads/grad_reduce.py `reduce_scatter_grad`."""
        self.reduce_scatter_grad(state)

    # 3. finish backward ---------------------------------------------------------------
    def _on_backward_end(self) -> None:
        hand_over_all(self.units)  # a unit whose inputs' gradient never came: its gradients go now
        self.in_flight.wait_all()
        reshard_all(self.units)
        self.backward_order.end()  # re-recorded if it changed: core/params/prefetch.py

    def finish_backward(self) -> None:
        self.tracker.finish_if_pending()
        self.in_flight.wait_all()
        if not self._in_forward:  # e.g. a forward whose loss was never backpropagated
            reshard_all(self.units)

    # 4. step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Update this rank's shards. No all-gather: the next forward gathers. False if fp16 skipped it."""
        self.finish_backward()
        self.check_user_grads_before_step()
        self.comm.agree_on_step(f"optimizer step {self.optimizer.steps_called + 1}")  # [Note: rank-dependent units]
        return self.optimizer.apply(self.grad_shards(), self.take_clip_coef())

    # 5. zero_grad ------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.begin_zero_grad(forward_cut_short=self._in_forward)  # a pass that raised, ...: core/engine.py
        for fp in self.trainable:  # core/grads/grad_reduce.py [Note: grad shards]
            state = self.states[fp.index]
            state.unpacked = False  # a backward left half-done: its params' own gradients go too
            self.drop_grad_shard(state)  # and a gradient kept by no_sync and never sent; `.grad` is None

    # 6. state_dict ----------------------------------------------------------------------
    def state_dict(self, full: bool = True) -> dict[str, torch.Tensor]:
        """The unwrapped model's state_dict (same keys), whole on every rank: the fp32 masters where they exist
        (as at stage 0), else the param shards, gathered one flat param at a time (core/engine.py
        `full_state_items`), so it works at any point of a step. A collective."""
        if not full:
            raise ValueError("Zero3Engine.state_dict supports full=True only; use engine.save() for shards")
        return super().state_dict(full=True)

    def full_flat_source(self, fp: FlatParamLayout, masters: dict[int, torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """This rank's shard to all-gather: the fp32 master where `fp` has one, else its param shard. Never a
        unit's flat_data, so `full_state_items` works at any point of a step."""
        return masters.get(fp.index, self.param_shards[fp.index]), True

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True) -> Iterator[None]:
        """Every parameter whole inside the block (evaluation, initialisation, inspection). A collective.

        Works at any point of a step: units the step has gathered stay gathered, every other
        unit is gathered for the block (core/params/unit.py `gathered`). With `writeback`, changes
        made inside the block are written back into this rank's shards on exit (and into the
        fp32 masters, for the elements whose low-precision value changed: core/engine.py
        `write_back`). Make the same change on every rank. `writeback=False` promises the
        block only reads.
        """
        with gathered(self.units, snapshot=writeback and self.policy.needs_master) as olds:
            try:
                yield
            finally:
                if writeback:
                    news = [fp.shard_of(self.flat_data[fp.index]) for fp in self.flat_params]  # (shard_numel,) each
                    self.write_back(self.flat_params, olds, news)
                    for shard, new in zip(self.param_shards, news):
                        shard.copy_(new)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out = {
            "params": self.param_shards,
            "grads": [s.grad_shard for s in self.states if s.grad_shard is not None],
            "master_params": self.optimizer.master_tensors(),
            "optimizer_states": self.optimizer.state_tensors(),
        }
        alive = [t for unit in self.units for t in unit.gathered_buffers()]
        if alive:
            out["unsharded_params"] = alive
        grads = [s.flat_grad for s in self.states if s.flat_grad is not None]
        grads += [p.grad for s in self.states if s.unpacked for p in s.fp.params  # not packed yet:
                  if p.grad is not None]  # autograd's own ([Note: gradients packed when complete])
        if grads:
            out["unsharded_grads"] = grads
        return out

    def unsharded_param_bytes(self) -> int:
        """Bytes of gathered parameter storage alive right now (the working set)."""
        return sum(t.untyped_storage().nbytes() for unit in self.units for t in unit.gathered_buffers())

    # 7. checkpoint hook ------------------------------------------------------------------
    def kept_range(self, fp: FlatParamLayout) -> tuple[int, int]:
        """Checkpoint loading reads only this rank's shard range of each flat param."""
        return fp.shard_range

    def load_flat_params(self, flats: Iterable[torch.Tensor]) -> None:
        """Checkpoint loading: the i-th of `flats` is this rank's (shard_numel,) range of flat param i, taken
        one at a time; every unit stays sharded."""
        self.finish_backward()
        reshard_all(self.units)  # the next forward gathers the loaded shards
        for fp, shard in zip(self.flat_params, flats):
            self.param_shards[fp.index].copy_(shard)  # (shard_numel,) cast to the param dtype
