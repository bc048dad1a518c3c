"""Loading: check every file, key and piece (any saved world size), then install one piece at a time.

[Note: loading]
Loading needs one collective. Every rank reads current.json and meta.json (checked against the
pointer's digest) and checks the rank files it reads slices of and rank file i for every
i % world_size == rank; rank 0 checks the model file (saved as Hugging Face shards, format.py
[Note: sharded model files]: model file j of the K shards and their index, rank j % world_size),
and a rank whose read of one fails checks them all, to name a corruption rather than its symptom;
so each file is checked by some rank without every rank reading every file. Every rank also checks,
from the headers alone, every key and shape of the model file and that the saved pieces cover each
of its masters and states. One all-gather of the verdicts, and of which snapshot each rank read,
lets every rank raise the same ValueError — naming the file or the parameter — before anything is
read into or written to the engine and before a later collective could hang; ranks that read
different snapshots refuse too. Only then is anything read, and each piece is installed as it
arrives: of the model a rank reads, a tensor slice at a time, only the range of each flat param it
keeps (`engine.kept_range`: its shard at stage 3, so 4Ψ/N bytes, all 4Ψ at stages 0-2, whose params
are whole), which the stage's `load_flat_params` writes into its own storage before the next is
read; then each master's values and optimizer states, one master at a time. So a load holds one
flat param's range or one master's states beside the engine, never the model (the simulated load
phase of `zerokit memory --simulate` measures it). Shards are read as one file would be, each key
from the shard whose header holds it. What is read after the verdict was checked (sha256, keys,
ranges), so a read fails there only if a file changed during the load; the error then says the
engine is partly loaded.

[Note: hyperparameters]
A load restores each parameter's saved numeric hyperparameters (lr, betas, eps, ...), as torch's
Optimizer.load_state_dict does; rank 0 warns once, naming what changed. A group steps whole flat
buffers, so it holds one value per hyperparameter: parameters saved with different values that
share one of the engine's groups are refused on every rank, naming two of them, their values and
the fix (build the engine with the saved run's `param_groups`). No parameter ever takes another
parameter's value. Every other group entry (amsgrad, maximize, foreach, fused, capturable,
differentiable, ...) is restored too, as torch does, each of its saved type: a tensor lr stays a
tensor of its dtype ([Note: hyperparameter types], format.py); a value meta.json cannot hold is
refused at load, naming it. An engine of another optimizer class is refused.
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings
from dataclasses import dataclass, field

import torch

from zerokit.checkpoint.commit import raise_on_every_rank
from zerokit.checkpoint.format import (
    MASTER, MODEL_INDEX_FILE, UNSTORABLE, SafetensorsReader, Snapshot, decode_hyperparameter, encode_hyperparameter,
    json_number, show_hyperparameter, master_start, model_files,
    open_checkpoint, parse_piece_key, rank_file, trainable_with_masters, verify_file)


@dataclass
class _Plan:
    """Everything checked and nothing read: where `_install` reads each value from, one at a time."""

    meta: dict
    path: str  # the snapshot directory
    hyper: list[dict] = field(default_factory=list)  # per optimizer param group
    hyper_changes: list[str] = field(default_factory=list)  # "key old -> new for 'name' ...", for the warning


def load(engine, directory: str | os.PathLike) -> dict:
    """Load a checkpoint written by `save` at any world size, stage or precision; return its meta.

    Every rank calls it (one small collective exchanges the verdict). Bad input — a
    missing or corrupted file (size or sha256 unlike meta.json's record), a checkpoint of
    another format version, a different model (names, shapes), another optimizer class,
    ranks that read different checkpoints — raises ValueError on every rank, naming the
    file and the parameter, and leaves the engine as it was; so do hyperparameters the
    engine's param groups cannot carry (see [Note: hyperparameters]). Restores parameters,
    buffers, fp32 masters, optimizer state, each parameter's numeric hyperparameters (lr,
    betas, ... as torch's load_state_dict does; rank 0 warns once if they differ from the
    engine's), and the loss-scaler state; clears gradients.
    """
    directory = os.fspath(directory)
    engine.finish_backward()
    plan, snapshot, problems = None, None, []
    try:
        plan, snapshot = _check(engine, directory)
    except Exception as exc:  # every rank must hear about it before anyone moves on
        problems.append(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc))
    what = f"cannot load checkpoint {directory}"
    everyone = engine.comm.all_gather_object((problems, snapshot and (snapshot.path, snapshot.meta_sha256)),
                                             label="checkpoint load: what each rank read", phase="checkpoint")
    errors = [f"rank {r}: {msg}" for r, (theirs, _) in enumerate(everyone) for msg in theirs]
    if not errors and len({sha for _, (_, sha) in everyone}) > 1:
        errors = [f"rank {r} read {path} (meta.json sha256 {sha[:12]}...)" for r, (_, (path, sha)) in
                  enumerate(everyone)]
        errors.append("the ranks read different checkpoints (different directories, or a save committed during "
                      "the load): every rank must load the same one")
    if errors:
        raise_on_every_rank(engine, what, errors)
    _install(engine, plan)
    if plan.hyper_changes and engine.comm.world_rank == 0:  # one warning per load, not one per rank
        warnings.warn(f"zerokit: loading {directory} restored the optimizer hyperparameters it saved, which differ "
                      f"from this engine's (as torch's Optimizer.load_state_dict does): "
                      f"{'; '.join(plan.hyper_changes)}. To train with other values, set them in "
                      "engine.optimizer.param_groups after the load", UserWarning, stacklevel=3)
    return plan.meta


def committed_snapshot(directory: str | os.PathLike) -> str:
    """The path of the snapshot `directory`'s current.json names (its meta.json checked). No process group."""
    return open_checkpoint(os.fspath(directory)).path


def load_full_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The plain, unsharded state_dict a checkpoint holds (every key, aliases expanded). No process group.

    Reads the committed snapshot's meta.json and model file(s) (model.safetensors, or its shards and their
    index), each checked against its sha256.
    """
    snapshot = open_checkpoint(os.fspath(directory))
    for name in model_files(snapshot.meta["files"]):
        verify_file(os.path.join(snapshot.path, name), snapshot.meta["files"][name], snapshot.meta_path)
    out: dict[str, torch.Tensor] = {}
    with _open_model(snapshot.path, snapshot.meta) as f:
        for key in f.keys():
            out[key] = f.get_tensor(key)
        for alias, target in snapshot.meta["aliases"].items():
            if target not in out:
                raise ValueError(f"{f.path}: {alias!r} is an alias of {target!r}, which the file does not hold")
            out[alias] = out[target]
    return out


@contextlib.contextmanager
def _open_safetensors(path: str):
    """The file opened for reading by ranges, with any failure to open (truncated, not safetensors) reported
    under the file's name."""
    try:
        handle = SafetensorsReader(path)  # by byte ranges, not mapped: format.py [Note: reading without mapping]
    except Exception as exc:
        raise ValueError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from exc
    with handle as f:
        yield f


class _ModelFiles:
    """A snapshot's model file(s) read as one: `keys()`, `get_slice(key)`, `get_tensor(key)`, `read_into`,
    from whichever file's header holds the key (every file's header is read; no data until asked); `path`
    names them all, `path_of(key)` the one holding the key."""

    def __init__(self, directory: str, names: list[str], stack: contextlib.ExitStack):
        self.paths = [os.path.join(directory, name) for name in names]
        self.path = self.paths[0] if len(self.paths) == 1 else \
            os.path.join(directory, f"model-*-of-{len(self.paths):05d}.safetensors")
        self._file_of: dict[str, SafetensorsReader] = {}
        for path in self.paths:
            if not os.path.isfile(path):
                raise ValueError(f"{path} is missing")
            f = stack.enter_context(_open_safetensors(path))
            for key in f.keys():
                if key in self._file_of:
                    raise ValueError(f"{path}: {key!r} is also in {self._file_of[key].path}")
                self._file_of[key] = f

    def keys(self) -> list[str]:
        return list(self._file_of)

    def path_of(self, key: str) -> str:
        return self._file_of[key].path

    def get_slice(self, key: str):
        if key not in self._file_of:
            raise KeyError(f"{self.path} has no tensor {key!r}")
        return self._file_of[key].get_slice(key)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._file_of[key].get_tensor(key)

    def read_into(self, key: str, start: int, out: torch.Tensor) -> None:
        self._file_of[key].read_into(key, start, out)


@contextlib.contextmanager
def _open_model(directory: str, meta: dict):
    """The snapshot's model file(s), as meta.json lists them, opened as one `_ModelFiles`."""
    names = [name for name in model_files(meta["files"]) if name != MODEL_INDEX_FILE]
    with contextlib.ExitStack() as stack:
        yield _ModelFiles(directory, names, stack)


# ====================================================================== verify and plan
def _check(engine, directory: str) -> tuple[_Plan, Snapshot]:
    """Every file's record and every key, shape and piece this rank will read, checked; no tensor data read."""
    snapshot = open_checkpoint(directory)
    meta, meta_path = snapshot.meta, snapshot.meta_path
    mine = engine.optimizer.name
    if meta["optimizer"]["class"] != mine:
        raise ValueError(f"{meta_path}: the checkpoint's optimizer is {meta['optimizer']['class']}, this engine's "
                         f"is {mine}; build the engine with the same optimizer class")
    checked: set[str] = set()

    def verify(name: str) -> None:
        if name not in checked:
            verify_file(os.path.join(snapshot.path, name), meta["files"][name], meta_path)
            checked.add(name)

    # See [Note: loading]: model files j and rank files i = rank (mod world size), and below the rank files this
    # rank reads slices of; the verdict gather in `load` makes every rank hear of any.
    n_saved = int(meta["world_size"])
    model = model_files(meta["files"])  # [model.safetensors], or the shards and their index
    for j in range(engine.rank, len(model), engine.world_size):
        verify(model[j])
    for r in range(engine.rank, n_saved, engine.world_size):
        verify(rank_file(r, n_saved))
    plan = _Plan(meta, snapshot.path)
    try:
        _check_model_file(engine, snapshot.path, meta)
    except Exception:
        for name in model:  # another rank checks them, but a corruption may be what broke this rank's read: name it
            verify(name)
        raise
    try:
        used = _read_rank_files(engine, snapshot.path, meta)  # no install: the pieces' coverage only
    except Exception:
        # Every rank opens every rank file's header; one another rank checks may be what broke
        # the read: name the corruption rather than its symptom.
        for r in range(n_saved):
            verify(rank_file(r, n_saved))
        raise
    for r in sorted(used):
        verify(rank_file(r, n_saved))
    plan.hyper, plan.hyper_changes = _match_hyperparameters(engine, meta, meta_path)
    return plan, snapshot


def _check_model_file(engine, directory: str, meta: dict) -> None:
    """Every key of the model file(s) against this model, and every shape, from the headers alone."""
    aliases = meta["aliases"]
    expected = engine.module.state_dict(keep_vars=True)  # names and shapes only (stage 3: no data)
    with _open_model(directory, meta) as f:
        path = f.path
        stored = set(f.keys())
        saved_names = stored | {a for a, target in aliases.items() if target in stored}
        missing = [k for k in expected if k not in saved_names]
        unexpected = sorted(saved_names - set(expected))
        _refuse_quantization_mismatch(path, meta, engine, missing, unexpected)
        if missing or unexpected:
            raise ValueError(f"{path} does not match this model: missing {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                             f"{' ...' if len(unexpected) > 5 else ''}")
        for name, t in expected.items():
            shape = tuple(f.get_slice(aliases.get(name, name)).get_shape())
            if shape != tuple(t.shape):
                raise ValueError(f"{f.path_of(aliases.get(name, name))}: {name!r} has shape {shape} in the "
                                 f"checkpoint, {tuple(t.shape)} in this model")


def kept_ranges(engine, f, aliases: dict[str, str]):
    """Each flat param's range this rank keeps (`engine.kept_range`: its shard at stage 3, all of it below), in
    the values dtype, read from the model file(s) `f` a tensor slice at a time: a generator, so that
    `engine.load_flat_params` holds one flat param's range at a time, never the model."""
    for fp in engine.flat_params:
        lo, hi = engine.kept_range(fp)
        # (hi - lo,) padding stays zero; a quantized base's bytes stay bytes (core/params/flat_param.py)
        kept = torch.zeros(hi - lo, dtype=fp.values_dtype)
        for j, (names, offset, numel) in enumerate(zip(fp.names, fp.layout.offsets, fp.layout.numels)):
            a, b = max(lo, offset), min(hi, offset + numel)
            if a < b:
                key = aliases.get(names[0], names[0])
                _read_param_range(f, key, fp, j, a - offset, b - offset, out=kept[a - lo:b - lo])
        yield kept


def buffer_names(engine) -> list[str]:
    """The module's state_dict keys that are no flat param's parameter (buffers, under each of their names)."""
    in_flat = {id(p) for fp in engine.flat_params for p in fp.params}
    return [name for name, t in engine.module.state_dict(keep_vars=True).items() if id(t) not in in_flat]


def _read_param_range(f, key: str, fp, j: int, a: int, b: int, out: torch.Tensor) -> None:
    """out (b - a,) := elements [a, b) of params[j]'s range of flat param `fp`, from the stored tensor `key` (its
    logical values): exactly those elements, read straight into `out`; for a parameter that keeps its strides
    (core/params/flat_param.py [Note: parameters keep their strides]), the whole tensor rearranged into the
    range's order, then sliced."""
    if fp.strides[j] is not None:
        out.copy_(fp.to_storage_order(j, f.get_tensor(key).reshape(-1))[a:b])
    else:
        f.read_into(key, a, out)


def _refuse_quantization_mismatch(path: str, meta: dict, engine, missing: list[str], unexpected: list[str]) -> None:
    """A layer quantized on one side only, or quantized differently (zerokit/quant.py), refused by name."""
    quantized = lambda names, other: sorted(n.rpartition(".")[0] for n in names  # noqa: E731
                                            if n.endswith(".weight_quant") and n[:-len("_quant")] in other)
    for layer in quantized(unexpected, set(missing))[:1]:
        raise ValueError(f"{path}: layer {layer!r} is quantized in the checkpoint and not in this model; quantize the "
                         "model the same way (zk.quantize) before zk.shard, or load zk.dequantized_state_dict's export")
    for layer in quantized(missing, set(unexpected))[:1]:
        raise ValueError(f"{path}: layer {layer!r} is quantized in this model and not in the checkpoint; load it into "
                         "the unquantized model, or quantize that model and save again")
    for fp in engine.flat_params:
        for names, p in zip(fp.names, fp.params):
            mine, saved = getattr(p, "zerokit_packed", None), meta["params"].get(names[0], {}).get("packed")
            if mine is not None and saved and str(mine) != saved:
                raise ValueError(f"{path}: layer {names[0].rpartition('.')[0]!r} is quantized as {saved} in the "
                                 f"checkpoint and as {mine} in this model; quantize the model the same way")


def _read_rank_files(engine, directory: str, meta: dict, install=None, ranks=None) -> set[int]:
    """This rank's masters and optimizer states, from whichever saved pieces overlap them.

    Without `install`: checks that the pieces cover every master and state (their keys and ranges
    alone) and reads no tensor data. With `install` = (master_fn, owned_fn): reads one master's
    values and states at a time and hands them to master_fn(master, values, states) (the
    whole-parameter path's states to owned_fn(own, states)), so only one master's pieces are alive
    beside the engine's. `ranks`: the saved ranks whose files are opened (default all; a simulated
    rank has only its own). Returns the saved ranks whose files it reads tensor data from (every
    opened file's header is read).
    """
    n_saved = int(meta["world_size"])
    kinds: dict[str, str] = meta["optimizer"]["state"]
    aliases = meta["aliases"]
    index: dict[tuple[str, str], list[tuple[int, int, int, str]]] = {}  # (kind, name) -> [(start, end, r, key)]
    paths = [os.path.join(directory, rank_file(r, n_saved)) for r in range(n_saved)]
    used: set[int] = set()
    reading = install is not None
    with contextlib.ExitStack() as stack:
        files: dict[int, SafetensorsReader] = {}
        keys: dict[int, set[str]] = {}
        for r in (range(n_saved) if ranks is None else ranks):
            if not os.path.isfile(paths[r]):
                raise ValueError(f"{paths[r]} is missing: the checkpoint was written by {n_saved} ranks and every "
                                 "rank file is needed")
            f = files[r] = stack.enter_context(_open_safetensors(paths[r]))
            keys[r] = set(f.keys())
            for key in f.keys():
                kind, name, start, end = parse_piece_key(key, meta["params"], paths[r])
                index.setdefault((kind, name), []).append((start, end, r, key))
        # Scalar states (Adam's step) are equal for every master, since all of them step
        # together; a master holding only padding takes them from the first master piece.
        first_master_piece = next((pieces[0] for (kind, _), pieces in index.items() if kind == MASTER), None)

        whole = engine.optimizer.whole is not None
        if "whole" in kinds.values() and not whole:
            raise ValueError(f"{paths[0]}: optimizer states {sorted(k for k, v in kinds.items() if v == 'whole')} "
                             "were saved whole per parameter (an optimizer that needs whole parameters: "
                             "optim/whole_params.py); this engine steps flat shards: load it into an engine whose "
                             "optimizer class is not declared elementwise")
        if whole:
            used |= _read_owned_states(engine, kinds, index, files, paths, aliases, meta["params"],
                                       install[1] if reading else None)
            kinds = {}  # the masters carry no state on this path
        for fp, master in trainable_with_masters(engine):
            base = master_start(fp, master)
            size = master.numel()
            # (master numel,) each, padding stays zero, fp32 or float64; None when only checking
            values = torch.zeros(size, dtype=master.dtype) if reading else None
            states = {key: torch.zeros(size, dtype=master.dtype) if reading else None
                      for key, kind in kinds.items() if kind == "elementwise"}
            scalar_source = None  # (start, end, rank, key) of a master piece this master overlaps
            for i, (offset, numel) in enumerate(zip(fp.layout.offsets, fp.layout.numels)):
                lo, hi = max(base, offset), min(base + size, offset + numel)
                if lo >= hi:
                    continue
                a, b = lo - offset, hi - offset  # the part of parameter i this master holds
                at = lo - base  # ... and where it sits in the master
                name = aliases.get(fp.names[i][0], fp.names[i][0])
                pieces = index.get((MASTER, name), [])
                saved = meta["params"].get(name, {}).get("stride")  # None: saved contiguous
                fill = _fill if (tuple(saved) if saved else None) == fp.strides[i] else \
                    functools.partial(_fill_restrided, fp=fp, j=i, saved=tuple(saved) if saved else None)
                used |= fill(values[at:at + b - a] if reading else None, pieces, a, b, files, paths, name, MASTER)
                for key, tensor in states.items():
                    used |= fill(tensor[at:at + b - a] if reading else None, index.get((f"state.{key}", name), []),
                                 a, b, files, paths, name, f"state.{key}")
                if scalar_source is None:
                    scalar_source = next((pc for pc in pieces if pc[0] < b and pc[1] > a), None)
            scalar_source = scalar_source or first_master_piece
            for key, kind in kinds.items():
                if kind == "scalar":
                    if scalar_source is None:
                        raise ValueError(f"{paths[0]}: no piece to take optimizer state {key!r} from")
                    _s, _e, r, master_key = scalar_source
                    used.add(r)
                    state_key = f"state.{key}" + master_key[len(MASTER):]  # same name and range
                    if state_key not in keys[r]:
                        raise ValueError(f"{paths[r]}: optimizer state {state_key!r} is missing")
                    if reading:
                        states[key] = files[r].get_tensor(state_key)
            if reading:
                install[0](master, values, states)
    return used


def _read_owned_states(engine, kinds: dict[str, str], index: dict, files, paths, aliases, meta_params: dict,
                       install=None) -> set[int]:
    """The whole-parameter path's states of each parameter this rank owns (optim/whole_params.py): elementwise
    ones assembled from whichever saved pieces cover the parameter (saved by either path), scalar and whole
    ones from any file holding the parameter's; each parameter's handed to install(own, states) as it is read
    (without `install`: checked, not read). Returns the saved ranks whose files hold them."""
    fps = [fp for fp, _m in trainable_with_masters(engine)]
    used: set[int] = set()
    for own in engine.optimizer.owned():
        fp = fps[own.buffer]
        name = aliases.get(fp.names[own.index][0], fp.names[own.index][0])
        shape = tuple(own.tensor.shape)
        states = {}
        for key, kind in kinds.items():
            pieces = index.get((f"state.{key}", name), [])
            if not pieces:  # a key other parameters have (Adafactor: "variance" for vectors, row/col_var for
                continue    # matrices), or a parameter not yet stepped
            if kind == "elementwise":  # saved in the saving model's storage order: made logical, then strided
                flat = torch.zeros(own.numel, dtype=own.tensor.dtype) if install else None  # like this parameter
                used |= _fill(flat, pieces, 0, own.numel, files, paths, name, f"state.{key}")
                if install:
                    saved = meta_params.get(name, {}).get("stride")
                    logical = flat if not saved else flat.as_strided(shape, tuple(saved)).reshape(-1)
                    states[key] = torch.empty_like(own.tensor).copy_(logical.view(shape))
            else:
                _s, _e, r, piece = pieces[0]
                used.add(r)
                if install:
                    states[key] = files[r].get_tensor(piece)
                    if kind in ("int", "float"):  # a Python number (format.py `state_kinds`)
                        states[key] = int(states[key].item()) if kind == "int" else float(states[key].item())
        if install:
            install(own, states)
    return used


def _fill_restrided(out: torch.Tensor | None, pieces: list, a: int, b: int, files, paths, name: str, kind: str, *,
                    fp, j: int, saved: tuple[int, ...] | None) -> set[int]:
    """`_fill` for a parameter saved with other strides than params[j] of `fp` has (a channels_last checkpoint
    into a contiguous model, or back): the pieces hold its elements in the saving model's storage order, so
    the whole parameter is read, put in logical order, then in this model's (core/params/flat_param.py [Note:
    parameters keep their strides]), and [a, b) of that is kept."""
    shape, numel = fp.layout.shapes[j], fp.layout.numels[j]
    whole = None if out is None else torch.empty(numel, dtype=out.dtype)
    used = _fill(whole, pieces, 0, numel, files, paths, name, kind)
    if out is not None:
        logical = whole if saved is None else whole.as_strided(shape, saved).reshape(-1)
        out.copy_(fp.to_storage_order(j, logical)[a:b])
    return used


def _fill(out: torch.Tensor | None, pieces: list, a: int, b: int, files, paths, name: str, kind: str) -> set[int]:
    """out[:] = elements [a, b) of `name`'s `kind`, copied from the overlapping saved pieces; returns their ranks.
    The pieces' ranges must cover [a, b) (checked before any read); `out` None: only that check."""
    spans = sorted((max(a, start), min(b, end), start, r, key) for start, end, r, key in pieces
                   if max(a, start) < min(b, end))
    reach = a  # [a, reach) is covered by the spans so far
    for lo, hi, *_ in spans:
        if lo > reach:
            break
        reach = max(reach, hi)
    if reach < b:
        raise ValueError(f"{kind} of parameter {name!r}: elements [{a}, {b}) are not all in the rank files "
                         f"({os.path.dirname(paths[0])}/rank*-of-{len(paths)}.safetensors); element {reach} is "
                         "missing")
    if out is not None:
        for lo, hi, start, r, key in spans:
            files[r].read_into(key, lo - start, out[lo - a:hi - a])  # reads only this sub-range, into `out`
    return {r for *_, r, _key in spans}


def _match_hyperparameters(engine, meta: dict, meta_path: str) -> tuple[list[dict], list[str]]:
    """For each of this optimizer's groups, the hyperparameters its parameters were saved with; and what that
    changes, one line per (group, key). See [Note: hyperparameters]."""
    aliases = meta["aliases"]
    saved_of = {name: group["hyperparameters"] for group in meta["optimizer"]["param_groups"]
                for name in group["params"]}
    trainable = [fp for fp, _m in trainable_with_masters(engine)]
    out, changes = [], []
    for group, shards in zip(engine.optimizer.param_groups, engine.optimizer.group_shards):
        names = [aliases.get(n[0], n[0]) for k in shards for n in trainable[k].names]
        hyper: dict = {}
        first: dict[str, str] = {}  # key -> the parameter whose saved value the group takes
        for name in names:
            for key, value in saved_of.get(name, {}).items():  # every trainable name: its pieces were found
                if key not in group:
                    continue
                if key not in hyper:
                    hyper[key], first[key] = value, name
                elif value != hyper[key]:
                    raise ValueError(
                        f"{meta_path}: {name!r} was saved with {key}={value} and {first[key]!r} with "
                        f"{key}={hyper[key]}, but this engine steps both in one optimizer param group "
                        f"({key}={json_number(group[key])}), which holds one value: build the engine with the "
                        "param_groups of the run that saved the checkpoint (zk.shard(..., param_groups=...)), so "
                        "that parameters saved with different hyperparameters are in different groups")
        for key, value in hyper.items():
            if isinstance(value, dict) and UNSTORABLE in value:
                raise ValueError(
                    f"{meta_path}: {first[key]!r} was saved with optimizer hyperparameter {key!r} of a type "
                    f"meta.json cannot hold ({value[UNSTORABLE]}), so this load cannot restore it; keep "
                    "hyperparameters numbers, bools, strings, None, tensors of at most 64 elements without "
                    "requires_grad, or tuples of these (see [Note: hyperparameter types])")
            mine = encode_hyperparameter(group[key])
            if mine != value:
                others = len(names) - 1
                changes.append(f"{key} {show_hyperparameter(mine)} -> {show_hyperparameter(value)} for {names[0]!r}"
                               + (f" and {others} other parameter{'s' if others > 1 else ''}" if others else ""))
        device = group["params"][0].device if group["params"] else None
        out.append({key: decode_hyperparameter(value, group[key], device) for key, value in hyper.items()})
    return out, changes


# ====================================================================== install
def _install(engine, plan: _Plan, ranks=None) -> None:
    """Read what `_check` checked and write it into the engine, one flat param, buffer and master at a time
    (at most one flat param's range, or one master's values and states, is alive beside the engine's). No
    collective. `ranks`: the saved ranks whose files are opened (`_read_rank_files`).

    The files were checked before (their sha256, every key, shape and piece), so a read fails here only if
    a file changed or vanished during the load; the engine is then partly loaded, which the error says."""
    meta, optimizer = plan.meta, engine.optimizer
    try:
        with torch.no_grad():
            with _open_model(plan.path, meta) as f:
                engine.load_flat_params(kept_ranges(engine, f, meta["aliases"]))  # the stage's own storage
                module_state = engine.module.state_dict(keep_vars=True)
                for name in buffer_names(engine):
                    module_state[name].copy_(f.get_tensor(meta["aliases"].get(name, name)))
            for group, hyper in zip(optimizer.param_groups, plan.hyper):  # first: `fused` below reads the saved
                for key, value in hyper.items():                          # flags
                    if key in group:
                        group[key] = value
            fused = {id(m): bool(g.get("fused") or g.get("capturable")) for g in optimizer.param_groups
                     for m in g["params"]}

            def to_state(t, like: torch.Tensor):
                if not torch.is_tensor(t):
                    return t  # a Python number (HF Adafactor's step)
                if t.dim() > 0:
                    return t.to(like.device, like.dtype)
                return t.to(like.device) if fused[id(like)] else t.clone()

            def master_states(master, values, states):
                master.copy_(values)  # fp32 master (under fp32 the param shard itself)
                optimizer.set_state(master, {key: to_state(t, master) for key, t in states.items()})

            def owned_states(own, states):  # the whole-parameter path's
                optimizer.optimizer.state[own.tensor] = {key: to_state(t, own.tensor) for key, t in states.items()}

            _read_rank_files(engine, plan.path, meta, install=(master_states, owned_states), ranks=ranks)
    except Exception as exc:
        raise RuntimeError(f"loading {plan.path}: a file checked at the start of the load could not be read while "
                           f"installing it ({type(exc).__name__}: {exc}); the engine is partly loaded: load a "
                           "checkpoint again before training") from exc
    if engine.loss_scaler is not None and plan.meta.get("loss_scaler") is not None:
        engine.loss_scaler.load_state_dict(plan.meta["loss_scaler"])
    engine.zero_grad()  # also forgets a clip coefficient computed before the load
