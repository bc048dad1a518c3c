"""Stage 3 on CUDA through NCCL: the side-stream gather path trains like stage 0.

Each case spawns its ranks with `run_ranks(..., backend="nccl")` (a FileStore rendezvous,
one GPU per rank). World size 1 runs wherever one GPU exists: no collective crosses a
process there, but gathers still run on the side stream, synchronised with events, into
storage that is allocated and freed exactly as at N ranks.
"""
from __future__ import annotations

import pytest
import torch

import zerokit as zk
from common import OddBlock, odd_batch, odd_model
from zerokit.commands.step import train_step
from zerokit.launch import run_ranks

STEPS, BATCH = 4, 3
# SGD keeps a difference at the level of one rounding (Adam's m/sqrt(v) can turn a last-bit
# difference of a near-zero gradient into a whole lr-sized step). Stage 0 and stage 3 put
# the same weights at different offsets of different flat buffers, so cuBLAS may pick
# differently aligned kernels, and at 2+ ranks NCCL's ring sums in its own order: both move
# a value by a few ulps. fp32: 1e-5 absolute on O(1) weights, ~100x what that amounts to.
# bf16 (8 mantissa bits): a one-ulp gradient difference is 0.4%, times lr 0.1 -> 1e-3.
ATOL = {"fp32": 1e-5, "bf16": 2e-3}
SGD = dict(lr=0.1, momentum=0.9)


def _train_cuda(rank, world_size, stage, precision, **kw):
    device = torch.device("cuda", torch.cuda.current_device())
    model = odd_model().to(device)
    engine = zk.shard(model, torch.optim.SGD, stage=stage, precision=precision, wrap=(OddBlock,), **kw, **SGD)
    losses = []
    for step in range(STEPS):
        batch = [t.to(device) for t in odd_batch(step, BATCH, rank, world_size)]
        losses.append(train_step(engine, [batch], lambda b: engine(*b)).loss.float())
    torch.cuda.synchronize()
    sd = {k: v.cpu() for k, v in engine.state_dict(full=True).items()}
    return torch.stack(losses).cpu(), sd, engine


def _cuda_cases(rank, world_size):
    torch.cuda.set_device(rank)
    out = {}
    for precision in ("fp32", "bf16"):
        ref_losses, ref_sd, _ = _train_cuda(rank, world_size, 0, precision)
        for prefetch, reshard in ((1, True), (2, False)):
            losses, sd, engine = _train_cuda(rank, world_size, 3, precision, prefetch=prefetch,
                                             reshard_after_forward=reshard)
            assert engine.gather_stream is not None, "CUDA params must gather on the side stream"
            assert engine.unsharded_param_bytes() == 0, "every unit is freed after the step"
            mem = engine.memory()
            out[(precision, prefetch, reshard)] = dict(
                loss_diff=(losses - ref_losses).abs().max().item(),
                param_diff=max((sd[k].float() - ref_sd[k].float()).abs().max().item() for k in ref_sd),
                keys_equal=sd.keys() == ref_sd.keys(),
                shard_bytes=mem["params"],
                expected_shard_bytes=sum(fp.shard_numel for fp in engine.flat_params)
                * engine.param_shards[0].element_size(),
                by_phase=engine.comm.stats_by_phase())
    return out


def _check(results, world_size):
    for rank, res in enumerate(results):
        for (precision, prefetch, reshard), r in res.items():
            where = (world_size, rank, precision, prefetch, reshard)
            assert r["keys_equal"], where
            assert r["loss_diff"] <= ATOL[precision], (where, r["loss_diff"])
            assert r["param_diff"] <= ATOL[precision], (where, r["param_diff"])
            assert r["shard_bytes"] == r["expected_shard_bytes"], where
            if world_size > 1:
                assert r["by_phase"]["forward"]["all_gather"] > 0, where
                assert ("all_gather" in r["by_phase"]["backward"]) == reshard, (where, r["by_phase"])


@pytest.mark.gpus(1)
def test_stage3_on_one_gpu_trains_like_stage0(tmp_path):
    """World size 1 on CUDA (1-rank NCCL group via a FileStore): side-stream gathers, results match stage 0."""
    _check(run_ranks(_cuda_cases, 1, backend="nccl", timeout_s=300, store_dir=str(tmp_path)), 1)


@pytest.mark.gpus(2)
def test_stage3_on_two_gpus_trains_like_stage0(tmp_path):
    """World size 2 over NCCL: gathers on the side stream, reduce-scatters in backward, results match stage 0."""
    _check(run_ranks(_cuda_cases, 2, backend="nccl", timeout_s=300, store_dir=str(tmp_path)), 2)


@pytest.mark.gpus(4)
def test_stage3_on_four_gpus_trains_like_stage0(tmp_path):
    """World size 4 over NCCL, the same cases."""
    _check(run_ranks(_cuda_cases, 4, backend="nccl", timeout_s=300, store_dir=str(tmp_path)), 4)
