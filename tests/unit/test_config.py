"""zk.shard's options: checked once (core/config.py ShardConfig), unknown ones refused by name.

Also the one reduction call every stage makes (core/grads/grad_reduce.py GradReduction), at world
size 1, where a collective is the identity and what is left to check is who owns which buffer.
"""
import dataclasses

import pytest
import torch
from torch import nn

import zerokit as zk
from zerokit.core.collectives.comm import Comm
from zerokit.core.config import ShardConfig
from zerokit.core.grads.grad_reduce import GradReduction
from zerokit.core.precision import make_policy
from zerokit.stages.zero2 import Zero2Engine


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_misspelt_option_is_refused_at_shard_naming_the_option_meant(stage):
    model = _model()
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"'prefetc'.*did you mean 'prefetch'"):
        zk.shard(model, torch.optim.AdamW, stage=stage, lr=1e-3, prefetc=2)
    with pytest.raises(TypeError, match=r"'weight_deca'.*did you mean 'weight_decay'"):
        zk.shard(model, torch.optim.AdamW, stage=stage, weight_deca=0.1)
    # refused before anything was wrapped: the model's parameters are untouched
    assert [p.data_ptr() for p in model.parameters()] == before


def test_an_optimizer_taking_any_keyword_is_not_second_guessed():
    class Loose(torch.optim.SGD):
        def __init__(self, params, lr=0.1, **extra):
            super().__init__(params, lr=lr)
    engine = zk.shard(_model(), Loose, stage=1, lr=0.1, anything=1)
    assert engine.stage == 1


@pytest.mark.parametrize("bad, error", [
    (dict(max_in_flight=-1), ValueError), (dict(max_in_flight=True), ValueError), (dict(prefetch=1.5), ValueError),
    (dict(bucket_numel=0), ValueError), (dict(accumulate="sum"), ValueError), (dict(wrap="Block"), TypeError),
    (dict(param_groups={"lr": 1}), TypeError), (dict(stage=4), ValueError)])
def test_bad_values_are_refused_by_the_config(bad, error):
    with pytest.raises(error):
        ShardConfig(**{"stage": 2, **bad})


def test_the_config_is_frozen_and_stage_constructors_take_no_stray_keywords():
    config = ShardConfig(stage=2, bucket_numel=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bucket_numel = 16
    with pytest.raises(TypeError):
        Zero2Engine(_model(), torch.optim.SGD, dict(lr=0.1), comm=Comm(), policy=make_policy("fp32"), scaler=None,
                    config=config, max_in_flight=3)


def test_reduction_in_the_param_dtype_works_in_place():
    grad = torch.arange(6, dtype=torch.float32)
    r = GradReduction(Comm(), grad, torch.float32, "bucket 0").all_reduce()
    r.wait()
    assert r.result is grad and not r.copied and r.transient == []


def test_reduction_in_another_dtype_owns_its_copy_until_the_average_is_read():
    grad = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    r = GradReduction(Comm(), grad, torch.float32, "bucket 0").all_reduce()
    assert r.copied and r.result.dtype == torch.float32 and r.transient == [r.result]
    r.wait()
    assert r.transient == [r.result]  # stage 0 reads the average from the copy at step
    assert torch.equal(grad, torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16))  # bucket untouched


def test_reduce_scatter_accumulates_into_a_written_grad_shard_and_drops_its_temporaries():
    grad = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    shard = torch.tensor([10.0, 20.0])
    r = GradReduction(Comm(), grad, torch.float32, "bucket 0").reduce_scatter(shard, accumulate=True)
    assert len(r.transient) == 2  # the fp32 copy and the reduce-scatter's own output
    r.wait()
    assert r.result is shard and r.transient == []
    assert torch.equal(shard, torch.tensor([11.0, 22.0]))


def test_default_bucket_by_stage_within_32ki_and_4mi():
    from zerokit.core.config import DEFAULT_BUCKET_NUMEL, MIN_BUCKET_NUMEL, default_bucket_numel

    assert default_bucket_numel(1000, 2) == default_bucket_numel(1000, 0) == MIN_BUCKET_NUMEL  # one bucket, the floor
    assert default_bucket_numel(4_204_801, 2) == 131_401  # Ψ/32, rounded up
    assert default_bucket_numel(4_204_801, 3) == 131_401
    assert default_bucket_numel(4_204_801, 0) == 525_601  # Ψ/8
    assert default_bucket_numel(4_204_801, 1) == 4_194_304  # Ψ, over the cap
    assert default_bucket_numel(124_000_000, 2) == 3_875_000
    assert default_bucket_numel(1 << 30, 2) == DEFAULT_BUCKET_NUMEL
    assert default_bucket_numel(124_000_000, 0) == DEFAULT_BUCKET_NUMEL  # Ψ/8 over the cap
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))  # 2,099,200 params
    model[1].weight.requires_grad_(False)  # frozen params do not count: 1,050,624 trainable
    engine = zk.shard(model, torch.optim.SGD, stage=2, lr=0.1)
    assert engine.config.bucket_numel == default_bucket_numel(1_050_624, 2) == 32_832
    engine = zk.shard(model, torch.optim.SGD, stage=1, lr=0.1)
    assert engine.config.bucket_numel == default_bucket_numel(1_050_624, 1, 1) == 131_328  # one rank: stage 0's
    assert default_bucket_numel(1_050_624, 1, 2) == default_bucket_numel(1_050_624, 1, 4) == 1_050_624
    engine = zk.shard(model, torch.optim.SGD, stage=0, lr=0.1)
    assert engine.config.bucket_numel == default_bucket_numel(1_050_624, 0) == 131_328
    assert zk.shard(torch.nn.Linear(4, 4), torch.optim.SGD, stage=0, bucket_numel=8, lr=0.1).config.bucket_numel == 8


def test_backend_is_nccl_only_with_a_gpu_for_every_local_rank():
    import warnings

    from zerokit import choose_backend

    assert choose_backend(None, 0, 1, 0) == "gloo"
    assert choose_backend(None, 1, 2, 2) == "nccl"
    with pytest.warns(UserWarning, match="2 local ranks but 1 GPU"):
        assert choose_backend(None, 1, 2, 1) == "gloo"  # two ranks on one GPU: NCCL would refuse
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_backend("gloo", 3, 4, 1) == "gloo"  # asked for: no warning
    with pytest.raises(ValueError, match="start at most one rank per GPU, or pass backend='gloo'"):
        choose_backend("nccl", 1, 2, 1)
