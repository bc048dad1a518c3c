"""The number-format lesson: the computed table against the lecture's numbers, and the underflow run."""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerokit.cli import main as cli_main
from zerokit.commands.formats import (
    FP16_CATEGORIES,
    ActivationGradRecorder,
    classify_fp16,
    decompose,
    format_table,
    lecture_checks,
)


def _rows() -> dict[str, dict]:
    return {row["format"]: row for row in format_table()}


def test_table_bit_layouts_match_the_lecture():
    """fp32 is 1+8+23 bits, fp16 1+5+10, bf16 1+8+7 (the lecture's table), all derived from bit patterns."""
    rows = _rows()
    for name, (bits, exp, mant) in {"fp32": (32, 8, 23), "fp16": (16, 5, 10), "bf16": (16, 8, 7)}.items():
        row = rows[name]
        assert (row["bits"], row["sign_bits"], row["exponent_bits"], row["mantissa_bits"]) == (bits, 1, exp, mant)


def test_table_limits_match_the_lecture_numbers():
    """fp16 max 65504, smallest normal ~6.1e-5, smallest subnormal ~6e-8; bf16 range equals fp32's."""
    rows = _rows()
    fp16, bf16, fp32 = rows["fp16"], rows["bf16"], rows["fp32"]
    assert fp16["max"] == 65504.0
    assert fp16["smallest_normal"] == pytest.approx(6.1e-5, rel=0.01)
    assert fp16["smallest_subnormal"] == pytest.approx(5.96e-8, rel=0.01)
    assert fp16["eps"] == pytest.approx(9.77e-4, rel=0.01)
    assert bf16["eps"] == pytest.approx(7.81e-3, rel=0.01)
    assert bf16["smallest_normal"] == fp32["smallest_normal"] == pytest.approx(1.18e-38, rel=0.01)
    assert bf16["max"] == pytest.approx(3.39e38, rel=0.01) and fp32["max"] == pytest.approx(3.40e38, rel=0.01)
    assert fp16["exponent_bias"] == 15 and bf16["exponent_bias"] == fp32["exponent_bias"] == 127


def test_lecture_rounding_examples():
    """1.0001 rounds to 1.0 in fp16 and bf16 (not fp32); 6e-5 is subnormal and 1e-8 zero in fp16, normal in bf16."""
    assert decompose(1.0001, "fp16")["value"] == 1.0
    assert decompose(1.0001, torch.bfloat16)["value"] == 1.0
    assert decompose(1.0001, "fp32")["value"] != 1.0
    assert decompose(6e-5, "fp16")["kind"] == "subnormal"
    assert decompose(1e-8, "fp16")["kind"] == "zero" and decompose(1e-8, "fp16")["value"] == 0.0
    assert decompose(1e-8, "bf16")["kind"] == "normal"
    assert decompose(1e5, "fp16")["kind"] == "inf"


def test_decompose_bit_strings_of_known_values():
    """1.0 is the bias in the exponent field with an empty mantissa; -2.0 sets the sign bit; nan is a nan."""
    one = decompose(1.0, "fp16")
    assert (one["sign"], one["exponent_bits"], one["mantissa_bits"], one["exponent"]) == (0, "01111", "0" * 10, 0)
    minus_two = decompose(-2.0, "bf16")
    assert (minus_two["sign"], minus_two["exponent_bits"], minus_two["mantissa_bits"]) == (1, "10000000", "0" * 7)
    assert decompose(float("nan"), "fp32")["kind"] == "nan"
    with pytest.raises(ValueError, match="fp8"):
        decompose(1.0, "fp8")


@settings(max_examples=300, deadline=None)
@given(x=st.floats(allow_nan=False, allow_infinity=False, width=64), name=st.sampled_from(["fp32", "fp16", "bf16"]))
def test_decompose_fields_rebuild_the_rounded_value(x, name):
    """sign * 2^exponent * (implicit bit + mantissa) rebuilds exactly the value torch stores, for any float."""
    d = decompose(x, name)
    stored = torch.tensor(x, dtype=torch.float64).to(getattr(torch, {"fp32": "float32", "fp16": "float16",
                                                                   "bf16": "bfloat16"}[name])).item()
    assert d["value"] == stored
    if d["kind"] in ("inf", "zero"):
        assert math.isinf(stored) if d["kind"] == "inf" else stored == 0.0
        return
    m_bits = len(d["mantissa_bits"])
    fraction = int(d["mantissa_bits"], 2) / 2**m_bits
    lead = 1.0 if d["kind"] == "normal" else 0.0  # subnormals drop the implicit leading 1
    rebuilt = (-1.0) ** d["sign"] * 2.0 ** d["exponent"] * (lead + fraction)
    assert rebuilt == stored


def test_every_lecture_check_holds():
    """All of the lecture's format claims hold against the measured layouts."""
    checks = lecture_checks()
    assert len(checks) >= 8
    failed = [c for c in checks if not c["holds"]]
    assert not failed, failed


def test_classify_fp16_on_values_at_the_edges():
    """Exact zero, below/at half the smallest subnormal, subnormal, normal, max and past max land where IEEE says."""
    values = torch.tensor([
        0.0,               # fp32_zero
        2.0**-26,          # flushed: under half the smallest subnormal
        2.0**-25,          # flushed: exactly half rounds to even (0)
        1.5 * 2.0**-25,    # subnormal: rounds up to 2^-24
        -2.0**-20,         # subnormal
        2.0**-14,          # normal: the smallest normal
        65504.0,           # normal: the max
        65520.0,           # overflow: the midpoint to 65536 rounds to even, which is inf
        -1e5,              # overflow
    ])
    assert classify_fp16(values) == {"fp32_zero": 1, "flushed_to_zero": 2, "subnormal": 2, "normal": 2,
                                     "overflow": 2}
    # Scaling by 2^16 moves the tiny ones up into the normal range and the large ones further into inf.
    scaled = classify_fp16(values, scale=2.0**16)
    assert scaled == {"fp32_zero": 1, "flushed_to_zero": 0, "subnormal": 0, "normal": 5, "overflow": 3}


def test_classify_fp16_flush_count_equals_the_half_subnormal_threshold():
    """On random log-uniform values, 'flushed to zero' is exactly 0 < |g| <= smallest subnormal / 2."""
    gen = torch.Generator().manual_seed(0)
    g = torch.exp2(torch.empty(100_000).uniform_(-40, 0, generator=gen)) * torch.randn(100_000, generator=gen).sign()
    half_sub = torch.finfo(torch.float16).smallest_normal * torch.finfo(torch.float16).eps / 2
    counts = classify_fp16(g)
    assert counts["flushed_to_zero"] == int(((g.abs() <= half_sub) & (g != 0)).sum())
    assert counts["flushed_to_zero"] > 0 and counts["subnormal"] > 0 and counts["normal"] > 0


def test_recorder_captures_activation_gradients_not_parameter_gradients():
    """The recorder sees dL/d(output) of each module once (containers deduplicated), equal to the hand-derived one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x = torch.randn(5, 3)
    recorder = ActivationGradRecorder(model)
    recorder.start()
    model(x).sum().backward()
    grads = recorder.stop()
    recorder.remove()
    # Three distinct activations: Linear1 out (5,4), Tanh out (5,4), Linear2 out (5,2) == Sequential out.
    assert grads.numel() == 5 * 4 + 5 * 4 + 5 * 2
    w2 = model[2].weight.detach()  # (2, 4)
    h = torch.tanh(model[0](x)).detach()
    expected = torch.cat([
        (w2.sum(0) * (1 - h**2)).flatten(),  # dL/d(Linear1 out): through tanh'
        w2.sum(0).expand(5, 4).flatten(),     # dL/d(Tanh out) = ones @ W2
        torch.ones(10),                       # dL/d(Linear2 out) = 1 for a sum
    ])
    # Hooks fire in backward order; compare as multisets. Tolerance: fp32 rounding of one matmul.
    torch.testing.assert_close(grads.sort().values, expected.sort().values, rtol=1e-6, atol=1e-7)
    # Outside start/stop nothing is recorded.
    model(x).sum().backward()
    assert recorder.stop().numel() == 0


def test_underflow_command_writes_png_and_json(tmp_path, capsys):
    """`zerokit formats --underflow --steps 3` writes a PNG and a JSON whose fractions are in [0, 1] and sum to 1."""
    assert cli_main(["formats", "--underflow", "--steps", "3", "--out", str(tmp_path)]) == 0
    png, js = tmp_path / "underflow.png", tmp_path / "underflow.json"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(js.read_text())
    assert result["loss_scale"] == 2.0**16
    assert result["record_steps"] == [0, 1, 2] and len(result["per_step"]) == 3
    for row in [*result["per_step"], result["total"]]:
        for key in ("unscaled", "scaled"):
            fractions = row[key]
            assert set(fractions) == set(FP16_CATEGORIES)
            assert all(0.0 <= f <= 1.0 for f in fractions.values())
            assert sum(fractions.values()) == pytest.approx(1.0, abs=1e-9)
    for row in result["per_step"]:
        assert row["num_values"] > 0 and math.isfinite(row["loss"])
    # Scaling by 2^16 can only move values up: fewer flush to zero than without it.
    assert result["total"]["scaled"]["flushed_to_zero"] <= result["total"]["unscaled"]["flushed_to_zero"]
    assert sum(result["log2_hist"]["unscaled"]) == sum(result["log2_hist"]["scaled"]) > 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "flush to zero" in out
