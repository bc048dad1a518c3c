"""Sharded checkpoints: every rank writes what it owns; any world size, stage or precision reads it back.

This docstring is the checkpoint contract (format VERSION 2). A checkpoint directory holds
one committed snapshot and the pointer that names it:

    current.json                    the commit pointer, written by rank 0 and replaced atomically:
                                    format, version, "checkpoint" (the committed snapshot's name)
                                    and meta.json's size and sha256
    ckpt-<UTC time>-<token>/        one snapshot; never modified once current.json names it
      meta.json                     rank 0: world size, stage, precision, optimizer class and
                                    hyperparameters per group, loss-scaler state, versions,
                                    every parameter's names / shape / dtype, the caller's `extra`,
                                    and "files": {name: {"bytes", "sha256"}} for every file below
      model.safetensors             rank 0: engine.state_dict(full=True), the unwrapped model's
                                    keys (fp32 master values where they exist, frozen params and
                                    buffers as they are); a tied tensor is stored once, under its
                                    first name, and meta.json's "aliases" maps the other names to it
      rank{r}-of-{N}.safetensors    rank r: for every trainable flat param, the pieces of rank r's
                                    range [r * shard_numel, (r + 1) * shard_numel) of the fp32
                                    master and of each per-element optimizer state

Under hybrid sharding (core/hybrid.py) N is the shard group size S ("world_size" in meta.json;
"data_parallel_size" is every rank): the R shard groups hold equal shards, so only the first
(replica 0) writes rank files, rank 0 of the world writes the rest, and every rank of the world
takes part in the agreements below. Nothing else differs: a reader finds pieces by name and
range, whatever S, N and stage wrote them or read them.

[Note: checksums]
Every byte of a checkpoint is checked before a load changes anything: meta.json records the
size and sha256 of each safetensors file, current.json records meta.json's, and every field of
current.json is itself validated when read (its format and version, a snapshot name of the
ckpt-* form that exists, a digest that must match). The digests are plain sha256 of the files'
bytes, so `sha256sum` checks a copied checkpoint without zerokit. sha256 was measured against
the other strong stdlib hashes (benchmarks/checksum_cost.py): with the CPU's SHA extensions it
is the fastest of them; what it costs per GB on save and on load is in
benchmarks/results/checksum_cost.md.

[Note: the commit protocol]
`save` is a collective of four small all-gathers; a crash of any rank at any point leaves the
previous snapshot current and intact:

 1. agree: every rank's os.path.realpath(directory) is gathered (with rank 0's fresh snapshot
    name). Different paths raise ValueError on every rank, naming them, before anything is
    written.
 2. create: rank 0 makes <directory>/<snapshot>/; every rank hears whether that worked.
 3. write: every rank checks it sees the new snapshot (rank 0 created it, so a rank that does
    not is on another filesystem: refused), writes and fsyncs its rank file (rank 0 also the
    model file) and reads it back for size and sha256. The gather of every rank's problems and
    digests is the agreement that the snapshot is complete; on any problem rank 0 deletes the
    snapshot and every rank raises, naming the rank and the file.
 4. commit: rank 0 writes meta.json (with every digest), fsyncs the snapshot, writes
    current.json.tmp-<token>, fsyncs it, and os.replace()s it onto current.json: the one commit
    point. Then it deletes every other ckpt-* snapshot and pointer leftover (the previous
    checkpoint and those of crashed saves; a failure there is a warning, retried by the next
    save); every rank hears whether the commit worked.

A reader follows current.json, so it sees the previous snapshot before the os.replace and the
new one after it, and a snapshot is complete before anything names it: never a mix. A crash
leaves an uncommitted snapshot behind, which the next successful save removes. One writer per
directory: two jobs saving into the same directory at once are not supported. A checkpoint of
format version 1 (files directly in the directory, no checksums) is refused with a message.

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

[Note: loading]
Loading needs one collective. Every rank reads current.json and meta.json (checking meta.json
against the digest in current.json), checks the model file (every rank reads it whole) and the
rank files it reads slices of, plus rank file i for every i % world_size == rank, so each file
is checked by at least one rank without every rank reading every file. Then one all-gather of
the verdicts, and of which snapshot each rank read, lets every rank raise the same ValueError —
naming the file (a checksum mismatch, a missing file) or the parameter (another model) —
before anything is written into the engine and before any later collective could hang; ranks
that read different snapshots (a save committed during the load, or different checkpoints
passed) refuse too. Then the stage's `load_flat_params` writes the full values into its own
storage (whole buffers at stages 0-2, this rank's shards at stage 3), and the masters and
optimizer state of this rank's range are installed. A rank holds one full fp32 copy of the
model while loading (4Ψ bytes), the price of reading a plain model file.

[Note: hyperparameters]
meta.json records each optimizer param group's numeric hyperparameters (numbers and tuples of
numbers: lr, betas, eps, weight_decay, momentum, ...) with the names of its parameters. A load
restores them per parameter, as torch's Optimizer.load_state_dict does: each of the engine's
groups takes the values its parameters were saved with, whatever values or `param_groups` the
engine was built with, and rank 0 warns once, naming each value that changed and the parameters
it applies to. A group steps whole flat buffers, so it holds one value per hyperparameter: when
parameters saved with different values share one of the engine's groups (a run saved with a
no-decay group, loaded into an engine without one), the load refuses on every rank, naming two
of them, their values and the fix (build the engine with the saved run's `param_groups`). No
parameter ever takes another parameter's value. Other options (amsgrad, foreach, fused, ...)
are the engine's own; an engine of another optimizer class is refused.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import time
import warnings
from dataclasses import dataclass, field

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["save", "load", "load_full_state_dict", "committed_snapshot", "rank_file", "POINTER_FILE", "META_FILE",
           "MODEL_FILE"]

FORMAT = "zerokit-checkpoint"
VERSION = 2  # 1: files directly in the directory, meta.json written last, no checksums
POINTER_FILE = "current.json"
META_FILE = "meta.json"
MODEL_FILE = "model.safetensors"
HASH = "sha256"
MASTER = "master"
_KEY = re.compile(r"^(?P<kind>[^:]+)::(?P<name>.+)::(?P<start>\d+):(?P<end>\d+)$")
_SNAPSHOT = re.compile(r"^ckpt-\d{8}T\d{6}-[0-9a-f]{12}$")
_POINTER_LEFTOVER = re.compile(r"^current\.json\.tmp-[0-9a-f]{12}$")
_READ_CHUNK_BYTES = 8 << 20  # digest buffer: large enough that hashing, not the syscalls, is the cost


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
        for key, value in engine.optimizer.state_of(master).items():
            if torch.is_tensor(value) and value.shape == master.shape:
                kind = "elementwise"
            elif torch.is_tensor(value) and value.dim() == 0:
                kind = "scalar"
            else:
                raise ValueError(
                    f"optimizer state {key!r} of {engine.optimizer.name} for the flat param "
                    f"holding {fp.names[0][0]!r} is neither shaped like its master nor a 0-dim tensor; "
                    "a sharded checkpoint cannot re-slice it")
            if kinds.setdefault(key, kind) != kind:
                raise ValueError(f"optimizer state {key!r} is elementwise for some params and scalar for others")
    return kinds


# ====================================================================== save
def save(engine, directory: str | os.PathLike, extra: dict | None = None) -> None:
    """Write a sharded checkpoint of `engine` into `directory`, atomically. A collective: every rank calls it.

    `extra` (JSON-serialisable) is stored in meta.json and handed back by `load` (the
    training loop's step index, for instance). The new snapshot is written beside the
    directory's current one and becomes current in one step once every rank's files are
    on disk (see [Note: the commit protocol]); until then, and after any failure or crash,
    `load` reads the previous checkpoint. Raises ValueError on every rank if the ranks
    passed different directories (before writing anything) or if any rank failed to write,
    naming the rank and the file.
    """
    snapshot = _agree_on_directory(engine, directory)  # 1. agree (all-gather)
    directory = os.fspath(directory)
    engine.finish_backward()
    full = engine.state_dict(full=True)  # a collective at stages 1-3: every rank takes part
    what = f"cannot save checkpoint {directory}"
    snapshot_path = os.path.join(directory, snapshot)

    # 2. create: one rank makes the snapshot directory, so a rank that cannot see it is on another filesystem.
    problems: list[str] = []
    if engine.comm.world_rank == 0:
        try:
            os.makedirs(snapshot_path)  # the name is fresh: an existing one would be a bug
        except Exception as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
    _raise_if_any(engine, problems, what)

    # 3. write: every rank its own files, then the all-gather that agrees the snapshot is complete.
    records: dict[str, dict] = {}
    kinds: dict[str, str] = {}
    try:
        if not os.path.isdir(snapshot_path):
            raise OSError(f"{snapshot_path}, just created by rank 0, does not exist on rank {engine.comm.world_rank}: "
                          "the checkpoint directory must be on a filesystem every rank shares")
        kinds = _state_kinds(engine)
        if engine.comm.replica_rank == 0:  # hybrid sharding: one copy of the shards is written (core/hybrid.py)
            name = rank_file(engine.rank, engine.world_size)
            records[name] = _write_rank_file(engine, snapshot_path, kinds, _aliases(engine.module))
        if engine.comm.world_rank == 0:
            records[MODEL_FILE] = _write_model_file(engine, snapshot_path, full)
    except Exception as exc:  # reported to every rank below, never left for a peer to hang on
        problems.append(f"{type(exc).__name__}: {exc}")
    everyone = engine.comm.all_gather_object((problems, records), label="checkpoint save: every rank's files written",
                                             phase="checkpoint")
    errors = [f"rank {r}: {msg}" for r, (theirs, _) in enumerate(everyone) for msg in theirs]
    if errors:
        if engine.comm.world_rank == 0:  # every rank has stopped writing: the half-written snapshot can go
            shutil.rmtree(snapshot_path, ignore_errors=True)
        _raise(engine, what, errors)

    # 4. commit: rank 0 alone, after every rank's files are on disk.
    if engine.comm.world_rank == 0:
        committed = False
        try:
            files = {name: record for _, theirs in everyone for name, record in theirs.items()}
            meta_record = _write_meta(snapshot_path, _meta(engine, kinds, extra, files))
            _commit(directory, snapshot, meta_record)
            committed = True
            _fsync(directory)  # the rename itself, durable
            _remove_stale(directory, keep=snapshot)
        except Exception as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
            if not committed:
                shutil.rmtree(snapshot_path, ignore_errors=True)
    _raise_if_any(engine, problems, what)


def _agree_on_directory(engine, directory) -> str:
    """All-gather every rank's resolved directory; raise on every rank unless they are equal. Returns rank 0's
    fresh snapshot name, which every rank then writes into."""
    try:
        mine = os.path.realpath(os.fspath(directory))
    except Exception as exc:  # not a path: still take part in the gather, then fail with everyone
        mine = exc
    snapshot = _new_snapshot_name() if engine.comm.world_rank == 0 else None
    everyone = engine.comm.all_gather_object((mine, snapshot), label="checkpoint save: the directory",
                                             phase="checkpoint")
    bad = [f"rank {r}: {type(p).__name__}: {p}" for r, (p, _) in enumerate(everyone) if isinstance(p, Exception)]
    if bad:
        _raise(engine, f"cannot save checkpoint {directory!r}", bad)
    ranks_of: dict[str, list[int]] = {}
    for r, (path, _) in enumerate(everyone):
        ranks_of.setdefault(path, []).append(r)
    if len(ranks_of) > 1:
        listing = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {path}"
                            for path, rs in ranks_of.items())
        raise ValueError(f"zerokit: cannot save checkpoint: the ranks passed different directories ({listing}) "
                         f"(raised on rank {engine.comm.world_rank}, nothing written); every rank must pass the same "
                         "directory, on a filesystem every rank shares")
    return everyone[0][1]


def _new_snapshot_name() -> str:
    return f"ckpt-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(6)}"


def _raise(engine, what: str, errors: list[str]) -> None:
    raise ValueError(f"zerokit: {what} (raised on rank {engine.comm.world_rank}):\n  " + "\n  ".join(errors))


def _raise_if_any(engine, problems: list[str], what: str) -> None:
    everyone = engine.comm.all_gather_object(problems, label="checkpoint: every rank's problems", phase="checkpoint")
    errors = [f"rank {r}: {msg}" for r, theirs in enumerate(everyone) for msg in theirs]
    if errors:
        _raise(engine, what, errors)


def _digest(path: str) -> dict:
    """{"bytes", "sha256"} of the file's bytes as they are on disk (read back in chunks: no copy of the file)."""
    h = hashlib.new(HASH)
    buffer = bytearray(_READ_CHUNK_BYTES)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
            size += n
    return {"bytes": size, HASH: h.hexdigest()}


def _fsync(path: str) -> None:
    """Flush a file's data, or a directory's entries, to stable storage (the commit must not outrun them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_tensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> dict:
    """Write, fsync and digest one safetensors file; return its record for meta.json."""
    try:
        save_file(tensors, path, metadata=metadata)
        _fsync(path)
        return _digest(path)
    except Exception as exc:
        raise OSError(f"writing {path}: {exc}") from exc


def _write_rank_file(engine, directory: str, kinds: dict[str, str], aliases: dict[str, str]) -> dict:
    """This rank's pieces of every trainable flat param: master and optimizer states, by name and range."""
    tensors: dict[str, torch.Tensor] = {}
    for fp, master in _trainable_with_masters(engine):
        base = _master_start(fp, master)
        lo, _hi = fp.shard_range
        master_state = engine.optimizer.state_of(master)
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
    return _save_tensors(tensors, path,
                         {"format": FORMAT, "rank": str(engine.rank), "world_size": str(engine.world_size)})


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


def _write_model_file(engine, directory: str, full: dict[str, torch.Tensor]) -> dict:
    aliases = _aliases(engine.module)
    tensors = {k: v.detach().cpu().contiguous() for k, v in full.items() if k not in aliases}
    return _save_tensors(tensors, os.path.join(directory, MODEL_FILE), {"format": FORMAT})


def _write_meta(snapshot_path: str, meta: dict) -> dict:
    """Write meta.json, then fsync the snapshot directory (every file's entry); return meta.json's record."""
    path = os.path.join(snapshot_path, META_FILE)
    data = json.dumps(meta, indent=1, sort_keys=True).encode()
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _fsync(snapshot_path)
    except Exception as exc:
        raise OSError(f"writing {path}: {exc}") from exc
    return {"bytes": len(data), HASH: hashlib.new(HASH, data).hexdigest()}


def _commit(directory: str, snapshot: str, meta_record: dict) -> None:
    """Make `snapshot` the directory's checkpoint: one os.replace of current.json, the commit point."""
    pointer = {"format": FORMAT, "version": VERSION, "checkpoint": snapshot, META_FILE: meta_record}
    path = os.path.join(directory, POINTER_FILE)
    tmp = f"{path}.tmp-{snapshot[-12:]}"
    try:
        with open(tmp, "w") as f:
            json.dump(pointer, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a reader sees the old pointer or the new one
    except Exception as exc:
        raise OSError(f"committing {path}: {exc}") from exc


def _remove_stale(directory: str, keep: str) -> None:
    """Delete the snapshots and pointer leftovers current.json does not name: the previous checkpoint, and
    whatever crashed saves left. Best effort: the commit has happened; a failure here is only a warning."""
    for entry in os.listdir(directory):
        if entry == keep or not (_SNAPSHOT.match(entry) or _POINTER_LEFTOVER.match(entry)):
            continue
        path = os.path.join(directory, entry)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except OSError as exc:
            warnings.warn(f"zerokit: could not remove {path}, left by an earlier save ({exc}); the next save "
                          "tries again", stacklevel=3)


def _meta(engine, kinds: dict[str, str], extra: dict | None, files: dict[str, dict]) -> dict:
    optimizer = engine.optimizer
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
        value = optimizer.state_of(master).get("step")
        if value is not None:
            step = int(float(value))
            break
    params = {}
    for fp in engine.flat_params:
        for names, shape in zip(fp.names, fp.layout.shapes):
            params[aliases.get(names[0], names[0])] = {
                "names": list(names), "shape": list(shape), "dtype": str(fp.dtype).removeprefix("torch."),
                "requires_grad": fp.requires_grad}
    expected = {MODEL_FILE} | {rank_file(r, engine.world_size) for r in range(engine.world_size)}
    assert set(files) == expected, (sorted(files), sorted(expected))
    return {
        "format": FORMAT, "version": VERSION,
        "world_size": engine.world_size, "stage": engine.stage, "precision": engine.policy.name,
        "data_parallel_size": engine.comm.data_parallel_size,
        "optimizer": {"class": optimizer.name, "param_groups": groups, "state": kinds,
                      "step": step},
        "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "versions": {"zerokit": _zerokit_version(), "torch": torch.__version__,
                     "safetensors": safetensors.__version__},
        "params": params,
        "aliases": aliases,
        "extra": extra or {},
        "files": files,
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
    hyper_changes: list[str] = field(default_factory=list)  # "key old -> new for 'name' ...", for the warning


@dataclass(frozen=True)
class _Snapshot:
    """The committed snapshot current.json names, with its meta.json read and checked against the pointer."""

    path: str  # <directory>/ckpt-...
    meta_path: str
    meta: dict
    meta_sha256: str  # identifies the checkpoint: equal on every rank that read the same one


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
        plan, snapshot = _read(engine, directory)
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
        _raise(engine, what, errors)
    _install(engine, plan)
    if plan.hyper_changes and engine.comm.world_rank == 0:  # one warning per load, not one per rank
        warnings.warn(f"zerokit: loading {directory} restored the optimizer hyperparameters it saved, which differ "
                      f"from this engine's (as torch's Optimizer.load_state_dict does): "
                      f"{'; '.join(plan.hyper_changes)}. To train with other values, set them in "
                      "engine.optimizer.param_groups after the load", UserWarning, stacklevel=3)
    return plan.meta


def committed_snapshot(directory: str | os.PathLike) -> str:
    """The path of the snapshot `directory`'s current.json names (its meta.json checked). No process group."""
    return _open_checkpoint(os.fspath(directory)).path


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from exc


def _is_record(record) -> bool:
    """A file's {"bytes": int, "sha256": 64 hex digits} record, exactly."""
    return (isinstance(record, dict) and set(record) == {"bytes", HASH}
            and isinstance(record["bytes"], int) and not isinstance(record["bytes"], bool) and record["bytes"] >= 0
            and isinstance(record[HASH], str) and re.fullmatch(r"[0-9a-f]{64}", record[HASH]) is not None)


def _check_record(path: str, actual: dict, expected: dict, recorded_in: str) -> None:
    if actual["bytes"] != expected["bytes"]:
        raise ValueError(f"{path}: {actual['bytes']} bytes on disk, {expected['bytes']} recorded in {recorded_in}; "
                         "the file is truncated or was changed after the save")
    if actual[HASH] != expected[HASH]:
        raise ValueError(f"{path}: {HASH} checksum mismatch ({actual[HASH]} on disk, {expected[HASH]} recorded in "
                         f"{recorded_in}); the file is corrupted or was changed after the save")


def _verify_file(path: str, expected: dict, recorded_in: str) -> None:
    """Refuse a file whose size or sha256 differs from its record (size first: it costs no read)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        raise ValueError(f"{path} is missing: {recorded_in} lists it, and every file of a checkpoint is needed") \
            from None
    if size != expected["bytes"]:
        _check_record(path, {"bytes": size, HASH: ""}, expected, recorded_in)
    _check_record(path, _digest(path), expected, recorded_in)


def _open_checkpoint(directory: str) -> _Snapshot:
    """Follow current.json to the committed snapshot; read its meta.json and check it against the pointer."""
    pointer_path = os.path.join(directory, POINTER_FILE)
    if not os.path.isfile(pointer_path):
        _refuse_without_pointer(directory, pointer_path)
    pointer = _read_json(pointer_path)
    if not isinstance(pointer, dict) or pointer.get("format") != FORMAT:
        raise ValueError(f"{pointer_path}: not a zerokit checkpoint pointer")
    if pointer.get("version") != VERSION:
        raise ValueError(f"{pointer_path}: checkpoint format version {pointer.get('version')!r}; this zerokit reads "
                         f"version {VERSION}")
    name, record = pointer.get("checkpoint"), pointer.get(META_FILE)
    if not isinstance(name, str) or _SNAPSHOT.match(name) is None:
        raise ValueError(f"{pointer_path}: 'checkpoint' is {name!r}, not a snapshot name ckpt-<UTC time>-<token>")
    if not _is_record(record) or set(pointer) != {"format", "version", "checkpoint", META_FILE}:
        raise ValueError(f"{pointer_path}: malformed (expected format, version, checkpoint and {META_FILE}'s bytes "
                         f"and {HASH})")
    path = os.path.join(directory, name)
    meta_path = os.path.join(path, META_FILE)
    try:
        with open(meta_path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{meta_path}: cannot read it ({exc}); {pointer_path} names this snapshot as the "
                         "committed checkpoint") from exc
    _check_record(meta_path, {"bytes": len(data), HASH: hashlib.new(HASH, data).hexdigest()}, record, pointer_path)
    meta = json.loads(data)  # its digest matched: it is the meta.json the save wrote
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                         f"expected {FORMAT!r} version {VERSION}")
    expected = {MODEL_FILE} | {rank_file(r, meta["world_size"]) for r in range(meta["world_size"])}
    files = meta.get("files", {})
    if set(files) != expected or not all(_is_record(r) for r in files.values()):
        raise ValueError(f"{meta_path}: its file list {sorted(files)} is not {sorted(expected)} with sizes and "
                         f"{HASH} digests")
    return _Snapshot(path, meta_path, meta, record[HASH])


def _refuse_without_pointer(directory: str, pointer_path: str) -> None:
    """No current.json: say whether this is an old-format checkpoint, a snapshot, or no checkpoint at all."""
    meta_path = os.path.join(directory, META_FILE)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{pointer_path} is missing: {directory} holds no committed zerokit checkpoint (not a "
                         "checkpoint directory, or its first save did not finish)")
    meta = _read_json(meta_path)
    version = meta.get("version") if isinstance(meta, dict) else None
    parent = os.path.dirname(os.path.abspath(directory))
    if version == VERSION and os.path.isfile(os.path.join(parent, POINTER_FILE)):
        raise ValueError(f"{directory} is one snapshot inside the checkpoint directory {parent}: pass {parent}, "
                         f"whose {POINTER_FILE} names the committed snapshot")
    raise ValueError(f"{meta_path}: a zerokit checkpoint of format version {version!r} without {POINTER_FILE}; "
                     f"this zerokit reads format version {VERSION} (a committed snapshot, every file checksummed) "
                     "only: load it with the zerokit that wrote it and save it again")


@contextlib.contextmanager
def _open_safetensors(path: str):
    """safe_open, with any failure to open (truncated, not safetensors) reported under the file's name."""
    try:
        handle = safe_open(path, framework="pt")
    except Exception as exc:
        raise ValueError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from exc
    with handle as f:
        yield f


def _read(engine, directory: str) -> tuple[_Plan, _Snapshot]:
    snapshot = _open_checkpoint(directory)
    meta, meta_path = snapshot.meta, snapshot.meta_path
    mine = engine.optimizer.name
    if meta["optimizer"]["class"] != mine:
        raise ValueError(f"{meta_path}: the checkpoint's optimizer is {meta['optimizer']['class']}, this engine's "
                         f"is {mine}; build the engine with the same optimizer class")
    checked: set[str] = set()

    def verify(name: str) -> None:
        if name not in checked:
            _verify_file(os.path.join(snapshot.path, name), meta["files"][name], meta_path)
            checked.add(name)

    # See [Note: loading]: the model file (read whole), rank files i = rank (mod world size), and below
    # the rank files this rank reads slices of; the verdict gather in `load` makes every rank hear of any.
    n_saved = int(meta["world_size"])
    verify(MODEL_FILE)
    for r in range(engine.rank, n_saved, engine.world_size):
        verify(rank_file(r, n_saved))
    plan = _Plan(meta)
    _read_model_file(engine, snapshot.path, meta, plan)
    try:
        used = _read_rank_files(engine, snapshot.path, meta, plan)
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


def _read_rank_files(engine, directory: str, meta: dict, plan: _Plan) -> set[int]:
    """Assemble this rank's masters and optimizer states from whichever saved pieces overlap them.

    Returns the saved ranks whose files it read tensor data from (every file's header is read).
    """
    n_saved = int(meta["world_size"])
    kinds: dict[str, str] = meta["optimizer"]["state"]
    aliases = meta["aliases"]
    index: dict[tuple[str, str], list[tuple[int, int, int, str]]] = {}  # (kind, name) -> [(start, end, r, key)]
    paths = [os.path.join(directory, rank_file(r, n_saved)) for r in range(n_saved)]
    used: set[int] = set()
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
                used |= _fill(values[at:at + b - a], pieces, a, b, files, paths, name, MASTER)
                for key, tensor in states.items():
                    used |= _fill(tensor[at:at + b - a], index.get((f"state.{key}", name), []), a, b, files, paths,
                                  name, f"state.{key}")
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
                    try:
                        states[key] = files[r].get_tensor(state_key)
                    except Exception as exc:
                        raise ValueError(f"{paths[r]}: optimizer state {state_key!r} is missing ({exc})") from exc
            plan.masters.append(values)
            plan.states.append(states)
    return used


def _fill(out: torch.Tensor, pieces: list, a: int, b: int, files, paths, name: str, kind: str) -> set[int]:
    """out[:] = elements [a, b) of `name`'s `kind`, copied from the overlapping saved pieces; returns their ranks."""
    covered = torch.zeros(b - a, dtype=torch.bool)
    used = set()
    for start, end, r, key in pieces:
        lo, hi = max(a, start), min(b, end)
        if lo >= hi:
            continue
        sl = files[r].get_slice(key)
        out[lo - a:hi - a] = sl[lo - start:hi - start]  # reads only this sub-range from disk
        covered[lo - a:hi - a] = True
        used.add(r)
    if not bool(covered.all()):
        first = int((~covered).nonzero()[0]) + a
        raise ValueError(f"{kind} of parameter {name!r}: elements [{a}, {b}) are not all in the rank files "
                         f"({os.path.dirname(paths[0])}/rank*-of-{len(paths)}.safetensors); element {first} is "
                         "missing")
    return used


def _match_hyperparameters(engine, meta: dict, meta_path: str) -> tuple[list[dict], list[str]]:
    """For each of this optimizer's groups, the hyperparameters its parameters were saved with; and what that
    changes, one line per (group, key). See [Note: hyperparameters].

    A group steps whole flat buffers, so it holds one value per key: parameters of one group saved
    with different values are refused (a ValueError naming two of them, both values and the fix),
    never given one parameter's value.
    """
    aliases = meta["aliases"]
    saved_of = {name: group["hyperparameters"] for group in meta["optimizer"]["param_groups"]
                for name in group["params"]}
    fp_of_master = {id(m): fp for fp, m in _trainable_with_masters(engine)}
    out, changes = [], []
    for group in engine.optimizer.param_groups:
        names = [aliases.get(n[0], n[0]) for m in group["params"] if id(m) in fp_of_master
                 for n in fp_of_master[id(m)].names]
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
                        f"({key}={_json_number(group[key])}), which holds one value: build the engine with the "
                        "param_groups of the run that saved the checkpoint (zk.shard(..., param_groups=...)), so "
                        "that parameters saved with different hyperparameters are in different groups")
        for key, value in hyper.items():
            mine = _json_number(group[key])
            if mine != value:
                others = len(names) - 1
                changes.append(f"{key} {mine} -> {value} for {names[0]!r}"
                               + (f" and {others} other parameter{'s' if others > 1 else ''}" if others else ""))
        out.append(hyper)
    return out, changes


def _install(engine, plan: _Plan) -> None:
    """Write what `_read` assembled into the engine. No I/O, no collective."""
    with torch.no_grad():
        engine.load_flat_params(plan.flats)  # the stage's own storage: whole buffers, or shards
        module_state = engine.module.state_dict(keep_vars=True)
        for name, value in plan.buffers.items():
            module_state[name].copy_(value)
        optimizer = engine.optimizer
        fused = {id(m): bool(g.get("fused") or g.get("capturable")) for g in optimizer.param_groups
                 for m in g["params"]}
        for (_fp, master), values, states in zip(_trainable_with_masters(engine), plan.masters, plan.states):
            master.copy_(values)  # fp32 master (under fp32 the param shard itself)
            optimizer.set_state(master, {
                key: (t.to(master.device, master.dtype) if t.dim() > 0
                      else t.to(master.device) if fused[id(master)] else t.clone())
                for key, t in states.items()})
        for group, hyper in zip(optimizer.param_groups, plan.hyper):
            for key, value in hyper.items():
                if key in group:
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value
    if engine.scaler is not None and plan.meta.get("loss_scaler") is not None:
        engine.scaler.load_state_dict(plan.meta["loss_scaler"])
    engine.zero_grad()  # also forgets a clip coefficient computed before the load


def load_full_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The plain, unsharded state_dict a checkpoint holds (every key, aliases expanded). No process group.

    Reads the committed snapshot's meta.json and model file, both checked against their sha256.
    """
    snapshot = _open_checkpoint(os.fspath(directory))
    path = os.path.join(snapshot.path, MODEL_FILE)
    _verify_file(path, snapshot.meta["files"][MODEL_FILE], snapshot.meta_path)
    out: dict[str, torch.Tensor] = {}
    with _open_safetensors(path) as f:
        for key in f.keys():
            out[key] = f.get_tensor(key)
    for alias, target in snapshot.meta["aliases"].items():
        if target not in out:
            raise ValueError(f"{path}: {alias!r} is an alias of {target!r}, which the file does not hold")
        out[alias] = out[target]
    return out


class Checkpointing:
    """`engine.save(dir)` / `engine.load(dir)`: mixed into every stage's engine (before core's Engine).

    Generic over stages: everything goes through the engine interface (`flat_params`, the
    optimizer's master shards and states, `load_flat_params`), so core never imports this module.
    """

    def save(self, directory: str | os.PathLike, extra: dict | None = None) -> None:
        """Write a sharded checkpoint (every rank its own range; rank 0 the model and meta). A collective."""
        save(self, directory, extra=extra)

    def load(self, directory: str | os.PathLike) -> dict:
        """Load a checkpoint saved at any world size, stage or precision; returns its meta (with `extra`)."""
        return load(self, directory)
