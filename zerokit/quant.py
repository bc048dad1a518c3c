"""A quantized frozen base: NF4 and int8 weights under LoRA, at every ZeRO stage (QLoRA).

The lecture's decision flow ends at LoRA, and with one GPU (where ZeRO cannot help) at
quantization. QLoRA (Dettmers et al., 2023) does both: the frozen base weights are stored in
4 bits, the LoRA adapters train in bf16 on top. Here, from scratch in torch:

    NF4   each block of `block_size` consecutive elements of the flattened weight is divided by
          its absmax and rounded to the nearest of 16 NormalFloat levels (`nf4_levels`: quantiles
          of N(0, 1) scaled to [-1, 1], with an exact zero); two 4-bit codes per byte, the first
          element in the high nibble.
    int8  the same blocks, rounded to the nearest of the 255 levels k/127, k in [-127, 127].

Double quantization (`double_quant=True`) stores the per-block absmax constants in 8 bits too:
their mean is subtracted and each block of 256 of them is int8-absmax quantized, leaving one fp32
scale per 256 constants and one fp32 mean per weight. Codes are computed with the exact absmax,
as in the paper; dequantization uses the stored (double-quantized) one:

    W_q = level[code] * absmax_q        absmax_q = c8 * scale2 / 127 + mean

A code depends on its own block alone; with double quantization every constant depends on all
blocks (through the mean). `quantize_range` computes any byte range of a weight's packed bytes
from the blocks it depends on, bit for bit (what `engine.load_weights` does for a stage-3 shard).

Bytes per weight element (n elements, B = block_size, NF4 with double quantization):
    n/2 (codes) + n/B (absmax codes) + 4·ceil(n/B/256) + 4     ≈ 0.516 bytes at B = 64
without double quantization n/2 + 4n/B (0.5625); int8: n + the same constants (≈ 1.016).

[Note: quantized storage is one byte parameter]
Each quantized weight is one frozen uint8 `nn.Parameter` (`weight_quant`, 1-D, `spec.nbytes`
bytes: codes | absmax | fp32 scales | fp32 mean) carrying `zerokit_packed` (its QuantSpec;
in words, `str(spec)`). The engines keep such a parameter in its own dtype, in flat buffers of its own (the
dtype is part of the grouping key, core/params/flat_param.py): stages 0-2 replicate it like any frozen
weight, stage 3 shards its bytes with the unit and all-gathers the bytes, and every layer
dequantizes inside its forward, after the gather. It gets no gradient, master or optimizer state,
and a checkpoint stores it once, as bytes, checksummed with the rest.

[Note: the dequantized weight is not saved for backward]
`F.linear(x, W_q)` through autograd would save W_q (2 bytes per element at bf16) until
backward: the whole base dequantized, the memory quantization exists to save. `_QuantLinearFn`
saves the byte parameter instead and dequantizes again in backward for the input gradient
(grad @ W_q), as bitsandbytes does. Forward is `F.linear(x, W_q.to(x.dtype), bias)` exactly, and
the input gradient the `mm` autograd's linear backward runs, so a model whose weights are W_q
trains bit for bit the same (tests/distributed/test_quant_sharded.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["quantize", "dequantized_state_dict", "dequantize_", "QuantLinear", "QuantSpec", "nf4_levels",
           "quantize_tensor", "quantize_range", "dequantize_tensor", "bytes_per_element", "FORMATS"]

FORMATS = ("nf4", "int8")
DOUBLE_QUANT_BLOCK = 256  # absmax constants per second-level block
NF4_OFFSET = 0.9677083  # the quantile range [1 - offset, offset] the paper's levels span (bitsandbytes')


@dataclass(frozen=True)
class QuantSpec:
    """How one weight is quantized: enough to lay out and decode its bytes."""

    fmt: str  # "nf4" | "int8"
    shape: tuple[int, ...]  # the weight as forward uses it: (out_features, in_features)
    block_size: int = 64
    double_quant: bool = True
    dtype: torch.dtype = torch.float32  # the weight's dtype before quantization
    transposed: bool = False  # the original parameter is (in, out): transformers' Conv1D

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nblocks(self) -> int:
        return self.numel // self.block_size

    @property
    def nblocks2(self) -> int:
        return -(-self.nblocks // DOUBLE_QUANT_BLOCK)

    def parts(self) -> dict[str, tuple[int, int]]:
        """Byte ranges of the packed tensor: codes | absmax | scale2 | mean (the last two with double_quant)."""
        code_bytes = self.numel // 2 if self.fmt == "nf4" else self.numel
        out, at = {}, 0
        sizes = [("codes", code_bytes)]
        sizes += ([("absmax", self.nblocks), ("scale2", 4 * self.nblocks2), ("mean", 4)] if self.double_quant
                  else [("absmax", 4 * self.nblocks)])
        for name, size in sizes:
            out[name] = (at, at + size)
            at += size
        return out

    @property
    def nbytes(self) -> int:
        return max(hi for _, hi in self.parts().values())

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        return (f"{self.fmt} block {self.block_size}{' double-quant' if self.double_quant else ''} "
                f"{'x'.join(map(str, self.shape))}{' conv1d' if self.transposed else ''}")


def bytes_per_element(fmt: str, block_size: int = 64, double_quant: bool = True) -> float:
    """Stored bytes per weight element, large-weight limit (the per-weight fp32 mean left out)."""
    _check_format(fmt, block_size)
    codes = 0.5 if fmt == "nf4" else 1.0
    constants = (1 + 4 / DOUBLE_QUANT_BLOCK) / block_size if double_quant else 4 / block_size
    return codes + constants


def nf4_levels() -> torch.Tensor:
    """The 16 NormalFloat levels (16,) fp32, ascending, from -1 to 1 with an exact 0.

    QLoRA's construction: 8 positive levels are the N(0, 1) quantiles at 9 evenly spaced
    probabilities from NF4_OFFSET down to 1/2 (the last, 0, dropped), 7 negative ones likewise
    from 8 points; zero joins them, and everything is divided by the largest, so +-1 are levels.
    """
    def quantiles(count: int) -> torch.Tensor:  # probabilities in fp32, quantiles in fp64, as bitsandbytes
        p = torch.linspace(NF4_OFFSET, 0.5, count)[:-1]
        return torch.special.ndtri(p.double()).float()
    values = torch.cat([quantiles(9), torch.zeros(1), -quantiles(8)]).sort().values
    return values / values.max()


_LEVELS = nf4_levels()


def _check_format(fmt: str, block_size: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}: choose one of {FORMATS}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(f"block_size must be an even int >= 2, got {block_size!r}")


# ------------------------------------------------------------------ the codes, from scratch
def _int8_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(x / scale * 127) per row, as int8; a zero scale gives zero codes."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / safe * 127).clamp_(-127, 127).to(torch.int8)


def quantize_tensor(weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """`weight` (spec.shape) -> its packed bytes (spec.nbytes,) uint8."""
    w = weight.detach().reshape(spec.nblocks, spec.block_size).to(torch.float32)
    absmax = w.abs().amax(dim=1)  # (nblocks,)
    packed = torch.cat([_block_codes(w, absmax, spec), _constants(absmax, spec)])
    assert packed.numel() == spec.nbytes, (packed.numel(), spec.nbytes)
    return packed


def _block_codes(w: torch.Tensor, absmax: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The code bytes of whole blocks `w` (blocks, block_size) fp32 with their exact absmax (blocks,): each
    element's code depends on its own block alone, so any run of blocks gives quantize_tensor's bytes for it."""
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    if spec.fmt == "nf4":
        levels = _LEVELS.to(w.device)
        mids = (levels[1:] + levels[:-1]) / 2  # nearest level: which midpoints a value lies above
        codes = torch.bucketize(w / safe, mids).to(torch.uint8).reshape(-1)  # (numel,) in [0, 15]
        return (codes[0::2] << 4) | codes[1::2]  # (numel/2,) two codes per byte, first one high
    return _int8_codes(w, absmax[:, None]).view(torch.uint8).reshape(-1)


def _constants(absmax: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The bytes after the codes, from every block's absmax (nblocks,) fp32: absmax codes | scale2 | mean with
    double quantization (each depends on all blocks, through the mean), else the fp32 absmax itself."""
    if not spec.double_quant:
        return absmax.view(torch.uint8)
    mean = absmax.mean()
    centred = torch.zeros(spec.nblocks2 * DOUBLE_QUANT_BLOCK, device=absmax.device)
    centred[:spec.nblocks] = absmax - mean
    blocks = centred.view(spec.nblocks2, DOUBLE_QUANT_BLOCK)
    scale2 = blocks.abs().amax(dim=1)  # (nblocks2,)
    c8 = _int8_codes(blocks, scale2[:, None]).reshape(-1)[:spec.nblocks]
    return torch.cat([c8.view(torch.uint8), scale2.view(torch.uint8), mean.reshape(1).view(torch.uint8)])


QUANTIZE_CHUNK_NUMEL = 1 << 22  # elements of a weight `quantize_range` holds in fp32 at a time (16 MiB)


def range_blocks(spec: QuantSpec, a: int, b: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Which blocks bytes [a, b) of quantize_tensor's output depend on: ((first, end) of the blocks whose codes
    they hold, (first, end) of the blocks whose absmax they need); an empty range is (0, 0).

    A code byte depends on its block only (NF4: block_size/2 bytes per block, int8: block_size). Without
    double quantization an absmax byte is its block's fp32 absmax; with it every constant depends on the mean
    of all blocks' absmax, so a range touching them needs every block."""
    code_end = spec.parts()["codes"][1]
    per_byte = 2 if spec.fmt == "nf4" else 1  # elements per code byte
    bs = spec.block_size
    codes = (0, 0)
    if a < min(b, code_end):
        codes = (a * per_byte // bs, -(-min(b, code_end) * per_byte // bs))
    need = (0, 0)
    if max(a, code_end) < b:
        need = (0, spec.nblocks) if spec.double_quant else ((max(a, code_end) - code_end) // 4,
                                                            -(-(b - code_end) // 4))
    return codes, need


def quantize_range(read, spec: QuantSpec, a: int, b: int, chunk_numel: int = QUANTIZE_CHUNK_NUMEL) -> torch.Tensor:
    """Bytes [a, b) of `quantize_tensor(W, spec)`, bit for bit, reading only the blocks of W they depend on
    (`range_blocks`), at most `chunk_numel` elements (rounded down to whole blocks) at a time.

    `read(e0, e1)` returns elements [e0, e1) of W flattened in spec.shape's (out, in) order, as fp32 (what
    quantize_tensor's `.to(torch.float32)` makes of them). Exact because codes are elementwise given their
    block's absmax (an exact max), and the double-quant constants are computed by `_constants` from the
    same (nblocks,) absmax vector quantize_tensor computes them from.
    """
    if not 0 <= a <= b <= spec.nbytes:
        raise ValueError(f"byte range [{a}, {b}) outside the {spec.nbytes} bytes of {spec}")
    bs = spec.block_size
    (c0, c1), (m0, m1) = range_blocks(spec, a, b)
    spans = sorted(s for s in ((c0, c1), (m0, m1)) if s[0] < s[1])
    merged: list[list[int]] = []
    for lo, hi in spans:  # one read of blocks both parts need
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    step = max(1, chunk_numel // bs)  # blocks per chunk
    codes, absmax = [], []
    for lo, hi in merged:
        for k in range(lo, hi, step):
            k1 = min(hi, k + step)
            w = read(k * bs, k1 * bs).reshape(k1 - k, bs).to(torch.float32)
            amax = w.abs().amax(dim=1)  # (k1 - k,)
            if max(k, c0) < min(k1, c1):
                j0, j1 = max(k, c0), min(k1, c1)
                codes.append(_block_codes(w[j0 - k:j1 - k], amax[j0 - k:j1 - k], spec))
            if max(k, m0) < min(k1, m1):
                absmax.append(amax[max(k, m0) - k:min(k1, m1) - k])
    parts = spec.parts()
    code_end = parts["codes"][1]
    per_block = bs // 2 if spec.fmt == "nf4" else bs  # code bytes per block
    out = []
    if codes:
        got = torch.cat(codes)  # code bytes [c0 * per_block, c1 * per_block)
        out.append(got[a - c0 * per_block:min(b, code_end) - c0 * per_block])
    if absmax:
        values = torch.cat(absmax)  # (m1 - m0,): the whole vector under double quantization
        tail = _constants(values, spec)  # double quant: bytes [code_end, nbytes); else absmax bytes [4 m0, 4 m1)
        first = code_end + (0 if spec.double_quant else 4 * m0)
        out.append(tail[max(a, code_end) - first:b - first])
    result = torch.cat(out) if out else torch.empty(0, dtype=torch.uint8)
    assert result.numel() == b - a, (result.numel(), a, b, spec)
    return result


def _fp32(packed: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    # A copy: inside a flat buffer the bytes need not be 4-aligned, and a dtype view requires it.
    return packed[lo:hi].clone().view(torch.float32)


def absmax_of(packed: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The per-block absmax constants as dequantization uses them: (nblocks,) fp32."""
    parts = spec.parts()
    if not spec.double_quant:
        return _fp32(packed, *parts["absmax"])
    lo, hi = parts["absmax"]
    c8 = packed[lo:hi].view(torch.int8).to(torch.float32)  # (nblocks,)
    scale2 = _fp32(packed, *parts["scale2"])  # (nblocks2,)
    mean = _fp32(packed, *parts["mean"])  # (1,)
    per_block = torch.repeat_interleave(scale2 / 127, DOUBLE_QUANT_BLOCK)[:spec.nblocks]
    return c8 * per_block + mean


def dequantize_tensor(packed: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Packed bytes -> W_q, (spec.shape) fp32: level[code] * absmax per block."""
    lo, hi = spec.parts()["codes"]
    codes = packed[lo:hi]
    absmax = absmax_of(packed, spec)[:, None]  # (nblocks, 1)
    if spec.fmt == "nf4":
        idx = torch.stack((codes >> 4, codes & 15), dim=1).reshape(spec.nblocks, spec.block_size)
        values = _LEVELS.to(packed.device)[idx.long()]
    else:
        values = codes.view(torch.int8).to(torch.float32).reshape(spec.nblocks, spec.block_size) / 127
    return (values * absmax).reshape(spec.shape)


# ------------------------------------------------------------------ the layer
class _QuantLinearFn(torch.autograd.Function):
    """F.linear(x, W_q, bias) saving the bytes, not W_q: [Note: the dequantized weight is not saved for backward]."""

    @staticmethod
    def forward(ctx, x, packed, bias, spec):
        ctx.spec = spec
        ctx.save_for_backward(packed)
        return F.linear(x, dequantize_tensor(packed, spec).to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = dequantize_tensor(packed, ctx.spec).to(grad.dtype)  # (out, in)
            grad_x = grad.reshape(-1, grad.shape[-1]).mm(w).reshape(*grad.shape[:-1], w.shape[1])
        if ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, None, grad_bias, None


def quant_linear(x: torch.Tensor, packed: torch.Tensor, spec: QuantSpec, bias: torch.Tensor | None) -> torch.Tensor:
    """A quantized layer's output: F.linear(x, W_q.to(x.dtype), bias)."""
    return _QuantLinearFn.apply(x, packed, bias, spec)


class PackedParameter(nn.Parameter):
    """The frozen byte parameter of [Note: quantized storage is one byte parameter]: uint8, its QuantSpec in
    `zerokit_packed` (what the engines, the ledger and checkpoints read: core/params/flat_param.py), kept by copies."""

    def __new__(cls, data: torch.Tensor, spec: QuantSpec):
        p = super().__new__(cls, data, requires_grad=False)
        p.zerokit_packed = spec
        return p

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = PackedParameter(self.data.clone(memory_format=torch.preserve_format), self.zerokit_packed)
        return memo[id(self)]


def packed_parameter(packed: torch.Tensor, spec: QuantSpec) -> PackedParameter:
    return PackedParameter(packed, spec)


class QuantLinear(nn.Module):
    """A Linear whose frozen weight is stored quantized (`weight_quant`, uint8); `bias` stays as it was."""

    def __init__(self, spec: QuantSpec, weight_quant: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.spec = spec
        self.out_features, self.in_features = spec.shape
        self.weight_quant = weight_quant
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.weight_quant, self.spec, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.spec.describe()}"


def _is_conv1d(m: nn.Module) -> bool:
    """transformers' GPT-2 Conv1D (y = x @ W + b, W (in, out)), recognised without importing transformers."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and isinstance(getattr(m, "weight", None), torch.Tensor)


def _matches(name: str, patterns) -> bool:
    return name in patterns or name.rsplit(".", 1)[-1] in patterns


def _has_lora(model: nn.Module) -> bool:
    """Whether `model` holds a zerokit LoRALinear (zerokit/lora.py): a module whose `lora_A` and `lora_B` are
    Parameters. Recognised by those attributes, as `quantized_modules` recognises a LoRALinear over a quantized
    base, so that this module imports nothing of zerokit/lora.py (lora.py imports this one)."""
    return any(isinstance(getattr(m, "lora_A", None), nn.Parameter) and isinstance(getattr(m, "lora_B", None), nn.Parameter)
               for m in model.modules())


def quantize(model: nn.Module, fmt: str, targets=None, skip=(), block_size: int = 64,
             double_quant: bool = True) -> list[str]:
    """Replace the frozen weight of each targeted nn.Linear (and GPT-2 Conv1D) by quantized storage, in place.

    `targets=None`: every Linear / Conv1D not in `skip`; otherwise those whose dotted path, or its
    last component, is in `targets` (a string is one name). Call it before `zk.lora.inject` and
    `zk.shard`. Returns the sorted names of the quantized modules. Raises ValueError, before
    changing anything, for an unknown format, a trainable target weight (freeze the base first:
    `model.requires_grad_(False)`), a weight tied to another module, a weight whose element count
    is not a multiple of `block_size`, LoRA modules already in the model, or nothing matched.
    """
    _check_format(fmt, block_size)
    targets = (targets,) if isinstance(targets, str) else (None if targets is None else tuple(targets))
    skip = (skip,) if isinstance(skip, str) else tuple(skip)
    if _has_lora(model):
        raise ValueError("zk.quantize: the model already has LoRA modules; quantize first, then zk.lora.inject")
    candidates = [(name, m) for name, m in model.named_modules(remove_duplicate=False)
                  if name and (isinstance(m, nn.Linear) or _is_conv1d(m))]
    chosen = [(name, m) for name, m in candidates
              if (targets is None or _matches(name, targets)) and not _matches(name, skip)]
    if not chosen:
        raise ValueError(f"zk.quantize: no nn.Linear or Conv1D matches targets={targets} skip={skip}; "
                         f"candidates: {', '.join(n for n, _ in candidates[:8]) or 'none'}")
    owners: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(pname.rpartition(".")[0])
    for name, m in chosen:
        w = m.weight
        if w.requires_grad:
            raise ValueError(f"zk.quantize: {name}.weight is trainable; a quantized weight is a frozen base. "
                             "Freeze the base first (model.requires_grad_(False); zk.lora.inject adds trainable "
                             f"adapters after), or leave it out with skip=({name.rsplit('.', 1)[-1]!r},)")
        others = sorted(set(owners[id(w)]) - {n for n, mm in chosen if mm is m})  # a module under two names: fine
        if others:
            raise ValueError(f"zk.quantize: {name}.weight is tied to {', '.join(others)}; a tied weight is used "
                             f"unquantized there. Skip it: skip=({name.rsplit('.', 1)[-1]!r},)")
        if w.numel() % block_size:
            raise ValueError(f"zk.quantize: {name}.weight has {w.numel()} elements {tuple(w.shape)}, not a multiple "
                             f"of block_size={block_size}; pick a block size that divides it or skip the layer")
        if not w.is_floating_point():
            raise ValueError(f"zk.quantize: {name}.weight has dtype {w.dtype}, not a floating-point weight")
    done: dict[int, QuantLinear] = {}
    for name, m in chosen:
        if id(m) not in done:
            conv = _is_conv1d(m)
            weight = m.weight.detach().t() if conv else m.weight.detach()  # (out, in)
            spec = QuantSpec(fmt, tuple(weight.shape), block_size, double_quant, m.weight.dtype, conv)
            done[id(m)] = QuantLinear(spec, packed_parameter(quantize_tensor(weight.contiguous(), spec), spec), m.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, done[id(m)])
    return sorted(name for name, _ in chosen)


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every module holding a quantized weight (QuantLinear, or a LoRALinear over one), by dotted path."""
    return {name: m for name, m in model.named_modules(remove_duplicate=False)
            if isinstance(getattr(m, "spec", None), QuantSpec) and isinstance(getattr(m, "weight_quant", None), torch.Tensor)}


def dequantized_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """`state_dict` (default: the model's) with every `<layer>.weight_quant` replaced by `<layer>.weight`, W_q
    in fp32, in the original parameter's shape (a Conv1D's (in, out)); every other entry as it is. For a
    reference model, and for export into the unquantized model. At stage 3 pass `engine.state_dict(full=True)`.
    """
    mods = quantized_modules(model)
    source = model.state_dict() if state_dict is None else state_dict
    out = {}
    for key, value in source.items():
        layer, _, leaf = key.rpartition(".")
        if leaf == "weight_quant" and layer in mods:
            spec = mods[layer].spec
            w = dequantize_tensor(value.detach().reshape(-1), spec)
            out[f"{layer}.weight"] = (w.t() if spec.transposed else w).contiguous()
        else:
            out[key] = value.detach().clone()
    return out


def dequantize_(model: nn.Module) -> nn.Module:
    """In place: every quantized layer becomes a float one holding W_q (in the original dtype, frozen) and
    computing F.linear(x, W_q, bias): QuantLinear -> nn.Linear, a LoRALinear over a quantized base keeps its
    adapters over a float weight. The dequantized twin a torch reference trains; returns `model`."""
    seen: dict[int, nn.Module] = {}
    for name, m in list(quantized_modules(model).items()):
        if id(m) in seen:  # one module under several names: replaced (or converted) once, set under each
            if isinstance(m, QuantLinear):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, seen[id(m)])
            continue
        spec = m.spec
        weight = nn.Parameter(dequantize_tensor(m.weight_quant.detach(), spec).to(spec.dtype), requires_grad=False)
        if isinstance(m, QuantLinear):
            lin = nn.Linear(spec.shape[1], spec.shape[0], bias=m.bias is not None, device=weight.device,
                            dtype=spec.dtype)
            lin.weight = weight
            if m.bias is not None:
                lin.bias = m.bias
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, lin)
            seen[id(m)] = lin
        else:  # a LoRALinear over a quantized base
            del m.weight_quant
            m.weight, m.spec = weight, None
            seen[id(m)] = m
    return model
