"""Checkpoint integrity on gloo: checksums refuse changed bytes, a save commits atomically or not at all,
ranks agree on the directory, and a failure on one rank is an error on every rank.

Spawn 1 (world size 2) saves checkpoint A (stage 0, K steps) and B (K + M steps), then runs every
case that leaves the process group alive: bytes flipped in copies of A (rank files, model file,
meta.json, every byte of current.json), a rank file swapped for B's, rank-dependent directories,
a write failure on one rank, ranks loading different checkpoints. Then one spawn per crash
scenario: a rank really dies (os._exit) at a chosen point of a second save into a copy of A.
Spawn last (world size 3) loads every crashed directory, which must give A (or B, where the
crash came after the commit) bit for bit, saves into one to show the leftovers go, and repeats
the collective cases at three ranks.

A flip is `byte ^= 0x01`: the smallest change (one ulp of an fp32 weight), the hardest to see.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerokit as zk
from common import DIM, VOCAB, odd_batch, odd_model
from test_checkpoint import _equal_dicts, _expect_error, _full_optimizer_state, _params
from zerokit.checkpoint import POINTER_FILE, commit, committed_snapshot
from zerokit.commands.step import train_step
from zerokit.launch import RankFailed, run_ranks

K, M = 3, 2  # steps in checkpoint A; B has K + M
GLOBAL_ROWS = 6
BUCKET = 40
MASTER_PARAM = "blocks.0.fc1.weight"  # the weight whose stored master gets a flipped byte
EXIT_CODE = 17  # a crashing rank's exit status


def _engine(stage=0, seed=0):
    return zk.shard(odd_model(seed), torch.optim.AdamW, stage=stage, bucket_numel=BUCKET, lr=1e-2,
                    weight_decay=0.1)


def _train(engine, rank, world_size, first, steps):
    """Steps first .. first+steps-1 on the fixed global batch."""
    for step in range(first, first + steps):
        train_step(engine, [odd_batch(step, GLOBAL_ROWS // world_size, rank, world_size)], lambda b: engine(*b))


def _state(engine):
    return dict(params=_params(engine), opt=_full_optimizer_state(engine))


def _state_mismatch(a, b):
    return _equal_dicts(a["params"], b["params"]) + _equal_dicts(a["opt"], b["opt"])


def _tensor_span(path, key_prefix):
    """(begin, end) file offsets of the first tensor whose key starts with `key_prefix`."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    key = next(k for k in sorted(header) if k.startswith(key_prefix))
    begin, end = header[key]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def _on_rank0(rank, fn):
    """Filesystem set-up by one rank; every rank waits for it."""
    if rank == 0:
        fn()
    torch.distributed.barrier()


def _copy(src, dst):
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, symlinks=True)


def _corruptions(snapshot, world_size):
    """name -> (file, offset-or-action) applied to a copy of a checkpoint saved by `world_size` ranks."""
    last = world_size - 1
    rank_last = f"rank{last}-of-{world_size}.safetensors"
    cases = {}
    for r in (0, last):
        name = f"rank{r}-of-{world_size}.safetensors"
        begin, end = _tensor_span(os.path.join(snapshot, name), f"master::{MASTER_PARAM}::")
        cases[f"rank{r}-master"] = (name, (begin + end) // 2)
    begin, end = _tensor_span(os.path.join(snapshot, rank_last), "state.exp_avg_sq::")
    cases[f"rank{last}-optimizer-state"] = (rank_last, begin)
    cases[f"rank{last}-header"] = (rank_last, 20)  # inside a key name of the JSON header
    cases[f"rank{last}-last-byte"] = (rank_last, os.path.getsize(os.path.join(snapshot, rank_last)) - 1)
    cases[f"rank{last}-truncated"] = (rank_last, "truncate")
    begin, end = _tensor_span(os.path.join(snapshot, "model.safetensors"), MASTER_PARAM)
    cases["model-weight"] = ("model.safetensors", begin + 1)
    cases["model-header"] = ("model.safetensors", 12)
    meta_size = os.path.getsize(os.path.join(snapshot, "meta.json"))
    for i in range(8):  # spread over the file: braces, keys, numbers, the extra dict, the digests
        cases[f"meta-{i}"] = ("meta.json", i * (meta_size - 1) // 7)
    return cases


def _corrupt_and_load(rank, source, saved_world_size, scratch, stages):
    """Flip each case's byte in a fresh copy of `source`; load it at each stage. -> {case: {stage: result}}."""
    out = {}
    cases = _corruptions(committed_snapshot(source), saved_world_size)
    cases["untouched-copy"] = (None, None)  # the control: a copy loads
    for case, (name, where) in cases.items():
        directory = os.path.join(scratch, case)

        def corrupt():
            _copy(source, directory)
            if name is None:
                return
            path = os.path.join(committed_snapshot(directory), name)
            if where == "truncate":
                os.truncate(path, os.path.getsize(path) - 1)
            else:
                _flip(path, where)

        _on_rank0(rank, corrupt)
        out[case] = {"file": name}
        for stage in stages:
            engine = _engine(stage, seed=1)
            before = _params(engine)
            error = _expect_error(lambda: engine.load(directory))
            out[case][stage] = dict(error=error, untouched=not _equal_dicts(before, _params(engine)))
    return out


def _every_pointer_byte(rank, source, scratch):
    """Each byte of current.json changed in turn (^ 0x01): the error, or None where a load succeeded."""
    directory = os.path.join(scratch, "pointer")
    _on_rank0(rank, lambda: _copy(source, directory))
    pointer = os.path.join(directory, POINTER_FILE)
    size = os.path.getsize(pointer)
    engine = _engine(1, seed=1)
    errors = []
    for offset in range(size):
        _on_rank0(rank, lambda: _flip(pointer, offset))
        errors.append(_expect_error(lambda: engine.load(directory)))
        _on_rank0(rank, lambda: _flip(pointer, offset))  # flipped back: the next offset sees one change
    engine.load(directory)  # restored: loads again
    return dict(size=size, errors=errors)


# ---------------------------------------------------------------------- failures inside save, on one rank
class _Markers:
    """Files in a shared directory by which one rank waits until others have written theirs."""

    def __init__(self, directory):
        self.directory = directory

    def signal(self, name):
        open(os.path.join(self.directory, name), "w").close()

    def wait(self, names, timeout_s=60):
        deadline = time.monotonic() + timeout_s
        while not all(os.path.exists(os.path.join(self.directory, n)) for n in names):
            if time.monotonic() > deadline:
                raise TimeoutError(f"markers {names} not all in {self.directory}")
            time.sleep(0.01)


def _fail_after_others_wrote(rank, world_size, failing_rank, markers, action):
    """Patches for one save: every rank but `failing_rank` signals once its last file is written (its rank file:
    rank 0 streams the model file before it); `failing_rank` waits for all of them, then calls `action` (raise, or
    os._exit) instead of writing its rank file."""
    others = [f"wrote-{r}" for r in range(world_size) if r != failing_rank]
    write_rank = commit._write_rank_file

    def rank_file(*args, **kwargs):
        if rank == failing_rank:
            markers.wait(others)
            action()
        record = write_rank(*args, **kwargs)
        markers.signal(f"wrote-{rank}")
        return record

    return [mock.patch.object(commit, "_write_rank_file", rank_file)]


def _save_with(patches, engine, directory, **kwargs):
    for p in patches:
        p.start()
    try:
        return _expect_error(lambda: engine.save(directory, **kwargs))
    finally:
        for p in patches:
            p.stop()


def _raise_oserror():
    raise OSError(28, "No space left on device (simulated)")


def _save_failures(rank, world_size, source, scratch, expected):
    """A second save into a copy of `source` fails on one rank (each rank in turn; and a file write that fails
    outright); the save raises everywhere and `source`'s checkpoint still loads bit for bit."""
    out = {"source_listing": sorted(os.listdir(source))}
    engine = _engine(0, seed=3)
    _train(engine, rank, world_size, 0, 1)  # other values than the checkpoint's
    for failing in range(world_size):
        directory = os.path.join(scratch, f"fail-rank{failing}")
        markers = os.path.join(scratch, f"markers-fail-rank{failing}")
        _on_rank0(rank, lambda: (_copy(source, directory), os.makedirs(markers)))
        patches = _fail_after_others_wrote(rank, world_size, failing, _Markers(markers), _raise_oserror)
        out[failing] = dict(error=_save_with(patches, engine, directory))
        out[failing].update(_after_failed_save(rank, directory, expected))
    # a write that fails inside the file writer on the last rank: the error names that rank and its file
    directory = os.path.join(scratch, "permission")
    _on_rank0(rank, lambda: _copy(source, directory))
    denied = mock.patch.object(commit.SafetensorsWriter, "write", side_effect=PermissionError(13, "Permission denied"))
    out["permission"] = dict(error=_save_with([denied] if rank == world_size - 1 else [], engine, directory))
    out["permission"].update(_after_failed_save(rank, directory, expected))
    # rank 0's model file fails at its first tensor: the other ranks still finish the gathers, then all raise
    directory = os.path.join(scratch, "model-file")
    _on_rank0(rank, lambda: _copy(source, directory))
    full = mock.patch.object(commit.SafetensorsWriter, "write", side_effect=OSError(28, "No space left on device"))
    out["model_file"] = dict(error=_save_with([full] if rank == 0 else [], engine, directory))
    out["model_file"].update(_after_failed_save(rank, directory, expected))
    # the directory is a regular file: rank 0 cannot create the snapshot
    not_a_dir = os.path.join(scratch, "not-a-directory")
    _on_rank0(rank, lambda: open(not_a_dir, "w").close())
    out["not_a_directory"] = dict(error=_expect_error(lambda: engine.save(not_a_dir)))
    return out


def _after_failed_save(rank, directory, expected):
    """What a failed save left: the directory listing (the snapshot must be gone) and the checkpoint loaded."""
    torch.distributed.barrier()
    listing = sorted(os.listdir(directory))
    loaded = _engine(3, seed=1)
    loaded.load(directory)
    return dict(listing=listing, mismatch=_state_mismatch(expected, _state(loaded)))


def _directories(rank, world_size, scratch, source):
    """Rank-dependent directories are refused before anything is written; one directory through a symlink is
    the same directory."""
    out = {}
    engine = _engine(0)
    split = [os.path.join(scratch, "dirdep", "A"), os.path.join(scratch, "dirdep", "B")]
    mine = split[1] if rank == 1 else split[0]  # rank 1 alone elsewhere
    out["paths"] = [os.path.realpath(p) for p in split]
    out["dependent"] = _expect_error(lambda: engine.save(mine))
    torch.distributed.barrier()
    out["written"] = [p for p in split if os.path.exists(p)] + (
        [os.path.join(scratch, "dirdep")] if os.path.exists(os.path.join(scratch, "dirdep")) else [])
    torch.distributed.barrier()  # every rank has looked before rank 0 fills them below
    # both directories already hold checkpoint A: neither changes
    _on_rank0(rank, lambda: [_copy(source, p) for p in split])
    listings = [sorted(os.listdir(p)) for p in split]
    out["dependent_existing"] = _expect_error(lambda: engine.save(mine))
    torch.distributed.barrier()
    out["existing_unchanged"] = listings == [sorted(os.listdir(p)) for p in split]
    # the same directory reached through a symlink on rank 0
    real, link = os.path.join(scratch, "real"), os.path.join(scratch, "link")
    _on_rank0(rank, lambda: (os.makedirs(real), os.symlink(real, link)))
    engine.save(link if rank == 0 else real, extra={"via": "symlink"})
    out["symlink_meta"] = _engine(0, seed=1).load(real)["extra"]
    return out


# ---------------------------------------------------------------------- spawn 1: world size 2
# ---------------------------------------------------------------------- a rank file no loading rank reads
class _Temperature(nn.Module):
    """A frozen classifier whose one trainable element is its temperature. Saved by 2 ranks, the flat buffer of
    1 element is padded to 2 and rank 1's range is padding only: rank1-of-2 holds no piece, and no loading rank
    reads a slice of it, at any stage (pieces are read by name and range). Only the rule that rank i checks
    rank file j for every j = i (mod world size) covers it (zerokit/checkpoint/loading.py [Note: loading])."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(DIM, VOCAB).requires_grad_(False)
        self.temperature = nn.Parameter(torch.ones(1))

    def forward(self, x, y):
        return F.cross_entropy(self.body(x) / self.temperature, y)


def _unread_rank_file(rank, world_size, root):
    directory, corrupted = os.path.join(root, "temperature"), os.path.join(root, "temperature-corrupted")
    engine = zk.shard(_Temperature(), torch.optim.AdamW, stage=1, lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    batch = torch.randn(4, DIM, generator=g), torch.randint(0, VOCAB, (4,), generator=g)
    train_step(engine, [batch], lambda b: engine(*b))
    engine.save(directory)
    saved = _state(engine)

    def corrupt():  # rank1-of-2's metadata "rank":"1" becomes "rank":"0": still a valid safetensors header
        _copy(directory, corrupted)
        path = os.path.join(committed_snapshot(corrupted), "rank1-of-2.safetensors")
        with open(path, "rb") as f:
            at = f.read().index(b'"rank":"1"') + len(b'"rank":"')
        _flip(path, at)

    _on_rank0(rank, corrupt)
    from safetensors import safe_open
    with safe_open(os.path.join(committed_snapshot(corrupted), "rank1-of-2.safetensors"), framework="pt") as f:
        out = {"rank1_keys": list(f.keys()), "rank1_metadata": f.metadata()}
    for stage in (0, 3):
        intact = zk.shard(_Temperature(), torch.optim.AdamW, stage=stage, lr=1e-2)
        intact.load(directory)
        loaded = zk.shard(_Temperature(), torch.optim.AdamW, stage=stage, lr=1e-2)
        out[stage] = dict(intact_mismatch=_state_mismatch(saved, _state(intact)),
                          error=_expect_error(lambda: loaded.load(corrupted)))
    return out


def _cases_ws2(rank, world_size, root):
    out = {}
    a, b = os.path.join(root, "A-ws2"), os.path.join(root, "B-ws2")
    engine = _engine(0)
    _train(engine, rank, world_size, 0, K)
    engine.save(a, extra={"step": K})
    out["A"] = _state(engine)
    _train(engine, rank, world_size, K, M)
    engine.save(b, extra={"step": K + M})
    out["B"] = _state(engine)
    for name in ("c1", "c2", "c4"):  # the crash spawns at world size 2 save into copies of A
        _on_rank0(rank, lambda: _copy(a, os.path.join(root, f"crash-{name}")))

    scratch = os.path.join(root, "scratch-ws2")
    out["corrupt"] = _corrupt_and_load(rank, a, 2, scratch, stages=(0, 3))
    out["pointer"] = _every_pointer_byte(rank, a, scratch)

    # one rank file of B copied over A's: each file intact, together a mix of two checkpoints
    mixed = os.path.join(scratch, "mixed")
    _on_rank0(rank, lambda: (_copy(a, mixed), shutil.copy(os.path.join(committed_snapshot(b), "rank1-of-2.safetensors"),
                                                          committed_snapshot(mixed))))
    out["mixed"] = _expect_error(lambda: _engine(1, seed=1).load(mixed))

    out["failures"] = _save_failures(rank, world_size, a, scratch, out["A"])
    out["directories"] = _directories(rank, world_size, scratch, a)

    # loads that disagree across ranks, and copies of one checkpoint that agree
    copy = os.path.join(scratch, "copy-of-A")
    _on_rank0(rank, lambda: _copy(a, copy))
    out["different_checkpoints"] = _expect_error(lambda: _engine(1, seed=1).load(a if rank == 0 else b))
    loaded = _engine(1, seed=1)
    loaded.load(a if rank == 0 else copy)
    out["copies_mismatch"] = _state_mismatch(out["A"], _state(loaded))

    # an old-format checkpoint, and a snapshot passed instead of its directory
    old = os.path.join(scratch, "format1")
    _on_rank0(rank, lambda: (os.makedirs(old), json.dump({"format": "zerokit-checkpoint", "version": 1},
                                                         open(os.path.join(old, "meta.json"), "w"))))
    out["format1"] = _expect_error(lambda: _engine(1, seed=1).load(old))
    out["snapshot_path"] = _expect_error(lambda: _engine(1, seed=1).load(committed_snapshot(a)))
    out["snapshot_parent"] = a
    out["snapshot_A"] = os.path.basename(committed_snapshot(a))
    return out


# ---------------------------------------------------------------------- crash spawns
# name: (world size, dying rank, where it dies). "write": instead of writing its rank file, once every
# other rank has written its files; "commit": after meta.json, before current.json is replaced;
# "cleanup": after the commit, before the previous snapshot is removed.
CRASHES = {
    "c1": (2, 0, "write"),  # rank 0 dies after the model file and rank 1's rank file are written
    "c2": (2, 1, "write"),  # rank 1 dies after rank 0 has written its rank file and the model file
    "c3": (3, 0, "commit"),  # the new snapshot is complete, but never committed
    "c4": (2, 0, "cleanup"),  # committed: the load gives the new checkpoint
}
# what the crashed snapshot holds besides what the pointer names
CRASH_LEFTOVER = {
    "c1": ["model.safetensors", "rank1-of-2.safetensors"],
    "c2": ["model.safetensors", "rank0-of-2.safetensors"],
    "c3": ["meta.json", "model.safetensors", "rank0-of-3.safetensors", "rank1-of-3.safetensors",
           "rank2-of-3.safetensors"],
}


def _die():
    os._exit(EXIT_CODE)


def _crash(rank, world_size, directory, markers, dying, where):
    engine = _engine(0)
    _train(engine, rank, world_size, 0, K + M)  # at world size 2 exactly checkpoint B's state
    if where == "write":
        patches = _fail_after_others_wrote(rank, world_size, dying, _Markers(markers), _die)
    else:
        target = {"commit": "_commit", "cleanup": "_remove_stale"}[where]
        patches = [mock.patch.object(commit, target, lambda *a, **k: _die())] if rank == dying else []
    for p in patches:
        p.start()
    engine.save(directory, extra={"step": K + M})
    return "the save returned: the crash point was never reached"


# ---------------------------------------------------------------------- spawn last: world size 3
def _cases_ws3(rank, world_size, root, expected_a, expected_b):
    out = {"crash": {}}
    for name in CRASHES:
        directory = os.path.join(root, f"crash-{name}")
        loaded = _engine(3, seed=1)
        meta = loaded.load(directory)
        expected = expected_b if name == "c4" else expected_a
        out["crash"][name] = dict(mismatch=_state_mismatch(expected, _state(loaded)), step=meta["extra"]["step"])
    # the next successful save removes what the crashes left
    engine = _engine(0, seed=2)
    _train(engine, rank, world_size, 0, 1)
    saved = _state(engine)
    for name in CRASHES:
        directory = os.path.join(root, f"crash-{name}")
        engine.save(directory)
        torch.distributed.barrier()
        loaded = _engine(1, seed=1)
        loaded.load(directory)
        out["crash"][name].update(after_save=sorted(os.listdir(directory)),
                                  after_save_mismatch=_state_mismatch(saved, _state(loaded)))

    scratch = os.path.join(root, "scratch-ws3")
    a3 = os.path.join(root, "A-ws3")
    engine.save(a3)
    out["A3"] = saved
    out["corrupt_ws2"] = _corrupt_and_load(rank, os.path.join(root, "A-ws2"), 2, scratch + "-from2", stages=(3,))
    out["corrupt_ws3"] = _corrupt_and_load(rank, a3, 3, scratch, stages=(1,))
    out["failures"] = _save_failures(rank, world_size, a3, scratch, saved)
    out["directories"] = _directories(rank, world_size, scratch, a3)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("integrity"))


@pytest.fixture(scope="module")
def ws2(root, tmp_path_factory):
    return run_ranks(_cases_ws2, 2, root, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=240)


@pytest.fixture(scope="module")
def unread(root, tmp_path_factory):
    return run_ranks(_unread_rank_file, 2, root, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=120)


@pytest.fixture(scope="module")
def crashes(root, ws2, tmp_path_factory):
    """Run every crash scenario; -> {name: (RankFailed message or None, listing, snapshot the pointer names,
    what the uncommitted snapshot holds)}, all read right after the crash."""
    out = {}
    for name, (world_size, dying, where) in CRASHES.items():
        directory = os.path.join(root, f"crash-{name}")
        if world_size == 3:
            _copy(os.path.join(root, "A-ws2"), directory)
        markers = str(tmp_path_factory.mktemp(f"markers-{name}"))
        try:
            run_ranks(_crash, world_size, directory, markers, dying, where,
                      store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=120)
            failure = None
        except RankFailed as exc:
            failure = str(exc)
        listing = sorted(os.listdir(directory))
        current = os.path.basename(committed_snapshot(directory))
        stale = [e for e in listing if e.startswith("ckpt-") and e != current]
        leftover = sorted(os.listdir(os.path.join(directory, stale[0]))) if len(stale) == 1 else None
        out[name] = (failure, listing, current, leftover)
    return out


@pytest.fixture(scope="module")
def ws3(root, ws2, crashes, tmp_path_factory):
    return run_ranks(_cases_ws3, 3, root, ws2[0]["A"], ws2[0]["B"], store_dir=str(tmp_path_factory.mktemp("rdzv")),
                     timeout_s=300)


def _spawn(request, world_size):
    """The world-size-2 spawn's results, or the world-size-3 one's (which runs after the crash spawns)."""
    return request.getfixturevalue({2: "ws2", 3: "ws3"}[world_size])


def _assert_refused_everywhere(outs, error_of, file_name, what):
    for r, out in enumerate(outs):
        error = error_of(out)
        assert error is not None, (r, what, "loaded without complaint")
        assert file_name in error, (r, what, error)


# ---------------------------------------------------------------------- checksums
@pytest.mark.parametrize("world_size", [2, 3])
def test_flipped_byte_anywhere_in_a_rank_file_is_refused_on_every_rank_naming_the_file(request, world_size):
    """One changed byte in a rank file (a master weight, an optimizer state, the header, the last byte) or one
    byte cut off: ValueError on every rank, whatever stage loads it, naming the file; the engine is untouched."""
    outs = _spawn(request, world_size)
    runs = {2: [("ws2", outs, "corrupt", (0, 3))],
            3: [("ws3 from 2", outs, "corrupt_ws2", (3,)), ("ws3", outs, "corrupt_ws3", (1,))]}[world_size]
    for label, outs, key, stages in runs:
        for case, result in outs[0][key].items():
            if not case.startswith("rank"):
                continue
            for stage in stages:
                _assert_refused_everywhere(outs, lambda o: o[key][case][stage]["error"], result["file"],
                                           (label, case, stage))
                for r, out in enumerate(outs):
                    error = out[key][case][stage]["error"]
                    assert "sha256 checksum mismatch" in error or "bytes on disk" in error, (label, case, error)
                    assert out[key][case][stage]["untouched"], (label, case, r)


def test_changed_rank_file_no_loading_rank_reads_a_slice_of_is_refused_naming_it(unread):
    """rank1-of-2 of a 1-element model holds no piece (its range is padding), so no loading rank reads from it;
    one changed byte of it is still refused on every rank, at stages 0 and 3, naming the file: the rank whose
    turn it is checks it. The intact checkpoint loads exactly (the control)."""
    for r, out in enumerate(unread):
        assert out["rank1_keys"] == [] and out["rank1_metadata"]["rank"] == "0", out  # the case is what it claims
        for stage in (0, 3):
            assert out[stage]["intact_mismatch"] == [], (r, stage, out[stage]["intact_mismatch"])
            error = out[stage]["error"]
            assert error is not None, (r, stage, "loaded without complaint")
            assert "rank1-of-2.safetensors: sha256 checksum mismatch" in error, error
            assert f"(raised on rank {r})" in error and "\n  rank 1: " in error, error  # rank 1 checked it


@pytest.mark.parametrize("world_size", [2, 3])
def test_flipped_byte_in_model_file_or_meta_is_refused_on_every_rank(request, world_size):
    """model.safetensors (a weight, the header) and eight places in meta.json: refused everywhere, naming the
    file; an unchanged copy of the same checkpoint loads (the control)."""
    outs = _spawn(request, world_size)
    key, stage = ("corrupt", 0) if world_size == 2 else ("corrupt_ws3", 1)
    for case, result in outs[0][key].items():
        if case.startswith("model") or case.startswith("meta"):
            _assert_refused_everywhere(outs, lambda o: o[key][case][stage]["error"], result["file"], case)
            for out in outs:
                assert "sha256 checksum mismatch" in out[key][case][stage]["error"], out[key][case][stage]["error"]
                assert out[key][case][stage]["untouched"], case
    for out in outs:
        assert out[key]["untouched-copy"][stage]["error"] is None, out[key]["untouched-copy"][stage]["error"]


def test_every_changed_byte_of_current_json_is_refused(ws2):
    """current.json holds meta.json's digest and every other field is checked: each of its bytes changed in turn
    is refused on both ranks (a parse error, an unknown snapshot, a digest that does not match, ...)."""
    for r, out in enumerate(ws2):
        p = out["pointer"]
        assert p["size"] > 100, p["size"]
        accepted = [i for i, e in enumerate(p["errors"]) if e is None]
        assert accepted == [], (r, accepted)
        assert all(POINTER_FILE in e or "meta.json" in e for e in p["errors"]), r


def test_rank_file_of_another_checkpoint_is_refused(ws2):
    """A's snapshot with B's rank 1 file (each file intact, same size): refused on both ranks — the mix that
    loaded silently before checksums."""
    _assert_refused_everywhere(ws2, lambda o: o["mixed"], "rank1-of-2.safetensors", "mixed")
    for out in ws2:
        assert "sha256 checksum mismatch" in out["mixed"], out["mixed"]


def test_consolidate_refuses_a_corrupted_model_file(ws2, root, tmp_path):
    """scripts/consolidate.py checks the model file's sha256 too: exit 2, naming the file; nothing written."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "consolidate.py")
    out = tmp_path / "out.safetensors"
    done = subprocess.run([sys.executable, script, os.path.join(root, "scratch-ws2", "model-weight"), str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "model.safetensors" in done.stderr and "checksum mismatch" in done.stderr, done.stderr
    assert not out.exists()


# ---------------------------------------------------------------------- atomic commit
@pytest.mark.parametrize("name", ["c1", "c2", "c3"])
def test_crash_during_a_second_save_leaves_the_first_checkpoint_loadable_bitwise(ws2, crashes, ws3, name):
    """A rank dies mid-save (after the other ranks wrote, or after a complete but uncommitted snapshot): the
    directory still loads checkpoint A exactly — params and optimizer state, at 3 ranks and stage 3."""
    failure, listing, current, leftover = crashes[name]
    assert failure is not None and "crash point was never reached" not in failure, failure
    assert current == ws2[0]["snapshot_A"], (current, ws2[0]["snapshot_A"])  # the pointer never moved
    assert leftover == CRASH_LEFTOVER[name], (name, listing, leftover)  # the crash came where it claims to
    for r, out in enumerate(ws3):
        got = out["crash"][name]
        assert got["mismatch"] == [], (r, got["mismatch"])
        assert got["step"] == K


def test_crash_after_the_commit_loads_the_second_checkpoint(ws2, crashes, ws3):
    """Rank 0 dies after replacing current.json, before removing the previous snapshot: the load gives the new
    checkpoint (B) exactly; the previous snapshot is still on disk until the next save."""
    failure, listing, current, _ = crashes["c4"]
    assert failure is not None and "crash point was never reached" not in failure, failure
    assert len([e for e in listing if e.startswith("ckpt-")]) == 2, listing  # the previous one not yet removed
    assert current != ws2[0]["snapshot_A"], current
    for r, out in enumerate(ws3):
        assert out["crash"]["c4"]["mismatch"] == [], (r, out["crash"]["c4"]["mismatch"])
        assert out["crash"]["c4"]["step"] == K + M


def test_next_successful_save_removes_what_crashed_saves_left(ws3):
    """After a save into each crashed directory it holds current.json and one snapshot, which loads exactly."""
    for r, out in enumerate(ws3):
        for name, got in out["crash"].items():
            assert len(got["after_save"]) == 2 and got["after_save"][1] == POINTER_FILE, (r, name, got["after_save"])
            assert got["after_save_mismatch"] == [], (r, name, got["after_save_mismatch"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_save_failing_on_one_rank_raises_on_every_rank_and_keeps_the_previous_checkpoint(request, world_size):
    """Each rank in turn fails after every other rank wrote its files, one rank's file write is denied, and rank
    0's model file fails while every rank gathers for it: ValueError on every rank naming the failing rank (and
    the file); the half-written snapshot is removed and the previous checkpoint loads bit for bit."""
    outs = _spawn(request, world_size)
    for r, out in enumerate(outs):
        f = out["failures"]
        expected_listing = f["source_listing"]  # current.json and the source's snapshot, nothing else
        for failing in range(world_size):
            error = f[failing]["error"]
            assert error is not None and f"rank {failing}: OSError" in error and "No space left" in error, error
            assert f[failing]["listing"] == expected_listing, (failing, f[failing]["listing"])
            assert f[failing]["mismatch"] == [], (r, failing, f[failing]["mismatch"])
        denied = f["permission"]["error"]
        assert denied is not None and f"rank {world_size - 1}: OSError" in denied, denied
        assert f"rank{world_size - 1}-of-{world_size}.safetensors" in denied and "Permission denied" in denied, denied
        assert f["permission"]["mismatch"] == [] and f["permission"]["listing"] == expected_listing, f["permission"]
        streamed = f["model_file"]["error"]  # raised while the other ranks gathered: they finished, then raised
        assert streamed is not None and "rank 0: OSError" in streamed and "model.safetensors" in streamed, streamed
        assert f["model_file"]["mismatch"] == [] and f["model_file"]["listing"] == expected_listing, f["model_file"]
        nd = f["not_a_directory"]["error"]
        assert nd is not None and "rank 0:" in nd and "not-a-directory" in nd, nd


# ---------------------------------------------------------------------- one directory
@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_dependent_directory_raises_on_every_rank_before_writing(request, world_size):
    """Rank 1 passes another directory than the others: ValueError on every rank naming both paths; nothing is
    created, and directories that held a checkpoint are unchanged. A symlink to the same directory is accepted."""
    outs = _spawn(request, world_size)
    for r, out in enumerate(outs):
        d = out["directories"]
        for error in (d["dependent"], d["dependent_existing"]):
            assert error is not None and "different directories" in error, error
            assert all(p in error for p in d["paths"]), (d["paths"], error)
        assert d["written"] == [], d["written"]
        assert d["existing_unchanged"], r
        assert d["symlink_meta"] == {"via": "symlink"}, d["symlink_meta"]


def test_ranks_loading_different_checkpoints_refuse_and_copies_of_one_load(ws2):
    """Rank 0 loads A, rank 1 B: refused on both ranks. Rank 0 loads A, rank 1 a copy of A (node-local copies):
    the same checkpoint, loaded exactly."""
    for r, out in enumerate(ws2):
        error = out["different_checkpoints"]
        assert error is not None and "different checkpoints" in error, error
        assert out["copies_mismatch"] == [], (r, out["copies_mismatch"])


def test_old_format_and_a_snapshot_path_are_refused_with_what_to_do(ws2):
    """A format-1 directory says its version and that this zerokit reads 2; a snapshot passed instead of its
    checkpoint directory names the directory to pass."""
    for out in ws2:
        assert out["format1"] is not None and "version 1" in out["format1"] and "version 2" in out["format1"], \
            out["format1"]
        assert out["snapshot_path"] is not None and f"pass {out['snapshot_parent']}" in out["snapshot_path"], \
            out["snapshot_path"]
