"""zerokit/quant.py without a process group: NF4 against the paper's definition, int8, the layer, refusals.

The NF4 check rebuilds everything independently of zerokit and of torch's special functions: the
16 levels from Python's statistics.NormalDist quantiles (QLoRA's construction), each block's
absmax, each element's nearest level by a linear search, two codes per byte with the first in the
high nibble; and compares with the levels bitsandbytes publishes.
"""
from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerokit as zk
from zerokit import quant
from zerokit.core.accounting.estimate import estimate, quantized_weight_bytes

# bitsandbytes' NF4 table (functional.py), the values QLoRA's kernels use.
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]


def paper_levels() -> list[float]:
    """QLoRA's NF4: 8 positive quantiles of N(0,1) at 9 points from 0.9677 to 1/2, 7 negative at 8, a zero."""
    def probs(count):
        return [0.9677083 + (0.5 - 0.9677083) * i / (count - 1) for i in range(count - 1)]
    nd = statistics.NormalDist()
    values = sorted([nd.inv_cdf(p) for p in probs(9)] + [0.0] + [-nd.inv_cdf(p) for p in probs(8)])
    return [v / max(values) for v in values]


def paper_codes(w: list[float], block: int, levels: list[float]) -> list[int]:
    """Packed NF4 bytes by the definition: per block, x / absmax, the nearest level's index, two per byte."""
    codes = []
    for b in range(0, len(w), block):
        chunk = w[b:b + block]
        absmax = max(abs(v) for v in chunk)
        for v in chunk:
            x = v / absmax
            codes.append(min(range(16), key=lambda i: abs(x - levels[i])))
    return [(codes[i] << 4) | codes[i + 1] for i in range(0, len(codes), 2)]


def test_nf4_levels_are_the_papers_and_the_published_table():
    mine = quant.nf4_levels().tolist()
    assert mine == PUBLISHED_NF4  # bit for bit
    assert max(abs(a - b) for a, b in zip(mine, paper_levels())) < 1e-6
    assert mine[7] == 0.0 and mine[0] == -1.0 and mine[-1] == 1.0


@pytest.mark.parametrize("double_quant", [False, True])
def test_an_independent_nf4_finds_the_same_codes(double_quant):
    w = torch.randn(16, 48, generator=torch.Generator().manual_seed(0))  # 12 blocks of 64
    spec = quant.QuantSpec("nf4", (16, 48), 64, double_quant)
    packed = quant.quantize_tensor(w, spec)
    lo, hi = spec.parts()["codes"]
    assert packed[lo:hi].tolist() == paper_codes(w.reshape(-1).tolist(), 64, PUBLISHED_NF4)


def test_dequantization_is_level_times_absmax_exactly():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    for fmt in quant.FORMATS:
        spec = quant.QuantSpec(fmt, (8, 64), 32, double_quant=False)
        wq = quant.dequantize_tensor(quant.quantize_tensor(w, spec), spec)
        blocks = w.reshape(-1, 32)
        absmax = blocks.abs().amax(1, keepdim=True)
        if fmt == "nf4":
            levels = quant.nf4_levels()
            idx = (blocks / absmax - levels[:, None, None]).abs().argmin(0)
            expected = levels[idx] * absmax
        else:
            expected = torch.round(blocks / absmax * 127) / 127 * absmax
        assert torch.equal(wq.reshape(-1, 32), expected), fmt
    # double quantization: the absmax constants come back within half an 8-bit step of their block's range
    spec = quant.QuantSpec("nf4", (8, 64), 2, double_quant=True)  # 256 constants: one second-level block
    absmax = w.reshape(-1, 2).abs().amax(1)
    stored = quant.absmax_of(quant.quantize_tensor(w, spec), spec)
    assert (stored - absmax).abs().max() <= (absmax - absmax.mean()).abs().max() / 254 * 1.0001


def test_packed_sizes_match_the_formula_and_bytes_per_element():
    for fmt in quant.FORMATS:
        for dq in (False, True):
            for shape in [(64, 64), (96, 384), (3, 64)]:
                spec = quant.QuantSpec(fmt, shape, 64, dq)
                packed = quant.quantize_tensor(torch.randn(shape), spec)
                assert packed.numel() == spec.nbytes == quantized_weight_bytes(spec.numel, fmt, 64, dq)
    assert quant.bytes_per_element("nf4") == 0.5 + (1 + 4 / 256) / 64  # 0.5159...
    assert quant.bytes_per_element("nf4", double_quant=False) == 0.5625
    assert quant.bytes_per_element("int8") == 1 + (1 + 4 / 256) / 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_input_gradient_equal_a_linear_holding_w_q(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(64, 32).requires_grad_(False)
    model = nn.Sequential(lin)
    zk.quantize(model, "nf4")
    wq = zk.dequantized_state_dict(model)["0.weight"]
    ref = nn.Linear(64, 32).requires_grad_(False)
    ref.load_state_dict({"weight": wq, "bias": lin.bias})
    model.to(dtype), ref.to(dtype)
    model[0].bias.requires_grad_(True)  # another trainable parameter: the bias of a quantized layer
    ref.bias.requires_grad_(True)
    x1 = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    y1, y2 = model(x1), ref(x2)
    assert torch.equal(y1, y2)
    g = torch.randn_like(y1)
    y1.backward(g), y2.backward(g)
    assert torch.equal(x1.grad, x2.grad)
    torch.testing.assert_close(model[0].bias.grad, ref.bias.grad)


def test_the_dequantized_weight_is_not_saved_for_backward():
    model = nn.Sequential(nn.Linear(256, 256)).requires_grad_(False)
    zk.quantize(model, "nf4")
    saved = []
    x = torch.randn(4, 256, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(x)
    assert [t.dtype for t in saved] == [torch.uint8]  # the packed bytes only


def test_refusals_name_the_layer():
    def frozen():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3)).requires_grad_(False)
    with pytest.raises(ValueError, match="unknown quantization format 'nf8'"):
        zk.quantize(frozen(), "nf8")
    with pytest.raises(ValueError, match=r"0.weight is trainable"):
        zk.quantize(nn.Sequential(nn.Linear(64, 64)), "nf4")
    with pytest.raises(ValueError, match=r"2.weight has 192 elements \(3, 64\), not a multiple of block_size=64|"
                                         r"not a multiple of block_size=128"):
        zk.quantize(frozen(), "int8", block_size=128)
    model = frozen()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="not a multiple of block_size=128"):
        zk.quantize(model, "nf4", block_size=128)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing changed
    with pytest.raises(ValueError, match="block_size must be an even int"):
        zk.quantize(frozen(), "nf4", block_size=63)
    tied = frozen()
    tied[2].weight = nn.Parameter(torch.zeros(64, 64), requires_grad=False)
    tied[0].weight = tied[2].weight
    with pytest.raises(ValueError, match="tied to 2"):
        zk.quantize(tied, "nf4", targets=("0",))
    injected = frozen()
    zk.lora.inject(injected, targets=("0",))
    with pytest.raises(ValueError, match="quantize first, then zk.lora.inject"):
        zk.quantize(injected, "nf4")


def test_lora_over_a_quantized_base_and_what_it_refuses():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).requires_grad_(False)
    assert zk.quantize(model, "int8", targets=("0",)) == ["0"]
    assert zk.lora.inject(model, targets=("0", "1"), rank=4) == ["0", "1"]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["0.lora_A", "0.lora_B", "1.lora_A",
                                                                           "1.lora_B"]
    assert model[0].weight_quant.dtype == torch.uint8 and model[0].lora_A.dtype == torch.float32
    with pytest.raises(ValueError, match="cannot merge into a quantized base"):
        zk.lora.merge(model)


def test_peft_lora_on_a_zk_quantized_model_is_refused_by_peft_with_a_message():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=16, n_embd=24, n_layer=1, n_head=2))
    model.requires_grad_(False)
    zk.quantize(model, "nf4", skip=("lm_head",))
    with pytest.raises(ValueError, match="Target module QuantLinear.* is not supported"):
        get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"]))


def test_dequantized_state_dict_exports_into_the_unquantized_model_conv1d_included():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=61, n_positions=16, n_embd=24, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    original = GPT2LMHeadModel(config).requires_grad_(False)
    model = GPT2LMHeadModel(config).requires_grad_(False)
    model.load_state_dict(original.state_dict())
    names = zk.quantize(model, "nf4", skip=("lm_head",))
    assert names == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
                     "transformer.h.0.mlp.c_proj"]
    exported = zk.dequantized_state_dict(model)
    assert set(exported) == set(original.state_dict())
    assert exported["transformer.h.0.attn.c_attn.weight"].shape == (24, 72)  # Conv1D's (in, out)
    original.load_state_dict(exported)
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)
    error = (exported["transformer.h.0.mlp.c_fc.weight"] - original.state_dict()["transformer.h.0.mlp.c_fc.weight"])
    assert error.abs().max() == 0  # original now holds W_q itself


def test_estimate_with_a_quantized_base():
    psi, lora = 1_000_000, 10_000
    plain = estimate(psi, 4, 3, "bf16", lora=lora)
    nf4 = estimate(psi, 4, 3, "bf16", lora=lora, quantize="nf4", quantized_params=[640_000, 320_000])
    assert nf4.quantized_params == -(-(quantized_weight_bytes(640_000) + quantized_weight_bytes(320_000)) // 4)
    assert nf4.params == 2 * (-(-lora // 4) + -(-(psi - lora - 960_000) // 4))
    assert (nf4.grads, nf4.master_params, nf4.optimizer_states) == (plain.grads, plain.master_params,
                                                                    plain.optimizer_states)
    assert "quantized_params" in nf4.as_dict() and "quantized_params" not in plain.as_dict()
    assert estimate(psi, 4, 0, "bf16", lora=lora, quantize="int8").quantized_params == quantized_weight_bytes(psi - lora, "int8")
    with pytest.raises(ValueError, match="quantize must be one of"):
        estimate(psi, 4, 0, quantize="fp4", lora=lora)
    with pytest.raises(ValueError, match="not both"):
        estimate(psi, 4, 0, lora=lora, trainable_params=lora)


def test_formats_quant_errors_rank_the_codes():
    """`zerokit formats --quant`'s measure on normal weights: int8 < NF4 < uniform 4-bit in RMS, at NF4's bytes."""
    from zerokit.commands.formats import quantization_errors
    err = quantization_errors([torch.randn(1 << 14, generator=torch.Generator().manual_seed(0))])
    assert err["int8"]["rms_relative"] < err["nf4"]["rms_relative"] < err["uniform4"]["rms_relative"] < 0.15
    assert err["nf4"]["bytes_per_param"] == err["uniform4"]["bytes_per_param"] < err["int8"]["bytes_per_param"]


def test_a_copied_quantized_model_keeps_its_encoding():
    import copy
    model = nn.Sequential(nn.Linear(64, 64)).requires_grad_(False)
    zk.quantize(model, "nf4")
    twin = copy.deepcopy(model)
    assert str(twin[0].weight_quant.zerokit_packed) == "nf4 block 64 double-quant 64x64"
    assert torch.equal(twin[0].weight_quant, model[0].weight_quant)


def test_memory_and_plan_commands_take_the_quantized_branch(capsys):
    """FSDP-QLoRA's case: 70B, bf16, two 24 GB GPUs: stage 3 over an NF4 base fits, the plan ends at qlora."""
    from zerokit.cli import main
    assert main(["memory", "--params", "70e9", "--world-size", "2", "--quantize", "nf4", "--lora",
                 "--gpu-memory", "24"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:1] in "0123"]
    assert [r[-1] for r in rows] == ["no", "no", "no", "yes"] and rows[3][-2] == "18.2"
    assert main(["plan", "--params", "70e9", "--gpus", "2", "--gpu-memory", "24"]) == 0
    out = capsys.readouterr().out
    assert "decision: qlora" in out and "LoRA over an NF4 base (QLoRA) + ZeRO-3 + activation checkpointing" in out
    with pytest.raises(SystemExit, match="add --lora"):
        main(["memory", "--params", "7e9", "--world-size", "2", "--quantize", "nf4"])


def independent_nf4_decode(packed: bytes, shape: tuple[int, int], block: int = 64, block2: int = 256) -> torch.Tensor:
    """W_q from the packed bytes by the layout docs/quantization.md documents, written from scratch: codes
    (two per byte, first element high) | one int8 absmax code per block | one fp32 scale per `block2`
    absmax codes | one fp32 mean; absmax_q = c8 * (scale2 / 127) + mean, W_q = PUBLISHED_NF4[code] * absmax_q."""
    import struct
    n = shape[0] * shape[1]
    nblocks = n // block
    nblocks2 = -(-nblocks // block2)
    at = n // 2
    codes = [c for byte in packed[:at] for c in (byte >> 4, byte & 15)]
    c8 = struct.unpack(f"{nblocks}b", packed[at:at + nblocks])
    at += nblocks
    scale2 = struct.unpack(f"<{nblocks2}f", packed[at:at + 4 * nblocks2])
    (mean,) = struct.unpack("<f", packed[at + 4 * nblocks2:at + 4 * nblocks2 + 4])
    assert len(packed) == at + 4 * nblocks2 + 4
    f32 = torch.float32
    per_block = torch.tensor(scale2, dtype=f32) / 127  # the second-level scale of each of the nblocks2 blocks
    absmax = torch.tensor(c8, dtype=f32) * per_block[torch.arange(nblocks) // block2] + torch.tensor(mean, dtype=f32)
    levels = torch.tensor(PUBLISHED_NF4, dtype=f32)[torch.tensor(codes)]
    return (levels.reshape(nblocks, block) * absmax[:, None]).reshape(shape)


def test_double_quant_over_several_second_level_blocks_against_an_independent_decoder():
    """More than one 256-block of absmax constants (576 blocks of 64: three second-level blocks), rows scaled
    from 0.05 to 20 so each second-level block has its own range: the bytes decode, by the test's own
    reader of the documented layout, to what a quantized nn.Linear computes with, and each block's stored
    absmax is within half an 8-bit step of its second-level block's own range of the true absmax."""
    torch.manual_seed(3)
    lin = nn.Linear(384, 96)
    with torch.no_grad():
        lin.weight.mul_(torch.logspace(-1.3, 1.3, 96)[:, None])
    w = lin.weight.detach().clone()
    model = nn.Sequential(lin)
    model.requires_grad_(False)
    zk.quantize(model, "nf4")
    layer = model[0]
    spec = layer.spec
    assert spec.double_quant and spec.nblocks == 576 and spec.nblocks2 == 3
    packed = bytes(layer.weight_quant.detach().tolist())
    wq = independent_nf4_decode(packed, (96, 384))
    x = torch.randn(5, 384)
    assert torch.equal(layer(x), F.linear(x, wq, layer.bias))
    assert torch.equal(quant.dequantize_tensor(layer.weight_quant, spec), wq)
    # the encoder: each second-level block's scale is its own range, and the codes are the paper's
    absmax = w.reshape(576, 64).abs().amax(1)
    centred = absmax - absmax.mean()
    stored = wq.reshape(576, 64).abs().amax(1)  # level +-1 is hit by each block's absmax element
    for k in range(3):
        own = slice(256 * k, 256 * (k + 1))
        assert (stored[own] - absmax[own]).abs().max() <= centred[own].abs().max() / 254 * 1.0001, k
    assert list(packed[:spec.numel // 2]) == paper_codes(w.reshape(-1).tolist(), 64, PUBLISHED_NF4)
