"""engine.load_weights on 2 gloo ranks: a 2-file Hugging Face-style index into a meta-built engine, at every stage.

The weights of an eagerly built GPT (seed 5) are written as two safetensors files and a
model.safetensors.index.json, the tied head stored once under "wte.weight" (as Hugging Face saves a tie).
An engine built on the meta device (seed 0, other values) that loads them must hold exactly what the engine
built from the seed-5 model holds (fp32 masters included, under bf16), and train 2 AdamW steps bit for bit
like it. A mis-shaped, missing or unexpected key is refused on every rank, naming the key and the file.
"""
import json
import os

import pytest
import torch

import zerokit as zk
from zerokit.launch import run_ranks
from zerokit.models import GPT, Block, preset

from common import train_on_tokens


def _write_hf_index(directory: str, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in halves.items():
        save_file({k: state[k].contiguous() for k in part}, os.path.join(directory, name))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: name for name, part in halves.items() for k in part}}, f)


def _meta_engine(stage: int, precision: str):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(preset("tiny"))
    return zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, wrap=(Block,), lr=1e-2,
                    param_init_fn=GPT._init_weights)


def _cases(rank: int, world_size: int, root: str) -> dict:
    from safetensors.torch import save_file

    torch.manual_seed(5)
    weights = {k: v.clone() for k, v in GPT(preset("tiny")).state_dict().items()}
    hf = {k: v for k, v in weights.items() if k != "lm_head.weight"}  # a tie saved once
    index_dir, single = os.path.join(root, "index"), os.path.join(root, "single.safetensors")
    bad_shape, missing, extra = (os.path.join(root, n) for n in ("bad.safetensors", "missing.safetensors",
                                                                 "extra.safetensors"))
    if rank == 0:
        os.makedirs(index_dir, exist_ok=True)
        _write_hf_index(index_dir, hf)
        save_file(hf, single)
        save_file({**hf, "blocks.0.mlp.fc.weight": torch.zeros(3, 3)}, bad_shape)
        save_file({k: v for k, v in hf.items() if k != "ln_f.weight"}, missing)
        save_file({**hf, "not.in.model": torch.zeros(2)}, extra)
    torch.distributed.barrier()
    out = {}
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16"):
            torch.manual_seed(5)
            reference = zk.shard(GPT(preset("tiny")), torch.optim.AdamW, stage=stage, precision=precision,
                                 wrap=(Block,), lr=1e-2)
            loaded = _meta_engine(stage, precision)
            report = loaded.load_weights(index_dir if stage % 2 == 0 else single)
            a, b = reference.state_dict(), loaded.state_dict()
            start_equal = all(torch.equal(a[k], b[k]) for k in a)
            out[(stage, precision)] = dict(start_equal=start_equal, report=report,
                                           losses_equal=(train_on_tokens(reference, 2, 20 + rank, 64)
                                                         == train_on_tokens(loaded, 2, 20 + rank, 64)),
                                           end_equal=all(torch.equal(v, loaded.state_dict()[k])
                                                         for k, v in reference.state_dict().items()))
    for name, path in (("bad_shape", bad_shape), ("missing", missing), ("extra", extra)):
        engine = _meta_engine(3, "fp32")
        try:
            engine.load_weights(path)
            out[name] = "not refused"
        except ValueError as exc:
            out[name] = str(exc)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return run_ranks(_cases, 2, str(root), store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=280)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_load_weights_equals_the_engine_built_from_those_weights(results, stage, precision):
    for rank, result in enumerate(results):
        case = result[(stage, precision)]
        assert case["start_equal"] and case["losses_equal"] and case["end_equal"], (rank, case)
        assert case["report"] == {"missing": [], "unexpected": []}


@pytest.mark.parametrize("name, needle", [("bad_shape", "'blocks.0.mlp.fc.weight' has shape (3, 3)"),
                                          ("missing", "lacks 1 parameter(s) of this model: 'ln_f.weight'"),
                                          ("extra", "'not.in.model'")])
def test_bad_weights_are_refused_on_every_rank_naming_the_key(results, name, needle):
    for result in results:
        assert needle in result[name], result[name]
        assert "rank 0" in result[name] and "rank 1" in result[name]
