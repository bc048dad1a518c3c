"""LoRA: low-rank adaptation of a frozen pretrained model.

The idea (Hu et al., 2021, as CS224N lecture 12 presents it). Fine-tuning changes a pretrained weight
W (d x k) by some ΔW. LoRA bets that the useful ΔW has low rank and writes it as a product

    W_new = W + α · B · A,      B: (d, r),  A: (r, k),  r ≪ min(d, k)

W stays frozen; only A and B are learned. A layer y = x Wᵀ + b becomes

    y = x Wᵀ + b + α · (x Aᵀ) Bᵀ

computed as two thin matmuls through the r-wide bottleneck (x Aᵀ is (..., r)), never forming the
(d, k) product B·A during training. A starts Kaiming-uniform (a = √5, as nn.Linear does) and B
starts at zero, so ΔW = 0 and the adapted model begins *exactly* at the pretrained one; B moves
away from zero as training goes. α trades pretrained knowledge against the new task (α < 1 keeps
more of the base); the lecture's defaults are targets q and v, r = 8, α = 1. (The lecture's slide
code writes x @ (W_A @ W_B) with W_A (k, r) and W_B (r, d): that is this same product written for
x @ W instead of nn.Linear's x Wᵀ, i.e. W_A = Aᵀ and W_B = Bᵀ.)

Why it saves memory. W has d·k entries; the adapter r·(d + k). For d = k = 768, r = 8 that is
r(d+k)/(dk) = 2r/768 ≈ 2% (`lora_fraction`). The saving is not in the weights (W is still there)
but in everything training adds on top: gradients, fp32 master copies and Adam's two moments
exist only for A and B. With mixed-precision Adam a full fine-tune costs 16 bytes per parameter;
with LoRA the frozen base costs its 2 bytes of bf16 weights and only the adapters cost the rest.

How it composes with sharding. `inject` freezes every base parameter (requires_grad=False), so
a zerokit engine built afterwards (`zk.shard(...)`) gives those parameters no gradient, no master
copy and no optimizer state, and shards only what trains; nothing here talks to the engine.
Call `inject` before `zk.shard`, because the engine lays out its flat buffers at construction.

After training, `merge` folds α·B·A into W for inference with zero extra cost; `unmerge` takes it
out again. A merged W differs from the pretrained W by exactly that delta, and unmerging restores
W only up to floating-point rounding (bitwise in general only if the arithmetic was exact; in
bf16 the round trip loses low bits, so keep a pristine copy of W if that matters). Adapters are
small, so one base model serves many tasks by swapping adapter files (`save_adapter` /
`load_adapter`, safetensors, only `lora_A` / `lora_B`).

Matching rule of `inject`: a module is adapted when it is an `nn.Linear` (or a layer `zk.quantize`
made, whose frozen base stays quantized: zerokit/quant.py) and the LAST component
of its dotted module path is in `targets`. With targets ("q", "v"), `blocks.0.attn.q` matches;
`blocks.0.attn.qkv` and `q.proj` do not.
"""
from __future__ import annotations

import math
import operator
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from zerokit.quant import QuantLinear, quant_linear

__all__ = [
    "LoRALinear",
    "inject",
    "merge",
    "unmerge",
    "lora_modules",
    "adapter_state_dict",
    "load_adapter_state_dict",
    "save_adapter",
    "load_adapter",
    "trainable_report",
    "lora_fraction",
]

_ADAPTER_SUFFIXES = ("lora_A", "lora_B")


class LoRALinear(nn.Module):
    """An nn.Linear with a frozen base weight and a trainable low-rank update α·B·A.

    The base `weight` (d, k) and `bias` (d,) are the original Parameter objects of the replaced
    linear, registered under the same names, so state_dict keys of the base model do not change
    and weights tied elsewhere stay tied. `lora_A` (r, k) and `lora_B` (d, r) take the base
    weight's dtype and device.
    """

    def __init__(self, base: nn.Linear | QuantLinear, rank: int, alpha: float = 1.0) -> None:
        super().__init__()
        d, k = base.out_features, base.in_features
        if not 1 <= rank <= min(d, k):
            raise ValueError(f"LoRA rank must be in [1, min(d, k)] = [1, {min(d, k)}] for a ({d} x {k}) weight, got {rank}")
        self.in_features = k
        self.out_features = d
        self.rank = rank
        self.alpha = float(alpha)
        self.merged = False
        # A quantized base (zerokit/quant.py) keeps its byte parameter under its own name, `weight_quant`.
        self.spec = base.spec if isinstance(base, QuantLinear) else None
        # Reuse the Parameter objects (not copies): no extra memory, and a weight tied to an
        # embedding stays the same tensor.
        if self.spec is None:
            self.weight = base.weight
            self.weight.requires_grad_(False)
        else:
            self.weight_quant = base.weight_quant
        if base.bias is not None:
            self.bias = base.bias
            self.bias.requires_grad_(False)
        else:
            self.register_parameter("bias", None)
        device = (base.weight if self.spec is None else base.weight_quant).device
        dtype = base.weight.dtype if self.spec is None else self.spec.dtype
        # Initialise in fp32 and cast, so the same seed gives the same adapter whatever dtype
        # the base model is in (and kaiming on a bf16 tensor would round each draw anyway).
        a = torch.empty(rank, k, dtype=torch.float32, device=device)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.lora_A = nn.Parameter(a.to(dtype))                                       # (r, k)
        self.lora_B = nn.Parameter(torch.zeros(d, rank, dtype=dtype, device=device))  # (d, r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec is None:
            out = F.linear(x, self.weight, self.bias)                                    # (..., d)
        else:
            out = quant_linear(x, self.weight_quant, self.spec, self.bias)               # (..., d)
        if self.merged:
            return out  # ΔW already lives in W
        # Scale the r-wide intermediate rather than the d-wide output: same math, fewer flops.
        low = F.linear(x, self.lora_A) * self.alpha                                      # (..., r)
        return out + F.linear(low, self.lora_B)                                          # (..., d)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """α·B·A as a (d, k) tensor in at least fp32 (formed only here, for merge/unmerge)."""
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        return (self.lora_B.to(dtype) @ self.lora_A.to(dtype)) * self.alpha

    @torch.no_grad()
    def _fold(self, sign: float) -> None:
        # Add in (at least) fp32 and round once, so a bf16 W is rounded one time per fold, not twice.
        w = self.weight
        delta = self.delta_weight()
        w.copy_((w.to(delta.dtype) + sign * delta).to(w.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, rank={self.rank}, alpha={self.alpha}, merged={self.merged}")


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Every LoRALinear in `model` by dotted module path, sorted by path (shared ones under each path)."""
    found = {name: m for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, LoRALinear)}
    return dict(sorted(found.items()))


def inject(model: nn.Module, targets: tuple[str, ...] | list[str] | str = ("q", "v"),
           rank: int = 8, alpha: float = 1.0) -> list[str]:
    """Replace each nn.Linear whose last path component is in `targets` by a LoRALinear, in place.

    Every parameter of the model is frozen first; only the new `lora_A` / `lora_B` train.
    Returns the sorted names of the adapted modules. Raises ValueError, before changing anything,
    when the model already holds LoRA modules, when nothing matches, or when `rank` does not fit
    a matched weight. A single string is taken as one target name.
    """
    if isinstance(targets, str):
        targets = (targets,)
    targets = tuple(targets)
    if isinstance(rank, bool):
        raise TypeError(f"LoRA rank must be an int, got {rank!r}")
    rank = operator.index(rank)  # any integer type (numpy too); a float raises TypeError
    if lora_modules(model):
        raise ValueError(f"model already has LoRA modules ({', '.join(lora_modules(model))}); "
                         "inject once (load_adapter swaps adapters)")
    # remove_duplicate=False: one Linear registered under two paths must be replaced under both.
    linears = [(name, m) for name, m in model.named_modules(remove_duplicate=False)
               if isinstance(m, (nn.Linear, QuantLinear)) and name]
    matched = [(name, m) for name, m in linears if name.rsplit(".", 1)[-1] in targets]
    if not matched:
        sample = ", ".join(name for name, _ in linears[:8]) or "none"
        more = f" (and {len(linears) - 8} more)" if len(linears) > 8 else ""
        raise ValueError(f"no nn.Linear (or zk.quantize'd layer) whose last name component is in targets={targets}; "
                         f"nn.Linear modules in the model: {sample}{more}")
    for name, m in matched:
        if not 1 <= rank <= min(m.out_features, m.in_features):
            raise ValueError(f"LoRA rank {rank} does not fit '{name}' ({m.out_features} x {m.in_features}): "
                             f"need 1 <= rank <= {min(m.out_features, m.in_features)}")

    for p in model.parameters():
        p.requires_grad_(False)
    wrappers: dict[int, LoRALinear] = {}
    for name, m in matched:
        wrapper = wrappers.setdefault(id(m), LoRALinear(m, rank, alpha))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, wrapper)
    return sorted(name for name, _ in matched)


def _require_lora(model: nn.Module) -> dict[str, LoRALinear]:
    mods = lora_modules(model)
    if not mods:
        raise ValueError("model has no LoRA modules; call zerokit.lora.inject(model, ...) first")
    return mods


def merge(model: nn.Module) -> list[str]:
    """Fold α·B·A into each adapted W in place; forward then skips the low-rank path.

    After merging, W = W_pretrained + α·B·A (W stays frozen). Refuses a model already merged and
    a W shared with another module (a tied head), since merging would change that module too.
    Returns the merged module names.
    """
    mods = _require_lora(model)
    unique = {id(m): (name, m) for name, m in mods.items()}.values()
    quantized = [name for name, m in unique if m.spec is not None]
    if quantized:
        raise ValueError(f"cannot merge into a quantized base ({', '.join(quantized)}): W + alpha*B*A is not "
                         "representable in its codes; merge into zk.dequantized_state_dict(model)'s weights instead")
    already = [name for name, m in unique if m.merged]
    if already:
        raise ValueError(f"LoRA modules already merged: {', '.join(already)}; call unmerge first")
    owners: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(pname)
    for name, m in unique:
        paths = {p.rpartition(".")[0] for p in owners[id(m.weight)]}
        others = sorted(p for p in paths if p not in mods)
        if others:
            raise ValueError(f"cannot merge '{name}': its weight is shared with {', '.join(others)}, "
                             "which merging would change too; keep the adapter unmerged")
    for _, m in unique:
        m._fold(+1.0)
        m.merged = True
    return sorted(mods)


def unmerge(model: nn.Module) -> list[str]:
    """Subtract α·B·A back out of each merged W (restores W up to fp rounding). Returns the names."""
    mods = _require_lora(model)
    unique = {id(m): (name, m) for name, m in mods.items()}.values()
    not_merged = [name for name, m in unique if not m.merged]
    if not_merged:
        raise ValueError(f"LoRA modules not merged: {', '.join(not_merged)}; nothing to unmerge")
    for _, m in unique:
        m._fold(-1.0)
        m.merged = False
    return sorted(mods)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A snapshot (detached copies) of every lora_A / lora_B under its full state_dict name."""
    out: dict[str, torch.Tensor] = {}
    for name, m in _require_lora(model).items():
        for suffix in _ADAPTER_SUFFIXES:
            out[f"{name}.{suffix}"] = getattr(m, suffix).detach().clone()
    return out


def _adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return {f"{name}.{s}": getattr(m, s) for name, m in _require_lora(model).items() for s in _ADAPTER_SUFFIXES}


def load_adapter_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors into the model, strictly: every key present, no extra, shapes equal.

    Values are cast to each adapter's dtype and device. Everything is checked before anything is
    copied; a merged model is refused (its W holds the old adapter's delta).
    """
    params = _adapter_params(model)
    merged = [name for name, m in lora_modules(model).items() if m.merged]
    if merged:
        raise ValueError(f"cannot load adapters into merged modules ({', '.join(merged)}); call unmerge first")
    missing = sorted(set(params) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(params))
    if missing:
        raise ValueError(f"adapter state_dict is missing keys: {', '.join(missing)}")
    if unexpected:
        raise ValueError(f"adapter state_dict has unexpected keys: {', '.join(unexpected)}")
    for key, p in params.items():
        if tuple(state_dict[key].shape) != tuple(p.shape):
            raise ValueError(f"adapter '{key}' has shape {tuple(state_dict[key].shape)}, "
                             f"model expects {tuple(p.shape)} (different rank or layer size?)")
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(state_dict[key])


def save_adapter(model: nn.Module, path: str | os.PathLike) -> None:
    """Write only the adapters (and each module's α, as metadata) to a safetensors file."""
    metadata = {"format": "zerokit.lora"}
    metadata.update({f"alpha.{name}": repr(m.alpha) for name, m in lora_modules(model).items()})
    save_file(adapter_state_dict(model), os.fspath(path), metadata=metadata)


def load_adapter(model: nn.Module, path: str | os.PathLike) -> None:
    """Load a `save_adapter` file strictly (see load_adapter_state_dict); α must match the model's."""
    with safe_open(os.fspath(path), framework="pt") as f:
        metadata = f.metadata() or {}
        state_dict = {key: f.get_tensor(key) for key in f.keys()}
    # α is not a tensor but changes what the same A, B mean; a silent mismatch would change outputs.
    for name, m in lora_modules(model).items():
        saved = metadata.get(f"alpha.{name}")
        if saved is not None and float(saved) != m.alpha:
            raise ValueError(f"adapter file {os.fspath(path)} has alpha={float(saved)} for '{name}', "
                             f"model has alpha={m.alpha}; inject with the same alpha")
    load_adapter_state_dict(model, state_dict)


def trainable_report(model: nn.Module) -> dict[str, int | float | str]:
    """Parameter counts (tied parameters counted once): total, trainable, their fraction, one line."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    fraction = trainable / total if total else 0.0
    line = f"trainable params: {trainable:,} / {total:,} ({100 * fraction:.3f}%)"
    return {"total_params": total, "trainable_params": trainable, "fraction": fraction, "line": line}


def lora_fraction(d: int, k: int, r: int) -> float:
    """Adapter parameters over base parameters for one (d x k) weight at rank r: r(d + k) / (d k)."""
    if min(d, k, r) < 1:
        raise ValueError(f"d, k, r must be positive, got d={d}, k={k}, r={r}")
    return r * (d + k) / (d * k)
