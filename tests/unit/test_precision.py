"""Precision policy validation, the fp16 loss-scaler state machine, and the overflow check."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerokit.core.precision import (
    PRECISIONS,
    LossScaler,
    PrecisionPolicy,
    has_inf_or_nan,
    make_loss_scaler,
    make_policy,
)


# ---------------------------------------------------------------- policy

@pytest.mark.parametrize("name,dtype,master,scaler", [
    ("fp32", torch.float32, False, False),
    ("bf16", torch.bfloat16, True, False),
    ("fp16", torch.float16, True, True),
])
def test_policy_defaults_follow_the_name(name, dtype, master, scaler):
    """Each name sets param and reduce dtype, fp32 masters, and whether masters and a scaler are needed."""
    policy = make_policy(name)
    assert policy.name == name
    assert policy.param_dtype == dtype
    assert policy.reduce_dtype == dtype
    assert policy.master_dtype == torch.float32
    assert policy.needs_master is master
    assert policy.uses_loss_scaler is scaler
    assert (make_loss_scaler(policy) is not None) is scaler


def test_policy_reduce_dtype_override_by_dtype_or_name():
    """bf16 params with fp32 reductions can be asked for with a dtype or a name; the policy stays bf16."""
    for reduce in (torch.float32, "fp32"):
        policy = make_policy("bf16", reduce_dtype=reduce)
        assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    again = make_policy(make_policy("fp16"), reduce_dtype=torch.float32)
    assert again.name == "fp16" and again.reduce_dtype == torch.float32


def test_unknown_precision_name_lists_the_valid_ones():
    """A typo raises ValueError naming every valid precision."""
    with pytest.raises(ValueError) as info:
        make_policy("fp8")
    for name in PRECISIONS:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="fp32"):
        make_policy("fp32", reduce_dtype="float64")
    with pytest.raises(ValueError, match="reduce_dtype"):
        make_policy("fp32", reduce_dtype=torch.int32)
    with pytest.raises(TypeError):
        make_policy(torch.float16)


def test_policy_rejects_inconsistent_dtypes():
    """A policy whose param dtype contradicts its name, or non-fp32 masters, is refused."""
    with pytest.raises(ValueError, match="param_dtype"):
        PrecisionPolicy("bf16", param_dtype=torch.float16)
    with pytest.raises(ValueError, match="master_dtype"):
        PrecisionPolicy("fp16", master_dtype=torch.float16)


def test_policy_is_frozen():
    """Policies are immutable values (safe to share between stages and ranks)."""
    policy = make_policy("bf16")
    with pytest.raises(Exception):
        policy.param_dtype = torch.float32  # type: ignore[misc]


# ---------------------------------------------------------------- loss scaler

def _reference_scale_trace(overflows: list[bool], init: float, interval: int, hysteresis: int,
                           min_scale: float) -> list[float]:
    """An independent restatement of the documented rules, tracking the exponent as an integer."""
    exponent, clean, budget, trace = 0, 0, hysteresis, []
    min_exponent = round(math.log2(min_scale / init))
    for overflow in overflows:
        if overflow:
            clean = 0
            if budget > 1:
                budget -= 1
            else:
                exponent = max(exponent - 1, min_exponent)
        else:
            clean += 1
            if clean == interval:
                exponent, clean, budget = exponent + 1, 0, hysteresis
        trace.append(init * 2.0**exponent)
    return trace


@settings(max_examples=200, deadline=None)
@given(
    overflows=st.lists(st.booleans(), max_size=120),
    interval=st.integers(1, 6),
    hysteresis=st.integers(1, 4),
    init_exponent=st.integers(4, 16),
)
def test_scaler_follows_documented_state_machine(overflows, interval, hysteresis, init_exponent):
    """Random overflow/clean sequences: the scale is init*2^k within [min, ...], backs off after the
    hysteresis budget, grows exactly every growth_interval clean steps, and matches the rules."""
    init, min_scale = 2.0**init_exponent, 1.0
    scaler = LossScaler(init_scale=init, growth_interval=interval, hysteresis=hysteresis, min_scale=min_scale)
    expected = _reference_scale_trace(overflows, init, interval, hysteresis, min_scale)
    clean_run = 0
    for step, overflow in enumerate(overflows):
        before = scaler.scale
        at_min_with_no_budget = before == min_scale and scaler._hysteresis_left == 1
        if overflow and at_min_with_no_budget:
            with pytest.raises(RuntimeError, match="stuck at minimum"):
                scaler.update(True)
            return
        scaler.update(overflow)
        after = scaler.scale
        assert after == expected[step], (step, overflows[: step + 1], after, expected[step])
        # Always an exact power-of-two multiple of init, never below the minimum.
        ratio = math.log2(after / init)
        assert ratio == int(ratio) and after >= min_scale
        clean_run = 0 if overflow else clean_run + 1
        if overflow:
            assert after in (before, before / 2)  # tolerated (hysteresis) or halved
        elif clean_run % interval == 0:
            assert after == before * 2  # exactly at the growth_interval-th consecutive clean step
        else:
            assert after == before


def test_hysteresis_tolerates_overflows_before_backing_off():
    """hysteresis=3: two overflows keep the scale, the third halves it; the budget refills only on growth."""
    scaler = LossScaler(init_scale=1024.0, growth_interval=3, hysteresis=3)
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 1024.0
    scaler.update(True)
    assert scaler.scale == 512.0
    scaler.update(False)  # one clean step does not refill the budget (DeepSpeed's default)
    scaler.update(True)
    assert scaler.scale == 256.0
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 512.0  # grew, and the budget is full again
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 512.0


def test_overflow_resets_the_growth_counter():
    """An overflow in the middle of a clean window restarts the count of clean steps."""
    scaler = LossScaler(init_scale=64.0, growth_interval=4)
    for _ in range(3):
        scaler.update(False)
    scaler.update(True)
    assert scaler.scale == 32.0
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 32.0
    scaler.update(False)
    assert scaler.scale == 64.0


def test_default_configuration_matches_deepspeed_fp16_defaults():
    """Defaults: 2**16 initial scale, x2 growth every 2000 clean steps, x0.5 backoff, min 1, hysteresis 1."""
    scaler = LossScaler()
    assert scaler.scale == 2.0**16
    for _ in range(1999):
        scaler.update(False)
    assert scaler.scale == 2.0**16
    scaler.update(False)
    assert scaler.scale == 2.0**17
    scaler.update(True)
    assert scaler.scale == 2.0**16


@given(st.lists(st.booleans(), max_size=200))
def test_static_scaler_never_changes(overflows):
    """dynamic=False: the scale is constant whatever happens, and overflows never raise."""
    scaler = LossScaler(init_scale=128.0, growth_interval=1, min_scale=128.0, dynamic=False)
    for overflow in overflows:
        scaler.update(overflow)
        assert scaler.scale == 128.0
    assert scaler.num_overflows == sum(overflows)


def test_stuck_at_min_scale_raises_with_advice():
    """At min_scale with the hysteresis budget spent, another overflow raises a RuntimeError that says why."""
    scaler = LossScaler(init_scale=4.0, min_scale=1.0, hysteresis=2)
    scaler.update(True)   # budget 2 -> 1
    scaler.update(True)   # 4 -> 2
    scaler.update(True)   # 2 -> 1
    assert scaler.scale == 1.0
    with pytest.raises(RuntimeError) as info:
        scaler.update(True)
    message = str(info.value)
    assert "stuck at minimum" in message and "bf16" in message and "diverged" in message


def test_backoff_clamps_at_min_scale_before_raising():
    """A min_scale that is not init/2^k is reached by clamping; only the overflow after that raises."""
    scaler = LossScaler(init_scale=8.0, min_scale=3.0)
    scaler.update(True)
    assert scaler.scale == 4.0
    scaler.update(True)
    assert scaler.scale == 3.0
    with pytest.raises(RuntimeError, match="stuck at minimum"):
        scaler.update(True)


@given(st.lists(st.booleans(), max_size=60), st.lists(st.booleans(), max_size=60))
def test_state_dict_round_trip_continues_identically(prefix, suffix):
    """A scaler restored from state_dict behaves exactly like the original on any continuation."""
    # min_scale far below reach so 120 overflows cannot hit the stuck-at-minimum error.
    config = dict(init_scale=2.0**20, growth_interval=3, hysteresis=2, min_scale=2.0**-120)
    original = LossScaler(**config)
    for overflow in prefix:
        original.update(overflow)
    restored = LossScaler()  # different defaults: the checkpoint's configuration must win
    restored.load_state_dict(original.state_dict())
    assert restored.state_dict() == original.state_dict()
    for overflow in suffix:
        original.update(overflow)
        restored.update(overflow)
        assert restored.scale == original.scale
    assert restored.state_dict() == original.state_dict()


def test_load_state_dict_rejects_missing_keys():
    """A truncated state dict names the keys it lacks."""
    with pytest.raises(ValueError, match="hysteresis_left"):
        LossScaler().load_state_dict({"scale": 2.0})


@pytest.mark.parametrize("kwargs,word", [
    (dict(init_scale=0.0), "init_scale"),
    (dict(init_scale=float("inf")), "init_scale"),
    (dict(min_scale=-1.0), "min_scale"),
    (dict(init_scale=1.0, min_scale=2.0), "min_scale"),
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(growth_interval=0, dynamic=True), "growth_interval"),
    (dict(growth_interval=-1), "growth_interval"),
    (dict(hysteresis=0), "hysteresis"),
])
def test_scaler_rejects_bad_configuration(kwargs, word):
    """Each invalid knob raises ValueError naming it."""
    with pytest.raises(ValueError, match=word):
        LossScaler(**kwargs)


def test_growth_interval_zero_is_a_static_scale():
    """`{"init_scale": 1.0, "growth_interval": 0}` (never grow) is a static scale: no growth, no backoff,
    overflows still counted; the state round-trips (GradScaler [Note: a static scale of 1])."""
    scaler = LossScaler(init_scale=1.0, growth_interval=0)
    assert scaler.dynamic is False
    for overflow in (False, True, False, True, True):
        scaler.update(overflow)
        assert scaler.scale == 1.0
    assert scaler.num_overflows == 3
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict() and restored.dynamic is False


# ---------------------------------------------------------------- has_inf_or_nan

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_has_inf_or_nan_finds_one_bad_element(dtype, bad):
    """One inf, -inf or nan anywhere among several tensors flips the flag to 1.0 (float32 scalar)."""
    tensors = [torch.randn(7, 15).to(dtype), torch.randn(33).to(dtype), torch.randn(4, 4).to(dtype)]
    assert has_inf_or_nan(tensors).item() == 0.0
    tensors[1][17] = bad
    flag = has_inf_or_nan(tensors)
    assert flag.dtype == torch.float32 and flag.dim() == 0
    assert flag.item() == 1.0


def test_has_inf_or_nan_clean_and_edge_cases():
    """Clean tensors, huge finite values, empty tensors and an empty list all read 0.0."""
    big = torch.full((1000,), torch.finfo(torch.float32).max)  # a sum or 2-norm would overflow here
    fp16_max = torch.full((10,), torch.finfo(torch.float16).max, dtype=torch.float16)
    assert has_inf_or_nan([big, fp16_max]).item() == 0.0
    assert has_inf_or_nan([torch.empty(0), torch.zeros(3)]).item() == 0.0
    empty = has_inf_or_nan([])
    assert empty.dtype == torch.float32 and empty.item() == 0.0
    assert has_inf_or_nan([torch.empty(0), torch.tensor([float("nan")])]).item() == 1.0
