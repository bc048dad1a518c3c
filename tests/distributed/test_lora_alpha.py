"""LoRA with α ≠ 1 and α ≠ r over an NF4 base, sharded (2 gloo ranks, stages 0 and 3), against two references
that do not go through zerokit's LoRALinear.

Every other LoRA test uses α = 1 and compares zerokit with a DDP model that holds the same `LoRALinear`, so a
wrong scale (1/r, α/r, none) is the same on both sides and passes. Here r = 4, α = 3, and the references are:

* the explicit formula, in plain torch under torch DDP: each adapted layer computes
  F.linear(x, W_q, b) + α · (x Aᵀ) Bᵀ (zerokit's convention, zerokit/lora.py: W + α·B·A, the lecture's,
  with α applied to the r-wide intermediate as zerokit does, so fp32 at 2 ranks is bitwise);
* PEFT's LoraConfig(r, lora_alpha=α·r) on the dequantized base (PEFT scales by lora_alpha / r, so that is
  the same α), under torch DDP: equal within PEFT_RTOL (PEFT scales the d-wide output, zerokit the r-wide
  intermediate: rounding differs in the last bits).

SGD with momentum, so the scale of every gradient reaches the weights unnormalised.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerokit as zk
from common import _build_ddp
from zerokit import quant
from zerokit.launch import run_ranks
from zerokit.models import Block, CharCorpus, build_model

R, ALPHA = 4, 3.0
STEPS, BATCH, SEQ = 4, 2, 16
OPT = dict(lr=0.5, momentum=0.9)
PEFT_RTOL = 1e-4


def base() -> nn.Module:
    model = build_model("tiny", seed=0)
    model.requires_grad_(False)
    zk.quantize(model, "nf4", skip=("lm_head",))
    return model


def zk_model() -> nn.Module:
    model = base()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        zk.lora.inject(model, targets=("q", "v"), rank=R, alpha=ALPHA)
    return model


class Explicit(nn.Module):
    """y = x W_qᵀ + b + α (x Aᵀ) Bᵀ, with W_q decoded once and A, B plain Parameters."""

    def __init__(self, weight, bias, lora_A, lora_B):
        super().__init__()
        self.register_buffer("weight", weight)
        self.bias = bias
        self.lora_A = nn.Parameter(lora_A.detach().clone())
        self.lora_B = nn.Parameter(lora_B.detach().clone())

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_A) * ALPHA, self.lora_B)


def explicit_model() -> nn.Module:
    model = quant.dequantize_(zk_model())
    for name, m in list(zk.lora.lora_modules(model).items()):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, Explicit(m.weight.detach().clone(), m.bias, m.lora_A, m.lora_B))
    return model


def peft_model() -> nn.Module:
    from peft import LoraConfig, get_peft_model
    adapters = {n: m for n, m in zk.lora.lora_modules(zk_model()).items()}
    model = quant.dequantize_(base())  # plain nn.Linear layers holding W_q
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA * R, lora_dropout=0.0, target_modules=["q", "v"]))
    with torch.no_grad():
        for name, m in adapters.items():
            layer = model.base_model.model.get_submodule(name)
            layer.lora_A["default"].weight.copy_(m.lora_A)
            layer.lora_B["default"].weight.copy_(m.lora_B)
    return model


def batch(step, rank, world_size):
    g = torch.Generator().manual_seed(700 + step)
    data = torch.randint(0, CharCorpus.vocab_size, (BATCH * world_size, SEQ + 1), generator=g)
    rows = data[rank * BATCH:(rank + 1) * BATCH]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def adapters_of(state: dict) -> dict:
    """{'<layer>.lora_A': ..., ...} from a zerokit, explicit or PEFT state dict."""
    out = {}
    for k, v in state.items():
        if "lora_" in k:
            k = k.replace("base_model.model.", "").replace(".default.weight", "")
            out[k] = v.detach().float().clone()
    return out


def _torch_run(model, rank, world_size):
    ddp = _build_ddp(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], **OPT)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out = ddp(*batch(step, rank, world_size))
        loss = out[1] if isinstance(out, tuple) else out.loss if hasattr(out, "loss") else out[1]
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "adapters": adapters_of(model.state_dict())}


def _ranks(rank, world_size):
    out = {}
    for stage in (0, 3):
        engine = zk.shard(zk_model(), torch.optim.SGD, stage=stage, wrap=(Block,), **OPT)
        losses = []
        for step in range(STEPS):
            engine.zero_grad()
            loss = engine(*batch(step, rank, world_size))[1]
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        out[stage] = {"losses": torch.stack(losses), "adapters": adapters_of(engine.state_dict(full=True))}
    out["explicit"] = _torch_run(explicit_model(), rank, world_size)
    out["peft"] = _torch_run(peft_model(), rank, world_size)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("peft")
    return run_ranks(_ranks, 2, store_dir=str(tmp_path_factory.mktemp("lora_alpha")), timeout_s=300)


@pytest.mark.parametrize("stage", [0, 3])
def test_lora_alpha_over_nf4_is_the_explicit_formula_bitwise_and_peft_lora_alpha(runs, stage):
    for rank, out in enumerate(runs):
        zk_run, explicit, peft = out[stage], out["explicit"], out["peft"]
        assert sorted(zk_run["adapters"]) == sorted(explicit["adapters"]) == sorted(peft["adapters"])
        assert len(zk_run["adapters"]) == 2 * 2 * 2  # q and v of the tiny GPT's 2 blocks, A and B each
        assert torch.equal(zk_run["losses"], explicit["losses"]), (rank, zk_run["losses"], explicit["losses"])
        for k, v in zk_run["adapters"].items():
            assert torch.equal(v, explicit["adapters"][k]), (rank, k, (v - explicit["adapters"][k]).abs().max())
            torch.testing.assert_close(v, peft["adapters"][k], rtol=PEFT_RTOL, atol=1e-6)
        torch.testing.assert_close(zk_run["losses"], peft["losses"], rtol=PEFT_RTOL, atol=0)
        # the adapters moved: B left zero, so the α-scaled branch shaped the later losses
        assert all(v.abs().max() > 0 for k, v in zk_run["adapters"].items() if k.endswith("lora_B"))
