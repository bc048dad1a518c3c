"""A model built on the meta device, materialized one flat param at a time, with eager's bits.

    with torch.device("meta"):
        model = GPT(cfg)                      # shapes only: no memory, no random numbers drawn
    engine = zk.shard(model, stage=3, wrap=(Block,), param_init_fn=GPT._init_weights)

`zk.shard` accepts a model whose parameters and buffers are (some or all) on the meta device.
`DeferredInit.prepare` (called once, by `Engine.__init__`, before anything is laid out) works out
how each one gets its values; then each stage's `FlatParamLayout.flatten_params` asks for exactly
its flat param's values (`fill`), so a rank never holds more than one flat param of initialized
values at a time beyond what it keeps: at stage 3 its shards, so a model no rank can hold is built,
initialized and sharded in O(Ψ/N + one unit) per rank.

[Note: the same bits as an eager build]
An eager build draws its random numbers as it constructs: every torch module with parameters calls
its `reset_parameters()` at the end of its `__init__`, children before their parents, and a model's
own init (nanoGPT's `self.apply(self._init_weights)`) then visits every module, children first. A
meta build draws nothing. zerokit replays the same calls in the same order — every module's
`reset_parameters()` (or `_reset_parameters()`, torch's MultiheadAttention and Transformer) in
post-order, then `param_init_fn(module)` for every module in post-order, which is `model.apply(fn)`'s
order — from the same generator state, so each parameter ends with the bits an eager build followed
by `model.apply(param_init_fn)` gives. Tied parameters are one Parameter in several slots: every call
that writes it runs in the same order, and the last writer's values are kept, as in eager. (FSDP2's
`to_empty` + `init_weights()` says it cannot reproduce single-device init; this is why it can here.)

A call's values depend on the generator's state when it starts, which depends on every call before
it, so one flat param's values cannot be made without knowing the states in between. `prepare` runs
every call once on scratch tensors (a module at a time) and records, per call, the CPU generator's
state before it and which parameters it wrote; `fill(params, views)` then replays only the calls that
wrote one of those parameters, each from its recorded state, with scratch stand-ins for the module's
other parameters, and copies the final values into the flat param's views. Afterwards the generator is
left where an eager build would leave it (the state after the last call), so dropout masks and data
order after `zk.shard` match the eager run's too. Init runs on the CPU generator (then copied to the
engine's device), so the reference is an eager build on CPU. A call is run with its module's own
parameters and buffers swapped for stand-ins; one that reaches into a child's (MultiheadAttention sets
`out_proj.bias`) is seen touching a meta tensor and rerun with the whole subtree's stand-ins.

Under a process group every rank replays rank 0's generator state (broadcast once), so every rank
computes rank 0's values without a broadcast of the values themselves, as an eager model's are
broadcast from rank 0 (core/params/model_guard.py); the ranks then agree on a digest of the calls and of
what each wrote, so an init that differs between ranks is refused rather than trained on.

Buffers built on the meta device are small and replicated: they get their values in `prepare`, from
the same calls (BatchNorm's `reset_parameters` zeroes its running statistics), and are then broadcast
from rank 0 like any buffer. A parameter or buffer that no call writes is refused before anything is
allocated, naming it and the fix. Only the CPU generator is replayed: a `param_init_fn` drawing from
Python's `random` or NumPy gives values, but not eager's.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from zerokit.core.params import deferred as recorded
from zerokit.core.params.deferred import is_lazy

_PENDING = "_zerokit_deferred"  # a placeholder's attribute: the DeferredInit that will fill it, until it has

INIT_FIX = ("give it values in its module's reset_parameters() (torch's convention), or in a "
            "param_init_fn(module) passed to zk.shard, which is called for every module, children first")


def is_deferred(p: torch.Tensor) -> bool:
    """A parameter built on the meta device whose values `DeferredInit.fill` has not produced yet."""
    return getattr(p, _PENDING, None) is not None


def deferred_of(params: list[nn.Parameter]) -> "DeferredInit | None":
    for p in params:
        init = getattr(p, _PENDING, None)
        if init is not None:
            return init
    return None


_LAYOUT_ONLY = [False]


@contextlib.contextmanager
def layout_only():
    """Engines built inside keep a meta-built model on meta: their layout (flat params, units, shard ranges)
    without values or memory, as `zerokit explain` reports it. Such an engine cannot run."""
    _LAYOUT_ONLY.append(True)
    try:
        yield
    finally:
        _LAYOUT_ONLY.pop()


def init_device(comm) -> torch.device:
    """Where a meta-built model's parameters are made: the current CUDA device under NCCL, else the CPU."""
    if getattr(comm, "backend", None) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def has_meta_state(module: nn.Module) -> bool:
    """Some parameter or buffer is on the meta device (replayed) or recorded by zk.deferred_init (core/params/deferred.py)."""
    return any(t.is_meta or is_lazy(t) for t in module.parameters()) or any(t.is_meta or is_lazy(t)
                                                                           for t in module.buffers())


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def _post_order(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) children before their parent, each module once: `module.apply`'s order."""
    out, seen = [], set()

    def visit(name: str, m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child_name, child in m.named_children():
            visit(f"{name}.{child_name}".lstrip("."), child)
        out.append((name, m))
    visit("", module)
    return out


def _reset_method(m: nn.Module):
    for attr in ("reset_parameters", "_reset_parameters"):
        fn = getattr(m, attr, None)
        if callable(fn):
            return attr, fn
    return None


class _ReachesOut(Exception):
    """A call touched a tensor outside the stand-ins it was given (a child's parameter, still meta)."""


class _MetaWatch(TorchFunctionMode):
    """Raises `_ReachesOut` at the first op with a meta tensor among its arguments."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.is_meta:
                raise _ReachesOut()
        return func(*args, **kwargs)


def _sentinel(shape, dtype) -> torch.Tensor:
    """A CPU scratch tensor whose every element reads as "not written": NaN, or the dtype's minimum."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=dtype)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype)


def _written(t: torch.Tensor, version: int) -> bool:
    """Did a call write `t` (a sentinel stand-in): its version counter moved, or any element is no longer the
    sentinel (writes through `.data` do not move the version)."""
    if t._version != version:
        return True
    if t.numel() == 0:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return not bool(torch.isnan(t).all())
    if t.dtype == torch.bool:
        return bool(t.any())
    return bool((t != torch.iinfo(t.dtype).min).any())


def placeholder(shape, dtype, device) -> torch.Tensor:
    """A tensor of `shape` whose storage holds 0 bytes: a Parameter's stand-in until its flat param exists."""
    t = torch.empty(0, dtype=dtype, device=device)
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(n, 1)
    t.set_(t.untyped_storage(), 0, tuple(shape), tuple(reversed(stride)))
    return t


class _Call:
    __slots__ = ("name", "module", "fn", "rng", "subtree", "wrote")

    def __init__(self, name: str, module: nn.Module, fn, rng: torch.Tensor | None, subtree: bool, wrote: set[int]):
        self.name, self.module, self.fn = name, module, fn
        self.rng = rng  # the CPU generator's state before it, or None when it draws nothing
        self.subtree = subtree  # stand-ins for the whole subtree (the call reached into a child's tensors)
        self.wrote = wrote  # ids of the deferred parameters it wrote


class DeferredInit:
    """How a meta-built model's parameters get their values: [Note: the same bits as an eager build]."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.module, self.device = module, device
        self.calls: list[_Call] = []
        self.end_rng: torch.Tensor | None = None  # where an eager build leaves the generator
        self.digest = 0  # of the calls, what each wrote and the generator after each: agreed across ranks
        self.placeholders: dict[int, nn.Parameter] = {}  # id(meta Parameter) -> the placeholder in its slots
        self.originals: dict[int, nn.Parameter] = {}  # id(placeholder) -> the meta Parameter it stands for
        # id(parameter) -> its first slot (id(module), key) in registration order: the owner of a tie
        self.name_of = {id(p): n for n, p in module.named_parameters()}  # the meta Parameters' first names
        self.first_slot: dict[int, tuple[int, str]] = {}
        for mod in module.modules():
            for key, p in mod._parameters.items():
                if p is not None:
                    self.first_slot.setdefault(id(p), (id(mod), key))

    @classmethod
    def prepare(cls, module: nn.Module, param_init_fn, world, device: torch.device) -> "DeferredInit | None":
        """Work out every deferred tensor's init and install placeholders; None when nothing is on meta."""
        if _LAYOUT_ONLY[-1]:
            return None
        if not has_meta_state(module):
            if param_init_fn is not None:
                raise ValueError("zk.shard(param_init_fn=...) initializes a model built on the meta device, but no "
                                 "parameter or buffer of this model is on meta: call model.apply(param_init_fn) "
                                 "before zk.shard, or build the model under `with torch.device('meta'):`")
            return None
        if param_init_fn is not None and not callable(param_init_fn):
            raise TypeError(f"param_init_fn must be a callable(module), got {param_init_fn!r}")
        self = cls(module, device)
        self._agree_on_recordings(world)
        if _has_meta(module):
            self._agree_on_rng(world)
            with torch.no_grad():
                self._dry_run(param_init_fn)
        elif param_init_fn is not None:
            raise ValueError("zk.shard(param_init_fn=...) replays an init over a model built on the meta device; this "
                             "model was built under zk.deferred_init(), whose recording already holds its init: "
                             "call param_init_fn inside the deferred_init() block (model.apply(fn) records too)")
        self._finish_recorded()
        self._install_placeholders()
        return self

    # -- prepare ------------------------------------------------------------------------------
    def _agree_on_recordings(self, world) -> None:
        """zk.deferred_init's recordings (core/params/deferred.py): every rank replays rank 0's generator states."""
        self.recordings: dict[int, list[torch.Tensor]] = {}  # id(recording) -> the states to replay with
        order = []
        for _mod, _kind, _key, t in self._slots(self.module, recurse=True):
            if is_lazy(t) and id(t._zk_root.recording) not in self.recordings:
                self.recordings[id(t._zk_root.recording)] = t._zk_root.recording.states
                order.append(t._zk_root.recording)
        if not order:
            return
        shape = [(len(r.states), r.digest()) for r in order]
        self.digest ^= hash(tuple(shape)) & ((1 << 62) - 1)
        if world is None or not world.distributed:
            return
        everyone = world.all_gather_object(shape, label="the deferred_init recordings (ops and draws)", phase="init")
        if any(theirs != shape for theirs in everyone):
            raise ValueError("zk.shard: the model recorded by zk.deferred_init() differs between ranks (its ops or "
                             "random draws, or the real tensors they read): every rank must build the same model the "
                             "same way. A step that ran for real while recording (zk.quantize called after the `with "
                             "zk.deferred_init():` block computes each weight from this rank's own seed) reads "
                             "different values on ranks seeded differently: quantize inside the block, or seed every "
                             "rank alike")
        on = torch.device("cuda", torch.cuda.current_device()) if world.backend == "nccl" else torch.device("cpu")
        for r in order:
            if not r.states:
                continue
            states = torch.stack(r.states).to(on)  # (draws, 5056) uint8: rank 0's generator before each draw
            world.broadcast(states, src=0, phase="init", label="the deferred_init generator states")
            self.recordings[id(r)] = [s.clone() for s in states.cpu()]  # each its own storage

    def _value(self, t: torch.Tensor) -> torch.Tensor:
        return recorded.value(t, self.recordings[id(t._zk_root.recording)])

    def _finish_recorded(self) -> None:
        """Recorded buffers and plain tensor attributes get their values now (small, replicated); recorded
        parameters that nothing wrote (a bare torch.empty) are refused, as on meta."""
        missing = []
        for name, p in self.module.named_parameters():
            if is_lazy(p) and recorded.never_written(p):
                missing.append(f"parameter {name!r}")
        if missing:
            raise ValueError(f"zk.shard: {', '.join(missing[:6])} {'was' if len(missing) == 1 else 'were'} recorded by "
                             f"zk.deferred_init() as uninitialized memory (torch.empty with nothing writing it): "
                             f"{INIT_FIX}, inside the deferred_init() block")
        for mod in self.module.modules():
            for key, b in list(mod._buffers.items()):
                if is_lazy(b):
                    mod._buffers[key] = self._value(b).to(self.device)
            for key, v in list(vars(mod).items()):
                if is_lazy(v):  # a tensor kept as a plain attribute (HF's rotary original_inv_freq)
                    setattr(mod, key, self._value(v).to(self.device))

    def _agree_on_rng(self, world) -> None:
        """Every rank draws from rank 0's CPU generator state ([Note: the same bits as an eager build])."""
        if world is None or not world.distributed:
            return
        on = torch.device("cuda", torch.cuda.current_device()) if world.backend == "nccl" else torch.device("cpu")
        state = torch.get_rng_state().to(on)  # (5056,) uint8
        world.broadcast(state, src=0, phase="init", label="the meta-device init's generator state")
        torch.set_rng_state(state.cpu())

    @staticmethod
    def _slots(m: nn.Module, recurse: bool):
        """(owner module, "_parameters" or "_buffers", key, tensor) for m's own tensors, or its subtree's."""
        for mod in (m.modules() if recurse else [m]):
            for kind in ("_parameters", "_buffers"):
                for key, t in getattr(mod, kind).items():
                    if t is not None:
                        yield mod, kind, key, t

    def _dry_run(self, param_init_fn) -> None:
        # Deferred buffers become real tensors now (sentinel-filled), written in place by the calls below.
        made: dict[int, tuple[torch.Tensor, int]] = {}  # id(buffer) -> (buffer, its version when made)
        for mod, kind, key, t in list(self._slots(self.module, recurse=True)):
            if kind == "_buffers" and t.is_meta:
                b = _sentinel(t.shape, t.dtype)
                mod._buffers[key] = b
                made[id(b)] = (b, b._version)
        order = _post_order(self.module)
        plan = []
        for name, m in order:
            reset = _reset_method(m)
            if reset is not None and has_meta_state(m):
                plan.append((f"{name or type(m).__name__}.{reset[0]}()", m, reset[1]))
        if param_init_fn is not None:
            fn_name = getattr(param_init_fn, "__qualname__", repr(param_init_fn))
            for name, m in order:
                plan.append((f"{fn_name}({name or type(m).__name__})", m, functools.partial(param_init_fn, m)))
        written: set[int] = set()
        record = []
        for name, m, fn in plan:
            rng = torch.get_rng_state()
            wrote, subtree = self._run(m, fn, rng, None, tries=(False, True))
            after = torch.get_rng_state()
            if wrote:  # what no deferred parameter depends on is never replayed
                self.calls.append(_Call(name, m, fn, None if torch.equal(rng, after) else rng, subtree, wrote))
            written |= wrote
            record.append((name, self._names_of(wrote), hashlib.blake2b(after.numpy().tobytes(), digest_size=8).hexdigest()))
        self.end_rng = torch.get_rng_state()
        self.digest ^= int.from_bytes(hashlib.blake2b(repr(record).encode(), digest_size=8).digest(), "little", signed=True)
        # Refuse what nothing initialized, before any flat param is allocated.
        missing = [f"parameter {n!r}" for n, p in self.module.named_parameters() if p.is_meta and id(p) not in written]
        missing += [f"buffer {n!r}" for n, b in self.module.named_buffers() if id(b) in made and not _written(*made[id(b)])]
        if missing:
            one = len(missing) == 1
            shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
            raise ValueError(f"zk.shard: {shown} {'was' if one else 'were'} built on the meta device and nothing gave "
                             f"{'it' if one else 'them'} values: {INIT_FIX}. A buffer computed in __init__ can instead "
                             "be made on a real device inside `with torch.device('meta'):` by passing device='cpu' to "
                             "the call that creates it"
                             + (". LoRA adapters (zk.lora.inject) are drawn after the base model's init, which a "
                                "meta build cannot replay: inject them into a model built eagerly"
                                if any("lora_" in m for m in missing) else ""))
        for mod, kind, key, b in list(self._slots(self.module, True)):
            if kind == "_buffers" and id(b) in made and b.device != self.device:
                mod._buffers[key] = b.to(self.device)

    def _names_of(self, ids: set[int]) -> list[str]:
        return sorted(self.name_of[i] for i in ids)

    def _run(self, m: nn.Module, fn, rng: torch.Tensor | None, targets: dict[int, nn.Parameter] | None,
             tries: tuple[bool, ...]) -> tuple[set[int], bool]:
        """Run one call on stand-ins; return (ids of the deferred parameters it wrote, whether it took the subtree).

        Each try swaps stand-ins into m's own slots (False) or its whole subtree's (True); a try without the
        subtree that touches a meta tensor is undone and the next one runs. Stand-ins: a deferred parameter's
        is a sentinel tensor (the dry run, targets None) or `targets[id]` (fill: kept across calls), unless
        this slot is not the parameter's first (a later owner of a tie, whose draws eager discarded): then
        a throwaway of the same shape, so the generator still advances as in eager. Real parameters and,
        in fill, buffers get clones, so that no call changes what is already real.
        """
        for subtree in tries:
            if rng is not None:
                torch.set_rng_state(rng)
            swapped, shared = [], {}  # (slot, original, stand-in, its version, counts); id -> stand-in
            for mod, kind, key, t in list(self._slots(m, recurse=subtree)):
                owner = kind == "_parameters" and t.is_meta and self.first_slot.get(id(t)) == (id(mod), key)
                if kind == "_buffers":
                    if targets is None:
                        continue  # the dry run writes the real buffers
                    s = shared.setdefault(id(t), t.detach().clone())
                elif not t.is_meta:
                    s = shared.setdefault(id(t), nn.Parameter(t.detach().clone(), t.requires_grad))
                elif not owner:
                    s = nn.Parameter(_sentinel(t.shape, t.dtype), t.requires_grad)
                elif targets is not None and id(t) in targets:
                    s = targets[id(t)]
                else:
                    s = shared.setdefault(id(t), nn.Parameter(_sentinel(t.shape, t.dtype), t.requires_grad))
                getattr(mod, kind)[key] = s
                swapped.append((mod, kind, key, t, s, s._version, owner))
            reached_out = False
            try:
                with contextlib.nullcontext() if subtree else _MetaWatch():
                    fn()
            except _ReachesOut:
                reached_out = True
            finally:
                wrote = set()
                for mod, kind, key, t, s, version, owner in swapped:
                    now = getattr(mod, kind).get(key)
                    if now is not s and now is not None and not reached_out:  # assigned a new tensor: take its values
                        s.data.copy_(now.detach())
                        version = -1
                    getattr(mod, kind)[key] = t
                    if owner and _written(s, version):
                        wrote.add(id(t))
            if not reached_out:
                return wrote, subtree
        raise RuntimeError("zk.shard: an initialization call touched a meta tensor even with its whole subtree "
                           "materialized: it reads a parameter or buffer of another module")

    def _install_placeholders(self) -> None:
        """Put a 0-byte Parameter of the right shape in every meta parameter's slots (ties kept by identity)."""
        for mod, kind, key, t in list(self._slots(self.module, recurse=True)):
            if kind != "_parameters" or not (t.is_meta or is_lazy(t)):
                continue
            new = self.placeholders.get(id(t))
            if new is None:
                new = nn.Parameter(placeholder(t.shape, t.dtype, self.device), requires_grad=t.requires_grad)
                new.__dict__.update({k: v for k, v in t.__dict__.items()  # attributes set on the parameter stay
                                     if not k.startswith("_zk_")})
                self.placeholders[id(t)] = new
                self.originals[id(new)] = t
                setattr(new, _PENDING, self)
            mod._parameters[key] = new

    # -- fill ---------------------------------------------------------------------------------
    def fill(self, params: list[nn.Parameter], views: list[torch.Tensor]) -> None:
        """Write the initialized values of the deferred ones among `params` into their `views`.

        Replays, in order and each from its recorded generator state, every call that wrote one of them,
        with the model's slots holding the meta parameters it was built with meanwhile; then leaves the
        generator where the whole init left it.
        """
        wanted = {id(self.originals[id(p)]): (p, v) for p, v in zip(params, views) if is_deferred(p)}
        if not wanted:
            return
        # Each call writes straight into the flat param's view when the dtypes agree (no second copy of the unit).
        targets = {i: nn.Parameter(view if view.dtype == p.dtype else _sentinel(p.shape, p.dtype), p.requires_grad)
                   for i, (p, view) in wanted.items()}
        for i, (p, view) in list(wanted.items()):
            original = self.originals[id(p)]
            if is_lazy(original):  # recorded by zk.deferred_init: computed from its recording
                view.copy_(self._value(original))
                del wanted[i]
                delattr(p, _PENDING)
        if not wanted:
            return
        restore = self._show_originals()
        try:
            with torch.no_grad():
                for call in self.calls:
                    if call.wrote & wanted.keys():
                        self._run(call.module, call.fn, call.rng, targets, tries=(call.subtree,))
                for i, (p, view) in wanted.items():
                    if targets[i].data_ptr() != view.data_ptr():
                        view.copy_(targets[i].detach())
        finally:
            for mod, key, t in restore:
                mod._parameters[key] = t
            torch.set_rng_state(self.end_rng)
        for p, _ in wanted.values():
            delattr(p, _PENDING)

    def _show_originals(self) -> list:
        """Put every deferred parameter's meta Parameter back in its slots; return (module, key, placeholder)."""
        swapped = []
        for mod, kind, key, t in list(self._slots(self.module, recurse=True)):
            if kind == "_parameters" and id(t) in self.originals:
                mod._parameters[key] = self.originals[id(t)]
                swapped.append((mod, key, t))
        return swapped


