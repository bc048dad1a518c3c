"""A meta-built or deferred-recorded model on 2 gloo ranks: rank 0's eager values on every rank, then training as
from the eager model.

Rank 1 seeds differently on purpose: an eager model's values are broadcast from rank 0, a meta-built one's
are computed on every rank from rank 0's generator state (core/params/materialize.py), and a recorded one's
(zk.deferred_init, core/params/deferred.py) from rank 0's recorded generator states, so all start from rank 0's
eager bits. Then 3 AdamW steps at every stage equal the same stage's steps from the eager model, bit for bit
(which tests/distributed/test_zero12.py and test_zero3.py tie to DDP). An init that differs between ranks is
refused on every rank, as is a recording that differs between ranks.
"""
import pytest
import torch
from torch import nn

import zerokit as zk
from zerokit.launch import run_ranks
from zerokit.models import GPT, Block, preset

from common import train_on_tokens

STEPS = 3


def _train(rank: int, stage: int, build: str) -> tuple[list[float], dict]:
    torch.manual_seed(0 if build == "eager" else rank)  # meta, deferred: rank 1's own seed must not matter
    with {"eager": torch.device("cpu"), "meta": torch.device("meta"), "deferred": zk.deferred_init()}[build]:
        model = GPT(preset("tiny"))
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, wrap=(Block,), lr=1e-2,
                      param_init_fn=GPT._init_weights if build == "meta" else None)
    start = {k: v.clone() for k, v in engine.state_dict().items()}
    losses = train_on_tokens(engine, STEPS, seed=10 + rank, vocab=model.cfg.vocab_size)
    return losses, start, {k: v.clone() for k, v in engine.state_dict().items()}


def _rank_dependent_init(rank: int) -> str:
    def init(m):
        if isinstance(m, nn.Linear) and rank == 1:
            nn.init.zeros_(m.weight)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(preset("tiny"))
    try:
        zk.shard(model, torch.optim.SGD, stage=3, wrap=(Block,), lr=0.1, param_init_fn=init)
    except ValueError as exc:
        return str(exc)
    return "not refused"


def _rank_dependent_recording(rank: int) -> str:
    torch.manual_seed(0)
    with zk.deferred_init():
        model = GPT(preset("tiny"))
        model.lm_head.weight.data[0].fill_(float(rank))
    try:
        zk.shard(model, torch.optim.SGD, stage=3, wrap=(Block,), lr=0.1)
    except ValueError as exc:
        return str(exc)
    return "not refused"


def _hf_llama_start(rank: int) -> bool:
    """HF Llama recorded under a rank's own seed starts from rank 0's eager build (stage 3)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(cfg).state_dict()
    torch.manual_seed(rank)
    with zk.deferred_init():
        model = transformers.LlamaForCausalLM(cfg)
    engine = zk.shard(model, torch.optim.AdamW, stage=3, wrap=(type(model.model.layers[0]),), lr=1e-3)
    got = engine.state_dict()
    return sorted(got) == sorted(reference) and all(torch.equal(got[k], v) for k, v in reference.items())


def _cases(rank: int, world_size: int) -> dict:
    out = {}
    torch.manual_seed(0)
    reference = {k: v.clone() for k, v in GPT(preset("tiny")).state_dict().items()}  # rank 0's eager build
    for stage in (0, 1, 2, 3):
        eager = _train(rank, stage, "eager")
        for build in ("meta", "deferred"):
            other = _train(rank, stage, build)
            out[stage, build] = dict(
                start_is_rank0_eager=all(torch.equal(other[1][k], v) for k, v in reference.items()),
                losses_equal=eager[0] == other[0],
                end_equal=all(torch.equal(eager[2][k], other[2][k]) for k in eager[2]))
    out["refusal"] = _rank_dependent_init(rank)
    out["recording refusal"] = _rank_dependent_recording(rank)
    out["hf llama"] = _hf_llama_start(rank)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_cases, 2, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=240)


@pytest.mark.parametrize("build", ["meta", "deferred"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_meta_build_starts_from_rank0_and_trains_as_eager(results, stage, build):
    for rank, result in enumerate(results):
        assert result[stage, build] == dict(start_is_rank0_eager=True, losses_equal=True, end_equal=True), \
            (rank, stage, build)


def test_deferred_hf_llama_starts_from_rank0_eager(results):
    assert [r["hf llama"] for r in results] == [True, True]


def test_recording_that_differs_between_ranks_is_refused_on_every_rank(results):
    for result in results:
        assert "differs between ranks" in result["recording refusal"], result["recording refusal"]


def test_rank_dependent_init_is_refused_on_every_rank(results):
    for result in results:
        assert "the meta-device initialization differs between ranks" in result["refusal"], result["refusal"]
