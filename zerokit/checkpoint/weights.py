"""`engine.load_weights(path)`: pretrained weights into a built engine, each rank reading only what it keeps.

    engine = zk.shard(meta_model, torch.optim.AdamW, stage=3, wrap=(Block,), param_init_fn=...)
    engine.load_weights("gpt2-xl/")     # model.safetensors, or model.safetensors.index.json and its shards

[Note: loading pretrained weights]
`path` is a `.safetensors` file, or a directory holding `model.safetensors` or a Hugging Face sharded
checkpoint (`model.safetensors.index.json`, whose "weight_map" names the file of every key), or a
zerokit checkpoint directory (its current.json followed to the committed snapshot, whose model file
or shards and index are those; the optimizer state there is not read: `engine.load` resumes). Every
rank opens the files (nothing is read yet), checks every key against the
model, and reads, a tensor slice at a time, only the range of each flat param it keeps
(`engine.kept_range`: its shard at stage 3, everything at stages 0-2, whose params are whole), cast to
fp32 (exact from bf16, fp16 or fp32); stage 3 thus reads Ψ/N of the weights per rank and never holds
the model. A parameter tied under several names is found under any of them (Hugging Face saves a tied
head once, under one key). Refused on every rank, naming the key and the file, before anything is
written: a parameter the files lack, a key the model lacks, a shape that differs. LoRA adapters
(zk.lora.inject) are the one exception: a base checkpoint does not hold them, so missing ones keep
their values. Then, as for a freshly built model, the fp32 masters take the loaded values (exactly,
not their bf16 rounding), the optimizer state is cleared (the next step is a first step) and the
gradients are zeroed; persistent buffers in the files are loaded, ones they lack keep their values.

[Note: loading into a quantized base]
A model quantized by zk.quantize holds `<layer>.weight_quant` (uint8 bytes, zerokit/quant.py) where the
files hold `<layer>.weight`, the float weight in its original shape (a GPT-2 Conv1D's (in, out)). Such a
weight is quantized as it arrives, one weight at a time, into the bytes zk.quantize gives the eager model
loaded from the same files, bit for bit (the file's values cast to the dtype the model had when quantized,
then quantize_tensor's arithmetic: `quant.quantize_range`). Of each packed param a rank computes only the
bytes of its kept range, and reads only the blocks those bytes depend on: a code byte, its own block
(block_size elements; NF4 packs a block into block_size/2 bytes); without double quantization an absmax
byte, its block; with it (the default) every constant depends on all blocks through their mean, so a
range holding any of a weight's constants reads the whole weight, streamed QUANTIZE_CHUNK_NUMEL elements
at a time. At stage 3 a rank thus reads its shards' blocks and, per flat param, at most the whole of the
two weights its range starts and ends inside of. A file may instead hold the packed bytes under
`<layer>.weight_quant` (zerokit's own state_dict and model.safetensors store them so), read as they are;
only their size is checkable, so they must come from the same zk.quantize settings. Refused, naming the
key: a weight of another shape or an integer dtype, bytes of another size or dtype, and both forms of
one weight.
"""
from __future__ import annotations

import functools
import json
import os

import torch

from zerokit.checkpoint.commit import raise_if_any
from zerokit.checkpoint.format import (
    MODEL_FILE, MODEL_INDEX_FILE, POINTER_FILE, SafetensorsReader, master_start, open_checkpoint,
    trainable_with_masters)
from zerokit.checkpoint.loading import _read_param_range, buffer_names
from zerokit.core.params.flat_param import is_packed
from zerokit.quant import quantize_range

PACKED_SUFFIX = "_quant"  # a quantized layer's `<layer>.weight_quant` (zerokit/quant.py) stands for `<layer>.weight`

INDEX_FILE = MODEL_INDEX_FILE
SINGLE_FILE = MODEL_FILE


def weight_files(path: str | os.PathLike) -> dict[str, str]:
    """key -> the file holding it, for a .safetensors file, a directory with model.safetensors, an HF index, or a
    zerokit checkpoint directory (its committed snapshot's model file(s))."""
    path = os.fspath(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, POINTER_FILE)):
        path = open_checkpoint(path).path  # current.json checked and followed
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no \"weight_map\" (key -> file)")
            return {key: os.path.join(path, name) for key, name in weight_map.items()}
        single = os.path.join(path, SINGLE_FILE)
        if not os.path.isfile(single):
            raise ValueError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        path = single
    elif not os.path.isfile(path):
        raise ValueError(f"{path}: no such file or directory")
    with SafetensorsReader(path) as f:
        return {key: path for key in f.keys()}


def load_weights(engine, path: str | os.PathLike, strict: bool = True) -> dict[str, list[str]]:
    """[Note: loading pretrained weights]. A collective (one verdict exchange); returns the keys it kept
    ("missing": LoRA adapters left as they were; "unexpected": keys ignored under strict=False)."""
    from zerokit.lora import lora_modules

    adapters = {f"{prefix}.{name}" for prefix in lora_modules(engine.module) for name in ("lora_A", "lora_B")}
    problems, checked, files = [], None, {}
    handle = _opener(files)
    try:
        try:
            where = weight_files(path)
            checked = _check(engine, path, strict, where, adapters, handle)
        except (ValueError, OSError) as exc:
            problems.append(str(exc))
        raise_if_any(engine, problems, f"load_weights({os.fspath(path)!r})")
        source, missing, buffers, report = checked
        masters = dict(trainable_with_masters(engine))

        def kept_ranges():  # one flat param's range at a time, never the model
            for fp in engine.flat_params:
                lo, hi = engine.kept_range(fp)
                kept = _read_range(engine, fp, lo, hi, source=source, missing=missing, where=where, handle=handle)
                master = masters.get(fp)
                if master is not None:  # fp32, exact, not the params' bf16 rounding (fp32: the param shard)
                    at = master_start(fp, master) - lo
                    master.copy_(kept[at:at + master.numel()])
                yield kept

        with torch.no_grad():
            engine.load_flat_params(kept_ranges())
            module_state = engine.module.state_dict(keep_vars=True)
            for name in buffers:
                module_state[name].copy_(handle(where[name]).get_tensor(name))
            engine.optimizer.clear_states()  # as before a first step
    finally:
        for f in files.values():
            f.__exit__(None, None, None)
    engine.zero_grad()
    return report


def _opener(files: dict):
    """file path -> its SafetensorsReader, opened once and kept in `files` (the caller closes them)."""
    def handle(file: str):
        if file not in files:
            if not os.path.isfile(file):
                raise ValueError(f"{file} (named by {INDEX_FILE}) is missing")
            files[file] = SafetensorsReader(file)  # by byte ranges, not mapped (format.py)
        return files[file]
    return handle


def _check(engine, path, strict: bool, where: dict[str, str], adapters: set[str], handle):
    """Every key, shape and dtype, from the files' headers, before any value is read: (names[0] -> (key, how) of
    each parameter the files provide, the parameters they lack, the buffer keys they hold, report)."""
    source, missing, known = {}, [], set()  # names[0] -> (key, how); names nothing provides
    for fp in engine.flat_params:
        for names, shape, p in zip(fp.names, fp.layout.shapes, fp.params):
            if is_packed(p):  # its float original or its bytes: [Note: loading into a quantized base]
                found = _quantized_source(names, p.zerokit_packed, where, handle)
                known.update(names)
                known.update(n[:-len(PACKED_SUFFIX)] for n in names)
                if found is None:
                    missing.append(names[0][:-len(PACKED_SUFFIX)])
                else:
                    source[names[0]] = found
                continue
            known.update(names)
            key = next((n for n in names if n in where), None)
            if key is None:
                missing.append(names[0])
                continue
            stored = tuple(handle(where[key]).get_slice(key).get_shape())
            if stored != tuple(shape):
                raise ValueError(f"{where[key]}: {key!r} has shape {stored}, this model's is {tuple(shape)}")
            source[names[0]] = (key, "as is")
    buffer_keys = set(buffer_names(engine))
    known |= buffer_keys
    refused = [m for m in missing if m not in adapters]
    if refused:
        raise ValueError(f"{os.fspath(path)} lacks {len(refused)} parameter(s) of this model: "
                         + ", ".join(repr(m) for m in refused[:5]) + (" ..." if len(refused) > 5 else ""))
    unexpected = sorted(k for k in where if k not in known)
    if unexpected and strict:
        raise ValueError(f"{where[unexpected[0]]} holds {len(unexpected)} key(s) this model does not have: "
                         + ", ".join(repr(k) for k in unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
                         + " (load_weights(..., strict=False) ignores them)")
    module_state = engine.module.state_dict(keep_vars=True)
    buffers = sorted(buffer_keys & where.keys())
    for name in buffers:
        stored = tuple(handle(where[name]).get_slice(name).get_shape())
        if stored != tuple(module_state[name].shape):
            raise ValueError(f"{where[name]}: {name!r} has shape {stored}, this model's is "
                             f"{tuple(module_state[name].shape)}")
    return source, set(missing), buffers, {"missing": sorted(set(missing)), "unexpected": unexpected}


def _read_range(engine, fp, lo: int, hi: int, *, source: dict, missing: set[str], where: dict[str, str], handle
                ) -> torch.Tensor:
    """Elements [lo, hi) of flat param `fp` (this rank's kept range), in its values dtype (uint8 for a
    quantized base's bytes), from the files; a missing adapter's elements keep their current values."""
    out = _current_range(engine, fp, lo, hi) if any(n[0] in missing for n in fp.names) else \
        torch.zeros(hi - lo, dtype=fp.values_dtype)
    for j, (names, offset, numel, p) in enumerate(zip(fp.names, fp.layout.offsets, fp.layout.numels, fp.params)):
        a, b = max(lo, offset), min(hi, offset + numel)
        if a < b and names[0] in source:
            key, how = source[names[0]]
            f = handle(where[key])
            if how == "quantize":  # bytes [a, b) of this weight's quantization, from the blocks they need
                out[a - lo:b - lo] = quantize_range(functools.partial(_weight_elements, f, key, p.zerokit_packed),
                                                    p.zerokit_packed, a - offset, b - offset)
            elif how == "bytes":
                f.read_into(key, a - offset, out[a - lo:b - lo])
            else:  # in the range's order, read into it
                _read_param_range(f, key, fp, j, a - offset, b - offset, out=out[a - lo:b - lo])
    return out


def _quantized_source(names: list[str], spec, where: dict[str, str], handle):
    """Where a quantized weight's values come from: (key, "quantize") for its float original (`<layer>.weight`,
    in the original parameter's shape: a Conv1D's (in, out)), (key, "bytes") for packed bytes
    (`<layer>.weight_quant`, uint8, spec.nbytes, as zerokit saves them); None when the files hold neither."""
    found = []
    for name in names:
        original = name[:-len(PACKED_SUFFIX)]
        for key, how in ((name, "bytes"), (original, "quantize")):
            if key in where:
                found.append((key, how))
    if len({how for _, how in found}) > 1:
        keys = sorted({k for k, _ in found})
        raise ValueError(f"{where[keys[0]]}: {' and '.join(map(repr, keys))} are one quantized weight, as its float "
                         "values and as packed bytes; keep one of them")
    if not found:
        return None
    key, how = found[0]
    f = handle(where[key])
    stored, dtype = tuple(f.get_slice(key).get_shape()), f.dtype(key)
    if how == "bytes":
        if dtype != torch.uint8 or stored != (spec.nbytes,):
            raise ValueError(f"{where[key]}: {key!r} holds {dtype} {stored}; this model's quantized weight "
                             f"({spec}) is {spec.nbytes} uint8 bytes")
        return found[0]
    shape = tuple(reversed(spec.shape)) if spec.transposed else tuple(spec.shape)
    if stored != shape:
        raise ValueError(f"{where[key]}: {key!r} has shape {stored}, this model's is {shape} (quantized: {spec})")
    if not dtype.is_floating_point:
        raise ValueError(f"{where[key]}: {key!r} has dtype {dtype}, not the floating-point weight this model "
                         f"quantizes ({spec})")
    return found[0]


def _weight_elements(f, key: str, spec, e0: int, e1: int) -> torch.Tensor:
    """Elements [e0, e1) of the weight W (spec.shape, (out, in)) that stored tensor `key` holds, flattened, in fp32
    after rounding to spec.dtype: the values zk.quantize would see in the eager model loaded from the file.
    A Conv1D's file tensor is W.t() (in, out): the rows of W it needs are columns there, read as such."""
    if not spec.transposed:
        values = f.read_elements(key, e0, e1)
    else:
        cols = spec.shape[1]  # W's row length (in)
        r0, r1 = e0 // cols, -(-e1 // cols)  # W's rows [r0, r1): columns of the stored (in, out) tensor
        values = f.read_columns(key, r0, r1).t().reshape(-1)[e0 - r0 * cols:e1 - r0 * cols]
    return values.to(spec.dtype).to(torch.float32)


def _current_range(engine, fp, lo: int, hi: int) -> torch.Tensor:
    """The values flat param `fp` holds now over [lo, hi), its kept range, fp32: from its master where this rank
    has one (exact), elsewhere from the param storage."""
    if engine.stage == 3:
        out = engine.param_shards[fp.index].detach().to(fp.values_dtype).clone()
    else:
        out = engine.flat_data[fp.index].detach()[lo:hi].to(fp.values_dtype).clone()
    master = dict(trainable_with_masters(engine)).get(fp)
    if master is not None:
        at = master_start(fp, master) - lo
        out[at:at + master.numel()] = master.detach().to(out.dtype)
    return out
