"""`zerokit formats`: CS224N lecture 12's number formats, computed from the bits instead of quoted.

A float is sign * 2^(exponent - bias) * 1.mantissa. With 16 bits there is a trade: fp16 spends
5 bits on the exponent and 10 on the mantissa, bf16 8 and 7. Exponent bits buy range (how
small and how large), mantissa bits buy precision (the gap between neighbours, `eps` at 1.0).
Below the smallest normal number (exponent field 0) a format goes *subnormal*: the leading 1
is dropped, so the value keeps fewer and fewer significant bits, down to the smallest subnormal
(bit pattern 0...01); anything under half of that rounds to zero.

Every number here is measured, not typed in: the layout comes from the bit pattern of +inf
(all exponent bits set, mantissa clear), the limits come from constructing bit patterns and
viewing them as floats, and each is checked against `torch.finfo`. The lecture's claims
(1.0001 rounds to 1.0 in fp16, values below ~6e-5 leave fp16's normal range, bf16 keeps
fp32's range) are then checked against those measurements and printed as PASS/FAIL.

`zerokit formats --underflow` tests the lecture's strongest claim ("more than half of the
activation gradients become zero in fp16") on our own tiny GPT: it trains in fp32, records
dL/d(activation) for every module output at a few steps, and counts what casting those values
to fp16 would do, with no loss scale and with the LossScaler's initial scale.

`zerokit formats --quant` shows the codes a quantized base (zerokit/quant.py) stores: the 16 NF4
levels, and the quantization error each code makes, relative (RMS(W - W_q) / RMS(W) and
max|W - W_q| / max|W|), blockwise absmax in blocks of 64 with double-quantized constants, beside
its stored bytes per parameter: NF4, int8, and a uniform 4-bit code (round(x / absmax * 7), the
same bytes as NF4 but evenly spaced levels; its absmax kept exact, a slight advantage). Measured on normally distributed weights and on the
Linear weights of the built-in GPT (--model) after --steps steps of fp32 AdamW on the corpus.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from zerokit.core.nest import tensors_in

FORMATS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# The integer type a float's bits are viewed as, by width.
_INT_OF_WIDTH = {32: torch.int32, 16: torch.int16}
DEFAULT_VALUES = (1.0, 1.0001, 6e-5, 1e-8, 1e5)


def _dtype_of(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in FORMATS:
            raise ValueError(f"format {dtype!r} is not one of {list(FORMATS)}")
        return FORMATS[dtype]
    if dtype not in FORMATS.values():
        raise ValueError(f"dtype {dtype} is not one of {list(FORMATS.values())}")
    return dtype


def _name_of(dtype: torch.dtype) -> str:
    return next(name for name, d in FORMATS.items() if d == dtype)


def _bits_of(value: torch.Tensor) -> int:
    """The raw bit pattern of a 0-dim float tensor, as a non-negative Python int."""
    width = torch.finfo(value.dtype).bits
    return int(value.view(_INT_OF_WIDTH[width]).item()) & ((1 << width) - 1)


def _float_from_bits(pattern: int, dtype: torch.dtype) -> float:
    width = torch.finfo(dtype).bits
    if pattern >= 1 << (width - 1):  # the signed integer type holds the top bit as a negative number
        pattern -= 1 << width
    return float(torch.tensor(pattern, dtype=_INT_OF_WIDTH[width]).view(dtype).item())


def layout(dtype: torch.dtype | str) -> dict[str, Any]:
    """Bit layout and limits of one format, derived from bit patterns and checked against torch.finfo."""
    dtype = _dtype_of(dtype)
    info = torch.finfo(dtype)
    width = info.bits
    # +inf is the pattern with every exponent bit set and the mantissa clear.
    exponent_bits = bin(_bits_of(torch.tensor(float("inf"), dtype=dtype))).count("1")
    mantissa_bits = width - 1 - exponent_bits
    bias = (1 << (exponent_bits - 1)) - 1
    largest = _float_from_bits((((1 << exponent_bits) - 2) << mantissa_bits) | ((1 << mantissa_bits) - 1), dtype)
    smallest_normal = _float_from_bits(1 << mantissa_bits, dtype)  # exponent field 1, mantissa 0
    smallest_subnormal = _float_from_bits(1, dtype)  # exponent field 0, lowest mantissa bit
    one = _bits_of(torch.tensor(1.0, dtype=dtype))
    eps = _float_from_bits(one + 1, dtype) - 1.0  # gap from 1.0 to the next representable number
    # The measured limits must agree with torch's own table; a mismatch means the derivation is wrong.
    assert (largest, smallest_normal, eps) == (info.max, info.smallest_normal, info.eps), \
        (dtype, largest, info.max, smallest_normal, info.smallest_normal, eps, info.eps)
    assert smallest_subnormal == info.smallest_normal * info.eps, (dtype, smallest_subnormal)
    assert one == bias << mantissa_bits, (dtype, hex(one), bias)
    return {
        "format": _name_of(dtype),
        "dtype": str(dtype),
        "bits": width,
        "sign_bits": 1,
        "exponent_bits": exponent_bits,
        "mantissa_bits": mantissa_bits,
        "exponent_bias": bias,
        "max": largest,
        "smallest_normal": smallest_normal,
        "smallest_subnormal": smallest_subnormal,
        "eps": eps,
        "decimal_digits": mantissa_bits * math.log10(2.0),  # ~significant decimal digits of a normal number
    }


def format_table() -> list[dict[str, Any]]:
    """One row per format (fp32, fp16, bf16): bit counts, bias, largest, smallest normal/subnormal, eps."""
    return [layout(dtype) for dtype in FORMATS.values()]


def decompose(x: float, dtype: torch.dtype | str) -> dict[str, Any]:
    """What `x` becomes in `dtype`: sign, exponent and mantissa bit strings, the rounded value, its kind.

    Rounding is torch's round-to-nearest-even conversion of the Python float (a double).
    """
    dtype = _dtype_of(dtype)
    lay = layout(dtype)
    e_bits, m_bits = lay["exponent_bits"], lay["mantissa_bits"]
    stored = torch.tensor(x, dtype=torch.float64).to(dtype)
    pattern = _bits_of(stored)
    sign = pattern >> (e_bits + m_bits)
    exponent_field = (pattern >> m_bits) & ((1 << e_bits) - 1)
    mantissa_field = pattern & ((1 << m_bits) - 1)
    value = float(stored.item())
    if exponent_field == (1 << e_bits) - 1:
        kind, exponent = ("inf" if mantissa_field == 0 else "nan"), None
    elif exponent_field == 0:
        kind = "zero" if mantissa_field == 0 else "subnormal"
        exponent = None if mantissa_field == 0 else 1 - lay["exponent_bias"]
    else:
        kind, exponent = "normal", exponent_field - lay["exponent_bias"]
    if x == 0 or not math.isfinite(value):
        rel_error = None if not math.isfinite(value) else abs(value - x)
    else:
        rel_error = abs(value - x) / abs(x)
    return {
        "input": x,
        "format": lay["format"],
        "value": value,
        "sign": sign,
        "exponent_bits": format(exponent_field, f"0{e_bits}b"),
        "mantissa_bits": format(mantissa_field, f"0{m_bits}b"),
        "exponent": exponent,  # unbiased; subnormals use the smallest normal exponent
        "kind": kind,
        "relative_error": rel_error,
    }


def lecture_checks() -> list[dict[str, Any]]:
    """The lecture's claims about fp16 and bf16, each checked against the measured layouts."""
    fp32, fp16, bf16 = (layout(d) for d in (torch.float32, torch.float16, torch.bfloat16))
    checks: list[dict[str, Any]] = []

    def check(claim: str, holds: bool, evidence: str) -> None:
        checks.append({"claim": claim, "holds": bool(holds), "evidence": evidence})

    for lay, want in ((fp32, (8, 23)), (fp16, (5, 10)), (bf16, (8, 7))):
        got = (lay["exponent_bits"], lay["mantissa_bits"])
        check(f"{lay['format']} is 1 sign + {want[0]} exponent + {want[1]} mantissa bits", got == want,
              f"measured 1 + {got[0]} + {got[1]}")
    for name in ("fp16", "bf16"):
        d = decompose(1.0001, name)
        check(f"1.0001 rounds to 1.0 in {name}", d["value"] == 1.0,
              f"1.0001 -> {d['value']!r} (eps at 1.0 is {layout(name)['eps']:.3g})")
    d32 = decompose(1.0001, "fp32")
    check("fp32 still tells 1.0001 from 1.0", d32["value"] != 1.0, f"1.0001 -> {d32['value']!r}")
    check("fp16's normal range ends near 6e-5 (below it values go subnormal)",
          5.9e-5 < fp16["smallest_normal"] < 6.2e-5 and decompose(6e-5, "fp16")["kind"] == "subnormal",
          f"smallest normal {fp16['smallest_normal']:.4g}; 6e-5 is {decompose(6e-5, 'fp16')['kind']}")
    zero_below = fp16["smallest_subnormal"] / 2
    d = decompose(1e-8, "fp16")
    check("fp16 flushes values below ~6e-8 to zero (1e-8 -> 0)",
          d["kind"] == "zero" and 5.9e-8 < fp16["smallest_subnormal"] < 6.0e-8,
          f"smallest subnormal {fp16['smallest_subnormal']:.4g}, values <= {zero_below:.4g} round to 0; "
          f"1e-8 -> {d['value']!r}")
    d = decompose(1e5, "fp16")
    check("fp16's largest value is 65504 (1e5 overflows to inf)", fp16["max"] == 65504.0 and d["kind"] == "inf",
          f"max {fp16['max']:g}; 1e5 -> {d['value']!r}")
    same_range = (bf16["exponent_bits"] == fp32["exponent_bits"]
                  and bf16["smallest_normal"] == fp32["smallest_normal"]
                  and math.isclose(bf16["max"], fp32["max"], rel_tol=1e-2))
    check("bf16 keeps fp32's range (same exponent bits, same smallest normal, max within 1%)", same_range,
          f"bf16 max {bf16['max']:.4g} vs fp32 {fp32['max']:.4g}; smallest normal {bf16['smallest_normal']:.4g} "
          f"vs {fp32['smallest_normal']:.4g}")
    d = decompose(1e-8, "bf16")
    check("bf16 keeps 1e-8 (no underflow where fp16 has it)", d["kind"] == "normal",
          f"1e-8 -> {d['value']!r}")
    return checks


# ---------------------------------------------------------------- underflow measurement

FP16_CATEGORIES = ("fp32_zero", "flushed_to_zero", "subnormal", "normal", "overflow")


def classify_fp16(values: torch.Tensor, scale: float = 1.0) -> dict[str, int]:
    """Counts of what casting `values * scale` (fp32) to fp16 does, one category per element.

    fp32_zero: already exactly 0 (not fp16's fault); flushed_to_zero: nonzero but rounds to 0;
    subnormal: survives with fewer than 11 significant bits; normal: full precision;
    overflow: becomes +-inf. The categories partition the elements.
    """
    g = values.detach().float().flatten() * scale  # (numel,) fp32
    h = g.to(torch.float16)
    a = h.abs()
    nonzero = g != 0
    tiny = torch.finfo(torch.float16).smallest_normal
    counts = {
        "fp32_zero": int((~nonzero).sum()),
        "flushed_to_zero": int((nonzero & (h == 0)).sum()),
        "subnormal": int(((a > 0) & (a < tiny)).sum()),
        "normal": int((torch.isfinite(h) & (a >= tiny)).sum()),
        "overflow": int(torch.isinf(h).sum()),
    }
    assert sum(counts.values()) == g.numel(), (counts, g.numel())  # nan inputs would break the partition
    return counts


# log2 histogram bins: integer exponents covering fp32's subnormals (2^-149) up to its max (2^127).
_LOG2_LO, _LOG2_HI = -150, 129


def _log2_histogram(values: torch.Tensor) -> torch.Tensor:
    """Counts of nonzero |values| per bin [2^e, 2^(e+1)), e in [_LOG2_LO, _LOG2_HI)."""
    a = values.detach().float().flatten().abs()
    e = torch.floor(torch.log2(a[a > 0])).long().clamp(_LOG2_LO, _LOG2_HI - 1) - _LOG2_LO
    return torch.bincount(e, minlength=_LOG2_HI - _LOG2_LO)


class ActivationGradRecorder:
    """Collects dL/d(output) of every module's tensor outputs during one backward.

    A forward hook on each module registers a tensor hook on its outputs; the tensor hook sees
    the gradient flowing into that activation. A module whose output is another module's output
    (a container returning its last child's result, GPT returning lm_head's logits) would be
    counted twice, so outputs are deduplicated by tensor identity within one forward.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.active = False
        self.grads: list[torch.Tensor] = []
        self._seen: dict[int, torch.Tensor] = {}  # id -> tensor, keeps ids unique while recording
        self._handles = [m.register_forward_hook(self._on_forward) for m in model.modules()]

    def _on_forward(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not self.active:
            return
        for t in tensors_in(output):
            # Skip the scalar loss: its gradient is the constant 1.
            if t.requires_grad and t.is_floating_point() and t.numel() > 1 and id(t) not in self._seen:
                self._seen[id(t)] = t
                t.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        self.grads.append(grad.detach().float().flatten().clone())

    def start(self) -> None:
        self.active, self.grads, self._seen = True, [], {}

    def stop(self) -> torch.Tensor:
        """All gradients recorded since `start`, concatenated: (total activation elements,)."""
        self.active, self._seen = False, {}
        grads, self.grads = self.grads, []
        return torch.cat(grads) if grads else torch.empty(0)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _fractions(counts: dict[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total else {k: 0.0 for k in counts}


def measure_underflow(steps: int = 30, model_name: str = "tiny", batch_size: int = 16, lr: float = 3e-3,
                      num_records: int = 4, seed: int = 0) -> dict[str, Any]:
    """Train `model_name` in fp32 for `steps` steps; at `num_records` evenly spaced steps record every
    activation gradient and classify it as fp16 would store it, unscaled and times the loss scale."""
    from zerokit.core.precision import LossScaler
    from zerokit.models import CharCorpus, build_model

    if steps < 1 or num_records < 1:
        raise ValueError(f"--steps ({steps}) and num_records ({num_records}) must be >= 1")
    scale = LossScaler().scale  # the fp16 initial loss scale the engine would start with
    model = build_model(model_name, seed=seed)
    corpus = CharCorpus.load()
    block_size = model.cfg.block_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    record_at = sorted({round(i * (steps - 1) / max(num_records - 1, 1)) for i in range(num_records)})
    recorder = ActivationGradRecorder(model)
    per_step: list[dict[str, Any]] = []
    totals = {"unscaled": dict.fromkeys(FP16_CATEGORIES, 0), "scaled": dict.fromkeys(FP16_CATEGORIES, 0)}
    hist_unscaled = torch.zeros(_LOG2_HI - _LOG2_LO, dtype=torch.long)
    hist_scaled = torch.zeros_like(hist_unscaled)
    try:
        for step in range(steps):
            x, y = corpus.batch(batch_size, block_size, step)
            recording = step in record_at
            if recording:
                recorder.start()
            _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if recording:
                grads = recorder.stop()  # (num activation elements,) fp32
                row: dict[str, Any] = {"step": step, "loss": loss.item(), "num_values": grads.numel()}
                for key, s in (("unscaled", 1.0), ("scaled", scale)):
                    counts = classify_fp16(grads, s)
                    for k, v in counts.items():
                        totals[key][k] += v
                    row[key] = _fractions(counts)
                hist_unscaled += _log2_histogram(grads)
                hist_scaled += _log2_histogram(grads * scale)
                nonzero = grads[grads != 0].abs()
                row["median_abs_grad"] = float(nonzero.median()) if nonzero.numel() else 0.0
                per_step.append(row)
            optimizer.step()
    finally:
        recorder.remove()

    fp16 = layout(torch.float16)
    total = {key: _fractions(c) for key, c in totals.items()}
    nonzero_frac = 1.0 - total["unscaled"]["fp32_zero"]
    flushed_of_nonzero = total["unscaled"]["flushed_to_zero"] / nonzero_frac if nonzero_frac else 0.0
    return {
        "model": model_name,
        "steps": steps,
        "batch_size": batch_size,
        "block_size": block_size,
        "lr": lr,
        "record_steps": record_at,
        "loss_scale": scale,
        "fp16": {k: fp16[k] for k in ("smallest_subnormal", "smallest_normal", "max")},
        "per_step": per_step,
        "total": total,
        "unscaled_flushed_fraction_of_nonzero": flushed_of_nonzero,
        "lecture_claim": "more than half of the activation gradients become zero in fp16 (no loss scaling)",
        "lecture_claim_holds_here": flushed_of_nonzero > 0.5,
        "log2_hist": {"lo": _LOG2_LO, "unscaled": hist_unscaled.tolist(), "scaled": hist_scaled.tolist()},
        "versions": {"torch": torch.__version__},
    }


def plot_histogram(result: dict[str, Any], path: Path) -> None:
    """log2|g| histogram of the recorded activation gradients, unscaled and scaled, fp16 limits marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo = result["log2_hist"]["lo"]
    unscaled = result["log2_hist"]["unscaled"]
    scaled = result["log2_hist"]["scaled"]
    used = [i for i, (a, b) in enumerate(zip(unscaled, scaled)) if a or b]
    fig, ax = plt.subplots(figsize=(10, 5))
    if used:
        first, last = max(used[0] - 2, 0), min(used[-1] + 3, len(unscaled))
        edges = [lo + i for i in range(first, last + 1)]
        total = max(sum(unscaled), 1)
        ax.stairs([c / total for c in unscaled[first:last]], edges, label="|g| (no scaling)", fill=True, alpha=0.5)
        ax.stairs([c / total for c in scaled[first:last]], edges,
                  label=f"|g| x {result['loss_scale']:g} (loss scale)", fill=True, alpha=0.5)
    fp16 = result["fp16"]
    for value, label, style in ((fp16["smallest_subnormal"], "fp16 smallest subnormal", ":"),
                                (fp16["smallest_normal"], "fp16 smallest normal", "--"),
                                (fp16["max"], "fp16 max", "-")):
        ax.axvline(math.log2(value), color="k", linestyle=style, label=f"{label} = 2^{math.log2(value):.2f}")
    flushed = result["total"]["unscaled"]["flushed_to_zero"]
    ax.set_title(f"activation gradients of the {result['model']} GPT, steps {result['record_steps']}: "
                 f"{flushed:.1%} flush to zero in fp16 unscaled, "
                 f"{result['total']['scaled']['flushed_to_zero']:.1%} scaled")
    ax.set_xlabel("log2 |dL/d activation|")
    ax.set_ylabel("fraction of nonzero values")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from zerokit.cli import positive_int

    parser.add_argument("--values", type=float, nargs="+", default=list(DEFAULT_VALUES),
                        help="values to show in every format (default: %(default)s)")
    parser.add_argument("--underflow", action="store_true",
                        help="train the tiny GPT in fp32 and measure how its activation gradients fare in fp16")
    parser.add_argument("--quant", action="store_true",
                        help="NF4's levels and the error of NF4, int8 and uniform 4-bit codes (zerokit/quant.py)")
    parser.add_argument("--steps", type=positive_int, default=30,
                        help="training steps for --underflow and --quant (>= 1)")
    parser.add_argument("--model", default="tiny", help="model preset for --underflow and --quant")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="batch size for --underflow (>= 1)")
    parser.add_argument("--out", type=Path, default=Path("out/formats"),
                        help="where --underflow writes PNG and JSON, --quant its JSON")


def _print_tables(values: list[float]) -> bool:
    table = format_table()
    print(f"{'format':6} {'bits':>4} {'sign':>4} {'exp':>4} {'mant':>4} {'bias':>5} {'largest':>12} "
          f"{'min normal':>12} {'min subnormal':>14} {'eps':>12}")
    for row in table:
        print(f"{row['format']:6} {row['bits']:4d} {row['sign_bits']:4d} {row['exponent_bits']:4d} "
              f"{row['mantissa_bits']:4d} {row['exponent_bias']:5d} {row['max']:12.5g} {row['smallest_normal']:12.5g} "
              f"{row['smallest_subnormal']:14.5g} {row['eps']:12.5g}")
    print()
    for x in values:
        print(f"{x!r}:")
        for name in FORMATS:
            d = decompose(x, name)
            err = "" if d["relative_error"] is None else f"  rel. error {d['relative_error']:.2g}"
            print(f"  {name:5} {d['sign']} {d['exponent_bits']:>8} {d['mantissa_bits']:<23} -> {d['value']!r:<24} "
                  f"{d['kind']}{err}")
    print("\nCS224N lecture 12's claims, checked against the bits:")
    all_hold = True
    for c in lecture_checks():
        all_hold &= c["holds"]
        print(f"  [{'PASS' if c['holds'] else 'FAIL'}] {c['claim']}: {c['evidence']}")
    return all_hold


def _print_underflow(result: dict[str, Any]) -> None:
    print(f"\nActivation gradients of the {result['model']} GPT (fp32 training, batch {result['batch_size']} x "
          f"{result['block_size']}), recorded at steps {result['record_steps']}, cast to fp16:")
    head = f"{'step':>5} {'loss':>7} {'values':>9}  " + "  ".join(f"{k:>15}" for k in FP16_CATEGORIES)
    for key, label in (("unscaled", "no loss scale"), ("scaled", f"loss scale {result['loss_scale']:g}")):
        print(f"\n{label}:\n{head}")
        for row in result["per_step"]:
            print(f"{row['step']:5d} {row['loss']:7.3f} {row['num_values']:9d}  "
                  + "  ".join(f"{row[key][k]:15.2%}" for k in FP16_CATEGORIES))
        print(f"{'all':>5} {'':7} {sum(r['num_values'] for r in result['per_step']):9d}  "
              + "  ".join(f"{result['total'][key][k]:15.2%}" for k in FP16_CATEGORIES))
    frac = result["unscaled_flushed_fraction_of_nonzero"]
    verdict = "holds" if result["lecture_claim_holds_here"] else "does NOT hold"
    print(f"\nCS224N lecture 12: '{result['lecture_claim']}'. Here {frac:.1%} of the nonzero activation gradients flush to "
          f"zero without scaling, so the claim {verdict} for this model (the lecture's figure comes from a "
          f"different, larger network; the fraction depends on the model, the batch and the loss reduction).")
    print(f"Without scaling another {result['total']['unscaled']['subnormal']:.1%} land in fp16's subnormal range, "
          f"where they keep fewer than 11 significant bits.")
    scaled = result["total"]["scaled"]
    print(f"With the loss scale: {scaled['flushed_to_zero']:.2%} flush to zero, {scaled['subnormal']:.2%} subnormal, "
          f"{scaled['overflow']:.4%} overflow to inf.")


# ---------------------------------------------------------------- quantization error
def _uniform4(w: torch.Tensor, block_size: int = 64) -> torch.Tensor:
    """A uniform 4-bit code: per block, round(x / absmax * 7) in [-7, 7], dequantized."""
    blocks = w.reshape(-1, block_size)
    absmax = blocks.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return (torch.round(blocks / absmax * 7) / 7 * absmax).reshape(w.shape)


def quantization_errors(weights: list[torch.Tensor], block_size: int = 64) -> dict[str, dict[str, float]]:
    """Relative RMS and max error of each code over `weights` (each a multiple of block_size), with bytes/param."""
    from zerokit import quant
    out = {}
    for code in ("nf4", "int8", "uniform4"):
        sq_err = sq = 0.0
        max_err = max_w = 0.0
        for w in weights:
            w = w.detach().float().reshape(-1)
            if code == "uniform4":
                wq = _uniform4(w, block_size)
            else:
                spec = quant.QuantSpec(code, (w.numel(),), block_size)
                wq = quant.dequantize_tensor(quant.quantize_tensor(w, spec), spec)
            err = (w - wq).double()
            sq_err += float((err ** 2).sum())
            sq += float((w.double() ** 2).sum())
            max_err, max_w = max(max_err, float(err.abs().max())), max(max_w, float(w.abs().max()))
        out[code] = {"rms_relative": math.sqrt(sq_err / sq), "max_relative": max_err / max_w,
                     "bytes_per_param": quant.bytes_per_element("nf4" if code == "uniform4" else code, block_size)}
    return out


def measure_quantization(model_name: str = "tiny", steps: int = 30, batch_size: int = 16, seed: int = 0) -> dict:
    """NF4 levels, and the three codes' errors on N(0, 1) weights and on the trained GPT's Linear weights."""
    from zerokit import quant
    from zerokit.models import CharCorpus, build_model
    normal = torch.randn(1 << 20, generator=torch.Generator().manual_seed(seed))
    model = build_model(model_name, seed=seed)
    corpus = CharCorpus.load()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = corpus.batch(batch_size, model.cfg.block_size, step)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    linears = [m.weight for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    return {"levels": quant.nf4_levels().tolist(), "block_size": 64, "double_quant": True,
            "normal": quantization_errors([normal]), "model": model_name, "steps": steps,
            "final_loss": losses[-1] if losses else None,
            "trained": quantization_errors([w for w in linears if w.numel() % 64 == 0]),
            "trained_params": sum(w.numel() for w in linears)}


def _print_quantization(result: dict[str, Any]) -> None:
    print("\nNF4's 16 levels (QLoRA: N(0, 1) quantiles scaled to [-1, 1], an exact 0):")
    print("  " + " ".join(f"{v:+.4f}" for v in result["levels"]))
    print(f"\nQuantization error, blocks of {result['block_size']}, absmax constants double-quantized "
          f"(relative: RMS(W - W_q) / RMS(W), max|W - W_q| / max|W|):")
    print(f"{'code':9} {'B/param':>8}  {'normal RMS':>10} {'normal max':>10}  {'GPT RMS':>10} {'GPT max':>10}")
    for code in ("nf4", "int8", "uniform4"):
        n, t = result["normal"][code], result["trained"][code]
        print(f"{code:9} {n['bytes_per_param']:8.4f}  {n['rms_relative']:10.4%} {n['max_relative']:10.4%}  "
              f"{t['rms_relative']:10.4%} {t['max_relative']:10.4%}")
    print(f"normal: 2^20 draws of N(0, 1); GPT: the {result['trained_params']:,} Linear weights of the "
          f"{result['model']} GPT after {result['steps']} AdamW steps (loss {result['final_loss']:.3f}), head excepted")


def run(args: argparse.Namespace) -> int:
    ok = _print_tables(args.values)
    if getattr(args, "quant", False):
        result = measure_quantization(model_name=args.model, steps=args.steps, batch_size=args.batch_size)
        _print_quantization(result)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quantization.json").write_text(json.dumps(result, indent=1))
        print(f"\nwrote {args.out / 'quantization.json'}")
    if args.underflow:
        result = measure_underflow(steps=args.steps, model_name=args.model, batch_size=args.batch_size)
        _print_underflow(result)
        args.out.mkdir(parents=True, exist_ok=True)
        json_path, png_path = args.out / "underflow.json", args.out / "underflow.png"
        json_path.write_text(json.dumps(result, indent=1))
        plot_histogram(result, png_path)
        print(f"\nwrote {json_path} and {png_path}")
    return 0 if ok else 1
