"""What the engine does to, and checks about, the user's model: one place, two call sites.

`ModelGuard(module, comm, stage, config)` is built by `Engine.__init__` before a stage lays
anything out, and then:

  * construction (`__init__`): every rank checks that every rank holds the same parameters
    and buffers (names, shapes, dtypes, requires_grad), copies rank 0's values to every rank
    (frozen parameters and buffers too, as DDP does), checks that every rank now holds the
    same bits, and refuses a model with nothing to train. Each check is one fixed-size
    exchange of a digest in the common case; only on a mismatch are the details exchanged, to
    name the first difference and the rank that has it. A refusal is raised on every rank,
    before any collective that could hang on the mismatch ([Note: agreement before training]).
    A model built on the meta device is prepared after the signature check (core/params/materialize.py):
    its parameters are neither broadcast nor checksummed, since every rank computes rank 0's
    values, and the ranks agree on a digest of its init instead;
  * before each `engine(...)` forward (`before_forward`) and each step (`before_step`): the
    parameters and buffers must still have the dtype, device and storage the engine built
    them with ([Note: a model changed under the engine]); and, before the forward, the buffers
    are broadcast from rank 0 exactly when torch DDP would ([Note: buffers as DDP keeps them]).

[Note: buffers as DDP keeps them]
torch DDP (`broadcast_buffers=True`, its default) broadcasts every buffer from rank 0 in the
pre-forward of `ddp(x)` when `require_forward_param_sync` holds: True before the first forward,
then set after each forward to "grad was enabled and gradients will be synchronised" (not
inside `no_sync()`). So a training forward makes the next forward sync, a forward under
`torch.no_grad()` or inside `no_sync()` makes the next one skip (model.eval() plays no part).
The engine keeps the same flag with the same rule, so the bits of every replica's buffers equal
rank 0's, which equal DDP's. The broadcast runs in `engine(...)`, not in `model(x)` (DDP's
`ddp.module(x)` does not sync either). Buffers are coalesced: one broadcast per (dtype, device),
flattened and copied back, none when the model has no buffers. Its bytes are counted by the
comm ledger under kind "broadcast", phase "buffers"; hybrid sharding broadcasts over the whole
world (every replica). `broadcast_buffers=False` keeps each rank's buffers local, as DDP's
option. `state_dict()` issues no collective: after a training forward the buffers already
equal rank 0's.

[Note: agreement before training]
Different models on different ranks must be caught for buffers as well as parameters: an
extra buffer on one rank would hang the initial broadcast until the process-group timeout and a
buffer of a different size would be partly copied. The signature of every parameter and buffer (names, shapes,
dtypes, requires_grad) and each rank's local problems are hashed into one int64; one
all-reduce of (digest, -digest, problems) tells every rank whether all agree. Only then are
tensors broadcast; afterwards a checksum of every tensor's bits is compared the same way, so
that a broadcast that did not reach a rank is refused rather than trained on.

[Note: a model changed under the engine]
The engine trains its own flat buffers: each parameter is a view into one of them. A
`model.half()`, `.double()`, `.to(dtype or device)` after `zk.shard` replaces the parameters'
storage, so the optimizer would keep updating buffers the model no longer reads (at stage 0
training would silently use stale weights). Each `engine(...)` and each step compares every
parameter's dtype, device and storage, and every buffer's dtype and device, with what the
engine built (no collective; a pass over the parameters' metadata) and refuses naming the
parameter and the fix: move or cast the model before `zk.shard`. A parameter frozen or
unfrozen after `zk.shard` is refused the same way: the engine built gradient storage, hooks and
optimizer state for exactly the parameters that required grad, so an unfrozen one would never
train (torch DDP has the same rule: its reducer is built once, at construction).
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from zerokit.core.params.flat_param import ParamInfo, is_packed, unique_params
from zerokit.core.params.deferred import is_lazy
from zerokit.core.params.materialize import DeferredInit, init_device, is_deferred
from zerokit.core.params.sharded_tensors import MOVE_FIX

_CHECKSUM_CHUNK = 1 << 20  # elements widened to int64 at a time when checksumming
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
def _digest(obj) -> int:
    """A stable int64 digest of a Python value (repr, not hash(): str hashes differ between processes)."""
    return int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=8).digest(), "little", signed=True)


def unique_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) in registration order, each tensor once."""
    seen, out = set(), []
    for name, b in module.named_buffers():
        if id(b) not in seen:
            seen.add(id(b))
            out.append((name, b))
    return out


def bits_checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the tensor's bits (plain and position-weighted), on its device: (2,)."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()]) if flat.element_size() in _INT_OF_SIZE else flat.double()
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for lo in range(0, bits.numel(), _CHECKSUM_CHUNK):
        chunk = bits[lo:lo + _CHECKSUM_CHUNK].to(torch.int64)
        weights = torch.arange(lo, lo + chunk.numel(), dtype=torch.int64, device=chunk.device) % 65521 + 1
        out[0] += chunk.sum()
        out[1] += (chunk * weights).sum()  # wraps around on overflow: a checksum, the same on every rank
    return out


class ModelGuard:
    """The model's agreement across ranks, its buffers' sync and its dtype/device guard (see the module notes)."""

    def __init__(self, module: nn.Module, comm, stage: int, config):
        self.module, self.comm, self.stage = module, comm, stage
        self.broadcast_buffers = config.broadcast_buffers
        # Hybrid sharding: agreement and buffers concern every replica, so the whole world.
        self.world = getattr(comm, "world", comm)
        self.params: list[ParamInfo] = self._check_signature(config.param_groups)
        # A meta-built model (the signature says which parameters are on meta, so every rank agrees it is one)
        # gets placeholders now and its values as each stage lays it out: every rank computes rank 0's from
        # rank 0's generator state, so they are neither broadcast nor checksummed; the ranks agree instead on
        # a digest of the init calls and what each wrote (core/params/materialize.py).
        self.deferred = self._prepare_deferred(config)
        if self.deferred is not None:
            self.params = unique_params(module, config.param_groups)  # the placeholders, not the meta Parameters
        broadcast_module_state(module, comm)
        self._check_values()
        self._check_trainable()
        # Where each parameter and buffer is registered (module, key): read per forward without walking the model.
        self.param_slots = [(mod, key, p, f"{prefix}.{key}".lstrip("."))
                            for prefix, mod in module.named_modules(remove_duplicate=False)
                            for key, p in mod._parameters.items() if p is not None]
        self.buffer_slots = [(mod, key, f"{prefix}.{key}".lstrip("."), b.dtype, b.device)
                             for prefix, mod in module.named_modules(remove_duplicate=False)
                             for key, b in mod._buffers.items() if b is not None]
        self.sync_next_forward = True  # DDP's require_forward_param_sync: [Note: buffers as DDP keeps them]
        self._expected: list | None = None  # (param, name, dtype, device, storage), from the engine's flat buffers
        self._trainable: list = []  # (param, name, requires_grad at zk.shard)

    # -- construction: [Note: agreement before training] ---------------------------------------
    def _agree(self, digest: int, problem: bool, label: str) -> bool:
        """One fixed-size exchange: True when every rank's digest is equal and no rank has a problem."""
        if not self.world.distributed:
            return not problem
        device = (torch.device("cuda", torch.cuda.current_device()) if self.world.backend == "nccl"
                  else torch.device("cpu"))
        mine = torch.tensor([digest, -digest if digest != -2**63 else 2**63 - 1, int(problem)],
                            dtype=torch.int64, device=device)
        top = self.world.all_reduce_scalars(mine, op="max", label=label).tolist()
        return top[0] == -top[1] and top[2] == 0

    def _check_signature(self, param_groups) -> list[ParamInfo]:
        problems: list[str] = []
        try:
            infos = unique_params(self.module, param_groups)
        except Exception as exc:  # a bad param_groups function must not leave other ranks hanging
            infos, problems = [], [f"param_groups failed: {exc!r}"]
        devices = sorted({str(i.param.device) for i in infos})
        if len(devices) > 1:
            where = {d: next(i.names[0] for i in infos if str(i.param.device) == d) for d in devices}
            problems.append("parameters are on several devices: " + ", ".join(f"{n!r} on {d}" for d, n in where.items())
                            + "; move the model to one device first")
        for info in infos:
            if not info.param.is_floating_point() and not is_packed(info.param):
                problems.append(f"parameter {info.names[0]!r} has dtype {info.param.dtype}; "
                                f"only floating-point parameters can be trained or sharded (register it as a buffer)")
        if not infos and not problems:
            problems.append("the model has no parameters")
        signature = ([("parameter", i.names[0], tuple(i.param.shape), str(i.param.dtype), i.param.requires_grad)
                      + (("on meta",) if i.param.is_meta else ("recorded",) if is_lazy(i.param) else ())
                      for i in infos],
                     [("buffer", name, tuple(b.shape), str(b.dtype))
                      + (("on meta",) if b.is_meta else ("recorded",) if is_lazy(b) else ())
                      for name, b in unique_buffers(self.module)])
        if self._agree(_digest(signature), bool(problems), "the model check (names, shapes, dtypes)"):
            return infos
        everyone = self.world.all_gather_object((problems, signature), label="the model check (details)", phase="init")
        errors = [f"rank {r}: {msg}" for r, (theirs, _) in enumerate(everyone) for msg in theirs]
        reference = everyone[0][1]
        for r, (_, their_signature) in enumerate(everyone[1:], start=1):
            for kind, mine, theirs in zip(("parameters", "buffers"), reference, their_signature):
                difference = _first_difference(kind, mine, theirs, r)
                if difference:
                    errors.append(difference + "; every rank must build the same model")
                    break
        raise ValueError(f"zerokit stage {self.stage}: cannot wrap this model (raised on rank {self.world.rank}):\n  "
                         + "\n  ".join(errors))

    def _prepare_deferred(self, config):
        """core/params/materialize.py's DeferredInit for a meta-built model (None otherwise), agreed by every rank.

        Every rank holds the same signature by now, so every rank or none prepares; a refusal (something
        nothing initializes, an init function that raised) on any rank is raised on every rank."""
        deferred, error = None, None
        try:
            deferred = DeferredInit.prepare(self.module, config.param_init_fn, self.world, init_device(self.comm))
        except Exception as exc:  # an init that fails on one rank must not leave the others waiting
            error = exc
        if deferred is None and error is None:
            return None
        if self._agree(deferred.digest if deferred is not None else 0, error is not None,
                       "the meta-device init (its calls and what each wrote)"):
            return deferred
        if error is not None:
            raise error
        raise ValueError(
            f"zerokit stage {self.stage}: cannot wrap this model (raised on rank {self.world.rank}): the meta-device "
            "initialization differs between ranks, or failed on another rank (its error is raised there): every "
            "rank's reset_parameters() / param_init_fn calls must write the same parameters and draw the same "
            "random numbers (an init that depends on the rank?)")

    def _named_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        return ([("parameter", i.names[0], i.param) for i in self.params if not is_deferred(i.param)]
                + [("buffer", name, b) for name, b in unique_buffers(self.module)])

    def _check_values(self) -> None:
        """After the initial broadcast every rank must hold rank 0's bits, parameters and buffers alike."""
        if not self.world.distributed:  # one process (or a simulated rank, maybe on the meta device): nothing to compare
            return
        named = self._named_tensors()
        sums = [bits_checksum(t) for _, _, t in named]
        table = torch.stack(sums).cpu().tolist() if sums else []
        if self._agree(_digest(table), False, "the model check (values after the initial broadcast)"):
            return
        everyone = self.world.all_gather_object(table, label="the model check (value details)", phase="init")
        for r, theirs in enumerate(everyone[1:], start=1):
            for (kind, name, _), a, b in zip(named, everyone[0], theirs):
                if a != b:
                    raise ValueError(
                        f"zerokit stage {self.stage}: cannot wrap this model (raised on rank {self.world.rank}): "
                        f"{kind} {name!r} on rank {r} differs from rank 0's after the initial broadcast from rank 0: "
                        "every rank must start from rank 0's values (was the broadcast skipped, or the model changed "
                        "on one rank while zk.shard ran?)")

    def _check_trainable(self) -> None:
        """Nothing to train is refused, on every rank (every rank holds the same signature by now)."""
        if any(i.param.requires_grad for i in self.params):
            return
        elements = sum(i.param.numel() for i in self.params)
        raise ValueError(
            f"zerokit stage {self.stage}: no parameter of this model requires grad ({len(self.params)} frozen "
            f"parameters, {elements} elements): step() would never change anything. Unfreeze some "
            "(param.requires_grad_(True)) or inject LoRA adapters (zk.lora.inject(model, ...)) before zk.shard")

    # -- each use: [Note: a model changed under the engine], [Note: buffers as DDP keeps them] -------
    def before_forward(self, engine) -> None:
        self.check_unchanged(engine)
        if self.broadcast_buffers and self.sync_next_forward:
            self.sync_buffers()

    def after_forward(self, engine) -> None:
        """DDP's _post_forward rule: the next forward syncs iff this one had grad enabled outside no_sync()."""
        self.sync_next_forward = torch.is_grad_enabled() and engine.sync_gradients

    def before_step(self, engine) -> None:
        self.check_unchanged(engine)

    def sync_buffers(self) -> None:
        """Rank 0's buffers to every rank: one broadcast per (dtype, device), none without buffers."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        seen = set()
        for mod, key, _, _, _ in self.buffer_slots:  # read afresh: a buffer may be reassigned, as DDP re-reads them
            b = mod._buffers.get(key)
            if b is not None and b.numel() and id(b) not in seen:
                seen.add(id(b))
                groups.setdefault((b.dtype, b.device), []).append(b)
        if not groups or self.world.world_size == 1:  # a simulated rank counts them too
            return
        with torch.no_grad():
            for (dtype, _), bufs in groups.items():
                with torch.autograd._unsafe_preserve_version_counter(tuple(bufs)):  # as DDP's _sync_buffers
                    flat = _flatten_dense_tensors(bufs)  # (sum of numels,)
                    self.world.broadcast(flat, src=0, phase="buffers",
                                         label=f"buffers ({len(bufs)} of {str(dtype).replace('torch.', '')})")
                    if self.world.rank != 0:
                        for b, value in zip(bufs, _unflatten_dense_tensors(flat, bufs)):
                            b.copy_(value)

    def check_unchanged(self, engine) -> None:
        """Refuse parameters or buffers whose dtype, device or storage changed since zk.shard."""
        if self._expected is None:
            self._expected = [(p, fp.names[j][0], data.dtype, data.device, data.untyped_storage()._cdata)
                              for fp, data in zip(engine.flat_params, engine.flat_data)
                              for j, p in enumerate(fp.params)]
            self._trainable = [(p, fp.names[j][0], fp.requires_grad) for fp in engine.flat_params
                               for j, p in enumerate(fp.params)]
        for mod, key, p, name in self.param_slots:  # a Parameter replaced (model.to(another device) does)
            now = mod._parameters.get(key)
            if now is not p:
                self._refuse(f"parameter {name!r} is no longer the Parameter the engine was built with"
                             + (f" (now {now.dtype} on {now.device})" if now is not None else " (removed)"))
        with torch._C.DisableTorchFunctionSubclass():  # metadata only: skip stage 3's sharded-parameter dispatch
            flipped = [(name, was) for p, name, was in self._trainable if p.requires_grad != was]
            changed = [(p, name, dtype, device) for p, name, dtype, device, storage in self._expected
                       if p.dtype != dtype or p.device != device or p.untyped_storage()._cdata != storage]
        for name, was in flipped[:1]:
            raise RuntimeError(
                f"zerokit stage {self.stage} (rank {self.comm.rank}): parameter {name!r} was "
                f"{'trainable' if was else 'frozen'} at zk.shard and has requires_grad={not was} now. The engine gives "
                "gradient storage, hooks, a master copy and optimizer state to exactly the parameters that required "
                "grad when it was built, so it would " + ("keep stepping it with a zero gradient" if was else
                                                           "never train it") + ": freeze or unfreeze parameters before "
                "zk.shard, and build a new engine (engine.save / load carries the training state across) when the "
                "set of trainable parameters changes")
        for p, name, dtype, device in changed[:1]:
            now = (f"is now {p.dtype} on {p.device}" if (p.dtype, p.device) != (dtype, device)
                   else "no longer lives in the engine's flat buffer")
            self._refuse(f"parameter {name!r} {now}, but the engine was built with {dtype} on {device}")
        for mod, key, name, dtype, device in self.buffer_slots:
            b = mod._buffers.get(key)
            if b is not None and (b.dtype != dtype or b.device != device):
                self._refuse(f"buffer {name!r} is now {b.dtype} on {b.device}, but the engine was built with "
                             f"{dtype} on {device}")

    def _refuse(self, what: str) -> None:
        raise RuntimeError(
            f"zerokit stage {self.stage} (rank {self.comm.rank}): {what} (model.half(), .double(), .to(...) after "
            "zk.shard?). The engine trains its own flat buffers, which the model would no longer use: "
            + MOVE_FIX)


def _first_difference(kind: str, mine: list[tuple], theirs: list[tuple], r: int) -> str | None:
    """The first entry where rank r's list differs from rank 0's, in words; None when equal."""
    names_mine, names_theirs = {a[1] for a in mine}, {b[1] for b in theirs}
    for a, b in zip(mine, theirs):
        if a == b:
            continue
        if b[1] not in names_mine:
            return f"{b[0]} {b[1]!r} (shape {b[2]}, {b[3]}) is on rank {r} but not on rank 0"
        if a[1] not in names_theirs:
            return f"{a[0]} {a[1]!r} (shape {a[2]}, {a[3]}) is on rank 0 but not on rank {r}"
        fields = "(name, shape, dtype, requires_grad)" if a[0] == "parameter" else "(name, shape, dtype)"
        return f"{a[0]} {a[1]!r}: rank 0 has {fields} = {a[1:]}, rank {r} has {b[1:]}"
    if len(mine) != len(theirs):
        extra, where = (theirs[len(mine)], f"on rank {r} but not on rank 0") if len(theirs) > len(mine) else (
            mine[len(theirs)], f"on rank 0 but not on rank {r}")
        return f"{extra[0]} {extra[1]!r} (shape {extra[2]}, {extra[3]}) is {where}"
    return None


def broadcast_module_state(module: nn.Module, comm) -> None:
    """Copy rank 0's parameters (frozen ones too) and buffers to every rank, as DDP does at construction."""
    seen = set()
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if id(t) in seen or t.numel() == 0 or is_deferred(t):  # values made on every rank: core/params/materialize.py
            continue
        seen.add(id(t))
        comm.broadcast(t.data, src=0, phase="init", label=name)
