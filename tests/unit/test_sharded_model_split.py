"""The split rule of Hugging Face-style sharded model files (zerokit/checkpoint/format.py [Note: sharded model
files]), against huggingface_hub's own `split_torch_state_dict_into_shards` and `parse_size_to_int`.

No process group: the names, the rule, the index bytes and which file sets a meta.json may list. The files a
save writes, and transformers reading them, are tests/distributed/test_sharded_model_files.py.
"""
import json
import random

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from huggingface_hub.serialization._base import parse_size_to_int

from zerokit.checkpoint.format import (
    MODEL_FILE, MODEL_INDEX_FILE, model_files, model_index_bytes, model_layout, model_shard_file, parse_shard_size,
    snapshot_files, split_into_shards)

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)


def _random_state(rng: random.Random, n: int) -> dict[str, torch.Tensor]:
    """n tensors of random dtypes and shapes (0-dim ones included), names not in sorted order. None empty:
    huggingface_hub identifies storages by data pointer, and every empty tensor's is 0, so it files them all
    with the first one as if tied; zerokit knows its ties by name (format.py `aliases`) and places each."""
    state = {}
    for i in range(n):
        shape = tuple(rng.choice([1, 2, 3, 5, 8, 13]) for _ in range(rng.randint(0, 3)))
        state[f"layer{rng.randint(0, 99)}.p{i}"] = torch.zeros(shape, dtype=rng.choice(DTYPES))
    return state


def _hf_layout(state: dict[str, torch.Tensor], max_shard_size) -> dict[str, list[str]]:
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    return {name: list(keys) for name, keys in split.filename_to_tensors.items()}


@pytest.mark.parametrize("seed", range(40))
def test_the_split_is_huggingface_hubs_for_random_state_dicts(seed):
    """Same files, same names in each, same order, for limits around the tensor sizes (oversized ones included)."""
    rng = random.Random(seed)
    state = _random_state(rng, rng.randint(1, 30))
    specs = {k: (v.dtype, tuple(v.shape)) for k, v in state.items()}
    sizes = [v.numel() * v.element_size() for v in state.values()]
    for limit in {1, max(sizes) or 1, max(1, sum(sizes) // 3), sum(sizes) or 1, rng.randint(1, 400), 10**9}:
        assert model_layout(specs, limit) == _hf_layout(state, limit), limit


def test_the_split_follows_state_dict_order_not_optimal_packing():
    """huggingface_hub's documented example: [6, 6, 2, 6, 2, 2] under 10 -> [6], [6+2], [6+2+2]; a tensor larger
    than the limit alone, listed before the file being filled."""
    assert split_into_shards(dict(a=6, b=6, c=2, d=6, e=2, f=2), 10) == [["a"], ["b", "c"], ["d", "e", "f"]]
    assert split_into_shards(dict(a=1, b=1, big=5, d=1), 3) == [["big"], ["a", "b", "d"]]
    assert split_into_shards(dict(a=3, b=3), 3) == [["a"], ["b"]]  # exactly the limit fits; one byte more does not
    assert split_into_shards({}, 3) == []


def test_one_file_or_no_limit_is_model_safetensors_alone():
    specs = {"a": (torch.float32, (4,)), "b": (torch.float32, (4,))}
    assert model_layout(specs) == {MODEL_FILE: ["a", "b"]}
    assert model_layout(specs, "1KB") == {MODEL_FILE: ["a", "b"]}
    assert model_layout(specs, 16) == {model_shard_file(1, 2): ["a"], model_shard_file(2, 2): ["b"]}
    assert model_shard_file(1, 2) == "model-00001-of-00002.safetensors"


@pytest.mark.parametrize("text", ["5GB", "5gb", " 2.5 MB", "100KB", "1TB", "0.5GB", "10kb"])
def test_sizes_are_read_as_huggingface_hub_reads_them(text):
    assert parse_shard_size(text) == parse_size_to_int(text)


def test_sizes_in_bytes_and_refusals():
    assert parse_shard_size(1000) == parse_shard_size("1000") == 1000
    for bad in ["5GiB", "five GB", "", "GB", 0, -1, "0KB", True, 2.5, None]:
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_shard_size(bad)


def test_the_index_has_transformers_bytes():
    """json.dumps(indent=2, sort_keys=True) + newline; total_size counts every stored tensor's bytes,
    total_parameters the elements of parameters (not buffers)."""
    specs = {"w": (torch.float32, (3, 2)), "b": (torch.bfloat16, (5,)), "buf": (torch.int64, (2,))}
    layout = {model_shard_file(1, 2): ["w"], model_shard_file(2, 2): ["b", "buf"]}
    data = model_index_bytes(layout, specs, parameters={"w", "b"})
    index = json.loads(data)
    assert index == {"metadata": {"total_parameters": 11, "total_size": 24 + 10 + 16},
                     "weight_map": {"w": model_shard_file(1, 2), "b": model_shard_file(2, 2),
                                    "buf": model_shard_file(2, 2)}}
    assert data == (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def test_a_snapshot_lists_one_model_file_or_every_shard_and_the_index():
    shards = [model_shard_file(i, 3) for i in (1, 2, 3)]
    assert model_files({MODEL_FILE, "rank0-of-2.safetensors"}) == [MODEL_FILE]
    assert model_files(set(shards) | {MODEL_INDEX_FILE, "rank0-of-2.safetensors"}) == shards + [MODEL_INDEX_FILE]
    assert snapshot_files(2, shards + [MODEL_INDEX_FILE]) == set(shards) | {MODEL_INDEX_FILE, "rank0-of-2.safetensors",
                                                                            "rank1-of-2.safetensors"}
    for bad in [set(), set(shards), set(shards[:2]) | {MODEL_INDEX_FILE}, set(shards) | {MODEL_INDEX_FILE, MODEL_FILE},
                {model_shard_file(1, 1), MODEL_INDEX_FILE}, {MODEL_INDEX_FILE, MODEL_FILE},
                {model_shard_file(1, 2), model_shard_file(2, 3), MODEL_INDEX_FILE}]:
        with pytest.raises(ValueError, match="model file"):
            model_files(bad)


def test_train_max_shard_size_is_checked_when_parsed_and_kept_as_given():
    """`zerokit train --max-shard-size` reads sizes as engine.save does; a typo is an argparse error, no spawn."""
    import argparse

    from zerokit.commands.train import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--max-shard-size", "5GB"]).max_shard_size == "5GB"
    assert parser.parse_args([]).max_shard_size is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-shard-size", "5GiB"])
    from zerokit.commands.train import check_arguments
    with pytest.raises(ValueError, match="--max-shard-size SIZE splits the model file of --save DIR"):
        check_arguments(vars(parser.parse_args(["--model", "tiny", "--max-shard-size", "5GB"])))
