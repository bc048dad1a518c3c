"""A QLoRA model recorded by zk.deferred_init(), on 2 gloo ranks: NF4 base, LoRA adapters, stage 3 (and 0).

Users write it as they write the eager model (docs/quantization.md), inside the recording:

    with zk.deferred_init():
        model = GPT(cfg)
        model.requires_grad_(False)
        zk.quantize(model, "nf4", skip=("lm_head",))
        zk.lora.inject(model, targets=("q", "v"), rank=4)
    engine = zk.shard(model, torch.optim.AdamW, stage=3, wrap=(Block,))
    engine.load_weights(path)            # optional: each weight quantized as it arrives

zk.quantize on recorded weights records the quantization too (core/params/deferred.py), so zk.shard computes each
weight's packed bytes unit by unit from rank 0's recorded draws. Rank 1 seeds differently on purpose. The
reference is the eager model built after the same seed on every rank, quantized and injected the same way.
Checked: the engines' state (packed bytes, adapters, fp32 masters) equal at the start, bit for bit, and after
2 AdamW steps; with load_weights, equal to the eager model that loaded the same file; zk.quantize called
after the `with` block (some weights computed for real while quantizing) equal as well when every rank seeds
alike, and refused by zk.shard on every rank when they do not.
"""
import os

import torch

import zerokit as zk
from zerokit.launch import run_ranks
from zerokit.models import GPT, Block, preset

from common import train_on_tokens


def _qlora(build: str, seed: int, weights: dict | None = None) -> torch.nn.Module:
    """The tiny GPT, frozen, NF4 (tied head skipped), LoRA on q and v: eager, recorded whole ("deferred") or
    recorded with zk.quantize and inject after the `with` block ("quantize_after")."""
    torch.manual_seed(seed)

    def quantize_and_inject(model):
        model.requires_grad_(False)
        zk.quantize(model, "nf4", skip=("lm_head",))
        zk.lora.inject(model, targets=("q", "v"), rank=4)

    if build == "eager":
        model = GPT(preset("tiny"))
        if weights is not None:
            model.load_state_dict(weights)
        quantize_and_inject(model)
    elif build == "deferred":
        with zk.deferred_init():
            model = GPT(preset("tiny"))
            quantize_and_inject(model)
    else:
        with zk.deferred_init():
            model = GPT(preset("tiny"))
        quantize_and_inject(model)
    return model


def _state(engine) -> dict:
    return {**{k: v.clone() for k, v in engine.state_dict().items()},
            **{f"master{i}": m.detach().clone() for i, m in enumerate(engine.optimizer.master_shards)}}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _cases(rank: int, world_size: int, root: str) -> dict:
    from safetensors.torch import save_file

    torch.manual_seed(5)
    weights = {k: v.clone() for k, v in GPT(preset("tiny")).state_dict().items()}
    path = os.path.join(root, "weights.safetensors")
    if rank == 0:
        save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, path)  # the tie, once
    torch.distributed.barrier()
    out = {}

    def run(stage, precision, build, seed, load=False):
        kw = dict(stage=stage, precision=precision, wrap=(Block,), lr=1e-2)
        reference = zk.shard(_qlora("eager", 0, weights if load else None), torch.optim.AdamW, **kw)
        engine = zk.shard(_qlora(build, seed), torch.optim.AdamW, **kw)
        if load:
            engine.load_weights(path)
        start = _equal(_state(reference), _state(engine))
        packed = sum(k.endswith("weight_quant") for k in engine.state_dict())
        losses = [train_on_tokens(e, 2, 20 + rank, 64) for e in (reference, engine)]
        return dict(start=start, end=_equal(_state(reference), _state(engine)), losses=losses[0] == losses[1],
                    packed=packed)

    for stage in (0, 1, 2, 3):
        out[("deferred", stage, "fp32")] = run(stage, "fp32", "deferred", seed=rank)
    out[("deferred", 3, "bf16")] = run(3, "bf16", "deferred", seed=rank)
    for stage in (0, 3):
        out[("load_weights", stage)] = run(stage, "fp32", "deferred", seed=rank, load=True)
    out[("quantize_after", 3)] = run(3, "fp32", "quantize_after", seed=0)
    try:
        zk.shard(_qlora("quantize_after", seed=rank), torch.optim.AdamW, stage=3, wrap=(Block,), lr=1e-2)
        out["rank_seeds_after"] = None
    except ValueError as exc:
        out["rank_seeds_after"] = str(exc)
    return out


def test_deferred_qlora_equals_the_eager_model_on_two_ranks(tmp_path):
    results = run_ranks(_cases, 2, str(tmp_path))
    for rank, res in enumerate(results):
        for case, got in res.items():
            if case == "rank_seeds_after":
                assert got is not None and "differs between ranks" in got and "quantize inside the block" in got, \
                    (rank, got)
                continue
            assert got["packed"] > 0, (rank, case)
            assert got["start"] and got["end"] and got["losses"], (rank, case, got)
