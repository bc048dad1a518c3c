"""A plain torch training loop on zerokit: `torchrun --nproc-per-node 2 examples/train_loop.py [stage]`
(gloo on CPU, NCCL on GPUs) or `python examples/train_loop.py [stage]` (one process)."""
import sys

import torch
import torch.distributed as dist

import zerokit as zk

rank, world_size = zk.init_distributed()  # torchrun's env://; without torchrun, world size 1
# NCCL (a GPU per rank; init_distributed set this rank's): the model and batches live there
device = torch.device("cuda") if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
torch.manual_seed(0)  # every rank builds the same model (zk.shard checks they agree)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(device)
stage = int(sys.argv[1]) if len(sys.argv) > 1 else 2
engine = zk.shard(model, torch.optim.AdamW, stage=stage, lr=1e-2)  # wraps model, owns the optimizer

target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1)).to(device)  # the same on every rank
data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
for step in range(60):
    x = torch.randn(32, 16, generator=data).to(device)
    loss = torch.nn.functional.mse_loss(engine(x), x @ target)  # engine(x) runs model(x)
    loss.backward()  # gradients are averaged over ranks during backward
    engine.step()  # the sharded AdamW step
    model.zero_grad()
    if step in (0, 59):
        print(f"rank {rank}/{world_size} stage {stage} step {step} loss {loss.item():.4f}", flush=True)
with engine.summon_full_params():  # stage 3 keeps only a shard of each weight outside it
    print(f"rank {rank} weights {sum(p.double().sum().item() for p in model.parameters()):.10f}", flush=True)
if dist.is_initialized():
    dist.destroy_process_group()
