"""zerokit.checkpoint.format without a process group: names, piece keys, meta.json and current.json checks,
digests, the streaming safetensors writer, and a snapshot directory written by the commit step's own writers read back by `open_checkpoint`."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import nn

from zerokit.checkpoint import commit
from zerokit.checkpoint.format import (
    FORMAT, HASH, META_FILE, MODEL_FILE, POINTER_FILE, POINTER_LEFTOVER, SAFETENSORS_DTYPES, SNAPSHOT_NAME, VERSION,
    SafetensorsWriter, aliases, check_meta, check_pointer, check_record, digest, digest_bytes, is_record, json_number,
    meta_bytes, new_snapshot_name, open_checkpoint, parse_piece_key, piece_key, pointer, rank_file, snapshot_files,
    verify_file)

PARAMS = {"blocks.0.fc1.weight": {"shape": [7, 15]}, "gain": {"shape": [1]}, "a::b": {"shape": [4]}}


def _record(data: bytes) -> dict:
    return {"bytes": len(data), HASH: hashlib.sha256(data).hexdigest()}


# ---------------------------------------------------------------------- names and keys
def test_file_names_of_a_snapshot_written_by_three_ranks():
    """The files a 3-rank snapshot holds: the model file and one rank file per rank."""
    assert rank_file(1, 3) == "rank1-of-3.safetensors"
    assert snapshot_files(3) == {MODEL_FILE, "rank0-of-3.safetensors", "rank1-of-3.safetensors",
                                 "rank2-of-3.safetensors"}


def test_new_snapshot_names_match_the_pattern_the_reader_and_the_cleanup_accept():
    """A fresh snapshot name is accepted by the reader; its pointer leftover by the cleanup; names differ."""
    names = {new_snapshot_name() for _ in range(20)}
    assert len(names) == 20  # the random token: two saves in one second never share a name
    for name in names:
        assert SNAPSHOT_NAME.match(name), name
        assert POINTER_LEFTOVER.match(f"{POINTER_FILE}.tmp-{name[-12:]}"), name
    assert not SNAPSHOT_NAME.match("ckpt-latest")


@pytest.mark.parametrize("kind", ["master", "state.exp_avg", "state.step"])
@pytest.mark.parametrize("name, start, end", [("blocks.0.fc1.weight", 0, 105), ("blocks.0.fc1.weight", 17, 18),
                                              ("gain", 0, 1), ("a::b", 1, 4)])
def test_piece_keys_round_trip(kind, name, start, end):
    """parse_piece_key inverts piece_key, also for a parameter name that contains '::'."""
    key = piece_key(kind, name, start, end)
    assert parse_piece_key(key, PARAMS, "rank0-of-2.safetensors") == (kind, name, start, end)


@pytest.mark.parametrize("key, message", [
    ("master:gain:0:1", "unrecognised key"),
    ("master::gain::0-1", "unrecognised key"),
    ("master::gain::-1:1", "unrecognised key"),
    ("master::other::0:1", "piece of unknown parameter 'other'"),
    ("master::gain::0:2", "is outside 'gain' (1 elements)"),
    ("master::blocks.0.fc1.weight::50:50", "is outside"),
    ("master::blocks.0.fc1.weight::100:106", "(105 elements)"),
])
def test_bad_piece_keys_are_refused_naming_the_file_and_the_key(key, message):
    """A key that is not <kind>::<name>::<start>:<end>, names no saved parameter, or is outside it: refused."""
    with pytest.raises(ValueError, match="^rank1-of-2.safetensors: ") as info:
        parse_piece_key(key, PARAMS, "rank1-of-2.safetensors")
    assert message in str(info.value), str(info.value)


def test_aliases_map_the_second_name_of_a_tied_tensor_to_its_first():
    """Tied embedding and head: the head's name is an alias of the embedding's; untied names are not."""
    model = nn.ModuleDict({"emb": nn.Embedding(5, 3), "head": nn.Linear(3, 5, bias=False)})
    assert aliases(model) == {}
    model["head"].weight = model["emb"].weight
    assert aliases(model) == {"head.weight": "emb.weight"}


@pytest.mark.parametrize("value, expected", [
    (0.1, 0.1), (3, 3), ((0.9, 0.999), [0.9, 0.999]), (torch.tensor(0.5), 0.5), (True, None), (None, None),
    ("adam", None), ((0.9, "x"), None), ((True, 1), None),
])
def test_json_number_keeps_numbers_and_tuples_of_numbers_only(value, expected):
    """Hyperparameters stored in meta.json: numbers, tuples of numbers (as lists); everything else None."""
    assert json_number(value) == expected


@pytest.mark.parametrize("value", [
    0.1, 3, True, False, None, "adam", (0.9, 0.999), torch.tensor(1e-2), torch.tensor(1e-2, dtype=torch.float64),
    torch.tensor(5, dtype=torch.int64), (torch.tensor(0.9), torch.tensor(0.99)), (torch.tensor(0.9), 0.99), [0.9, 0.999],
])
def test_a_hyperparameter_comes_back_from_meta_json_of_its_type(value):
    """[Note: hyperparameter types]: through JSON text and back, the same type (a tensor of its dtype, a tuple
    a tuple) and value; what JSON cannot hold is marked unstorable, not dropped."""
    import json
    from zerokit.checkpoint.format import UNSTORABLE, decode_hyperparameter, encode_hyperparameter
    back = decode_hyperparameter(json.loads(json.dumps(encode_hyperparameter(value))), value)

    def same(a, b):
        if type(a) is not type(b):
            return False
        if torch.is_tensor(a):
            return a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, (tuple, list)):
            return all(same(x, y) for x, y in zip(a, b))
        return a == b
    assert same(back, value), (back, value)
    assert UNSTORABLE in encode_hyperparameter(object())
    assert UNSTORABLE in encode_hyperparameter(torch.tensor(1.0, requires_grad=True))


def test_old_checkpoints_plain_hyperparameters_decode_as_before():
    """Checkpoints from before the types were recorded hold numbers and lists: a list becomes the group's tuple,
    a number stays the number (the only form they could hold)."""
    from zerokit.checkpoint.format import decode_hyperparameter
    assert decode_hyperparameter([0.9, 0.999], (0.5, 0.5)) == (0.9, 0.999)
    assert type(decode_hyperparameter(0.01, 0.5)) is float and decode_hyperparameter(3, 1) == 3


# ---------------------------------------------------------------------- digests
def test_digest_is_the_plain_sha256_of_the_file_across_the_read_chunk(tmp_path):
    """The record equals hashlib's sha256 of the bytes (what `sha256sum` prints), also past one read chunk."""
    data = os.urandom((8 << 20) + 3)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert digest(str(path)) == _record(data) == digest_bytes(data)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert digest(str(empty)) == {"bytes": 0, HASH: hashlib.sha256(b"").hexdigest()}


# ---------------------------------------------------------------------- the streaming writer
def _tensors(dtypes) -> dict[str, torch.Tensor]:
    """A tensor of every dtype, of assorted shapes (0-dim, empty, several dimensions), under unsorted names."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (), (0,), (2, 3, 4), (7,), (1, 1)]
    out = {}
    for i, dtype in enumerate(dtypes):
        for j, shape in enumerate(shapes[i % 3:i % 3 + 3]):
            out[f"m{(7 * i + j) % 11}.p{i}.{j}"] = (torch.randn(shape, generator=g) * 50).to(dtype)
    return out


def test_safetensors_dtype_order_is_the_order_safetensors_lays_tensors_out():
    """SAFETENSORS_DTYPES lists safetensors' own dtype names in the order its writer puts them (widest first)."""
    tensors = {str(dtype): torch.zeros(1, dtype=dtype) for dtype in SAFETENSORS_DTYPES}
    data = safetensors_bytes(tensors)
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    assert [(name, header[name]["dtype"]) for name in header] == [(str(d), n) for d, n in SAFETENSORS_DTYPES.items()]


@pytest.mark.parametrize("metadata", [None, {"format": FORMAT}])
@pytest.mark.parametrize("order", ["file", "reversed", "shuffled"])
def test_streaming_writer_writes_the_bytes_safetensors_writes_and_hashes_them(tmp_path, metadata, order):
    """Tensor by tensor, in the file's order or any other (read back for the hash), the file is byte for byte
    safetensors' save_file's for the same tensors and metadata, its record is the file's size and sha256, and
    safetensors reads every tensor back bit for bit."""
    tensors = _tensors(list(SAFETENSORS_DTYPES))
    path = str(tmp_path / "streamed.safetensors")
    writer = SafetensorsWriter(path, {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}, metadata)
    names = {"file": writer.order, "reversed": writer.order[::-1],
             "shuffled": sorted(tensors, key=lambda k: hashlib.sha256(k.encode()).digest())}[order]
    for name in names:
        writer.write(name, tensors[name])
    record = writer.close()
    data = open(path, "rb").read()
    assert data == safetensors_bytes(tensors, metadata=metadata)
    assert record == digest(path) == digest_bytes(data)
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_streaming_writer_hashes_across_read_chunks_and_refuses_what_its_header_does_not_say(tmp_path):
    """A tensor written ahead that spans several read-back chunks is hashed whole; a wrong dtype or shape, an
    unknown name, a second write and a tensor never written are refused; abandon() deletes the file."""
    big = torch.arange((9 << 20) // 4 + 5, dtype=torch.float32)  # past one read chunk
    tensors = {"a": torch.ones(3), "b": big}
    path = str(tmp_path / "big.safetensors")
    writer = SafetensorsWriter(path, {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()})
    writer.write("b", big)  # ahead of "a": hashed once "a" is written, read back from the file
    with pytest.raises(ValueError, match="written twice"):
        writer.write("b", big)
    with pytest.raises(ValueError, match="not in the header"):
        writer.write("c", big)
    with pytest.raises(ValueError, match=r"'a' is torch.float64 \(3,\), the header says torch.float32 \(3,\)"):
        writer.write("a", torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="never written"):
        writer.close()
    writer.write("a", tensors["a"])
    assert writer.close() == digest(path) and open(path, "rb").read() == safetensors_bytes(tensors)
    abandoned = SafetensorsWriter(str(tmp_path / "gone.safetensors"), {"a": (torch.float32, (3,))})
    abandoned.abandon()
    assert not (tmp_path / "gone.safetensors").exists()


@pytest.mark.parametrize("record, ok", [
    ({"bytes": 3, HASH: "ab" * 32}, True),
    ({"bytes": 0, HASH: "0" * 64}, True),
    ({"bytes": 3, HASH: "AB" * 32}, False),  # upper case: not what digest writes
    ({"bytes": 3, HASH: "ab" * 31}, False),
    ({"bytes": -1, HASH: "ab" * 32}, False),
    ({"bytes": True, HASH: "ab" * 32}, False),
    ({"bytes": 3.0, HASH: "ab" * 32}, False),
    ({"bytes": 3, HASH: "ab" * 32, "extra": 1}, False),
    ({"bytes": 3}, False),
    ([3, "ab" * 32], False),
])
def test_is_record_accepts_exactly_bytes_and_sha256(record, ok):
    assert is_record(record) is ok


def test_verify_file_names_truncation_corruption_and_a_missing_file(tmp_path):
    """Size first (truncated), then sha256 (corrupted), each naming the file, the record's home and the cause."""
    data = b"0123456789" * 100
    path = tmp_path / "rank0-of-1.safetensors"
    path.write_bytes(data)
    record = _record(data)
    verify_file(str(path), record, "meta.json")  # intact: no error

    path.write_bytes(data[:-1])
    with pytest.raises(ValueError, match=r"999 bytes on disk, 1000 recorded in meta.json; the file is truncated"):
        verify_file(str(path), record, "meta.json")

    path.write_bytes(data[:500] + b"X" + data[501:])
    with pytest.raises(ValueError, match=r"sha256 checksum mismatch .* recorded in meta.json\); the file is corrupted"):
        verify_file(str(path), record, "meta.json")

    path.unlink()
    with pytest.raises(ValueError, match=r"is missing: meta.json lists it"):
        verify_file(str(path), record, "meta.json")


def test_check_record_compares_size_before_digest():
    record = _record(b"abc")
    check_record("f", _record(b"abc"), record, "current.json")
    with pytest.raises(ValueError, match="4 bytes on disk, 3 recorded"):
        check_record("f", _record(b"abcd"), record, "current.json")
    with pytest.raises(ValueError, match="checksum mismatch"):
        check_record("f", _record(b"abd"), record, "current.json")


# ---------------------------------------------------------------------- current.json and meta.json
def test_pointer_round_trips_and_every_malformed_field_is_refused():
    """check_pointer gives back what pointer() was given; each field that is wrong is named."""
    name, record = new_snapshot_name(), _record(b"{}")
    content = pointer(name, record)
    assert check_pointer(json.loads(json.dumps(content)), "current.json") == (name, record)
    bad = {
        "not a zerokit checkpoint pointer": {**content, "format": "other"},
        "checkpoint format version 1; this zerokit reads version 2": {**content, "version": 1},
        "'checkpoint' is '../elsewhere', not a snapshot name": {**content, "checkpoint": "../elsewhere"},
        "malformed (expected format, version, checkpoint and meta.json's bytes and sha256)":
            {**content, META_FILE: {"bytes": 2}},
        "malformed": {**content, "note": "an extra field"},
    }
    for message, value in bad.items():
        with pytest.raises(ValueError, match="^current.json: ") as info:
            check_pointer(value, "current.json")
        assert message in str(info.value), (message, str(info.value))
    with pytest.raises(ValueError, match="not a zerokit checkpoint pointer"):
        check_pointer([content], "current.json")


def _meta(world_size=2) -> dict:
    return {"format": FORMAT, "version": VERSION, "world_size": world_size,
            "files": {name: _record(name.encode()) for name in snapshot_files(world_size)}}


def test_check_meta_refuses_another_version_or_a_file_list_unlike_its_snapshot():
    meta = _meta()
    assert check_meta(meta, "m.json") is meta
    with pytest.raises(ValueError, match=r"m.json: format 'zerokit-checkpoint' version 1, expected"):
        check_meta({**meta, "version": 1}, "m.json")
    with pytest.raises(ValueError, match=r"'world_size' is '2', not a positive integer"):
        check_meta({**meta, "world_size": "2"}, "m.json")
    with pytest.raises(ValueError, match=r"its file list .* is not .*rank2-of-3"):
        check_meta({**meta, "world_size": 3}, "m.json")  # files of 2 ranks, meta says 3
    broken = {**meta, "files": {**meta["files"], MODEL_FILE: {"bytes": 1}}}
    with pytest.raises(ValueError, match="with sizes and sha256 digests"):
        check_meta(broken, "m.json")


def test_meta_bytes_are_canonical():
    """Key order does not change meta.json's bytes (its digest is recorded in current.json)."""
    meta = _meta()
    shuffled = dict(reversed(list(meta.items())))
    assert meta_bytes(meta) == meta_bytes(shuffled) == meta_bytes(json.loads(meta_bytes(meta)))


# ---------------------------------------------------------------------- a snapshot directory
def _snapshot_directory(root, world_size=2) -> tuple[str, str, dict]:
    """A committed checkpoint written by commit's meta and pointer writers, with stand-in safetensors bytes."""
    directory = str(root / "ckpt")
    name = new_snapshot_name()
    path = os.path.join(directory, name)
    os.makedirs(path)
    files = {}
    for file in sorted(snapshot_files(world_size)):
        data = f"stand-in bytes of {file}".encode()
        with open(os.path.join(path, file), "wb") as f:
            f.write(data)
        files[file] = _record(data)
    meta = {"format": FORMAT, "version": VERSION, "world_size": world_size, "extra": {"step": 7}, "files": files}
    commit._commit(directory, name, commit._write_meta(path, meta))
    return directory, path, meta


def test_a_committed_snapshot_opens_with_its_meta(tmp_path):
    """Round trip: the pointer names the snapshot, meta.json's digest matches, the meta is what was written."""
    directory, path, meta = _snapshot_directory(tmp_path)
    snapshot = open_checkpoint(directory)
    assert snapshot.path == path
    assert snapshot.meta == meta
    assert snapshot.meta_sha256 == hashlib.sha256(meta_bytes(meta)).hexdigest()
    assert sorted(os.listdir(directory)) == sorted([POINTER_FILE, os.path.basename(path)])  # no tmp left
    for file, record in meta["files"].items():
        verify_file(os.path.join(path, file), record, snapshot.meta_path)


def test_a_changed_meta_json_is_refused_naming_the_pointer(tmp_path):
    directory, path, meta = _snapshot_directory(tmp_path)
    with open(os.path.join(path, META_FILE), "wb") as f:
        f.write(meta_bytes({**meta, "extra": {"step": 8}}))
    with pytest.raises(ValueError, match=r"meta.json: sha256 checksum mismatch .* recorded in .*current.json"):
        open_checkpoint(directory)


def test_a_pointer_to_a_missing_snapshot_is_refused(tmp_path):
    directory, path, _meta_ = _snapshot_directory(tmp_path)
    os.rename(path, path + "-moved")
    with pytest.raises(ValueError, match=r"meta.json: cannot read it .*names this snapshot as the committed"):
        open_checkpoint(directory)


def test_directories_without_a_pointer_are_refused_with_the_fix(tmp_path):
    """No checkpoint at all; a snapshot passed instead of its directory (pass the parent); a version-1
    checkpoint (load it with the zerokit that wrote it and save it again)."""
    with pytest.raises(ValueError, match="holds no committed zerokit checkpoint"):
        open_checkpoint(str(tmp_path))
    directory, path, _meta_ = _snapshot_directory(tmp_path)
    with pytest.raises(ValueError, match=f"is one snapshot inside the checkpoint directory {directory}: pass"):
        open_checkpoint(path)
    old = tmp_path / "old"
    old.mkdir()
    (old / META_FILE).write_text(json.dumps({"format": FORMAT, "version": 1}))
    with pytest.raises(ValueError, match="format version 1 without current.json.*save it again"):
        open_checkpoint(str(old))


def test_safetensors_reader_reads_what_safe_open_reads_and_refuses_a_truncated_file(tmp_path):
    """format.py [Note: reading without mapping]: the same tensors and row slices as safe_open, every dtype."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from zerokit.checkpoint.format import SafetensorsReader

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(5, 3, generator=g), "h": torch.randn(4, 2, generator=g).to(torch.bfloat16),
               "i": torch.arange(6, dtype=torch.int64).reshape(3, 2), "s": torch.tensor(2.5), "b": torch.ones(0),
               "u": torch.arange(7, dtype=torch.uint8)}
    path = str(tmp_path / "t.safetensors")
    save_file(tensors, path)
    with SafetensorsReader(path) as mine, safe_open(path, framework="pt") as theirs:
        assert sorted(mine.keys()) == sorted(theirs.keys())
        for key in tensors:
            assert mine.get_slice(key).get_shape() == list(theirs.get_slice(key).get_shape())
            a, b = mine.get_tensor(key), theirs.get_tensor(key)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
        assert torch.equal(mine.get_slice("w")[1:4], theirs.get_slice("w")[1:4])
        assert torch.equal(mine.get_slice("u")[2:5], tensors["u"][2:5])
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-8])
    with pytest.raises(ValueError, match="ends past the end of the file"):
        SafetensorsReader(path)
