"""Saving: every rank writes what it owns, and one os.replace of current.json commits the snapshot.

[Note: the commit protocol]
`save` is a collective of four small all-gathers, and the model file's gathers (one per flat
param); a crash of any rank at any point leaves the previous snapshot current and intact:

 1. agree: every rank's realpath(directory) is gathered with rank 0's fresh snapshot name;
    different paths raise ValueError on every rank before anything is written.
 2. create: rank 0 makes <directory>/<snapshot>/; a rank that then cannot see it is on another
    filesystem and is refused.
 3. write: rank 0 streams the model file (or its shards, then their index: format.py [Note:
    sharded model files]) while every rank gathers one flat param at a time
    (`_write_model_files`, every rank to the end whatever failed), then each rank writes, fsyncs
    and digests its rank file. The gather of every rank's problems and digests is the agreement
    that the snapshot is complete; on any problem rank 0 deletes it and every rank raises,
    naming the rank and the file.
 4. commit: rank 0 writes meta.json (every digest), fsyncs the snapshot, writes and fsyncs
    current.json.tmp-<token> and os.replace()s it onto current.json: the one commit point. Then
    it deletes every other ckpt-* snapshot and pointer leftover (a failure there only warns).

A reader follows current.json, so it sees the old snapshot or the new one, never a mix; a
snapshot is complete before anything names it. One writer per directory.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings

import torch

from zerokit.checkpoint.format import (
    FORMAT, MASTER, META_FILE, MODEL_INDEX_FILE, MODEL_METADATA, POINTER_FILE, POINTER_LEFTOVER, SNAPSHOT_NAME,
    SafetensorsWriter, aliases, build_meta, digest_bytes, master_start, meta_bytes, model_index_bytes, model_layout,
    new_snapshot_name, merge_kinds, parse_shard_size, piece_key, pointer, rank_file, state_kinds,
    trainable_with_masters)
from zerokit.core.precision import master_dtype_of


def save(engine, directory: str | os.PathLike, extra: dict | None = None, max_shard_size: int | str | None = None
         ) -> None:
    """Write a sharded checkpoint of `engine` into `directory`, atomically. A collective: every rank calls it.

    `extra` (JSON-serialisable) is stored in meta.json and handed back by `load` (the
    training loop's step index, for instance). `max_shard_size` (bytes, or "5GB" as Hugging
    Face writes it; default None: one model.safetensors) splits the consolidated model into
    model-0000i-of-0000K.safetensors and model.safetensors.index.json as transformers'
    save_pretrained does (format.py [Note: sharded model files]). The new snapshot is written beside the
    directory's current one and becomes current in one step once every rank's files are
    on disk (see [Note: the commit protocol]); until then, and after any failure or crash,
    `load` reads the previous checkpoint. Raises ValueError on every rank if the ranks
    passed different directories (before writing anything) or if any rank failed to write,
    naming the rank and the file.
    """
    if max_shard_size is not None:
        parse_shard_size(max_shard_size)  # a bad size raises here, on every rank alike, before any collective
    snapshot = _agree_on_directory(engine, directory)  # 1. agree (all-gather)
    directory = os.fspath(directory)
    engine.finish_backward()
    what = f"cannot save checkpoint {directory}"
    snapshot_path = os.path.join(directory, snapshot)

    # 2. create: one rank makes the snapshot directory, so a rank that cannot see it is on another filesystem.
    problems: list[str] = []
    if engine.comm.world_rank == 0:
        try:
            os.makedirs(snapshot_path)  # the name is fresh: an existing one would be a bug
        except Exception as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
    raise_if_any(engine, problems, what)

    # 3. write: the model file (a collective: every rank gathers, rank 0 writes), then every rank its own files;
    # then the all-gather that agrees the snapshot is complete.
    records: dict[str, dict] = {}
    kinds: dict[str, str] = {}
    try:
        if not os.path.isdir(snapshot_path):
            raise OSError(f"{snapshot_path}, just created by rank 0, does not exist on rank {engine.comm.world_rank}: "
                          "the checkpoint directory must be on a filesystem every rank shares")
        kinds = state_kinds(engine)
    except Exception as exc:  # reported to every rank below, never left for a peer to hang on
        problems.append(f"{type(exc).__name__}: {exc}")
    try:  # every rank, whatever went wrong above: the others' gathers need it
        records.update(_write_model_files(engine, snapshot_path, write=not problems, max_shard_size=max_shard_size))
    except Exception as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
    if not problems:
        try:
            if engine.comm.replica_rank == 0:  # hybrid sharding: one copy of the shards is written (core/collectives/hybrid.py)
                name = rank_file(engine.rank, engine.world_size)
                records[name] = _write_rank_file(engine, snapshot_path, kinds, aliases(engine.module))
        except Exception as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
    everyone = engine.comm.all_gather_object((problems, records, kinds),
                                             label="checkpoint save: every rank's files written", phase="checkpoint")
    errors = [f"rank {r}: {msg}" for r, (theirs, _, _) in enumerate(everyone) for msg in theirs]
    if errors:
        if engine.comm.world_rank == 0:  # every rank has stopped writing: the half-written snapshot can go
            shutil.rmtree(snapshot_path, ignore_errors=True)
        raise_on_every_rank(engine, what, errors)

    # 4. commit: rank 0 alone, after every rank's files are on disk.
    if engine.comm.world_rank == 0:
        committed = False
        try:
            files = {name: record for _, theirs, _ in everyone for name, record in theirs.items()}
            kinds = merge_kinds([theirs for _, _, theirs in everyone])  # whole-parameter path: each rank's own keys
            meta_record = _write_meta(snapshot_path, build_meta(engine, kinds, extra, files))
            _commit(directory, snapshot, meta_record)
            committed = True
            _fsync(directory)  # the rename itself, durable
            _remove_stale(directory, keep=snapshot)
        except Exception as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
            if not committed:
                shutil.rmtree(snapshot_path, ignore_errors=True)
    raise_if_any(engine, problems, what)


def _agree_on_directory(engine, directory) -> str:
    """All-gather every rank's resolved directory; raise on every rank unless they are equal. Returns rank 0's
    fresh snapshot name, which every rank then writes into."""
    try:
        mine = os.path.realpath(os.fspath(directory))
    except Exception as exc:  # not a path: still take part in the gather, then fail with everyone
        mine = exc
    snapshot = new_snapshot_name() if engine.comm.world_rank == 0 else None
    everyone = engine.comm.all_gather_object((mine, snapshot), label="checkpoint save: the directory",
                                             phase="checkpoint")
    bad = [f"rank {r}: {type(p).__name__}: {p}" for r, (p, _) in enumerate(everyone) if isinstance(p, Exception)]
    if bad:
        raise_on_every_rank(engine, f"cannot save checkpoint {directory!r}", bad)
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


def raise_on_every_rank(engine, what: str, errors: list[str]) -> None:
    """Raise the ValueError every rank raises: `errors` were gathered, so they are the same on every rank."""
    raise ValueError(f"zerokit: {what} (raised on rank {engine.comm.world_rank}):\n  " + "\n  ".join(errors))


def raise_if_any(engine, problems: list[str], what: str) -> None:
    """Gather every rank's `problems`; raise on every rank if any rank has one."""
    everyone = engine.comm.all_gather_object(problems, label="checkpoint: every rank's problems", phase="checkpoint")
    errors = [f"rank {r}: {msg}" for r, theirs in enumerate(everyone) for msg in theirs]
    if errors:
        raise_on_every_rank(engine, what, errors)


def _fsync(path: str) -> None:
    """Flush a file's data, or a directory's entries, to stable storage (the commit must not outrun them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_rank_file(engine, directory: str, kinds: dict[str, str], names_of: dict[str, str]) -> dict:
    """This rank's pieces of every trainable flat param: master and optimizer states, by name and range."""
    tensors: dict[str, torch.Tensor] = {}  # views of the master and its states: written as they are, not copied
    for fp, master in trainable_with_masters(engine):
        base = master_start(fp, master)
        lo, _hi = fp.shard_range
        master_state = engine.optimizer.state_of(master)
        for piece in fp.layout.pieces(engine.rank):
            name = names_of.get(fp.names[piece.index][0], fp.names[piece.index][0])  # the model file's key
            a = lo + piece.shard_offset - base  # where the piece sits in the master tensor
            b = a + piece.numel
            tensors[piece_key(MASTER, name, piece.start, piece.end)] = (  # fp32, float64 for a float64 model
                master.detach()[a:b].to(master_dtype_of(master.dtype)))
            if engine.optimizer.whole is not None:
                continue  # states by owned parameter, below
            for key, kind in kinds.items():
                value = master_state[key].detach()
                tensors[piece_key(f"state.{key}", name, piece.start, piece.end)] = (
                    value[a:b] if kind == "elementwise" else value)
    # The whole-parameter path (optim/whole_params.py): each owned parameter's states, whole, as pieces
    # [0, numel) of its name; elementwise ones flat, so a flat-path engine reads any range of them.
    fps = [fp for fp, _m in trainable_with_masters(engine)]
    for own in engine.optimizer.owned():
        fp = fps[own.buffer]
        name = names_of.get(fp.names[own.index][0], fp.names[own.index][0])
        for key, value in engine.optimizer.optimizer.state.get(own.tensor, {}).items():
            kind = kinds[key]
            if kind in ("int", "float"):  # a Python number: format.py `state_kinds`
                value = torch.tensor(value, dtype=torch.int64 if kind == "int" else torch.float64)
            tensors[piece_key(f"state.{key}", name, 0, own.numel)] = (  # elementwise: in the master's order
                fp.to_storage_order(own.index, value.detach().reshape(-1)) if kind == "elementwise"
                else value.detach())
    path = os.path.join(directory, rank_file(engine.rank, engine.world_size))
    writer = None
    try:
        writer = SafetensorsWriter(path, {key: (t.dtype, tuple(t.shape)) for key, t in tensors.items()},
                                   {"format": FORMAT, "rank": str(engine.rank), "world_size": str(engine.world_size)})
        for key in writer.order:  # the file's order: each piece hashed as it is written
            writer.write(key, tensors[key])
        return writer.close()
    except Exception as exc:
        if writer is not None:
            writer.abandon()
        raise OSError(f"writing {path}: {exc}") from exc


def _write_model_files(engine, directory: str, write: bool = True, max_shard_size=None) -> dict[str, dict]:
    """Stream the full state into model.safetensors, or the shards and index `max_shard_size` asks for
    (format.py [Note: sharded model files]); their records on world rank 0, {} elsewhere. A collective.

    Every rank iterates `engine.full_state_items` to the end, one flat param gathered at a time;
    rank 0 writes each tensor into its file as it arrives (a tied tensor once, under its first name),
    each file byte for byte what safetensors' save_file writes for its tensors (format.py [Note: the
    streaming writer]). A file is opened at its first tensor and closed (fsynced) at its last, so
    only the files the gather order is filling are open. A failure on rank 0 (or `write` False) stops
    the writing, never the gathers: the other ranks drain theirs, then rank 0 raises and `save`
    reports it on every rank.
    """
    layout, specs, file_of, left, writers, records = {}, {}, {}, {}, {}, {}
    error, path = None, directory
    names_of = aliases(engine.module)
    writing = engine.comm.world_rank == 0 and write

    def stop(exc: Exception, where: str) -> None:
        nonlocal error, writing, path
        error, writing, path = exc, False, where
        for writer in writers.values():
            writer.abandon()
        writers.clear()

    if writing:
        try:
            all_specs = engine.full_state_specs()
            specs = {name: all_specs[name] for name in engine.module.state_dict(keep_vars=True)
                     if name not in names_of}  # the state_dict's order: the one Hugging Face splits in
            layout = model_layout(specs, max_shard_size)
            file_of = {name: file for file, names in layout.items() for name in names}
            left = {file: len(names) for file, names in layout.items()}
        except Exception as exc:
            stop(exc, os.path.join(directory, next(iter(layout), "model.safetensors")))
    for name, tensor in engine.full_state_items(rank0_only=True):
        if writing and name in file_of:
            file = file_of[name]
            try:
                if file not in writers:
                    writers[file] = SafetensorsWriter(os.path.join(directory, file),
                                                      {n: specs[n] for n in layout[file]}, MODEL_METADATA)
                writers[file].write(name, tensor)
                left[file] -= 1
                if not left[file]:
                    records[file] = writers.pop(file).close()
            except Exception as exc:
                stop(exc, os.path.join(directory, file))
        del tensor  # before the next gather: a value still held keeps its flat param's gathered buffer alive
    if writing:
        file = MODEL_INDEX_FILE
        try:
            unwritten = [f for f in layout if f not in records]
            if unwritten:
                file = unwritten[0]
                raise ValueError(f"{left[file]} of its tensors never came from the gather")
            if len(layout) > 1:
                parameters = {n for fp in engine.flat_params for names in fp.names for n in names}
                records[file] = _write_small_file(os.path.join(directory, file),
                                                  model_index_bytes(layout, specs, parameters))
        except Exception as exc:
            stop(exc, os.path.join(directory, file))
    if error is not None:
        raise OSError(f"writing {path}: {error}") from error
    return records


def _write_small_file(path: str, data: bytes) -> dict:
    """Write `data` to `path` and fsync it; its {"bytes", "sha256"} record."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return digest_bytes(data)


def _write_meta(snapshot_path: str, meta: dict) -> dict:
    """Write meta.json, then fsync the snapshot directory (every file's entry); return meta.json's record."""
    path = os.path.join(snapshot_path, META_FILE)
    data = meta_bytes(meta)
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _fsync(snapshot_path)
    except Exception as exc:
        raise OSError(f"writing {path}: {exc}") from exc
    return digest_bytes(data)


def _commit(directory: str, snapshot: str, meta_record: dict) -> None:
    """Make `snapshot` the directory's checkpoint: one os.replace of current.json, the commit point."""
    path = os.path.join(directory, POINTER_FILE)
    tmp = f"{path}.tmp-{snapshot[-12:]}"
    try:
        with open(tmp, "w") as f:
            json.dump(pointer(snapshot, meta_record), f, indent=1, sort_keys=True)
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
        if entry == keep or not (SNAPSHOT_NAME.match(entry) or POINTER_LEFTOVER.match(entry)):
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
