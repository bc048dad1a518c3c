"""nn.SyncBatchNorm (convert_sync_batchnorm) at every stage on CUDA through NCCL, against DDP + SyncBatchNorm.

SyncBatchNorm has no CPU kernels (torch refuses it there, under DDP and zerokit alike:
tests/distributed/test_model_contract.py); on GPUs it synchronises its batch statistics with its
own collectives inside the forward, which zerokit leaves alone, and the running statistics then
follow the buffer broadcast of `broadcast_buffers=True` as under DDP.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerokit as zk
from common import ConvBlock, bn_batch as batch, bn_net
from zerokit.launch import run_ranks

STEPS = 5
ATOL = 1e-5  # NCCL's ring sums in its own order; one rounding on O(1) weights, as tests/gpu/test_zero3_cuda.py


def _cases(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP
    device = torch.device("cuda", torch.cuda.current_device())
    out = {}
    model = nn.SyncBatchNorm.convert_sync_batchnorm(bn_net()).to(device)
    ddp = DDP(model, device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ddp(*[t.to(device) for t in batch(step, rank)]).backward()
        opt.step()
    out["ddp"] = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    for stage in (0, 1, 2, 3):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(bn_net()).to(device)
        engine = zk.shard(model, torch.optim.SGD, stage=stage, lr=0.1, momentum=0.9, wrap=(ConvBlock,))
        for step in range(STEPS):
            engine.zero_grad()
            engine.backward(engine(*[t.to(device) for t in batch(step, rank)]))
            engine.step()
        out[stage] = {k: v.detach().float().cpu() for k, v in engine.state_dict(full=True).items()}
    return out


@pytest.mark.gpus(2)
def test_sync_batchnorm_matches_ddp_with_sync_batchnorm_at_every_stage(tmp_path):
    for r in run_ranks(_cases, 2, backend="nccl", timeout_s=300, store_dir=str(tmp_path)):
        for stage in (0, 1, 2, 3):
            for k, v in r["ddp"].items():
                torch.testing.assert_close(r[stage][k], v, rtol=0, atol=ATOL, msg=f"stage {stage} {k}")
