"""examples/train_loop.py made resumable: it commits a checkpoint every 10 steps, stops on SIGTERM or SIGUSR1
(a preemption) after saving, and a rerun of the same command continues from the last commit:
`torchrun --nproc-per-node 2 examples/resumable_loop.py DIR` or `python examples/resumable_loop.py DIR`.
Every step's data is a function of the step, so a resumed run trains on what the run never stopped would."""
import hashlib
import os
import sys

import torch

import zerokit as zk

rank, world_size = zk.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
engine = zk.shard(model, torch.optim.AdamW, stage=2, lr=1e-2)
target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
ckpt = sys.argv[1] if len(sys.argv) > 1 else "ckpt"

first = 0
if os.path.exists(os.path.join(ckpt, "current.json")):  # a committed checkpoint: resume from it
    first = engine.load(ckpt)["extra"]["step"]
for step in range(first, 60):
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * step + rank))  # data by step
    torch.nn.functional.mse_loss(engine(x), x @ target).backward()
    engine.step()
    model.zero_grad()
    stop = engine.stop_requested()  # the same answer on every rank, once any rank was signalled
    if stop or (step + 1) % 10 == 0:
        engine.save(ckpt, extra={"step": step + 1})  # atomic: the previous commit until this one is complete
    if stop:
        print(f"rank {rank}: stopped after step {step + 1}, saved", flush=True)
        sys.exit(75)  # rerun the same command to continue

weights = engine.state_dict(full=True)
digest = hashlib.sha256(b"".join(weights[k].numpy().tobytes() for k in sorted(weights))).hexdigest()
print(f"rank {rank} weights sha256 {digest}", flush=True)
