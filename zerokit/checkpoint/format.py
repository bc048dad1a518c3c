"""The checkpoint format (VERSION 2): names, file layout, piece keys, meta.json, digests. No process group.

A checkpoint directory holds one committed snapshot and the pointer that names it:

    current.json                    the commit pointer (rank 0, replaced atomically): format, version,
                                    "checkpoint" (the snapshot's name), meta.json's bytes and sha256
    ckpt-<UTC time>-<token>/        one snapshot; never modified once current.json names it
      meta.json                     rank 0: world size, stage, precision, optimizer class and per-group
                                    hyperparameters, loss-scaler state, versions, every parameter's names /
                                    shape / dtype, the caller's `extra`, and "files": {name: {"bytes",
                                    "sha256"}} for every file below
      model.safetensors             rank 0: engine.state_dict(full=True), the unwrapped model's keys (fp32
                                    masters where they exist), streamed as it is gathered ([Note: the
                                    streaming writer]); a tied tensor is stored once, under its first
                                    name, and meta.json's "aliases" maps the other names to it. Or, saved
                                    with `max_shard_size` and larger than it, Hugging Face's sharded layout
                                    instead ([Note: sharded model files]):
      model-00001-of-0000K.safetensors ... model-0000K-of-0000K.safetensors, model.safetensors.index.json
      rank{r}-of-{N}.safetensors    rank r: the pieces of range [r * shard_numel, (r + 1) * shard_numel) of
                                    every trainable flat param's fp32 master and per-element optimizer states

Under hybrid sharding (core/collectives/hybrid.py) N is the shard group size ("world_size" in meta.json;
"data_parallel_size" is every rank): only replica 0 writes rank files. A reader finds pieces by
name and range, whatever N and stage wrote them.

[Note: pieces keyed by name and range]
A flat buffer's layout depends on the world size (padding), the stage (stage 3 groups by unit)
and `bucket_numel`, so a rank file never refers to it. Each stored tensor is the part of *one
parameter* that fell in the writer's range, keyed

    "<kind>::<param name>::<start>:<end>"      kind = "master" or "state.<key>" (exp_avg, ...)

with [start, end) counted in the flattened parameter's elements; padding is never stored. A
reader with any layout copies the sub-ranges of the pieces that overlap what it owns.
Scalar optimizer states (Adam's `step`) are stored once per piece as 0-dim tensors. At stage 0
rank r still writes only range r, so the files are the same size at every stage.

[Note: sharded model files]
`save(dir, max_shard_size=S)` splits the model file the way transformers' `save_pretrained(max_shard_size=S)`
does (huggingface_hub's `split_torch_state_dict_into_shards`; `split_into_shards` below): the stored
tensors (a tied tensor once) in the model's state_dict order, each appended to the current file unless
that would take the file's tensor bytes past S, when a new file starts; a tensor larger than S alone
gets a file of its own (so that file exceeds S); tensors are never split. One file: model.safetensors,
as without S. K > 1 files: model-{i:05d}-of-{K:05d}.safetensors, each byte for byte what safetensors'
`save_file` writes for its tensors (header metadata {"format": "pt"}, as transformers writes it), and
model.safetensors.index.json, the bytes transformers writes: json.dumps({"metadata": {"total_parameters",
"total_size"}, "weight_map": {key: file}}, indent=2, sort_keys=True) + "\n", total_size the tensor bytes
of every file, the tied names left out of weight_map as transformers leaves them. meta.json records
every one of these files, the index included; a reader finds which are there from that list
(`model_files`). S is bytes, an int, or a string as huggingface_hub's `parse_size_to_int` reads it
("5GB", "500MB": decimal units TB, GB, MB, KB).

[Note: checksums]
Every byte is checked before a load changes anything: meta.json records each safetensors
file's size and sha256, current.json records meta.json's, and every field of current.json is
validated when read. The digests are plain sha256 of the files' bytes, so `sha256sum` checks a
copied checkpoint without zerokit. sha256 is the fastest strong hash in the stdlib on CPUs with
SHA extensions; its cost per GB on save and load is in benchmarks/results/checksum_cost.md.

[Note: the streaming writer]
The model file is written by `SafetensorsWriter` as each tensor is gathered, so no rank holds
the whole model. Its bytes are those safetensors' `save_file` writes for the same tensors: an
8-byte little-endian header length, the compact JSON header (`__metadata__` first, then the
tensors by dtype, widest first, then by name) padded with spaces to a multiple of 8, then each
tensor's raw bytes in header order. Tensors arrive in the engine's gather order, not the
header's, so each is written at its own offset, and the sha256 covers the file as it grows: a
tensor that continues the hashed prefix is hashed from memory; one written ahead of it is read
back from the file once the prefix reaches it (no read at all when they arrive in header order).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import struct
import time
from dataclasses import dataclass

import safetensors
import torch

FORMAT = "zerokit-checkpoint"
VERSION = 2  # 1: files directly in the directory, meta.json written last, no checksums
POINTER_FILE = "current.json"
META_FILE = "meta.json"
MODEL_FILE = "model.safetensors"
MODEL_INDEX_FILE = "model.safetensors.index.json"
MODEL_SHARD = re.compile(r"^model-(?P<index>\d{5})-of-(?P<count>\d{5})\.safetensors$")
MODEL_METADATA = {"format": "pt"}  # the model file(s)' header metadata: what transformers writes and reads
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # huggingface_hub's parse_size_to_int
HASH = "sha256"
MASTER = "master"
PIECE_KEY = re.compile(r"^(?P<kind>[^:]+)::(?P<name>.+)::(?P<start>\d+):(?P<end>\d+)$")
SNAPSHOT_NAME = re.compile(r"^ckpt-\d{8}T\d{6}-[0-9a-f]{12}$")
POINTER_LEFTOVER = re.compile(r"^current\.json\.tmp-[0-9a-f]{12}$")
_READ_CHUNK_BYTES = 8 << 20  # digest buffer: large enough that hashing, not the syscalls, is the cost


# ====================================================================== names and keys
def rank_file(rank: int, world_size: int) -> str:
    return f"rank{rank}-of-{world_size}.safetensors"


def snapshot_files(world_size: int, model: list[str] | tuple[str, ...] = (MODEL_FILE,)) -> set[str]:
    """Every file of a snapshot written by `world_size` ranks with model files `model` (meta.json's "files")."""
    return set(model) | {rank_file(r, world_size) for r in range(world_size)}


def model_shard_file(index: int, count: int) -> str:
    """The name of model file `index` (1-based) of `count`, as transformers names its shards."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def model_files(names) -> list[str]:
    """The model files among a snapshot's file names: [model.safetensors], or the K shards in order then the
    index ([Note: sharded model files]). ValueError unless the names hold exactly one such set."""
    names = set(names)
    shards = sorted(n for n in names if MODEL_SHARD.match(n))
    if not shards and MODEL_INDEX_FILE not in names:
        if MODEL_FILE not in names:
            raise ValueError(f"no model file ({MODEL_FILE}, or {MODEL_INDEX_FILE} and its shards)")
        return [MODEL_FILE]
    count = int(MODEL_SHARD.match(shards[0])["count"]) if shards else 0
    expected = [model_shard_file(i, count) for i in range(1, count + 1)]
    if count < 2 or shards != expected or MODEL_INDEX_FILE not in names or MODEL_FILE in names:
        raise ValueError(f"model files {shards + sorted(names & {MODEL_FILE, MODEL_INDEX_FILE})} are neither "
                         f"{MODEL_FILE} alone nor {MODEL_INDEX_FILE} with model-00001-of-0000K.safetensors ... "
                         "model-0000K-of-0000K.safetensors (K >= 2)")
    return expected + [MODEL_INDEX_FILE]


def parse_shard_size(size) -> int:
    """`max_shard_size` in bytes: a positive int, or a string as huggingface_hub's parse_size_to_int reads it
    ("5GB", "2.5 MB", "100kb": TB, GB, MB, KB, powers of 10), or of digits only (bytes)."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"max_shard_size {size!r}: give bytes (an int) or a size such as \"5GB\"")
    value = size
    if isinstance(size, str):
        text = size.strip()
        if text.isdigit():
            value = int(text)
        else:
            unit = text[-2:].upper()
            try:
                if unit not in SIZE_UNITS:
                    raise ValueError
                value = int(float(text[:-2].strip()) * SIZE_UNITS[unit])
            except ValueError:
                raise ValueError(f"max_shard_size {size!r}: not a size; give bytes or a number with one of the "
                                 f"units {', '.join(SIZE_UNITS)} (\"5GB\", \"500MB\"), as Hugging Face reads it") \
                    from None
    if value < 1:
        raise ValueError(f"max_shard_size {size!r} is not positive")
    return value


def split_into_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """The files `sizes` (name -> tensor bytes, in the state_dict's order) fall into, by huggingface_hub's rule
    ([Note: sharded model files]): in order, a tensor joins the current file unless that takes it past
    `max_bytes`, when the file is closed and a new one started; a tensor larger than `max_bytes` gets a file of
    its own at once (listed before the file being filled, as huggingface_hub lists it)."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in sizes.items():
        if size > max_bytes:
            shards.append([name])
            continue
        if current_bytes + size > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def model_layout(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], max_shard_size=None) -> dict[str, list[str]]:
    """file -> the names it holds, for the stored tensors `specs` (name -> (dtype, shape), in the state_dict's
    order): model.safetensors for all of them, unless `max_shard_size` splits them into several files."""
    if max_shard_size is None:
        return {MODEL_FILE: list(specs)}
    shards = split_into_shards({name: tensor_bytes(*spec) for name, spec in specs.items()},
                               parse_shard_size(max_shard_size))
    if len(shards) <= 1:
        return {MODEL_FILE: list(specs)}
    return {model_shard_file(i + 1, len(shards)): names for i, names in enumerate(shards)}


def tensor_bytes(dtype: torch.dtype, shape) -> int:
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * dtype.itemsize


def model_index_bytes(layout: dict[str, list[str]], specs: dict, parameters: set[str]) -> bytes:
    """model.safetensors.index.json's bytes for a sharded `layout`, exactly as transformers' save_pretrained
    writes them; `parameters`: the stored names that are parameters (total_parameters counts them, not buffers)."""
    weight_map = {name: file for file, names in layout.items() for name in names}
    index = {"metadata": {"total_parameters": sum(tensor_bytes(*specs[n]) // specs[n][0].itemsize
                                                  for n in weight_map if n in parameters),
                          "total_size": sum(tensor_bytes(*specs[n]) for n in weight_map)},
             "weight_map": weight_map}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def new_snapshot_name() -> str:
    return f"ckpt-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(6)}"


def piece_key(kind: str, name: str, start: int, end: int) -> str:
    return f"{kind}::{name}::{start}:{end}"


def parse_piece_key(key: str, params: dict, path: str) -> tuple[str, str, int, int]:
    """(kind, name, start, end) of a rank file's key, checked against meta.json's "params"; ValueError naming
    `path` and the key otherwise."""
    m = PIECE_KEY.match(key)
    if m is None:
        raise ValueError(f"{path}: unrecognised key {key!r}")
    name, start, end = m["name"], int(m["start"]), int(m["end"])
    info = params.get(name)
    if info is None:
        raise ValueError(f"{path}: piece of unknown parameter {name!r}")
    numel = 1
    for d in info["shape"]:
        numel *= d
    if not 0 <= start < end <= numel:
        raise ValueError(f"{path}: piece {key!r} is outside {name!r} ({numel} elements)")
    return m["kind"], name, start, end


# ====================================================================== the engine's side of the layout
def aliases(module) -> dict[str, str]:
    """Second and later names of a tensor reachable under several state_dict keys -> its first name."""
    first: dict[int, str] = {}
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in first:
            out[name] = first[id(t)]
        else:
            first[id(t)] = name
    return out


def master_start(fp, master: torch.Tensor) -> int:
    """Flat offset where this rank's master tensor begins: 0 when it spans the whole buffer (stage 0)."""
    if master.numel() == fp.padded_numel:
        return 0
    assert master.numel() == fp.shard_numel, (master.numel(), fp.shard_numel, fp.padded_numel)
    return fp.shard_range[0]


def trainable_with_masters(engine) -> list[tuple[object, torch.Tensor]]:
    trainable = [fp for fp in engine.flat_params if fp.requires_grad]
    masters = engine.optimizer.master_shards
    assert len(trainable) == len(masters), (len(trainable), len(masters))
    return list(zip(trainable, masters))


def state_kinds(engine) -> dict[str, str]:
    """Optimizer state key -> "elementwise" (shaped like the master) or "scalar" (0-dim), checked.

    On the whole-parameter path (optim/whole_params.py) a state is "elementwise" when shaped like its
    parameter, "scalar" when 0-dim, and "whole" otherwise (Adafactor's row and column statistics): saved
    whole by the parameter's owner, read whole by its owner at the loading world size; a Python number is
    "int" or "float" (saved as a 0-dim int64 / float64 tensor, restored as the number). This rank's view: a
    rank that owns nothing knows no key, so the save merges every rank's (`merge_kinds`)."""
    kinds: dict[str, str] = {}
    if engine.optimizer.whole is not None:
        for own in engine.optimizer.owned():
            for key, value in engine.optimizer.optimizer.state.get(own.tensor, {}).items():
                if type(value) in (int, float):  # Hugging Face's Adafactor counts its steps in a Python int
                    kind = type(value).__name__
                elif not torch.is_tensor(value):
                    raise ValueError(f"optimizer state {key!r} of {engine.optimizer.name} is a "
                                     f"{type(value).__name__}: a sharded checkpoint holds tensors and Python "
                                     "ints and floats")
                else:
                    kind = ("scalar" if value.dim() == 0 else "elementwise" if value.shape == own.tensor.shape
                            else "whole")
                if kinds.setdefault(key, kind) != kind:
                    raise ValueError(f"optimizer state {key!r} of {engine.optimizer.name} is {kind} for some "
                                     f"parameters and {kinds[key]} for others: a sharded checkpoint cannot hold it")
        return kinds
    for fp, master in trainable_with_masters(engine):
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


def merge_kinds(every_rank: list[dict[str, str]]) -> dict[str, str]:
    """One state-kind table from every rank's `state_kinds` (equal on the flat path; on the whole-parameter
    path each rank knows the keys of the parameters it owns)."""
    out: dict[str, str] = {}
    for kinds in every_rank:
        for key, kind in kinds.items():
            if out.setdefault(key, kind) != kind:
                raise ValueError(f"optimizer state {key!r} is {kind} on one rank and {out[key]} on another")
    return out


# ====================================================================== meta.json
def _zerokit_version() -> str:
    try:
        from importlib.metadata import version
        return version("zerokit")
    except Exception:  # run from a source checkout without an installed distribution
        return "source"


def json_number(value):
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


# [Note: hyperparameter types]
# torch takes hyperparameters of several types: `lr=torch.tensor(1e-2)` (a 0-dim tensor, for capturable
# or compiled steps), betas as a tuple of tensors, bool flags (maximize, capturable, differentiable,
# amsgrad), None-or-bool (foreach, fused). A float written back where a tensor lr was changes the step's
# arithmetic (a tensor lr multiplies in its dtype), and a flag left to
# the loading engine (maximize) can reverse it. So meta.json records each group entry with its type
# (`encode_hyperparameter`) and a load restores that type (`decode_hyperparameter`); a value JSON cannot
# hold is recorded as unstorable and refused at load, naming it, rather than dropped. Checkpoints written
# without types (plain numbers and lists only) decode them as they are.
UNSTORABLE = "unstorable"  # meta.json's key for a hyperparameter whose value JSON cannot hold


def encode_hyperparameter(value):
    """A param group's hyperparameter as meta.json holds it, its type kept ([Note: hyperparameter types]):
    None, bools, ints, floats and strings as themselves; a tensor as {"value": value.tolist(), "tensor":
    dtype name}; a tuple or list as a list of these; anything else as {"unstorable": its type's name}."""
    if torch.is_tensor(value):
        if value.requires_grad or value.is_sparse or value.numel() > 64:
            return {UNSTORABLE: f"tensor (requires_grad={value.requires_grad}, shape {tuple(value.shape)})"}
        out = {"value": value.detach().cpu().tolist(), "tensor": str(value.dtype).removeprefix("torch.")}
        return out if value.device.type == "cpu" else {**out, "device": value.device.type}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        items = [encode_hyperparameter(v) for v in value]
        if all(not isinstance(i, (list, dict)) or "tensor" in i for i in items):
            return items
    return {UNSTORABLE: type(value).__name__}


def decode_hyperparameter(saved, current, device: torch.device | None = None):
    """The value `encode_hyperparameter` recorded, of its saved type: a tensor back in its dtype, on the device
    of the group's `current` value when that is a tensor, else on the CPU where it was saved there (torch keeps
    a plain tensor lr on the CPU) and on `device` (the group's parameters') where it was on an accelerator
    (capturable / fused steps); a list as a tuple unless `current` is a list (torch's betas are tuples). Older
    checkpoints, which stored plain numbers and lists of numbers only, decode to those numbers and lists."""
    if isinstance(saved, dict):
        where = (current.device if torch.is_tensor(current)
                 else device if saved.get("device", "cpu") != "cpu" and device is not None else "cpu")
        return torch.tensor(saved["value"], dtype=getattr(torch, saved["tensor"]), device=where)
    if isinstance(saved, list):
        like = current if isinstance(current, (tuple, list)) and len(current) == len(saved) else [None] * len(saved)
        items = [decode_hyperparameter(s, c, device) for s, c in zip(saved, like)]
        return items if isinstance(current, list) else tuple(items)
    return saved


def show_hyperparameter(encoded) -> str:
    """An encoded hyperparameter for a message: numbers as numbers, a tensor as tensor(value, dtype)."""
    if isinstance(encoded, dict):
        if UNSTORABLE in encoded:
            return f"<{encoded[UNSTORABLE]}, not stored>"
        return f"tensor({encoded['value']}, dtype={encoded['tensor']})"
    if isinstance(encoded, list) and any(isinstance(v, dict) for v in encoded):
        return "(" + ", ".join(show_hyperparameter(v) for v in encoded) + ")"
    return repr(encoded) if isinstance(encoded, str) else str(encoded)


def param_records(engine) -> dict[str, dict]:
    """meta.json's "params": per parameter (under its first name) its names, shape, dtype, requires_grad, and its
    storage strides where they are not contiguous and its packing where it is quantized."""
    names_of = aliases(engine.module)
    params = {}
    for fp in engine.flat_params:
        for names, shape in zip(fp.names, fp.layout.shapes):
            params[names_of.get(names[0], names[0])] = {
                "names": list(names), "shape": list(shape), "dtype": str(fp.dtype).removeprefix("torch."),
                "requires_grad": fp.requires_grad}
        for names, stride in zip(fp.names, fp.strides):  # pieces in this storage order: core/params/flat_param.py
            if stride is not None:  # [Note: parameters keep their strides]; absent: contiguous
                params[names_of.get(names[0], names[0])]["stride"] = list(stride)
        for names, p in zip(fp.names, fp.params):  # a quantized weight: how its bytes encode it
            if getattr(p, "zerokit_packed", None):
                params[names_of.get(names[0], names[0])]["packed"] = str(p.zerokit_packed)
    return params


def build_meta(engine, kinds: dict[str, str], extra: dict | None, files: dict[str, dict]) -> dict:
    """meta.json's content for `engine`, given every file's record."""
    optimizer = engine.optimizer
    names_of = aliases(engine.module)
    trainable = [fp for fp, _m in trainable_with_masters(engine)]
    groups = []
    for group, shards in zip(optimizer.param_groups, optimizer.group_shards):
        fps = [trainable[k] for k in shards]
        names = [names_of.get(names[0], names[0]) for fp in fps for names in fp.names]
        hyper = {k: encode_hyperparameter(v) for k, v in group.items() if k != "params"}
        groups.append({"params": names, "hyperparameters": hyper})
    step = optimizer.first_step_count()
    params = param_records(engine)
    expected = snapshot_files(engine.world_size, model_files(files))
    assert set(files) == expected, (sorted(files), sorted(expected))
    return {
        "format": FORMAT, "version": VERSION,
        "world_size": engine.world_size, "stage": engine.stage, "precision": engine.policy.name,
        "data_parallel_size": engine.comm.data_parallel_size,
        "optimizer": {"class": optimizer.name, "param_groups": groups, "state": kinds,
                      "step": step},
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "versions": {"zerokit": _zerokit_version(), "torch": torch.__version__,
                     "safetensors": safetensors.__version__},
        "params": params,
        "aliases": names_of,
        "extra": extra or {},
        "files": files,
    }


def meta_bytes(meta: dict) -> bytes:
    """meta.json's bytes, exactly as written."""
    return json.dumps(meta, indent=1, sort_keys=True).encode()


def check_meta(meta, meta_path: str) -> dict:
    """Refuse a meta.json of another format or version, or whose file list is not its snapshot's."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        found = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else (None, None)
        raise ValueError(f"{meta_path}: format {found[0]!r} version {found[1]!r}, "
                         f"expected {FORMAT!r} version {VERSION}")
    world_size = meta.get("world_size")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"{meta_path}: 'world_size' is {world_size!r}, not a positive integer")
    files = meta.get("files", {})
    try:
        model = model_files(files if isinstance(files, dict) else {})
    except ValueError:  # no valid set of model files: refused below, listing what a snapshot holds
        model = [MODEL_FILE]
    expected = snapshot_files(world_size, model)
    if not isinstance(files, dict) or set(files) != expected or not all(is_record(r) for r in files.values()):
        raise ValueError(f"{meta_path}: its file list {sorted(files)} is not {sorted(expected)} with sizes and "
                         f"{HASH} digests")
    return meta


# ====================================================================== current.json
def pointer(snapshot: str, meta_record: dict) -> dict:
    """current.json's content: `snapshot` is the committed one, its meta.json has `meta_record`."""
    return {"format": FORMAT, "version": VERSION, "checkpoint": snapshot, META_FILE: meta_record}


def check_pointer(content, pointer_path: str) -> tuple[str, dict]:
    """The snapshot name and meta.json record of a current.json's content; ValueError unless every field is valid."""
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise ValueError(f"{pointer_path}: not a zerokit checkpoint pointer")
    if content.get("version") != VERSION:
        raise ValueError(f"{pointer_path}: checkpoint format version {content.get('version')!r}; this zerokit reads "
                         f"version {VERSION}")
    name, record = content.get("checkpoint"), content.get(META_FILE)
    if not isinstance(name, str) or SNAPSHOT_NAME.match(name) is None:
        raise ValueError(f"{pointer_path}: 'checkpoint' is {name!r}, not a snapshot name ckpt-<UTC time>-<token>")
    if not is_record(record) or set(content) != {"format", "version", "checkpoint", META_FILE}:
        raise ValueError(f"{pointer_path}: malformed (expected format, version, checkpoint and {META_FILE}'s bytes "
                         f"and {HASH})")
    return name, record


# ====================================================================== digests
def digest(path: str) -> dict:
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


def digest_bytes(data: bytes) -> dict:
    """The record of a file holding `data`."""
    return {"bytes": len(data), HASH: hashlib.new(HASH, data).hexdigest()}


def is_record(record) -> bool:
    """A file's {"bytes": int, "sha256": 64 hex digits} record, exactly."""
    return (isinstance(record, dict) and set(record) == {"bytes", HASH}
            and isinstance(record["bytes"], int) and not isinstance(record["bytes"], bool) and record["bytes"] >= 0
            and isinstance(record[HASH], str) and re.fullmatch(r"[0-9a-f]{64}", record[HASH]) is not None)


def check_record(path: str, actual: dict, expected: dict, recorded_in: str) -> None:
    if actual["bytes"] != expected["bytes"]:
        raise ValueError(f"{path}: {actual['bytes']} bytes on disk, {expected['bytes']} recorded in {recorded_in}; "
                         "the file is truncated or was changed after the save")
    if actual[HASH] != expected[HASH]:
        raise ValueError(f"{path}: {HASH} checksum mismatch ({actual[HASH]} on disk, {expected[HASH]} recorded in "
                         f"{recorded_in}); the file is corrupted or was changed after the save")


def verify_file(path: str, expected: dict, recorded_in: str) -> None:
    """Refuse a file whose size or sha256 differs from its record (size first: it costs no read)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        raise ValueError(f"{path} is missing: {recorded_in} lists it, and every file of a checkpoint is needed") \
            from None
    if size != expected["bytes"]:
        check_record(path, {"bytes": size, HASH: ""}, expected, recorded_in)
    check_record(path, digest(path), expected, recorded_in)


# ====================================================================== writing a safetensors file tensor by tensor
# torch dtype -> safetensors' name for it, in the order save_file lays tensors out (widest first, then by name)
SAFETENSORS_DTYPES = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.complex64: "C64", torch.float32: "F32",
    torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint16: "U16",
    torch.int16: "I16", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPE_RANK = {dtype: i for i, dtype in enumerate(SAFETENSORS_DTYPES)}


class SafetensorsWriter:
    """One safetensors file written a tensor at a time, hashed as it is written.

    `specs`: name -> (dtype, shape) of every tensor the file will hold; the header (and so every
    tensor's offset) is written at once. `write(name, tensor)` then puts each tensor's bytes at its
    offset, in any order (`order`, the file's, needs no read-back); `close()` fsyncs and returns the file's {"bytes", "sha256"} record;
    `abandon()` (the error path) closes and deletes the file. See [Note: the streaming writer].
    """

    def __init__(self, path: str, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = path
        self.order = sorted(specs, key=lambda name: (_DTYPE_RANK[specs[name][0]], name))  # the file's order
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self.extents: dict[str, tuple[int, int]] = {}  # name -> [begin, end) bytes after the header
        end = 0
        for name in self.order:
            dtype, shape = specs[name]
            numel = 1
            for d in shape:
                numel *= int(d)
            begin, end = end, end + numel * dtype.itemsize
            self.extents[name] = (begin, end)
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": [int(d) for d in shape],
                            "data_offsets": [begin, end]}
        self.specs = {name: (dtype, tuple(int(d) for d in shape)) for name, (dtype, shape) in specs.items()}
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        prefix = len(text).to_bytes(8, "little") + text
        self.data_start, self.size = len(prefix), len(prefix) + end
        self._hash = hashlib.new(HASH, prefix)
        self._hashed = self.data_start  # every byte before this offset is in the hash
        self._ahead: dict[int, int] = {}  # begin -> end (file offsets) of tensors written past `_hashed`
        self._written: set[str] = set()
        self._file = open(path, "w+b")
        try:
            self._file.write(prefix)
        except BaseException:
            self.abandon()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Put `tensor` (the dtype and shape `specs` gave `name`) at its offset. Each name once."""
        if name not in self.specs or name in self._written:
            raise ValueError(f"{self.path}: {name!r} is "
                             f"{'written twice' if name in self._written else 'not in the header'}")
        dtype, shape = self.specs[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path}: {name!r} is {tensor.dtype} {tuple(tensor.shape)}, the header says "
                             f"{dtype} {shape}")
        self._written.add(name)
        begin, end = (self.data_start + offset for offset in self.extents[name])
        if begin == end:
            return
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()  # its bytes, no copy
        self._file.seek(begin)
        self._file.write(data)
        if begin == self._hashed:
            self._hash.update(data)
            self._hashed = end
            self._catch_up()
        else:
            self._ahead[begin] = end

    def _catch_up(self) -> None:
        """Hash the tensors written ahead that now follow the hashed prefix, read back from the file."""
        if self._hashed not in self._ahead:
            return
        buffer = bytearray(_READ_CHUNK_BYTES)
        view = memoryview(buffer)
        while self._hashed in self._ahead:
            end = self._ahead.pop(self._hashed)
            self._file.seek(self._hashed)
            while self._hashed < end:
                n = self._file.readinto(view[:min(len(buffer), end - self._hashed)])
                if not n:
                    raise OSError(f"{self.path}: short read at byte {self._hashed} while hashing it")
                self._hash.update(view[:n])
                self._hashed += n

    def close(self) -> dict:
        """Flush and fsync the file; its record for meta.json. Every tensor of `specs` must have been written."""
        missing = [name for name in self.specs if name not in self._written]
        if missing:
            raise ValueError(f"{self.path}: {len(missing)} tensors never written ({missing[:3]} ...)")
        self._catch_up()
        assert self._hashed == self.size and not self._ahead, (self._hashed, self.size, self._ahead)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return {"bytes": self.size, HASH: self._hash.hexdigest()}

    def abandon(self) -> None:
        """Close and delete the file, ignoring errors (it is being given up on)."""
        try:
            self._file.close()
        except Exception:
            pass
        try:
            os.remove(self.path)
        except OSError:
            pass


# ====================================================================== reading a directory
@dataclass(frozen=True)
class Snapshot:
    """The committed snapshot current.json names, with its meta.json read and checked against the pointer."""

    path: str  # <directory>/ckpt-...
    meta_path: str
    meta: dict
    meta_sha256: str  # identifies the checkpoint: equal on every rank that read the same one


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from exc


def open_checkpoint(directory: str) -> Snapshot:
    """Follow current.json to the committed snapshot; read its meta.json and check it against the pointer."""
    pointer_path = os.path.join(directory, POINTER_FILE)
    if not os.path.isfile(pointer_path):
        _refuse_without_pointer(directory, pointer_path)
    name, record = check_pointer(read_json(pointer_path), pointer_path)
    path = os.path.join(directory, name)
    meta_path = os.path.join(path, META_FILE)
    try:
        with open(meta_path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{meta_path}: cannot read it ({exc}); {pointer_path} names this snapshot as the "
                         "committed checkpoint") from exc
    check_record(meta_path, digest_bytes(data), record, pointer_path)
    meta = check_meta(json.loads(data), meta_path)  # its digest matched: it is the meta.json the save wrote
    return Snapshot(path, meta_path, meta, record[HASH])


def _refuse_without_pointer(directory: str, pointer_path: str) -> None:
    """No current.json: say whether this is an old-format checkpoint, a snapshot, or no checkpoint at all."""
    meta_path = os.path.join(directory, META_FILE)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{pointer_path} is missing: {directory} holds no committed zerokit checkpoint (not a "
                         "checkpoint directory, or its first save did not finish)")
    meta = read_json(meta_path)
    version = meta.get("version") if isinstance(meta, dict) else None
    parent = os.path.dirname(os.path.abspath(directory))
    if version == VERSION and os.path.isfile(os.path.join(parent, POINTER_FILE)):
        raise ValueError(f"{directory} is one snapshot inside the checkpoint directory {parent}: pass {parent}, "
                         f"whose {POINTER_FILE} names the committed snapshot")
    raise ValueError(f"{meta_path}: a zerokit checkpoint of format version {version!r} without {POINTER_FILE}; "
                     f"this zerokit reads format version {VERSION} (a committed snapshot, every file checksummed) "
                     "only: load it with the zerokit that wrote it and save it again")


# ====================================================================== reading ranges of a safetensors file
READ_CHUNK_NUMEL = 1 << 22  # elements per read when a read must cast: 16 MB of fp32 scratch at most


class SafetensorsReader:
    """A safetensors file read by byte ranges, not mapped: `keys()`, `get_slice(key).get_shape()`,
    `get_slice(key)[i:j]` (rows i..j of the first dimension) and `get_tensor(key)`, as `safe_open` has them;
    also `dtype(key)`, `read_elements(key, a, b)` (flat elements a..b) and `read_columns(key, i, j)` (of a
    2-D tensor), which load_weights uses to read a quantized weight's blocks.

    [Note: reading without mapping]
    safetensors' `safe_open` maps the file, and every page a read touches then counts in the process's
    resident set until the file is closed: a rank reading its 1/N of the model file and of the rank
    files would show those bytes twice, once as the tensors it made and once as mapped file pages.
    This reader parses the header itself (8-byte little-endian length, JSON: dtype, shape,
    data_offsets per tensor) and reads exactly the requested bytes with one `readinto` into the tensor
    it returns, so what a load holds is what it made. An offset outside the file is refused naming it.
    """

    _TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "rb")
        try:
            size = os.fstat(self._file.fileno()).st_size
            (n,) = struct.unpack("<Q", self._file.read(8))
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file's {size} bytes")
            header = json.loads(self._file.read(n))
            self._data_start = 8 + n
            self._entries = {k: v for k, v in header.items() if k != "__metadata__"}
            for key, entry in self._entries.items():
                if entry["dtype"] not in self._TORCH_DTYPES:
                    raise ValueError(f"tensor {key!r} has dtype {entry['dtype']}, which zerokit does not read")
                if self._data_start + entry["data_offsets"][1] > size:
                    raise ValueError(f"tensor {key!r} ends past the end of the file (truncated?)")
        except Exception:
            self._file.close()
            raise

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def keys(self) -> list[str]:
        return list(self._entries)

    def get_slice(self, key: str) -> "_RowSlice":
        if key not in self._entries:
            raise KeyError(f"{self.path} has no tensor {key!r}")
        return _RowSlice(self, key)

    def get_tensor(self, key: str) -> torch.Tensor:
        shape = self._entries[key]["shape"]
        return self._read(key, 0, shape[0] if shape else 1).reshape(shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._TORCH_DTYPES[self._entries[key]["dtype"]]

    def _read(self, key: str, first: int, last: int) -> torch.Tensor:
        """Rows [first, last) of the first dimension (a 0-d tensor: its one element), as (rows, *rest)."""
        entry = self._entries[key]
        dtype, shape = self._TORCH_DTYPES[entry["dtype"]], list(entry["shape"])
        row = 1
        for d in shape[1:]:
            row *= d
        out = self._pread(key, first * row, max(last - first, 0) * row)
        return out.reshape([max(last - first, 0)] + shape[1:])

    def read_elements(self, key: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of tensor `key` flattened, (b - a,): exactly those bytes are read."""
        return self._pread(key, a, b - a)

    def read_columns(self, key: str, first: int, last: int) -> torch.Tensor:
        """Columns [first, last) of the 2-D tensor `key`, (rows, last - first): one read per row, of those
        columns only (all of it at once when they are every column)."""
        rows, cols = self._entries[key]["shape"]
        if first == 0 and last == cols:
            return self._pread(key, 0, rows * cols).reshape(rows, cols)
        return torch.stack([self._pread(key, r * cols + first, last - first) for r in range(rows)]) if rows else \
            torch.empty(0, last - first, dtype=self.dtype(key))

    def read_into(self, key: str, start: int, out: torch.Tensor) -> None:
        """Elements [start, start + out.numel()) of tensor `key` flattened, into `out` (1-D): read straight into its
        memory when it is a contiguous CPU tensor of the stored dtype, else through a scratch buffer of at most
        READ_CHUNK_NUMEL elements, cast as `copy_` casts; so a read never holds a second copy of the range."""
        entry = self._entries[key]
        dtype, count = self._TORCH_DTYPES[entry["dtype"]], out.numel()
        numel = 1
        for d in entry["shape"]:
            numel *= d
        if not 0 <= start <= start + count <= numel:
            raise ValueError(f"{self.path}: elements [{start}, {start + count}) are outside tensor {key!r} "
                             f"({numel} elements)")
        if out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu":
            self._read_bytes(key, start, out.view(torch.uint8) if count else out)
            return
        for i in range(0, count, READ_CHUNK_NUMEL):
            n = min(READ_CHUNK_NUMEL, count - i)
            out[i:i + n].copy_(self._pread(key, start + i, n))

    def _pread(self, key: str, start: int, count: int) -> torch.Tensor:
        """`count` elements of tensor `key` from flat element `start`, read into a fresh (count,) tensor."""
        dtype = self._TORCH_DTYPES[self._entries[key]["dtype"]]
        out = torch.empty(count * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8)
        self._read_bytes(key, start, out)
        return out.view(dtype)

    def _read_bytes(self, key: str, start: int, out: torch.Tensor) -> None:
        """out (uint8, contiguous) := the bytes of tensor `key` from its flat element `start` on: every read ends
        here, one `readinto`."""
        entry = self._entries[key]
        itemsize = torch.empty((), dtype=self._TORCH_DTYPES[entry["dtype"]]).element_size()
        self._file.seek(self._data_start + entry["data_offsets"][0] + start * itemsize)
        if out.numel() and self._file.readinto(memoryview(out.numpy())) != out.numel():
            raise ValueError(f"{self.path}: tensor {key!r} is cut short (truncated file?)")


class _RowSlice:
    def __init__(self, reader: SafetensorsReader, key: str):
        self.reader, self.key = reader, key

    def get_shape(self) -> list[int]:
        return list(self.reader._entries[self.key]["shape"])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        shape = self.get_shape()
        if not isinstance(rows, slice) or rows.step not in (None, 1) or not shape:
            raise TypeError("SafetensorsReader slices rows of the first dimension only: [i:j]")
        first, last, _ = rows.indices(shape[0])
        return self.reader._read(self.key, first, max(first, last))
