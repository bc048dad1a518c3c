"""The analytic memory formulas (core/accounting/estimate.py), `zerokit memory` and `zerokit plan`.

No process group. Activation estimates are checked against the tensors autograd really saves in
a forward pass of models.GPT (captured with saved_tensors_hooks).
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerokit.cli import main, parse_bytes, parse_count
from zerokit.commands.plan import guess_shape, lora_adapter_params, plan
from zerokit.core.accounting.estimate import (
    MemoryEstimate,
    activation_bytes_estimate,
    estimate,
    per_rank_formula,
    stage2_in_flight_grad_bytes,
    tied_head_grad_bytes,
    zero3_working_set_bytes,
)

psis = st.integers(min_value=0, max_value=10**13)
world_sizes = st.integers(min_value=1, max_value=4096)
stages = st.sampled_from([0, 1, 2, 3])
fast = settings(max_examples=200, deadline=None)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- the lecture's numbers

def test_lecture_table_7_5b_params_on_64_ranks():
    """Ψ = 7.5e9, N = 64, bf16 + Adam gives the lecture's 120 / 31.4 / 16.6 / 1.9 GB per rank."""
    totals_gb = [round(estimate(7.5e9, 64, stage).total / 1e9, 1) for stage in range(4)]
    assert totals_gb == [120.0, 31.4, 16.6, 1.9]


def test_lecture_formula_strings_for_mixed_adam():
    """per_rank_formula spells the design's (docs/design.md) column: 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N."""
    assert [per_rank_formula(s) for s in range(4)] == ["16Ψ", "4Ψ+12Ψ/N", "2Ψ+14Ψ/N", "16Ψ/N"]
    assert [per_rank_formula(s, "fp32") for s in range(4)] == ["16Ψ", "8Ψ+8Ψ/N", "4Ψ+12Ψ/N", "16Ψ/N"]


# ----------------------------------------------------------------------------- formulas, all Ψ and N

@fast
@given(psi=psis, n=world_sizes)
def test_mixed_adam_matches_design_table_at_padded_shards(psi, n):
    """bf16/fp16 + Adam: every category equals the design's (docs/design.md) formula with Ψ/N replaced by ceil(Ψ/N)."""
    s = ceil_div(psi, n)
    for precision in ("bf16", "fp16"):
        expected = {  # (params, grads, master, states) per stage
            0: (2 * psi, 2 * psi, 4 * psi, 8 * psi),
            1: (2 * psi, 2 * psi, 4 * s, 8 * s),
            2: (2 * psi, 2 * s, 4 * s, 8 * s),
            3: (2 * s, 2 * s, 4 * s, 8 * s),
        }
        for stage, (p, g, m, o) in expected.items():
            est = estimate(psi, n, stage, precision)
            assert (est.params, est.grads, est.master_params, est.optimizer_states) == (p, g, m, o), (stage, est)
            assert est.activations == 0 and est.total == p + g + m + o


@fast
@given(psi=psis, n=world_sizes)
def test_fp32_adam_has_no_master_copy_and_matches_design(psi, n):
    """fp32 + Adam: params 4Ψ, grads 4Ψ, states 8Ψ, master 0, sharded stage by stage."""
    s = ceil_div(psi, n)
    expected = {0: (4 * psi, 4 * psi, 8 * psi), 1: (4 * psi, 4 * psi, 8 * s),
                2: (4 * psi, 4 * s, 8 * s), 3: (4 * s, 4 * s, 8 * s)}
    for stage, (p, g, o) in expected.items():
        est = estimate(psi, n, stage, "fp32")
        assert (est.params, est.grads, est.master_params, est.optimizer_states) == (p, g, 0, o), (stage, est)


@fast
@given(psi=psis, n=world_sizes, stage=stages)
def test_padding_costs_less_than_one_element_per_rank(psi, n, stage):
    """The padded estimate exceeds the design's (docs/design.md) real-valued formula by less than one element's sharded bytes."""
    est = estimate(psi, n, stage)
    sharded = {0: 0, 1: 12, 2: 14, 3: 16}[stage]  # bytes per param that stage shards
    exact = Fraction(16 - sharded) * psi + Fraction(sharded * psi, n)
    assert 0 <= est.total - exact < sharded or (sharded == 0 and est.total == exact)


@fast
@given(psi=psis, n=world_sizes,
       precision=st.sampled_from(["fp32", "bf16", "fp16"]),
       optimizer=st.sampled_from(["adam", "adamw", "sgd_momentum", "sgd"]), stage=stages)
def test_formula_string_evaluates_to_the_estimate(psi, n, precision, optimizer, stage):
    """Substituting Ψ and ceil(Ψ/N) into per_rank_formula's text gives estimate(...).total exactly."""
    text = per_rank_formula(stage, precision, optimizer)
    value = 0
    for coef, per_n in re.findall(r"(\d+)Ψ(/N)?", text):
        value += int(coef) * (ceil_div(psi, n) if per_n else psi)
    assert text == "0" or re.fullmatch(r"\d+Ψ(\+\d+Ψ/N)?|\d+Ψ/N", text), text
    assert value == estimate(psi, n, stage, precision, optimizer).total


@fast
@given(psi=psis, n=world_sizes, precision=st.sampled_from(["fp32", "bf16", "fp16"]),
       optimizer=st.sampled_from(["adam", "sgd_momentum", "sgd"]))
def test_every_category_shrinks_or_stays_with_each_stage(psi, n, precision, optimizer):
    """Going from stage k to k + 1 never increases any category on a rank."""
    ests = [estimate(psi, n, s, precision, optimizer).as_dict() for s in range(4)]
    for lower, higher in zip(ests, ests[1:]):
        assert all(higher[k] <= lower[k] for k in lower), (lower, higher)


@fast
@given(psi=psis, stage=stages)
def test_one_rank_shards_nothing(psi, stage):
    """At world size 1 every stage holds exactly what DDP holds."""
    assert estimate(psi, 1, stage) == estimate(psi, 1, 0)


@fast
@given(data=st.data(), psi=st.integers(min_value=1, max_value=10**12), n=world_sizes, stage=stages)
def test_frozen_params_cost_only_their_weights(data, psi, n, stage):
    """With Ψ_t of Ψ trainable, grads/master/states follow Ψ_t alone; frozen weights add 2 B each."""
    psi_t = data.draw(st.integers(min_value=0, max_value=psi))
    lora = estimate(psi, n, stage, trainable_params=psi_t)
    only_trainable = estimate(psi_t, n, stage)
    assert (lora.grads, lora.master_params, lora.optimizer_states) == (
        only_trainable.grads, only_trainable.master_params, only_trainable.optimizer_states)
    if stage < 3:
        assert lora.params == 2 * psi
    else:  # frozen and trainable weights are separate flat buffers, each padded to N
        assert lora.params == 2 * (ceil_div(psi_t, n) + ceil_div(psi - psi_t, n))


def test_all_frozen_model_has_no_grads_master_or_states():
    """trainable_params=0: weights only, at every stage."""
    for stage in range(4):
        est = estimate(1000, 3, stage, trainable_params=0)
        assert (est.grads, est.master_params, est.optimizer_states) == (0, 0, 0)
        assert est.params == (2 * 334 if stage == 3 else 2000)


@fast
@given(psi=psis, n=world_sizes, stage=stages)
def test_sgd_variants_keep_one_or_zero_states(psi, n, stage):
    """SGD with momentum keeps 4 B of state per param (sharded like Adam's 8 B); plain SGD none."""
    adam = estimate(psi, n, stage, "fp32", "adam")
    momentum = estimate(psi, n, stage, "fp32", "sgd_momentum")
    plain = estimate(psi, n, stage, "fp32", "sgd")
    assert 2 * momentum.optimizer_states == adam.optimizer_states
    assert plain.optimizer_states == 0
    assert replace(plain, optimizer_states=adam.optimizer_states) == adam
    assert estimate(psi, n, stage, "fp32", "adamw") == adam


def test_total_and_as_dict_cover_every_category():
    """total sums all five categories, activations included, and as_dict lists exactly them."""
    est = MemoryEstimate(params=1, grads=20, master_params=300, optimizer_states=4000, activations=50000)
    assert est.total == 54321
    assert est.as_dict() == {"params": 1, "grads": 20, "master_params": 300, "optimizer_states": 4000,
                             "activations": 50000}
    assert sum(est.as_dict().values()) == est.total


@pytest.mark.parametrize("kwargs, name", [
    (dict(stage=4), "stage"), (dict(stage=-1), "stage"), (dict(stage=1.0), "stage"),
    (dict(world_size=0), "world_size"),
    (dict(precision="fp8"), "precision"), (dict(optimizer="lion"), "optimizer"),
    (dict(num_params=-5), "num_params"), (dict(num_params=1.5), "num_params"),
    (dict(trainable_params=2000), "trainable_params"),
    (dict(shard_group_size=3), "shard_group_size"), (dict(shard_group_size=0), "shard_group_size"),
])
def test_bad_input_raises_value_error_naming_the_argument(kwargs, name):
    """estimate rejects bad input with a ValueError whose message names the argument."""
    args = dict(num_params=1000, world_size=4, stage=1, precision="bf16", optimizer="adam")
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        estimate(**args)


# ----------------------------------------------------------------------------- activations, working set

def _saved_activation_bytes(cfg, batch_size: int, dtype: torch.dtype, seq_len: int) -> int:
    """Bytes of floating-point tensors a forward pass saves for backward (each storage once), plus the logits."""
    from zerokit.models import build_model

    model = build_model(cfg).to(dtype)
    idx = torch.randint(cfg.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        # Integer token ids and the 0-d loss are outside the estimate (see its docstring).
        if t.is_floating_point() and t.dim() > 0 and s.data_ptr() not in weights:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, _ = model(idx, idx)
    storages.setdefault(logits.untyped_storage().data_ptr(), logits.untyped_storage().nbytes())
    return sum(storages.values())


def _odd_config():
    from zerokit.models import GPTConfig

    return GPTConfig(vocab_size=37, block_size=15, n_layer=3, n_head=3, n_embd=21, mlp_ratio=3, bias=False)


@pytest.mark.parametrize("name", ["tiny", "odd"])
@pytest.mark.parametrize("batch_size, seq_len", [(1, None), (3, 7)])
def test_activation_estimate_equals_saved_tensors_at_fp32(name, batch_size, seq_len):
    """At fp32 the estimate equals, byte for byte, what a forward pass of models.GPT saves on CPU."""
    from zerokit.models import preset

    cfg = _odd_config() if name == "odd" else preset(name)
    T = seq_len or cfg.block_size
    assert activation_bytes_estimate(cfg, batch_size, "fp32", seq_len=T) == \
        _saved_activation_bytes(cfg, batch_size, torch.float32, T)


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_activation_estimate_at_16_bits_differs_only_by_layernorm_stats(precision, dtype):
    """At 16 bits the estimate counts LayerNorm mean/rstd in fp32 (as CUDA does); CPU keeps them at 2 B."""
    cfg = _odd_config()
    batch_size, T = 2, 11
    measured = _saved_activation_bytes(cfg, batch_size, dtype, T)
    estimated = activation_bytes_estimate(cfg, batch_size, precision, seq_len=T)
    num_layernorms = 2 * cfg.n_layer + 1
    # Each LayerNorm keeps mean and rstd, B*T values each: 2 bytes more apiece in fp32.
    assert estimated - measured == num_layernorms * 2 * batch_size * T * 2


def test_checkpointing_keeps_block_inputs_plus_one_block():
    """With checkpointing: (L-1) block inputs + one full block + head; never more than without it."""
    from zerokit.models import GPTConfig

    one = GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=8)
    many = replace(one, n_layer=6)
    for b in (1, 4):
        assert activation_bytes_estimate(one, b, "bf16", True) == activation_bytes_estimate(one, b, "bf16")
        full_one, full_many = (activation_bytes_estimate(c, b, "bf16") for c in (one, many))
        block = (full_many - full_one) // 5  # one block's saved bytes, from the difference of depths
        ckpt = activation_bytes_estimate(many, b, "bf16", checkpointing=True)
        assert ckpt == full_one + 5 * b * 16 * 8 * 2  # head + one block + 5 inputs of (b, T, d) bf16
        assert ckpt < full_many and block > b * 16 * 8 * 2


def test_activations_grow_linearly_with_batch():
    """Twice the batch, twice the activations (every saved tensor has a batch dimension)."""
    from zerokit.models import preset

    cfg = preset("gpt2-small")
    for ckpt in (False, True):
        one = activation_bytes_estimate(cfg, 1, "bf16", ckpt)
        assert activation_bytes_estimate(cfg, 2, "bf16", ckpt) == 2 * one
        assert activation_bytes_estimate(cfg, 0, "bf16", ckpt) == 0


def test_working_set_with_every_block_prefetched_is_the_whole_model():
    """zero3_working_set_bytes with L - 1 blocks prefetched gathers Ψ weights and Ψ grads."""
    from zerokit.models import num_params, preset

    for cfg in (preset("tiny"), preset("gpt2-medium"), _odd_config()):
        for precision, e in (("fp32", 4), ("bf16", 2)):
            assert zero3_working_set_bytes(cfg, precision, prefetch=cfg.n_layer - 1) == num_params(cfg) * 2 * e


@fast
@given(st.lists(st.integers(min_value=0, max_value=10**9), max_size=64), st.integers(min_value=0, max_value=8),
       st.sampled_from([2, 4]))
def test_stage2_in_flight_is_the_largest_buckets(sizes, max_in_flight, g):
    """stage2_in_flight_grad_bytes sums the max_in_flight + 2 largest buckets at g bytes: never less than any
    max_in_flight + 2 of them, at most (max_in_flight + 2) x the largest, all of them (the whole gradient,
    what stages 0-1 hold) once every bucket may be in flight."""
    got = stage2_in_flight_grad_bytes(sizes, max_in_flight, g)
    k = max_in_flight + 2
    assert got == g * sum(sorted(sizes, reverse=True)[:k])
    assert got >= g * sum(sizes[:k]) and got <= g * k * max(sizes, default=0)
    assert stage2_in_flight_grad_bytes(sizes, len(sizes), g) == g * sum(sizes)


def test_stage2_bound_reads_a_real_engines_buckets():
    """On a stage-2 engine of a tied GPT the buckets `phase_bound` reads cover every trainable element once, and
    the tied embedding, larger than the bucket cap, is its own bucket: the in-flight term counts it whole."""
    import torch

    import zerokit as zk
    from zerokit.commands.memory import stage2_buckets
    from zerokit.models import GPT, GPTConfig, num_params

    cfg = GPTConfig(vocab_size=4096, block_size=32, n_layer=2, n_head=2, n_embd=64)
    engine = zk.shard(GPT(cfg), torch.optim.AdamW, stage=2, precision="bf16", bucket_numel=1 << 15,
                      comm=zk.Comm(simulate=zk.Simulated(0, 8)), lr=1e-4)
    got = stage2_buckets(engine)
    assert got["max_in_flight"] == 2 and got["grad_bytes"] == 2
    assert num_params(cfg) <= sum(got["bucket_numels"]) < num_params(cfg) + 8 * len(got["bucket_numels"])
    assert max(got["bucket_numels"]) >= cfg.vocab_size * cfg.n_embd > 1 << 15
    assert stage2_in_flight_grad_bytes(**got) >= 2 * cfg.vocab_size * cfg.n_embd
    assert stage2_buckets(zk.shard(GPT(cfg), torch.optim.AdamW, stage=3, comm=zk.Comm(simulate=zk.Simulated(0, 8)),
                                   lr=1e-4)) == {}


def test_tied_head_holds_two_vocab_by_d_gradients_in_autograd():
    """tied_head_grad_bytes = 2·V·d·e, and that is what backward of a tied GPT really holds beside the weight's
    gradient: the (V, d) tensors ops make in a plain torch backward (per storage, the weight's own excluded,
    released when freed) peak at three alive at once, the head's and the embedding's gradients and their sum,
    which becomes .grad (the buffer a stage counts)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    from zerokit.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, block_size=16, n_layer=1, n_head=2, n_embd=32)
    assert tied_head_grad_bytes(cfg, "bf16") == 2 * 512 * 32 * 2
    assert tied_head_grad_bytes(cfg, "fp32") == 2 * 512 * 32 * 4
    model = GPT(cfg)
    assert model.lm_head.weight is model.wte.weight

    class CountVd(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.alive, self.peak, self.seen = 0, 0, set()

        def _release(self, key):
            self.alive -= 1
            self.seen.discard(key)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and tuple(t.shape) == (512, 32):
                    key = t.untyped_storage().data_ptr()
                    if key not in self.seen and key != weight:  # a new storage (an in-place add returns the old one)
                        self.seen.add(key)
                        self.alive += 1
                        self.peak = max(self.peak, self.alive)
                        weakref.finalize(t.untyped_storage(), self._release, key)
            return out

    weight = model.wte.weight.untyped_storage().data_ptr()
    idx = torch.randint(512, (1, 16))
    _, loss = model(idx, idx)
    with CountVd() as counter:
        loss.backward()
    assert model.wte.weight.grad.untyped_storage().data_ptr() in counter.seen  # the sum is the .grad, still alive
    assert counter.peak == 3, counter.peak
    assert tied_head_grad_bytes(cfg, "fp32") == (counter.peak - 1) * 512 * 32 * 4


def test_lora_adapter_count_matches_inject():
    """lora_adapter_params(cfg) equals the trainable parameters lora.inject leaves in models.GPT."""
    from zerokit import lora
    from zerokit.models import build_model

    cfg = _odd_config()
    model = build_model(cfg)
    lora.inject(model, targets=("q", "v"), rank=8, alpha=1.0)
    assert lora_adapter_params(cfg) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_guessed_shape_has_about_the_asked_parameters():
    """guess_shape's blocks hold Ψ to within 25% for models from 100M to 200B (GPT-3-like aspect)."""
    for psi in (1.25e8, 1.3e9, 7.5e9, 7e10, 1.75e11):
        shape = guess_shape(int(psi))
        assert shape.n_embd % 128 == 0 and shape.n_embd // shape.n_head == 128
        assert abs(12 * shape.n_layer * shape.n_embd**2 / psi - 1) < 0.25, shape


# ----------------------------------------------------------------------------- plan

GB = 10**9


def act_1gb_per_sample(batch_size: int, checkpointing: bool) -> int:
    """Hand-made activations: 1 GB per sample, 0.1 GB with checkpointing."""
    return batch_size * (GB // 10 if checkpointing else GB)


def test_plan_chooses_zero2_and_grows_the_batch():
    """1e9 params on 8 GPUs of 40 GB: ZeRO-2 (2Ψ+14Ψ/N = 3.75 GB) fits; 36 samples of 1 GB fit beside it."""
    p = plan(1e9, 8, 40 * GB, activation_bytes=act_1gb_per_sample)
    assert (p.decision, p.stage, p.checkpointing, p.lora) == ("zero2", 2, False, False)
    assert p.bytes_per_gpu == 3_750_000_000 + GB
    assert p.max_batch_size == 36  # 3.75 + 36 = 39.75 <= 40 < 3.75 + 37
    assert any("36" in line and "largest" in line for line in p.reasons)
    assert (p.precision, p.loss_scaler) == ("bf16", False)


def test_plan_moves_to_zero3_when_zero2_does_not_fit():
    """3.5 GB GPUs: ZeRO-2 needs 4.75 GB at batch 1, ZeRO-3 16Ψ/N + 1 GB = 3 GB fits."""
    p = plan(1e9, 8, 3.5 * GB, activation_bytes=act_1gb_per_sample)
    assert (p.decision, p.stage, p.checkpointing) == ("zero3", 3, False)
    assert p.bytes_per_gpu == 2 * GB + GB and p.max_batch_size == 1


def test_plan_adds_checkpointing_then_counts_the_working_set():
    """2.5 GB GPUs: ZeRO-3 fits only with checkpointing; a 0.6 GB working set then pushes it to LoRA."""
    p = plan(1e9, 8, 2.5 * GB, activation_bytes=act_1gb_per_sample)
    assert (p.decision, p.stage, p.checkpointing) == ("zero3", 3, True)
    assert p.max_batch_size == 5  # 2 GB + 5 x 0.1 GB = 2.5 GB
    p = plan(1e9, 8, 2.5 * GB, activation_bytes=act_1gb_per_sample, working_set_bytes=600_000_000)
    assert p.decision == "lora"


def test_plan_falls_back_to_lora_then_to_nothing():
    """1.5 GB GPUs need LoRA (at ZeRO-3: frozen 2 B/param sharded); 0.1 GB GPUs fit nothing."""
    p = plan(1e9, 8, 1.5 * GB, activation_bytes=act_1gb_per_sample, lora_trainable_params=10**6)
    assert (p.decision, p.lora, p.stage, p.checkpointing) == ("lora", True, 3, False)
    states = estimate(10**9 + 10**6, 8, 3, trainable_params=10**6).total
    assert p.bytes_per_gpu == states + GB
    assert any("r = 8" in line and "q, v" in line for line in p.reasons)
    p = plan(1e9, 8, 0.1 * GB, activation_bytes=act_1gb_per_sample, lora_trainable_params=10**6)
    assert (p.decision, p.stage, p.max_batch_size) == ("does_not_fit", None, None)
    assert "quantize" in p.reasons[-1]


def test_plan_on_one_gpu_says_zero_cannot_help():
    """One GPU: full training if 16Ψ + activations fit, else LoRA; the reasons say ZeRO cannot help."""
    p = plan(1e9, 1, 40 * GB, activation_bytes=act_1gb_per_sample)
    assert (p.decision, p.stage) == ("single_gpu", 0)
    assert p.bytes_per_gpu == 16 * GB + GB and p.max_batch_size == 24
    assert any("cannot help" in line for line in p.reasons)
    p = plan(1e9, 1, 10 * GB, bf16=False, activation_bytes=act_1gb_per_sample, lora_trainable_params=10**6)
    assert (p.decision, p.stage, p.lora, p.precision, p.loss_scaler) == ("lora", 0, True, "fp16", True)
    assert any("loss scaler" in line for line in p.reasons)


def test_plan_without_activations_cannot_size_the_batch():
    """With no activation estimate the plan says so and gives no batch limit."""
    p = plan(1e9, 8, 40 * GB)
    assert p.decision == "zero2" and p.max_batch_size is None
    assert any("activations not estimated" in line for line in p.reasons)


def test_plan_rejects_bad_input():
    """Bad plan() input raises ValueError naming the argument."""
    for kwargs, name in ((dict(num_gpus=0), "num_gpus"), (dict(gpu_memory_bytes=0), "gpu_memory_bytes"),
                         (dict(batch_size=0), "batch_size"), (dict(num_params=0), "num_params")):
        args = dict(num_params=10**9, num_gpus=2, gpu_memory_bytes=GB)
        args.update(kwargs)
        with pytest.raises(ValueError, match=name):
            plan(**args)


# ----------------------------------------------------------------------------- command line

def _table_rows(out: str) -> dict[int, list[str]]:
    """Stage number -> the cells of its row in `zerokit memory`'s table."""
    rows = {}
    for line in out.splitlines():
        match = re.match(r"^([0-3])\s{2,}", line)
        if match:
            rows[int(match.group(1))] = re.split(r"\s{2,}", line.strip())
    return rows


def test_memory_command_prints_the_lecture_table(capsys, tmp_path):
    """`zerokit memory --params 7.5e9 --world-size 64` prints 120.0 / 31.4 / 16.6 / 1.9 GB and writes JSON."""
    path = tmp_path / "memory.json"
    assert main(["memory", "--params", "7.5e9", "--world-size", "64", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert [rows[s][-1] for s in range(4)] == ["120.0", "31.4", "16.6", "1.9"]
    assert [rows[s][1] for s in range(4)] == ["DDP baseline", "P_os", "P_os+g", "P_os+g+p"]
    assert "GB = 1,000,000,000 bytes" in out
    record = json.loads(path.read_text())
    assert [r["total"] for r in record["stages"]] == [estimate(7.5e9, 64, s).total for s in range(4)]


def test_memory_command_takes_params_from_a_model_preset(capsys):
    """--model uses the preset's Ψ and also prints its working set and activations."""
    from zerokit.models import num_params, preset

    assert main(["memory", "--model", "gpt2-small", "--world-size", "8", "--precision", "fp32",
                 "--unit", "B"]) == 0
    out = capsys.readouterr().out
    psi = num_params(preset("gpt2-small"))
    assert f"{psi:,} parameters" in out
    assert _table_rows(out)[0][-1] == f"{16 * psi:,}"
    assert "working set" in out and "activations of one sequence" in out


def test_memory_command_rejects_bad_params(capsys):
    """A malformed --params is an argparse error (exit code 2) naming the option."""
    with pytest.raises(SystemExit) as exc:
        main(["memory", "--params", "lots", "--world-size", "8"])
    assert exc.value.code == 2
    assert "--params" in capsys.readouterr().err


def test_plan_command_prints_reasoning_and_decision(capsys, tmp_path):
    """`zerokit plan` on one 80 GB GPU for 7.5e9 params says ZeRO cannot help and picks LoRA."""
    path = tmp_path / "plan.json"
    assert main(["plan", "--params", "7.5B", "--gpus", "1", "--gpu-memory", "80", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "cannot help" in out and "120.00 GB" in out
    assert "\ndecision: lora\n" in out
    assert json.loads(path.read_text())["decision"] == "lora"


def test_plan_command_with_a_model_finds_zero2(capsys):
    """gpt2-medium on 4 GPUs of 24 GB fits at ZeRO-2 and reports the largest batch."""
    assert main(["plan", "--model", "gpt2-medium", "--gpus", "4", "--gpu-memory", "24GB"]) == 0
    out = capsys.readouterr().out
    assert "shape of gpt2-medium" in out and "largest per-GPU batch" in out
    assert out.rstrip().endswith("decision: zero2")


def test_size_parsers():
    """Parameter counts take e-notation and K/M/B suffixes; memory sizes default to GB."""
    assert parse_count("7.5e9") == parse_count("7.5B") == parse_count("7_500_000_000") == 7_500_000_000
    assert parse_count("350M") == 350_000_000 and parse_count("125k") == 125_000
    assert parse_bytes("80") == parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == parse_bytes("80gib") == 80 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    import argparse

    for bad in ("1.5", "seven", "7.5X"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_count(bad)
    for bad in ("0", "-3GB", "80 parsecs"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)
