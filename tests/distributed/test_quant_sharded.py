"""A quantized frozen base (NF4, int8) under LoRA at every ZeRO stage, against the dequantized torch DDP reference.

The tiny GPT is frozen, every Linear but the tied head quantized (`zk.quantize`), LoRA adapters
injected on q and v. The reference is the same model with each quantized weight replaced by its
dequantized value W_q (`zerokit.quant.dequantize_`: float layers computing F.linear(x, W_q, b)),
trained by torch's DistributedDataParallel with AdamW on the adapters. One spawn per world size
(2, then 3) runs every case:

* parity: nf4 and int8, stages 0-3, fp32 and bf16, 5 steps: the adapters after 5 steps. fp32 at 2
  ranks equals torch DDP bit for bit (a sum of two gradients has one order); at 3 ranks gloo's
  all-reduce adds in its own order, so within DDP_ATOL there, and stages 1-3 equal stage 0 bit for
  bit at every world size and precision; bf16 stages 1-3 equal bf16 stage 0 bit for bit, and bf16
  stays within BF16_ATOL of the fp32 reference;
* memory: `engine.memory()` by category, quantized_params apart, equals `zk.estimate(...,
  quantize=...)` up to padding (less than N elements per flat buffer), for nf4, int8 and the
  unquantized LoRA model;
* communication: stage 3's all-gather bytes per step, from the ledger, equal the sum of what the
  units gather (quantized bytes for the base), and the nf4 / unquantized ratio;
* no gradient, master or optimizer state for the base; the packed bytes unchanged by training;
* activation checkpointing, no_sync accumulation and clipping at stages 2 and 3 (fp32 bitwise
  against DDP at 2 ranks), fp16 at stage 3;
* Hugging Face GPT-2 (Conv1D) and Llama, quantized + zk.lora.inject, every stage, fp32, bitwise
  against the dequantized DDP reference at 2 ranks;
* checkpoints: saved at stage 3 by 2 ranks, loaded at stage 1 by 3 ranks, equal; the quantized base
  stored once, as uint8 bytes in model.safetensors (no rank-file pieces); an unquantized LoRA model
  or an int8 model loading the nf4 checkpoint is refused naming the layer.
"""
from __future__ import annotations

import copy
import os
import traceback

import pytest
import torch
from safetensors import safe_open

import zerokit as zk
from common import _build_ddp
from zerokit import quant
from zerokit.core.accounting.estimate import estimate
from zerokit.launch import run_ranks
from zerokit.models import Block, CharCorpus, build_model

STAGES = (0, 1, 2, 3)
FORMATS = ("nf4", "int8")
PRECISIONS = ("fp32", "bf16")
STEPS, BATCH, SEQ, LR = 5, 2, 16, 1e-2
# 3 ranks: torch DDP's gloo all-reduce adds three gradients in its own order, zerokit in rank order:
# last-bit differences, which AdamW turns into O(1e-7) relative changes of an O(lr) update.
DDP_ATOL = 1e-5
# bf16 against the fp32 reference, as the distance between the two runs' adapter updates relative to the
# reference's update: bf16 weights, activations and gradients flip the sign of Adam's step wherever a
# gradient is near zero. A wrong dequantization, a missing 1/N or a skipped reduction gives an update
# of another direction: a relative distance near 1 or above.
BF16_RTOL = 0.25


def qlora_gpt(fmt: str | None, checkpointing: bool = False) -> torch.nn.Module:
    """The tiny GPT, frozen, quantized (unless fmt is None) but the tied head, adapters on q and v."""
    model = build_model("tiny", seed=0)
    model.requires_grad_(False)
    if fmt is not None:
        zk.quantize(model, fmt, skip=("lm_head",))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        zk.lora.inject(model, targets=("q", "v"), rank=8, alpha=1.0)
    model.checkpointing = checkpointing
    return model


def token_batch(step: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(500 + step)
    data = torch.randint(0, CharCorpus.vocab_size, (BATCH * world_size, SEQ + 1), generator=g)
    rows = data[rank * BATCH:(rank + 1) * BATCH]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def adapters(state: dict) -> dict:
    return {k: v.detach().float().clone() for k, v in state.items() if "lora_" in k}


def counts(model) -> dict:
    """Ψ (quantized weights by element), Ψ_t, and each quantized weight's element count."""
    mods = {id(m): m for m in quant.quantized_modules(model).values()}
    q = [m.spec.numel for m in mods.values()]
    floats = [p for p in model.parameters() if p.is_floating_point()]
    return {"psi": sum(p.numel() for p in floats) + sum(q), "psi_t": sum(p.numel() for p in floats if p.requires_grad),
            "quantized": q}


# ---------------------------------------------------------------------------- in the ranks
def _zk_case(rank, world_size, fmt, stage, precision, accumulate=1, clip=None, checkpointing=False):
    model = qlora_gpt(fmt, checkpointing)
    info = counts(model)
    packed_before = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("weight_quant")}
    local = {"accumulate": "local"} if stage == 2 and accumulate > 1 else {}  # stage 2: DDP's order of sums
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, lr=LR, wrap=(Block,), **local)
    losses, gathered = [], 0
    for step in range(STEPS):
        before = engine.comm_stats()["all_gather"]
        engine.zero_grad()
        for micro in range(accumulate):
            x, y = token_batch(step * accumulate + micro, rank, world_size)
            if micro < accumulate - 1:
                with engine.no_sync():
                    engine.backward(engine(x, y)[1] / accumulate)
            else:
                _, loss = engine(x, y)
                engine.backward(loss / accumulate if accumulate > 1 else loss)
        if clip is not None:
            engine.clip_grad_norm_(clip)
        engine.step()
        gathered = engine.comm_stats()["all_gather"] - before
        losses.append(loss.detach().float())
    full = engine.state_dict(full=True)
    out = {"adapters": adapters(full), "losses": torch.stack(losses), "memory": engine.memory(), **info,
           "gathered_per_step": gathered,
           "packed_unchanged": all(torch.equal(full[k], v) for k, v in packed_before.items()),
           "frozen_with_grad": [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None],
           "flat": [(fp.padded_numel, fp.dtype.itemsize, fp.requires_grad, fp.dtype == torch.uint8)
                    for fp in engine.flat_params]}
    if stage == 3:  # what the units gather per step: every unit in forward, all but the root again in backward
        out["unit_gather_bytes"] = sum(fp.padded_numel * fp.dtype.itemsize * (1 if unit.is_root else 2)
                                       for unit in engine.units for fp in unit.flat_params)
    return out, engine


def _ddp_case(rank, world_size, fmt, accumulate=1, clip=None, checkpointing=False):
    model = quant.dequantize_(qlora_gpt(fmt, checkpointing))
    init = adapters(model.state_dict())
    ddp = _build_ddp(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            x, y = token_batch(step * accumulate + micro, rank, world_size)
            if micro < accumulate - 1:
                with ddp.no_sync():
                    (ddp(x, y)[1] / accumulate).backward()
            else:
                _, loss = ddp(x, y)
                (loss / accumulate if accumulate > 1 else loss).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        losses.append(loss.detach().float())
    return {"adapters": adapters(model.state_dict()), "losses": torch.stack(losses), "init": init}


def _guarded(fn, *args, **kwargs):
    try:
        return {"ok": fn(*args, **kwargs)}
    except Exception:
        return {"error": traceback.format_exc()}


def _hf(kind):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=16, n_embd=24, n_layer=2, n_head=2,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        targets = ("c_attn",)
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                             tie_word_embeddings=False))
        targets = ("q_proj", "v_proj")
    model.requires_grad_(False)
    zk.quantize(model, "nf4", skip=("lm_head",))
    torch.manual_seed(1)
    zk.lora.inject(model, targets=targets, rank=4)
    return model


def _hf_case(rank, world_size, kind, stage):
    model = _hf(kind) if stage is not None else quant.dequantize_(_hf(kind))
    if stage is None:
        run = _build_ddp(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    else:
        blocks = tuple({type(m) for m in model.modules() if type(m).__name__ in ("GPT2Block", "LlamaDecoderLayer")})
        run = opt = zk.shard(model, torch.optim.AdamW, stage=stage, wrap=blocks, lr=LR)
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, 61, (2 * world_size, 12), generator=g)[rank * 2:(rank + 1) * 2]
        model.zero_grad()
        run(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return adapters(model.state_dict() if stage is None else opt.state_dict(full=True))


def _checkpoint_save(rank, world_size, directory):
    _, engine = _zk_case(rank, world_size, "nf4", 3, "fp32")
    engine.save(directory)
    return adapters(engine.state_dict(full=True))


def _checkpoint_load(rank, world_size, directory, fmt):
    model = qlora_gpt(fmt)
    engine = zk.shard(model, torch.optim.AdamW, stage=1, lr=LR, wrap=(Block,))
    try:
        engine.load(directory)
    except ValueError as exc:
        return str(exc)
    full = engine.state_dict(full=True)
    x, y = token_batch(0, rank, world_size)
    _, loss = engine(x, y)  # the loaded model runs
    return {"adapters": adapters(full), "packed": {k: v for k, v in full.items() if k.endswith("weight_quant")},
            "loss": loss.detach()}


def _cases(rank, world_size, root):
    out = {}
    for fmt in FORMATS + (None,):
        for precision in PRECISIONS:
            for stage in STAGES:
                if fmt is None and precision == "bf16":
                    continue
                out[("zk", fmt, precision, stage)] = _guarded(lambda *a: _zk_case(*a)[0], rank, world_size, fmt,
                                                              stage, precision)
    for fmt in FORMATS:
        out[("ddp", fmt)] = _guarded(_ddp_case, rank, world_size, fmt)
    if world_size == 2:
        for stage in (2, 3):  # activation checkpointing, no_sync accumulation, clipping
            out[("acc", stage)] = _guarded(lambda *a, **k: _zk_case(*a, **k)[0], rank, world_size, "nf4", stage,
                                           "fp32", accumulate=2, clip=0.05, checkpointing=True)
        out[("acc", "ddp")] = _guarded(_ddp_case, rank, world_size, "nf4", accumulate=2, clip=0.05, checkpointing=True)
        out[("fp16",)] = _guarded(lambda *a: _zk_case(*a)[0], rank, world_size, "nf4", 3, "fp16")
        for kind in ("gpt2", "llama"):
            for stage in (None,) + STAGES:
                out[("hf", kind, stage)] = _guarded(_hf_case, rank, world_size, kind, stage)
        out[("save",)] = _guarded(_checkpoint_save, rank, world_size, os.path.join(root, "ckpt"))
    else:
        for fmt in ("nf4", "int8", None):
            out[("load", fmt)] = _guarded(_checkpoint_load, rank, world_size, os.path.join(root, "ckpt"), fmt)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("quant"))


@pytest.fixture(scope="module")
def ws2(root):
    return run_ranks(_cases, 2, root, store_dir=root, timeout_s=300)


@pytest.fixture(scope="module")
def ws3(root, ws2):  # loads the checkpoint ws2 saved
    return run_ranks(_cases, 3, root, store_dir=root, timeout_s=300)


def ok(results, key):
    found = []
    for rank, res in enumerate(results):
        r = res[key]
        if "error" in r:
            pytest.fail(f"{key} failed on rank {rank}:\n{r['error']}", pytrace=False)
        found.append(r["ok"])
    return found


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def update_distance(run: dict, ref: dict) -> float:
    """||Δ_run - Δ_ref|| / ||Δ_ref|| over every adapter, Δ the change from the initial adapters."""
    num = sum(((run[k] - ref["adapters"][k]) ** 2).sum() for k in run)
    den = sum(((ref["adapters"][k] - ref["init"][k]) ** 2).sum() for k in run)
    return float((num / den).sqrt())


# ---------------------------------------------------------------------------- the claims
@pytest.mark.parametrize("world", ["ws2", "ws3"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_lora_trains_like_the_dequantized_ddp_reference(world, fmt, request):
    """Adapters after 5 steps: fp32 bitwise to DDP at 2 ranks (DDP_ATOL at 3); every stage bitwise to stage 0."""
    results = request.getfixturevalue(world)
    n = len(results)
    ref = ok(results, ("ddp", fmt))
    for precision in PRECISIONS:
        base = ok(results, ("zk", fmt, precision, 0))
        for stage in STAGES:
            runs = ok(results, ("zk", fmt, precision, stage))
            for rank, (r, b, d) in enumerate(zip(runs, base, ref)):
                assert max_diff(r["adapters"], b["adapters"]) == 0, (precision, stage, rank)
                diff = max_diff(r["adapters"], d["adapters"])
                if precision == "fp32":
                    assert diff == 0 if n == 2 else diff <= DDP_ATOL, (stage, rank, diff)
                else:
                    assert update_distance(r["adapters"], d) <= BF16_RTOL, (stage, rank, diff)
                assert diff >= 0 and max_diff(r["adapters"], {k: v * 0 for k, v in r["adapters"].items()}) > 0
                assert r["packed_unchanged"] and r["frozen_with_grad"] == [], (stage, rank)


@pytest.mark.parametrize("world", ["ws2", "ws3"])
def test_memory_by_category_is_the_formula_up_to_padding(world, request):
    """engine.memory() (quantized_params apart) == zk.estimate(..., quantize=...) within N - 1 elements per buffer."""
    results = request.getfixturevalue(world)
    n = len(results)
    for fmt in FORMATS + (None,):
        for precision in ("fp32", "bf16") if fmt else ("fp32",):
            for stage in STAGES:
                for rank, r in enumerate(ok(results, ("zk", fmt, precision, stage))):
                    est = estimate(r["psi"], n, stage, precision, "adamw", trainable_params=r["psi_t"],
                                   quantize=fmt, quantized_params=r["quantized"] or None).as_dict()
                    measured = {k: v for k, v in r["memory"].items() if k in est}
                    assert ("quantized_params" in r["memory"]) == (fmt is not None)
                    slack = len(r["flat"]) * (n - 1) * 4
                    for category, bytes_ in est.items():
                        if category == "activations":
                            continue
                        assert abs(measured.get(category, 0) - bytes_) <= slack, (fmt, precision, stage, rank,
                                                                                  category, measured, est)
                    assert r["memory"]["optimizer_states"] > 0 and r["memory"].get("quantized_params", 1) > 0


def test_stage3_gathers_the_quantized_bytes(ws2):
    """The ledger's all-gather bytes per step are what the units hold (bytes for the base): nf4 < int8 < bf16."""
    per_step = {}
    for fmt in FORMATS + (None,):
        for rank, r in enumerate(ok(ws2, ("zk", fmt, "fp32", 3))):
            assert r["gathered_per_step"] == r["unit_gather_bytes"], (fmt, rank)
        per_step[fmt] = ok(ws2, ("zk", fmt, "fp32", 3))[0]["gathered_per_step"]
    bf16 = ok(ws2, ("zk", "nf4", "bf16", 3))[0]["gathered_per_step"]
    assert per_step["nf4"] < per_step["int8"] < per_step[None]
    assert bf16 < per_step["nf4"]  # the float parts in 2 bytes, the base's bytes unchanged


def test_checkpointing_no_sync_clipping_and_fp16(ws2):
    ref = ok(ws2, ("acc", "ddp"))
    for stage in (2, 3):
        for r, d in zip(ok(ws2, ("acc", stage)), ref):
            assert max_diff(r["adapters"], d["adapters"]) == 0, stage
            assert torch.equal(r["losses"], d["losses"]), stage
    for r in ok(ws2, ("fp16",)):
        assert torch.isfinite(r["losses"]).all() and r["packed_unchanged"]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_models_quantized_with_zk_lora_train_like_the_dequantized_ddp_reference(ws2, kind):
    ref = ok(ws2, ("hf", kind, None))
    for stage in STAGES:
        for rank, (r, d) in enumerate(zip(ok(ws2, ("hf", kind, stage)), ref)):
            assert r and max_diff(r, d) == 0, (kind, stage, rank)


def test_a_quantized_checkpoint_loads_at_another_world_size_and_stage_and_refuses_a_mismatch(ws2, ws3, root):
    saved = ok(ws2, ("save",))[0]
    for r in ok(ws3, ("load", "nf4")):
        assert isinstance(r, dict), r
        assert max_diff(r["adapters"], saved) == 0
        assert all(v.dtype == torch.uint8 for v in r["packed"].values()) and r["packed"]
    for fmt, says in (("int8", "quantized as nf4 block 64 double-quant 32x32 in the checkpoint and as int8"),
                      (None, "is quantized in the checkpoint and not in this model")):
        for msg in ok(ws3, ("load", fmt)):
            assert isinstance(msg, str) and "'blocks.0.attn" in msg and says in msg, (fmt, msg)
    (snapshot,) = [d for d in os.listdir(os.path.join(root, "ckpt")) if d.startswith("ckpt-")]
    with safe_open(os.path.join(root, "ckpt", snapshot, "model.safetensors"), framework="pt") as f:
        packed = [k for k in f.keys() if k.endswith("weight_quant")]
        assert packed and all(f.get_tensor(k).dtype == torch.uint8 for k in packed)
        assert not any(k.endswith(".q.weight") for k in f.keys())
    for name in os.listdir(os.path.join(root, "ckpt", snapshot)):
        if name.startswith("rank"):
            with safe_open(os.path.join(root, "ckpt", snapshot, name), framework="pt") as f:
                assert not any("weight_quant" in k for k in f.keys()), name
