"""Optimizers whose update needs a whole parameter, sharded by zerokit exactly as DDP steps them.

    python examples/shaped_optimizers.py                                          # one process, stage 3
    torchrun --standalone --nproc-per-node 2 examples/shaped_optimizers.py 3      # 2 ranks (gloo on CPU)

Two user optimizers of the kind a flat 1-D shard cannot step: `MuonLike` orthogonalizes each 2-D update
(it reads the parameter's shape and multiplies matrices), `LambLike` scales each parameter's Adam step
by its trust ratio ||w|| / ||update|| (norms over the whole parameter). zerokit takes them, as it takes
torch.optim.Adafactor, on its whole-parameter path (zerokit/optim/whole_params.py): each parameter is
stepped whole, in its shape, by one owner rank. The script trains a small GPT with each, beside torch
DDP with the same optimizer over `model.parameters()`, and prints the largest difference: 0.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist


class MuonLike(torch.optim.Optimizer):
    """Momentum, then each 2-D update orthogonalized by 5 Newton-Schulz steps (Muon's idea); others: SGD."""

    def __init__(self, params, lr=1e-2, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                update = buf
                if p.dim() == 2:
                    x = buf / (buf.norm() + 1e-7)
                    for _ in range(5):
                        x = 1.5 * x - 0.5 * x @ x.T @ x
                    update = x * max(1.0, p.shape[0] / p.shape[1]) ** 0.5
                p.add_(update, alpha=-group["lr"])


class LambLike(torch.optim.Optimizer):
    """Adam's direction scaled per parameter by the trust ratio ||w|| / ||update|| (LAMB's idea)."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = state["m"] / (state["v"].sqrt() + group["eps"]) + group["weight_decay"] * p
                w, u = p.norm(), update.norm()
                trust = torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))
                p.add_(update * trust, alpha=-group["lr"])


def main(stage: int) -> None:
    import zerokit as zk
    from zerokit.models import Block, build_model, preset

    rank, world = zk.init_distributed()  # torchrun's env://; without torchrun, world size 1
    cfg = preset("tiny")
    for cls in (MuonLike, LambLike, torch.optim.Adafactor):
        torch.manual_seed(0)
        model = build_model(cfg, seed=0)
        reference = build_model(cfg, seed=0)
        ddp = torch.nn.parallel.DistributedDataParallel(reference) if world > 1 else reference
        torch_opt = cls(reference.parameters(), lr=1e-2)
        engine = zk.shard(model, cls, stage=stage, wrap=(Block,), lr=1e-2)
        for step in range(4):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g)
            for wrapped, opt in ((ddp, torch_opt), (engine, engine.optimizer)):
                opt.zero_grad()
                _logits, loss = wrapped(x, x)
                loss.backward()
                opt.step()
        got, want = engine.state_dict(full=True), reference.state_dict()
        diff = max((got[k] - want[k]).abs().max().item() for k in want)
        print(f"rank {rank}/{world} stage {stage} {cls.__name__}: whole-parameter path "
              f"{engine.optimizer.whole is not None}, max |zerokit - DDP| after 4 steps = {diff:.3g}", flush=True)
        del engine, ddp  # both hold the process group's collectives: gone before it is destroyed
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
