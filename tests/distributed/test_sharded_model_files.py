"""engine.save(dir, max_shard_size=...) on 2 gloo ranks: the model as Hugging Face's sharded files and index.

One 2-rank spawn runs every case (and a 1-rank spawn loads its snapshots at another world size). At stages 0
and 3 the odd model (tests/common.py: a tied embedding and head, a frozen layer, odd shapes) trains K steps
and saves twice, with a small max_shard_size and without one: the sharded snapshot holds >= 2 model files and
model.safetensors.index.json, each file byte for byte what safetensors' save_file writes for its tensors,
split as huggingface_hub splits the state dict, every file and the index in meta.json with its sha256.
Plain `safetensors.torch.load_file` of every shard gives exactly `engine.state_dict(full=True)` (the tie
once); a fresh engine resumes from it bit for bit like one resumed from the single-file snapshot and like the
run never stopped, also at the other stage and at world size 1; `load_weights` reads it; a changed byte of a
shard or of the index, or a missing shard, is refused on every rank naming the file.

A Hugging Face GPT-2 (head tied to wte) and a Llama (untied), built from configs with transformers and
sharded by zk.shard at stages 0 and 3: before training, zerokit's files are byte for byte those of
transformers' own `save_pretrained(max_shard_size=...)` of the same model (the index too); after a step,
`AutoModelForCausalLM.from_pretrained(snapshot)` (config.json written beside the files) loads it with no
missing or unexpected keys and tensors equal to the engine's, GPT-2's head tied to wte again. And
`zerokit train --save DIR --max-shard-size` writes shards that `--resume` continues from.
"""
import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

import zerokit as zk
from common import OddBlock, odd_batch, odd_model
from zerokit.checkpoint import MODEL_FILE, MODEL_INDEX_FILE, committed_snapshot, load_full_state_dict
from zerokit.checkpoint.format import aliases
from zerokit.commands.step import train_step
from zerokit.launch import run_ranks

K, M = 2, 2  # steps before the save, steps after it
ROWS = 4  # global rows per step (2 per rank at world size 2, 4 at world size 1)
SHARD = 600  # bytes: the odd model's 900-byte frozen weight alone exceeds it, so it gets a file of its own
HF_SHARD = "10KB"
STAGES = (0, 3)


def _engine(stage, seed=0):
    return zk.shard(odd_model(seed), torch.optim.AdamW, stage=stage, bucket_numel=40, wrap=(OddBlock,), lr=1e-2)


def _train(engine, rank, world_size, first, steps):
    losses = []
    for step in range(first, first + steps):
        batch = odd_batch(step, ROWS // world_size, rank, world_size)
        losses.append(train_step(engine, [batch], lambda b: engine(*b)).loss.float().clone())
    return torch.stack(losses)


def _mismatch(a, b):
    if a.keys() != b.keys():
        return [f"keys {sorted(set(a) ^ set(b))}"]
    return [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]


def _error(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _on_rank0(rank, fn):
    if rank == 0:
        fn()
    torch.distributed.barrier()


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def _model_files(snapshot):
    return sorted(n for n in os.listdir(snapshot) if n.startswith("model"))


def _files_report(snapshot, state, names_of, limit):
    """What rank 0 checks of a sharded snapshot's files, against the state dict they should hold."""
    from huggingface_hub import split_torch_state_dict_into_shards

    with open(os.path.join(snapshot, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(snapshot, MODEL_INDEX_FILE)) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    stored = {k: v for k, v in state.items() if k not in names_of}
    loaded, as_save_file, oversized = {}, {}, []
    for name in shards:
        path = os.path.join(snapshot, name)
        part = load_file(path)
        loaded.update(part)
        with open(path, "rb") as f:
            as_save_file[name] = f.read() == safetensors_bytes(part, metadata={"format": "pt"})
        data = sum(v.numel() * v.element_size() for v in part.values())
        if data > limit and len(part) > 1:
            oversized.append(name)
    expanded = {**loaded, **{alias: loaded[target] for alias, target in names_of.items()}}
    hashes = {}
    for name in meta["files"]:
        with open(os.path.join(snapshot, name), "rb") as f:
            hashes[name] = hashlib.sha256(f.read()).hexdigest() == meta["files"][name]["sha256"]
    split = split_torch_state_dict_into_shards(stored, max_shard_size=limit)
    return dict(model_files=_model_files(snapshot), shards=shards, as_save_file=as_save_file, oversized=oversized,
                load_file_mismatch=_mismatch(loaded, stored), expanded_mismatch=_mismatch(expanded, state),
                tie_saved_once=sorted(set(state) - set(loaded)) == sorted(names_of),
                weight_map_is_hf_split=index["weight_map"] == split.tensor_to_filename,
                total_size=(index["metadata"]["total_size"], split.metadata["total_size"]),
                meta_lists=sorted(n for n in meta["files"] if n.startswith("model")), hashes=hashes,
                full_state_dict_mismatch=_mismatch(load_full_state_dict(os.path.dirname(snapshot)), state))


# ---------------------------------------------------------------------- the odd model
def _odd_cases(rank, world_size, root):
    out = {}
    for stage in STAGES:
        sharded, single = os.path.join(root, f"odd-s{stage}-sharded"), os.path.join(root, f"odd-s{stage}-single")
        engine = _engine(stage)
        _train(engine, rank, world_size, 0, K)
        at_save = engine.state_dict(full=True)
        engine.save(sharded, extra={"step": K}, max_shard_size=SHARD)
        engine.save(single, extra={"step": K})
        if rank == 0:
            out[(stage, "files")] = _files_report(committed_snapshot(sharded), at_save, aliases(engine.module), SHARD)
            out[(stage, "single_files")] = _model_files(committed_snapshot(single))
        straight = _train(engine, rank, world_size, K, M)
        straight_state = engine.state_dict(full=True)
        resumed = {}
        for name, directory, load_stage in (("sharded", sharded, stage), ("single", single, stage),
                                            ("sharded, other stage", sharded, 3 - stage)):
            fresh = _engine(load_stage, seed=1)  # other weights: the load must overwrite every value
            meta = fresh.load(directory)
            loaded = fresh.state_dict(full=True)
            resumed[name] = dict(step=meta["extra"]["step"], loaded_mismatch=_mismatch(loaded, at_save),
                                 losses=_train(fresh, rank, world_size, K, M), state=fresh.state_dict(full=True))
        out[(stage, "resume")] = dict(
            straight=straight, straight_state=straight_state,
            **{name: dict(step=r["step"], loaded_mismatch=r["loaded_mismatch"],
                          losses_equal=torch.equal(r["losses"], straight),
                          state_mismatch=_mismatch(r["state"], straight_state),
                          equals_single=(torch.equal(r["losses"], resumed["single"]["losses"])
                                         and not _mismatch(r["state"], resumed["single"]["state"])))
               for name, r in resumed.items()})
        weights = {}
        for name, path in (("snapshot", committed_snapshot(sharded)), ("checkpoint directory", sharded)):
            fresh = _engine(3 - stage, seed=1)
            report = fresh.load_weights(path)
            weights[name] = dict(report=report, mismatch=_mismatch(fresh.state_dict(full=True), at_save))
        out[(stage, "load_weights")] = weights
        out[(stage, "at_save")] = at_save
    out["refusals"] = _refusals(rank, world_size, os.path.join(root, "odd-s3-sharded"), root)
    out["bad_size"] = _error(lambda: _engine(0).save(os.path.join(root, "never"), max_shard_size="5GiB"))
    out["bad_size_wrote"] = os.path.exists(os.path.join(root, "never"))
    return out


def _refusals(rank, world_size, source, root):
    """A copy of the stage-3 sharded checkpoint with one thing changed, loaded at stages 3 and 0."""
    snapshot = committed_snapshot(source)
    shards = [n for n in _model_files(snapshot) if n != MODEL_INDEX_FILE]
    cases = {"shard 2 data byte": (shards[1], "data"), "last shard last byte": (shards[-1], "last"),
             "index byte": (MODEL_INDEX_FILE, 40), "shard 1 missing": (shards[0], "remove"),
             "index missing": (MODEL_INDEX_FILE, "remove"), "untouched copy": (None, None)}
    out = {}
    for case, (name, where) in cases.items():
        directory = os.path.join(root, "tampered-" + case.replace(" ", "-"))

        def tamper():
            shutil.copytree(source, directory)
            if name is None:
                return
            path = os.path.join(committed_snapshot(directory), name)
            if where == "remove":
                os.remove(path)
            elif where == "data":
                with open(path, "rb") as f:
                    header = int.from_bytes(f.read(8), "little")
                _flip(path, 8 + header + 3)
            else:
                _flip(path, os.path.getsize(path) - 1 if where == "last" else where)

        _on_rank0(rank, tamper)
        out[case] = dict(file=name, errors={stage: _error(lambda: _engine(stage, seed=1).load(directory))
                                            for stage in (3, 0)})
    return out


def _other_world_size(rank, world_size, root):
    """World size 1: each stage's 2-rank sharded snapshot loads at the other stage, and trains M steps."""
    out = {}
    for stage in STAGES:
        fresh = _engine(3 - stage, seed=1)
        meta = fresh.load(os.path.join(root, f"odd-s{stage}-sharded"))
        out[stage] = dict(step=meta["extra"]["step"], state=fresh.state_dict(full=True),
                          losses=_train(fresh, rank, world_size, K, M))
    return out


# ---------------------------------------------------------------------- Hugging Face models
def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=61, n_positions=16, n_embd=24, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _hf_cases(rank, world_size, root):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    out = {}
    for kind, build in (("gpt2", _gpt2), ("llama", _llama)):
        for stage in STAGES:
            model = build()
            reference = os.path.join(root, f"hf-{kind}-s{stage}-save_pretrained")
            _on_rank0(rank, lambda: model.save_pretrained(reference, max_shard_size=HF_SHARD))
            blocks = tuple({type(m) for m in model.modules() if type(m).__name__ in ("GPT2Block", "LlamaDecoderLayer")})
            engine = zk.shard(model, torch.optim.AdamW, stage=stage, wrap=blocks, lr=1e-2)
            fresh_dir, trained_dir = (os.path.join(root, f"hf-{kind}-s{stage}-{n}") for n in ("fresh", "trained"))
            engine.save(fresh_dir, max_shard_size=HF_SHARD)
            g = torch.Generator().manual_seed(7)
            ids = torch.randint(0, 61, (4, 12), generator=g)[rank * 2:(rank + 1) * 2]
            model.zero_grad()
            engine(input_ids=ids, labels=ids).loss.backward()
            engine.step()
            engine.save(trained_dir, max_shard_size=HF_SHARD)
            state = engine.state_dict(full=True)
            if rank == 0:
                ours = committed_snapshot(fresh_dir)
                theirs = sorted(n for n in os.listdir(reference) if n.startswith("model"))
                identical = {}
                for name in theirs:
                    with open(os.path.join(reference, name), "rb") as a, open(os.path.join(ours, name), "rb") as b:
                        identical[name] = a.read() == b.read() if os.path.exists(os.path.join(ours, name)) else None
                snapshot = committed_snapshot(trained_dir)
                model.config.save_pretrained(snapshot)  # config.json beside the files: what from_pretrained needs
                loaded, info = AutoModelForCausalLM.from_pretrained(snapshot, output_loading_info=True)
                loaded_state = loaded.state_dict()
                with open(os.path.join(snapshot, MODEL_INDEX_FILE)) as f:
                    weight_map = json.load(f)["weight_map"]
                head, emb = loaded.get_output_embeddings().weight, loaded.get_input_embeddings().weight
                out[(kind, stage)] = dict(
                    reference_files=theirs, our_files=_model_files(ours), identical=identical,
                    trained_files=_model_files(snapshot), info={k: list(v) for k, v in info.items()},
                    mismatch=_mismatch({k: v.detach() for k, v in loaded_state.items()}, state),
                    head_in_weight_map="lm_head.weight" in weight_map,
                    head_tied=head.data_ptr() == emb.data_ptr(), loaded_class=type(loaded).__name__)
            torch.distributed.barrier()
            resumed = zk.shard(build(), torch.optim.AdamW, stage=3 - stage, wrap=blocks, lr=1e-2)
            resumed.load(trained_dir)  # config.json, not in meta.json's list, does not disturb a load
            if rank == 0:
                out[(kind, stage)]["load_after_config_json"] = _mismatch(resumed.state_dict(full=True), state)
            else:
                resumed.state_dict(full=True)  # a collective
    return out


# ---------------------------------------------------------------------- zerokit train --max-shard-size
def _train_cli_cases(rank, world_size, root):
    import argparse

    from zerokit.commands.train import add_arguments, train_loop

    def cfg(**overrides):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        c = vars(parser.parse_args(["--model", "tiny", "--no-progress", "--batch-size", "2", "--clip", "0",
                                    "--stage", "3", "--max-shard-size", "40KB"]))
        c.update(overrides)
        return c

    ck = os.path.join(root, "train-cli")
    first = train_loop(rank, world_size, cfg(steps=2, save=ck))
    files = _model_files(committed_snapshot(ck))
    resumed = train_loop(rank, world_size, cfg(steps=3, resume=ck))
    straight = train_loop(rank, world_size, cfg(steps=3))
    return dict(files=files, first=first["losses"], resumed_first_step=resumed["first_step"],
                resumed=resumed["losses"], straight=straight["losses"],
                digests=(resumed["weights_sha256"], straight["weights_sha256"]))


def _cases(rank, world_size, root):
    return dict(odd=_odd_cases(rank, world_size, root), hf=_hf_cases(rank, world_size, root),
                cli=_train_cli_cases(rank, world_size, root))


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sharded"))


@pytest.fixture(scope="module")
def ws2(root, tmp_path_factory):
    return run_ranks(_cases, 2, root, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=400)


@pytest.fixture(scope="module")
def ws1(root, ws2, tmp_path_factory):
    return run_ranks(_other_world_size, 1, root, store_dir=str(tmp_path_factory.mktemp("rdzv1")), timeout_s=120)


# ---------------------------------------------------------------------- the odd model
@pytest.mark.parametrize("stage", STAGES)
def test_a_small_max_shard_size_writes_shards_and_an_index_as_hugging_face_splits(ws2, stage):
    got = ws2[0]["odd"][(stage, "files")]
    shards = got["shards"]
    assert len(shards) >= 2 and got["model_files"] == shards + [MODEL_INDEX_FILE], got["model_files"]
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert got["weight_map_is_hf_split"], "the split is not huggingface_hub's for the same state dict"
    assert got["total_size"][0] == got["total_size"][1]
    assert got["oversized"] == [], "a file holding several tensors is larger than max_shard_size"
    assert got["as_save_file"] == {name: True for name in shards}, got["as_save_file"]
    assert got["meta_lists"] == got["model_files"] and all(got["hashes"].values()), got["hashes"]
    assert ws2[0]["odd"][(stage, "single_files")] == [MODEL_FILE]  # without max_shard_size: today's one file


@pytest.mark.parametrize("stage", STAGES)
def test_load_file_of_every_shard_is_the_full_state_dict_with_the_tie_saved_once(ws2, stage):
    got = ws2[0]["odd"][(stage, "files")]
    assert got["load_file_mismatch"] == [] and got["expanded_mismatch"] == [], got
    assert got["tie_saved_once"], "head.weight (tied to emb.weight) is stored, or something else is missing"
    assert got["full_state_dict_mismatch"] == [], "load_full_state_dict (scripts/consolidate.py) differs"


@pytest.mark.parametrize("stage", STAGES)
def test_resume_from_a_sharded_snapshot_is_bitwise_like_the_single_file_one(ws2, stage):
    for rank, result in enumerate(ws2):
        got = result["odd"][(stage, "resume")]
        for name in ("sharded", "single", "sharded, other stage"):
            case = got[name]
            assert case["step"] == K and case["loaded_mismatch"] == [], (rank, name, case)
            if name != "sharded, other stage":  # the same stage: the bits of the run never stopped
                assert case["losses_equal"] and case["state_mismatch"] == [], (rank, name, case)
        assert got["sharded"]["equals_single"], rank


def test_a_sharded_snapshot_loads_at_another_world_size(ws2, ws1):
    for stage in STAGES:
        got = ws1[0][stage]
        assert got["step"] == K
        assert _mismatch(got["state"], ws2[0]["odd"][(stage, "at_save")]) == []


@pytest.mark.parametrize("stage", STAGES)
def test_load_weights_reads_a_sharded_snapshot_and_its_checkpoint_directory(ws2, stage):
    for rank, result in enumerate(ws2):
        for name, case in result["odd"][(stage, "load_weights")].items():
            assert case["report"] == {"missing": [], "unexpected": []}, (rank, name, case)
            assert case["mismatch"] == [], (rank, name, case)


def test_a_changed_or_missing_shard_or_index_is_refused_on_every_rank_naming_the_file(ws2):
    cases = ws2[0]["odd"]["refusals"]
    for case, got in cases.items():
        for rank, result in enumerate(ws2):
            theirs = result["odd"]["refusals"][case]
            for stage, error in theirs["errors"].items():
                if got["file"] is None:
                    assert error is None, (case, rank, stage, error)
                    continue
                assert error is not None, (case, rank, stage)
                assert got["file"] in error and f"raised on rank {rank}" in error, (case, rank, stage, error)
                assert ("missing" in error) if "missing" in case else ("checksum mismatch" in error), error


def test_a_bad_max_shard_size_is_refused_before_anything_is_written(ws2):
    for result in ws2:
        assert "max_shard_size '5GiB'" in result["odd"]["bad_size"]
        assert result["odd"]["bad_size_wrote"] is False


# ---------------------------------------------------------------------- Hugging Face models
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("stage", STAGES)
def test_the_files_are_transformers_save_pretrained_bytes(ws2, kind, stage):
    """Before training the engine holds the model's own weights: zerokit's shards and index are byte for byte
    what transformers' save_pretrained(max_shard_size=...) writes for that model."""
    got = ws2[0]["hf"][(kind, stage)]
    assert len(got["reference_files"]) >= 3 and got["our_files"] == got["reference_files"], got
    assert got["identical"] == {name: True for name in got["reference_files"]}, got["identical"]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("stage", STAGES)
def test_from_pretrained_loads_the_sharded_snapshot(ws2, kind, stage):
    got = ws2[0]["hf"][(kind, stage)]
    assert len(got["trained_files"]) >= 3 and MODEL_INDEX_FILE in got["trained_files"]
    assert got["loaded_class"] == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[kind]
    assert got["info"]["missing_keys"] == [] and got["info"]["unexpected_keys"] == [], got["info"]
    assert got["info"].get("mismatched_keys", []) == [], got["info"]
    assert got["mismatch"] == [], got["mismatch"]
    assert got["head_in_weight_map"] is (kind == "llama")  # GPT-2's tied head saved once, as HF saves it
    assert got["head_tied"] is (kind == "gpt2")
    assert got["load_after_config_json"] == []


# ---------------------------------------------------------------------- zerokit train
def test_train_cli_max_shard_size_writes_shards_that_resume_continues_from(ws2):
    for result in ws2:
        got = result["cli"]
        assert len(got["files"]) >= 3 and got["files"][-1] == MODEL_INDEX_FILE, got["files"]
        assert got["resumed_first_step"] == 2
        assert got["first"] + got["resumed"] == got["straight"], got
        assert got["digests"][0] == got["digests"][1]
