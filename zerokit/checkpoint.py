"""Sharded checkpoints: every rank writes what it owns; any world size, stage or precision reads it back.

A checkpoint is a directory:

    meta.json                    rank 0: world size, stage, precision, optimizer class and
                                 hyperparameters per group, loss-scaler state, versions,
                                 every parameter's names / shape / dtype, the caller's `extra`
    model.safetensors            rank 0: engine.state_dict(full=True), the unwrapped model's
                                 keys (fp32 master values where they exist, frozen params and
                                 buffers as they are); a tied tensor is stored once, under its
                                 first name, and meta.json's "aliases" maps the other names to it
    rank{r}-of-{N}.safetensors   rank r: for every trainable flat param, the pieces of rank r's
                                 range [r * shard_numel, (r + 1) * shard_numel) of the fp32
                                 master and of each per-element optimizer state

[Note: pieces keyed by name and range]
A flat buffer's layout depends on the world size (padding), the stage (stage 3 groups by
unit) and `bucket_numel`, so a shard file never refers to it. Each stored tensor is the part
of *one parameter* that fell in the writer's range, keyed

    "<kind>::<param name>::<start>:<end>"      kind = "master" or "state.<key>" (exp_avg, ...)

with [start, end) counted in the flattened parameter's elements; padding is never stored.
A reader with any layout asks, for each parameter part it owns, which stored pieces overlap
it and copies those sub-ranges (safetensors reads just the slice). Scalar optimizer states
(Adam's `step`) are stored once per piece as 0-dim tensors. At stage 0 every rank holds
everything, but rank r still writes only range r, so the files are the same size at every stage.

Loading needs no collective but one: every rank reads and checks everything it needs
first (meta, model file, every rank file's index, its own slices), then one all-gather of
the verdicts lets every rank raise the same ValueError — naming the file and the parameter —
before anything is written into the engine and before any later collective could hang.
Then the stage's `load_flat_params` writes the full values into its own storage (whole
buffers at stages 0-2, this rank's shards at stage 3), and the masters and optimizer state
of this rank's range are installed. A rank holds one full fp32 copy of the model while
loading (4Ψ bytes), the price of reading a plain model file.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["save", "load", "load_full_state_dict", "rank_file", "META_FILE", "MODEL_FILE"]

FORMAT = "zerokit-checkpoint"
VERSION = 1
META_FILE = "meta.json"
MODEL_FILE = "model.safetensors"
MASTER = "master"
_KEY = re.compile(r"^(?P<kind>[^:]+)::(?P<name>.+)::(?P<start>\d+):(?P<end>\d+)$")


def rank_file(rank: int, world_size: int) -> str:
    return f"rank{rank}-of-{world_size}.safetensors"


def piece_key(kind: str, name: str, start: int, end: int) -> str:
    return f"{kind}::{name}::{start}:{end}"


def _zerokit_version() -> str:
    try:
        from importlib.metadata import version
        return version("zerokit")
    except Exception:  # run from a source checkout without an installed distribution
        return "source"


def _master_start(fp, master: torch.Tensor) -> int:
    """Flat offset where this rank's master tensor begins: 0 when it spans the whole buffer (stage 0)."""
    if master.numel() == fp.padded_numel:
        return 0
    assert master.numel() == fp.shard_numel, (master.numel(), fp.shard_numel, fp.padded_numel)
    return fp.shard_range[0]


def _trainable_with_masters(engine) -> list[tuple[object, torch.Tensor]]:
    trainable = [fp for fp in engine.flat_params if fp.requires_grad]
    masters = engine.optimizer.master_shards
    assert len(trainable) == len(masters), (len(trainable), len(masters))
    return list(zip(trainable, masters))


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _json_number(value):
    """Hyperparameters as JSON: numbers (and tuples of numbers) only; None for anything else."""
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                for v in value):
        return list(value)
    return None


def _state_kinds(engine) -> dict[str, str]:
    """Optimizer state key -> "elementwise" (shaped like the master) or "scalar" (0-dim), checked."""
    kinds: dict[str, str] = {}
    for fp, master in _trainable_with_masters(engine):
        for key, value in engine.optimizer.optimizer.state.get(master, {}).items():
            if torch.is_tensor(value) and value.shape == master.shape:
                kind = "elementwise"
            elif torch.is_tensor(value) and value.dim() == 0:
                kind = "scalar"
            else:
                raise ValueError(
                    f"optimizer state {key!r} of {_optimizer_name(engine.optimizer.optimizer)} for the flat param "
                    f"holding {fp.names[0][0]!r} is neither shaped like its master nor a 0-dim tensor; "
                    "a sharded checkpoint cannot re-slice it")
            if kinds.setdefault(key, kind) != kind:
                raise ValueError(f"optimizer state {key!r} is elementwise for some params and scalar for others")
    return kinds


# ====================================================================== save
def save(engine, directory: str | os.PathLike, extra: dict | None = None) -> None:
    """Write a sharded checkpoint of `engine` into `directory`. A collective: every rank calls it.

    `extra` (JSON-serialisable) is stored in meta.json and handed back by `load` (the
    training loop's step index, for instance). Raises on every rank if any rank failed
    to write, naming the file.
    """
    directory = os.fspath(directory)
    engine.finish_backward()
    full = engine.state_dict(full=True)  # a collective at stages 1-3: every rank takes part
    problems: list[str] = []
    kinds: dict[str, str] = {}
    try:
        os.makedirs(directory, exist_ok=True)
        if engine.rank == 0 and os.path.exists(os.path.join(directory, META_FILE)):
            # Overwriting: until the new meta.json is written the directory reads as incomplete.
            os.remove(os.path.join(directory, META_FILE))
        kinds = _state_kinds(engine)
        _write_rank_file(engine, directory, kinds, _aliases(engine.module))
        if engine.rank == 0:
            _write_model_file(engine, directory, full)
    except Exception as exc:  # reported to every rank below, never left for a peer to hang on
        problems.append(f"{type(exc).__name__}: {exc}")
    _raise_if_any(engine, problems, f"cannot save checkpoint {directory}")
    # meta.json goes last, once every shard is on disk: a directory without it is incomplete.
    if engine.rank == 0:
        try:
            stale = re.compile(r"^rank\d+-of-(\d+)\.safetensors$")
            for entry in os.listdir(directory):  # rank files of an earlier save at another world size
                m = stale.match(entry)
                if m and int(m[1]) != engine.world_size:
                    os.remove(os.path.join(directory, entry))
            _write_atomic_json(os.path.join(directory, META_FILE), _meta(engine, kinds, extra))
        except Exception as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
    _raise_if_any(engine, problems, f"cannot save checkpoint {directory}")


def _raise_if_any(engine, problems: list[str], what: str) -> None:
    everyone = engine.comm.all_gather_object(problems)
    errors = [f"rank {r}: {msg}" for r, theirs in enumerate(everyone) for msg in theirs]
    if errors:
        raise ValueError(f"zerokit: {what} (raised on rank {engine.rank}):\n  " + "\n  ".join(errors))


def _save_tensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    tmp = path + ".tmp"
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)  # a reader never sees half a file
    except Exception as exc:
        raise OSError(f"writing {path}: {exc}") from exc


def _write_atomic_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except Exception as exc:
        raise OSError(f"writing {path}: {exc}") from exc


def _write_rank_file(engine, directory: str, kinds: dict[str, str], aliases: dict[str, str]) -> None:
    """This rank's pieces of every trainable flat param: master and optimizer states, by name and range."""
    tensors: dict[str, torch.Tensor] = {}
    state = engine.optimizer.optimizer.state
    for fp, master in _trainable_with_masters(engine):
        base = _master_start(fp, master)
        lo, _hi = fp.shard_range
        master_state = state.get(master, {})
        for piece in fp.layout.pieces(engine.rank):
            name = aliases.get(fp.names[piece.index][0], fp.names[piece.index][0])  # the model file's key
            a = lo + piece.shard_offset - base  # where the piece sits in the master tensor
            b = a + piece.numel
            # clone: safetensors stores each tensor on its own, never views of one storage
            tensors[piece_key(MASTER, name, piece.start, piece.end)] = master.detach()[a:b].float().cpu().clone()
            for key, kind in kinds.items():
                value = master_state[key].detach()
                stored = value[a:b] if kind == "elementwise" else value
                tensors[piece_key(f"state.{key}", name, piece.start, piece.end)] = stored.cpu().clone()
    path = os.path.join(directory, rank_file(engine.rank, engine.world_size))
    _save_tensors(tensors, path, {"format": FORMAT, "rank": str(engine.rank), "world_size": str(engine.world_size)})


def _aliases(module) -> dict[str, str]:
    """Second and later names of a tensor reachable under several state_dict keys -> its first name."""
    first: dict[int, str] = {}
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in first:
            out[name] = first[id(t)]
        else:
            first[id(t)] = name
    return out


def _write_model_file(engine, directory: str, full: dict[str, torch.Tensor]) -> None:
    aliases = _aliases(engine.module)
    tensors = {k: v.detach().cpu().contiguous() for k, v in full.items() if k not in aliases}
    _save_tensors(tensors, os.path.join(directory, MODEL_FILE), {"format": FORMAT})


def _meta(engine, kinds: dict[str, str], extra: dict | None) -> dict:
    optimizer = engine.optimizer.optimizer
    aliases = _aliases(engine.module)
    fp_of_master = {id(m): fp for fp, m in _trainable_with_masters(engine)}
    groups = []
    for group in optimizer.param_groups:
        fps = [fp_of_master[id(m)] for m in group["params"] if id(m) in fp_of_master]
        names = [aliases.get(names[0], names[0]) for fp in fps for names in fp.names]
        hyper = {k: _json_number(v) for k, v in group.items() if k != "params"}
        groups.append({"params": names, "hyperparameters": {k: v for k, v in hyper.items() if v is not None}})
    step = None
    for _fp, master in _trainable_with_masters(engine):
        value = optimizer.state.get(master, {}).get("step")
        if value is not None:
            step = int(float(value))
            break
    params = {}
    for fp in engine.flat_params:
        for names, shape in zip(fp.names, fp.layout.shapes):
            params[aliases.get(names[0], names[0])] = {
                "names": list(names), "shape": list(shape), "dtype": str(fp.dtype).removeprefix("torch."),
                "requires_grad": fp.requires_grad}
    return {
        "format": FORMAT, "version": VERSION,
        "world_size": engine.world_size, "stage": engine.stage, "precision": engine.policy.name,
        "optimizer": {"class": _optimizer_name(optimizer), "param_groups": groups, "state": kinds,
                      "step": step},
        "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "versions": {"zerokit": _zerokit_version(), "torch": torch.__version__,
                     "safetensors": safetensors.__version__},
        "params": params,
        "aliases": aliases,
        "extra": extra or {},
    }


# ====================================================================== load
@dataclass
class _Plan:
    """Everything read and checked, ready to be installed without further I/O."""

    meta: dict
    flats: list[torch.Tensor] = field(default_factory=list)  # (padded_numel,) fp32 per flat param
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    masters: list[torch.Tensor] = field(default_factory=list)  # like optimizer.master_shards
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)  # like master_shards
    hyper: list[dict] = field(default_factory=list)  # per optimizer param group


def load(engine, directory: str | os.PathLike) -> dict:
    """Load a checkpoint written by `save` at any world size, stage or precision; return its meta.

    Every rank calls it (one small collective exchanges the verdict). Bad input — a
    missing file, a different model (names, shapes), another optimizer class — raises
    ValueError on every rank, naming the file and the parameter, and leaves the engine as
    it was. Restores parameters, buffers, fp32 masters, optimizer state and numeric
    hyperparameters (lr, betas, ... as torch's load_state_dict does), and the loss-scaler
    state; clears gradients.
    """
    directory = os.fspath(directory)
    engine.finish_backward()
    plan, problems = None, []
    try:
        plan = _read(engine, directory)
    except Exception as exc:  # every rank must hear about it before anyone moves on
        problems.append(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc))
    _raise_if_any(engine, problems, f"cannot load checkpoint {directory}")
    _install(engine, plan)
    return plan.meta


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from exc


@contextlib.contextmanager
def _open_safetensors(path: str):
    """safe_open, with any failure to open (truncated, not safetensors) reported under the file's name."""
    try:
        handle = safe_open(path, framework="pt")
    except Exception as exc:
        raise ValueError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from exc
    with handle as f:
        yield f


def _read(engine, directory: str) -> _Plan:
    meta_path = os.path.join(directory, META_FILE)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{meta_path} is missing: not a zerokit checkpoint, or its save did not finish")
    meta = _read_json(meta_path)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                         f"expected {FORMAT!r} version {VERSION}")
    mine = _optimizer_name(engine.optimizer.optimizer)
    if meta["optimizer"]["class"] != mine:
        raise ValueError(f"{meta_path}: the checkpoint's optimizer is {meta['optimizer']['class']}, this engine's "
                         f"is {mine}; build the engine with the same optimizer class")
    plan = _Plan(meta)
    _read_model_file(engine, directory, meta, plan)
    _read_rank_files(engine, directory, meta, plan)
    plan.hyper = _match_hyperparameters(engine, meta)
    return plan


def _read_model_file(engine, directory: str, meta: dict, plan: _Plan) -> None:
    path = os.path.join(directory, MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing")
    aliases = meta["aliases"]
    expected = engine.module.state_dict(keep_vars=True)  # names and shapes only (stage 3: no data)
    with _open_safetensors(path) as f:
        stored = set(f.keys())
        saved_names = stored | {a for a, target in aliases.items() if target in stored}
        missing = [k for k in expected if k not in saved_names]
        unexpected = sorted(saved_names - set(expected))
        if missing or unexpected:
            raise ValueError(f"{path} does not match this model: missing {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                             f"{' ...' if len(unexpected) > 5 else ''}")

        def get(name: str) -> torch.Tensor:
            key = aliases.get(name, name)
            shape = tuple(f.get_slice(key).get_shape())
            if shape != tuple(expected[name].shape):
                raise ValueError(f"{path}: {name!r} has shape {shape} in the checkpoint, "
                                 f"{tuple(expected[name].shape)} in this model")
            return f.get_tensor(key)

        param_ids = set()
        for fp in engine.flat_params:
            full = torch.zeros(fp.padded_numel, dtype=torch.float32)  # (padded_numel,) padding stays zero
            for names, view, p in zip(fp.names, fp.views(full), fp.params):
                view.copy_(get(names[0]))
                param_ids.add(id(p))
            plan.flats.append(full)
        for name, t in expected.items():
            if id(t) not in param_ids and name not in plan.buffers:
                plan.buffers[name] = get(name)


def _read_rank_files(engine, directory: str, meta: dict, plan: _Plan) -> None:
    """Assemble this rank's masters and optimizer states from whichever saved pieces overlap them."""
    n_saved = int(meta["world_size"])
    kinds: dict[str, str] = meta["optimizer"]["state"]
    aliases = meta["aliases"]
    index: dict[tuple[str, str], list[tuple[int, int, int, str]]] = {}  # (kind, name) -> [(start, end, r, key)]
    paths = [os.path.join(directory, rank_file(r, n_saved)) for r in range(n_saved)]
    with contextlib.ExitStack() as stack:
        files = []
        for r, path in enumerate(paths):
            if not os.path.isfile(path):
                raise ValueError(f"{path} is missing: the checkpoint was written by {n_saved} ranks and every "
                                 "rank file is needed")
            f = stack.enter_context(_open_safetensors(path))
            files.append(f)
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise ValueError(f"{path}: unrecognised key {key!r}")
                name, start, end = m["name"], int(m["start"]), int(m["end"])
                info = meta["params"].get(name)
                if info is None:
                    raise ValueError(f"{path}: piece of unknown parameter {name!r}")
                numel = 1
                for d in info["shape"]:
                    numel *= d
                if not 0 <= start < end <= numel:
                    raise ValueError(f"{path}: piece {key!r} is outside {name!r} ({numel} elements)")
                index.setdefault((m["kind"], name), []).append((start, end, r, key))
        # Scalar states (Adam's step) are equal for every master, since all of them step
        # together; a master holding only padding takes them from the first master piece.
        first_master_piece = next((pieces[0] for (kind, _), pieces in index.items() if kind == MASTER), None)

        for fp, master in _trainable_with_masters(engine):
            base = _master_start(fp, master)
            size = master.numel()
            values = torch.zeros(size, dtype=torch.float32)  # (master numel,) padding stays zero
            states = {key: torch.zeros(size, dtype=torch.float32) for key, kind in kinds.items()
                      if kind == "elementwise"}  # (master numel,) each
            scalar_source = None  # (start, end, rank, key) of a master piece this master overlaps
            for i, (offset, numel) in enumerate(zip(fp.layout.offsets, fp.layout.numels)):
                lo, hi = max(base, offset), min(base + size, offset + numel)
                if lo >= hi:
                    continue
                a, b = lo - offset, hi - offset  # the part of parameter i this master holds
                at = lo - base  # ... and where it sits in the master
                name = aliases.get(fp.names[i][0], fp.names[i][0])
                pieces = index.get((MASTER, name), [])
                _fill(values[at:at + b - a], pieces, a, b, files, paths, name, MASTER)
                for key, tensor in states.items():
                    _fill(tensor[at:at + b - a], index.get((f"state.{key}", name), []), a, b, files, paths, name,
                          f"state.{key}")
                if scalar_source is None:
                    scalar_source = next((pc for pc in pieces if pc[0] < b and pc[1] > a), None)
            scalar_source = scalar_source or first_master_piece
            for key, kind in kinds.items():
                if kind == "scalar":
                    if scalar_source is None:
                        raise ValueError(f"{paths[0]}: no piece to take optimizer state {key!r} from")
                    _s, _e, r, master_key = scalar_source
                    state_key = f"state.{key}" + master_key[len(MASTER):]  # same name and range
                    try:
                        states[key] = files[r].get_tensor(state_key)
                    except Exception as exc:
                        raise ValueError(f"{paths[r]}: optimizer state {state_key!r} is missing ({exc})") from exc
            plan.masters.append(values)
            plan.states.append(states)


def _fill(out: torch.Tensor, pieces: list, a: int, b: int, files, paths, name: str, kind: str) -> None:
    """out[:] = elements [a, b) of `name`'s `kind`, copied from the overlapping saved pieces."""
    covered = torch.zeros(b - a, dtype=torch.bool)
    for start, end, r, key in pieces:
        lo, hi = max(a, start), min(b, end)
        if lo >= hi:
            continue
        sl = files[r].get_slice(key)
        out[lo - a:hi - a] = sl[lo - start:hi - start]  # reads only this sub-range from disk
        covered[lo - a:hi - a] = True
    if not bool(covered.all()):
        first = int((~covered).nonzero()[0]) + a
        raise ValueError(f"{kind} of parameter {name!r}: elements [{a}, {b}) are not all in the rank files "
                         f"({os.path.dirname(paths[0])}/rank*-of-{len(paths)}.safetensors); element {first} is "
                         "missing")


def _match_hyperparameters(engine, meta: dict) -> list[dict]:
    """For each of this optimizer's groups, the saved group holding its first parameter's numbers."""
    saved_group_of = {}
    for group in meta["optimizer"]["param_groups"]:
        for name in group["params"]:
            saved_group_of[name] = group["hyperparameters"]
    fp_of_master = {id(m): fp for fp, m in _trainable_with_masters(engine)}
    out = []
    for group in engine.optimizer.optimizer.param_groups:
        fps = [fp_of_master[id(m)] for m in group["params"] if id(m) in fp_of_master]
        hyper = {}
        if fps:
            first = meta["aliases"].get(fps[0].names[0][0], fps[0].names[0][0])
            hyper = saved_group_of.get(first, {})
        out.append(hyper)
    return out


def _install(engine, plan: _Plan) -> None:
    """Write what `_read` assembled into the engine. No I/O, no collective."""
    with torch.no_grad():
        engine.load_flat_params(plan.flats)  # the stage's own storage: whole buffers, or shards
        module_state = engine.module.state_dict(keep_vars=True)
        for name, value in plan.buffers.items():
            module_state[name].copy_(value)
        optimizer = engine.optimizer.optimizer
        fused = {id(m): bool(g.get("fused") or g.get("capturable")) for g in optimizer.param_groups
                 for m in g["params"]}
        for (_fp, master), values, states in zip(_trainable_with_masters(engine), plan.masters, plan.states):
            master.copy_(values)  # fp32 master (under fp32 the param shard itself)
            optimizer.state.pop(master, None)
            if states:
                optimizer.state[master] = {
                    key: (t.to(master.device, master.dtype) if t.dim() > 0
                          else t.to(master.device) if fused[id(master)] else t.clone())
                    for key, t in states.items()}
        for group, hyper in zip(optimizer.param_groups, plan.hyper):
            for key, value in hyper.items():
                if key in group:
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value
    if engine.scaler is not None and plan.meta.get("loss_scaler") is not None:
        engine.scaler.load_state_dict(plan.meta["loss_scaler"])
    engine.optimizer.grad_multiplier = None
    engine.zero_grad()


def load_full_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The plain, unsharded state_dict a checkpoint holds (every key, aliases expanded). No process group."""
    directory = os.fspath(directory)
    meta_path, path = os.path.join(directory, META_FILE), os.path.join(directory, MODEL_FILE)
    for p in (meta_path, path):
        if not os.path.isfile(p):
            raise ValueError(f"{p} is missing: not a complete zerokit checkpoint")
    meta = _read_json(meta_path)
    out: dict[str, torch.Tensor] = {}
    with _open_safetensors(path) as f:
        for key in f.keys():
            out[key] = f.get_tensor(key)
    for alias, target in meta["aliases"].items():
        if target not in out:
            raise ValueError(f"{path}: {alias!r} is an alias of {target!r}, which the file does not hold")
        out[alias] = out[target]
    return out
