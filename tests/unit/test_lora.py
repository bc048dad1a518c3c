"""LoRA: injection, freezing, gradients, merge/unmerge, adapter checkpoints, parameter counts."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from zerokit import lora

VOCAB, DIM, HIDDEN = 11, 16, 24


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM)
        self.v = nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.q(x) * torch.sigmoid(self.k(x)) + self.v(x))


class TinyNet(nn.Module):
    """Two attention-like blocks, an MLP with odd widths, and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Attn() for _ in range(2))
        self.fc = nn.Linear(DIM, HIDDEN)
        self.proj = nn.Linear(HIDDEN, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        # nn.Embedding's N(0, 1) through a tied head gives logits ~25; N(0, 0.25) keeps them O(1)
        # so SGD at lr 1.0 neither diverges nor leaves B near zero.
        nn.init.normal_(self.emb.weight, std=0.25)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)                                  # (B, T, DIM)
        for block in self.blocks:
            x = x + block(x)
        x = x + self.proj(F.gelu(self.fc(x)))
        return self.head(x)                                # (B, T, VOCAB)


def make_net(seed: int = 0, dtype: torch.dtype = torch.float32) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet().to(dtype)


def tokens(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (3, 5), generator=g)


def train_steps(model: nn.Module, idx: torch.Tensor, target: torch.Tensor, steps: int = 5, lr: float = 1.0) -> None:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        loss = F.cross_entropy(model(idx).float().flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_inject_returns_sorted_matching_names_and_replaces_modules():
    """inject adapts exactly the Linears whose last name is a target and returns their sorted names."""
    model = make_net()
    names = lora.inject(model, targets=("v", "q"), rank=4)
    assert names == ["blocks.0.q", "blocks.0.v", "blocks.1.q", "blocks.1.v"]
    assert list(lora.lora_modules(model)) == names
    for name in names:
        assert isinstance(model.get_submodule(name), lora.LoRALinear)
    for name in ("blocks.0.k", "blocks.1.o", "fc", "proj", "head"):
        assert type(model.get_submodule(name)) is nn.Linear


def test_fresh_adapter_output_is_bitwise_equal_to_base_model():
    """B = 0 at init, so the injected model starts exactly at the pretrained one."""
    base = make_net()
    model = copy.deepcopy(base)
    lora.inject(model, rank=4, alpha=3.0)
    idx = tokens()
    assert torch.equal(model(idx), base(idx))
    m = model.get_submodule("blocks.0.q")
    assert torch.count_nonzero(m.lora_B) == 0 and torch.count_nonzero(m.lora_A) > 0


def test_lora_A_follows_kaiming_uniform_bound():
    """A is Kaiming-uniform with a = sqrt(5): entries within 1/sqrt(k) and spread over that range."""
    torch.manual_seed(0)
    m = lora.LoRALinear(nn.Linear(200, 300), rank=64)
    bound = 1 / 200 ** 0.5  # gain sqrt(2/(1+5)) * sqrt(3/fan_in) = 1/sqrt(fan_in)
    assert m.lora_A.shape == (64, 200) and m.lora_B.shape == (300, 64)
    assert m.lora_A.abs().max() <= bound
    # 12,800 uniform draws: the max |a| lies within 1% of the bound with overwhelming probability.
    assert m.lora_A.abs().max() > 0.99 * bound


def test_only_adapters_require_grad_and_tied_weight_stays_frozen_and_tied():
    """After inject every base parameter (tied embedding/head included) is frozen; only lora_A/B train."""
    model = make_net()
    lora.inject(model, rank=2)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    expected = sorted(f"blocks.{i}.{t}.lora_{ab}" for i in range(2) for t in "qv" for ab in "AB")
    assert trainable == expected
    assert model.head.weight is model.emb.weight and not model.emb.weight.requires_grad


def test_backward_gives_grads_only_to_adapters():
    """One backward leaves every frozen parameter's .grad None and fills both adapter matrices."""
    model = make_net()
    lora.inject(model, rank=3, alpha=2.0)
    loss = F.cross_entropy(model(tokens()).flatten(0, 1), tokens(2).flatten())
    loss.backward()
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.grad is not None and p.grad.shape == p.shape, name
        else:
            assert p.grad is None, name
    # With B = 0 the gradient reaching A is B^T(...) = 0, but B's gradient is nonzero.
    assert torch.count_nonzero(model.blocks[0].q.lora_B.grad) > 0


def test_training_changes_only_adapters():
    """A few SGD steps move B away from zero and leave every base tensor bitwise unchanged."""
    base = make_net()
    model = copy.deepcopy(base)
    lora.inject(model, rank=4)
    train_steps(model, tokens(), tokens(2))
    assert torch.count_nonzero(model.blocks[1].v.lora_B) > 0
    sd = model.state_dict()
    for key, value in base.state_dict().items():
        assert torch.equal(sd[key], value), key


def test_state_dict_keys_preserved_and_extras_are_exactly_lora():
    """Injected state_dict keys are a superset of the base keys; the extras are exactly lora_A/lora_B."""
    base_keys = set(make_net().state_dict())
    model = make_net()
    names = lora.inject(model, targets=("q", "v", "proj"), rank=2)
    keys = set(model.state_dict())
    assert keys >= base_keys
    assert keys - base_keys == {f"{n}.lora_{ab}" for n in names for ab in "AB"}
    assert "proj.bias" not in keys  # a bias-less Linear stays bias-less


def test_merge_matches_unmerged_output_and_unmerge_restores_weight():
    """After training (B != 0), merged output equals unmerged within 1e-5; unmerge restores W within 1e-6."""
    model = make_net()
    lora.inject(model, rank=4, alpha=2.0)
    idx = tokens()
    train_steps(model, idx, tokens(2))
    w_before = {n: m.weight.detach().clone() for n, m in lora.lora_modules(model).items()}
    with torch.no_grad():
        unmerged = model(idx)
        assert lora.merge(model) == sorted(w_before)
        merged = model(idx)
    # fp32, |logits| ~ 1: folding BA into W reorders the sums, which moves results by a few ulp.
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=1e-5)
    for name, m in lora.lora_modules(model).items():
        assert m.merged
        delta = w_before[name] + m.alpha * m.lora_B @ m.lora_A
        torch.testing.assert_close(m.weight, delta, rtol=0, atol=1e-6)
        assert not torch.equal(m.weight, w_before[name])
    lora.unmerge(model)
    for name, m in lora.lora_modules(model).items():
        # Add then subtract the same fp32 delta: within one rounding of |W| ~ 0.3.
        torch.testing.assert_close(m.weight, w_before[name], rtol=0, atol=1e-6)
        assert not m.merged
    with torch.no_grad():
        torch.testing.assert_close(model(idx), unmerged, rtol=0, atol=1e-5)


def test_merge_twice_and_unmerge_unmerged_raise():
    """Merging a merged model or unmerging an unmerged one is a clear ValueError."""
    model = make_net()
    lora.inject(model, rank=2)
    with pytest.raises(ValueError, match="not merged: blocks.0.q"):
        lora.unmerge(model)
    lora.merge(model)
    with pytest.raises(ValueError, match="already merged: blocks.0.q"):
        lora.merge(model)


def test_merge_refuses_weight_tied_to_another_module():
    """Merging into a head tied to the embedding would change the embedding, so merge refuses."""
    model = make_net()
    lora.inject(model, targets=("head",), rank=2)
    assert model.head.weight is model.emb.weight
    with pytest.raises(ValueError, match="'head'.*shared with emb"):
        lora.merge(model)
    assert not model.head.merged


def test_functions_on_model_without_lora_raise():
    """merge / adapter_state_dict on a model that was never injected name the missing inject call."""
    model = make_net()
    for fn in (lora.merge, lora.unmerge, lora.adapter_state_dict):
        with pytest.raises(ValueError, match="call zerokit.lora.inject"):
            fn(model)


def test_inject_errors_no_match_bad_rank_double_inject():
    """No matching Linear, rank outside [1, min(d, k)], or a second inject raise ValueError and change nothing."""
    model = make_net()
    with pytest.raises(ValueError, match=r"targets=\('query',\).*blocks.0.q"):
        lora.inject(model, targets=("query",))
    with pytest.raises(ValueError, match="rank 0"):
        lora.inject(model, rank=0)
    with pytest.raises(ValueError, match=r"rank 17 does not fit 'blocks.0.q' \(16 x 16\)"):
        lora.inject(model, rank=17)
    with pytest.raises(TypeError):
        lora.inject(model, rank=2.0)
    # Nothing was modified by the failed calls.
    assert not lora.lora_modules(model) and all(p.requires_grad for p in model.parameters())
    lora.inject(model, rank=16)  # rank == min(d, k) is allowed: LoRA then spans full fine-tuning
    with pytest.raises(ValueError, match="already has LoRA modules"):
        lora.inject(model, targets=("k",))


def test_single_string_target_and_last_component_rule():
    """A string target is one name; matching is on the last path component only."""
    model = make_net()
    assert lora.inject(model, targets="fc", rank=2) == ["fc"]
    model = make_net()
    with pytest.raises(ValueError, match="no nn.Linear"):
        lora.inject(model, targets=("blocks",))  # a container name is not a Linear's last component


def test_adapter_save_load_round_trip_swaps_task_behaviour(tmp_path):
    """Two adapters trained on two tasks, loaded in turn into one fresh base, reproduce each task's output."""
    base = make_net()
    idx = tokens()
    outputs, paths = [], []
    for task in range(2):
        model = copy.deepcopy(base)
        torch.manual_seed(100)
        lora.inject(model, rank=4, alpha=2.0)
        train_steps(model, idx, tokens(10 + task))
        path = tmp_path / f"task{task}.safetensors"
        lora.save_adapter(model, path)
        assert set(load_file(path)) == set(lora.adapter_state_dict(model))
        with torch.no_grad():
            outputs.append(model(idx))
        paths.append(path)
    assert not torch.allclose(outputs[0], outputs[1], atol=1e-3)

    served = copy.deepcopy(base)
    torch.manual_seed(999)  # a different init: everything must come from the file
    lora.inject(served, rank=4, alpha=2.0)
    with torch.no_grad():
        for task in (0, 1, 0):
            lora.load_adapter(served, paths[task])
            assert torch.equal(served(idx), outputs[task])


def test_adapter_file_holds_only_adapters_and_is_small(tmp_path):
    """The adapter file contains only lora_A/lora_B tensors, far fewer numbers than the base model."""
    model = make_net()
    lora.inject(model, rank=2)
    path = tmp_path / "a.safetensors"
    lora.save_adapter(model, path)
    sd = load_file(path)
    assert all(k.endswith((".lora_A", ".lora_B")) for k in sd)
    assert sum(t.numel() for t in sd.values()) == lora.trainable_report(model)["trainable_params"]


def test_adapter_state_dict_is_a_snapshot():
    """adapter_state_dict copies: training afterwards does not change an earlier snapshot."""
    model = make_net()
    lora.inject(model, rank=2)
    snap = lora.adapter_state_dict(model)
    train_steps(model, tokens(), tokens(2), steps=1)
    assert torch.count_nonzero(snap["blocks.0.q.lora_B"]) == 0
    lora.load_adapter_state_dict(model, snap)
    assert torch.count_nonzero(model.blocks[0].q.lora_B) == 0


def test_load_adapter_state_dict_is_strict():
    """Missing, unexpected, or mis-shaped keys raise ValueError naming the key; nothing is copied."""
    model = make_net()
    lora.inject(model, rank=2)
    good = lora.adapter_state_dict(model)

    missing = dict(good)
    del missing["blocks.1.v.lora_A"]
    with pytest.raises(ValueError, match="missing keys: blocks.1.v.lora_A"):
        lora.load_adapter_state_dict(model, missing)

    extra = {**good, "blocks.0.k.lora_A": torch.zeros(2, DIM)}
    with pytest.raises(ValueError, match="unexpected keys: blocks.0.k.lora_A"):
        lora.load_adapter_state_dict(model, extra)

    wrong = {k: torch.ones_like(v) for k, v in good.items()}
    wrong["blocks.0.v.lora_B"] = torch.ones(DIM, 3)
    with pytest.raises(ValueError, match=r"'blocks.0.v.lora_B' has shape \(16, 3\), model expects \(16, 2\)"):
        lora.load_adapter_state_dict(model, wrong)
    assert torch.count_nonzero(model.blocks[0].q.lora_B) == 0  # the valid keys were not copied either


def test_load_adapter_refuses_merged_model_and_alpha_mismatch(tmp_path):
    """Loading into a merged model, or a file saved with another alpha, is a ValueError."""
    model = make_net()
    lora.inject(model, rank=2, alpha=1.0)
    path = tmp_path / "a.safetensors"
    lora.save_adapter(model, path)
    other = make_net()
    lora.inject(other, rank=2, alpha=4.0)
    with pytest.raises(ValueError, match="alpha=1.0 for 'blocks.0.q'"):
        lora.load_adapter(other, path)
    lora.merge(model)
    with pytest.raises(ValueError, match="merged modules"):
        lora.load_adapter(model, path)


def test_bf16_model_injects_trains_and_merges():
    """A bf16 model gets bf16 adapters, starts equal to the base, trains, and merges close to unmerged."""
    base = make_net(dtype=torch.bfloat16)
    model = copy.deepcopy(base)
    lora.inject(model, rank=4)
    idx = tokens()
    for m in lora.lora_modules(model).values():
        assert m.lora_A.dtype == m.lora_B.dtype == torch.bfloat16
    assert torch.equal(model(idx), base(idx))
    train_steps(model, idx, tokens(2))
    assert torch.count_nonzero(model.blocks[0].q.lora_B) > 0
    with torch.no_grad():
        unmerged = model(idx).float()
        lora.merge(model)
        merged = model(idx).float()
    # bf16 keeps 8 significant bits: folding BA into W rounds W once more (rel. 2^-8 per entry),
    # which moves logits of size ~1 by a few 1e-2 at most.
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=5e-2)


def test_adapter_init_is_independent_of_dtype():
    """Same seed, fp32 vs bf16 base: the bf16 A is the fp32 A rounded once."""
    torch.manual_seed(3)
    a32 = lora.LoRALinear(nn.Linear(DIM, DIM), rank=4).lora_A
    torch.manual_seed(3)
    a16 = lora.LoRALinear(nn.Linear(DIM, DIM).to(torch.bfloat16), rank=4).lora_A
    assert torch.equal(a16, a32.to(torch.bfloat16))


def test_lora_fraction_matches_lecture_and_measured_counts():
    """r(d+k)/(dk) is ~2% for d = k = 768, r = 8, and equals the parameter count of a real LoRALinear."""
    assert lora.lora_fraction(768, 768, 8) == pytest.approx(0.0208, abs=1e-4)
    assert lora.lora_fraction(768, 768, 8) == pytest.approx(2 * 8 / 768)  # the lecture's 2r/768
    for d, k, r in ((768, 768, 8), (7, 15, 3), (24, 16, 1)):
        m = lora.LoRALinear(nn.Linear(k, d), rank=r)
        measured = (m.lora_A.numel() + m.lora_B.numel()) / m.weight.numel()
        assert lora.lora_fraction(d, k, r) == pytest.approx(measured)
    with pytest.raises(ValueError):
        lora.lora_fraction(0, 768, 8)


def test_trainable_report_counts_tied_params_once():
    """trainable_report counts unique parameters: total, trainable, fraction, and a one-line summary."""
    model = make_net()
    lora.inject(model, rank=2)
    rep = lora.trainable_report(model)
    unique = {id(p): p for p in model.parameters()}.values()
    assert rep["total_params"] == sum(p.numel() for p in unique)
    assert rep["trainable_params"] == sum(p.numel() for p in unique if p.requires_grad)
    assert rep["trainable_params"] == 4 * 2 * (DIM + DIM)  # 4 adapted 16x16 Linears at r = 2
    assert rep["fraction"] == rep["trainable_params"] / rep["total_params"]
    assert f"{rep['trainable_params']:,}" in rep["line"] and "\n" not in rep["line"]


def test_shared_linear_replaced_under_every_path():
    """One Linear registered at two paths becomes one LoRALinear at both, so the sharing survives."""
    model = nn.Module()
    shared = nn.Linear(DIM, DIM)
    model.a = nn.Module()
    model.b = nn.Module()
    model.a.q = shared
    model.b.q = shared
    assert lora.inject(model, targets=("q",), rank=2) == ["a.q", "b.q"]
    assert model.a.q is model.b.q and isinstance(model.a.q, lora.LoRALinear)
    assert model.a.q.weight is shared.weight


@settings(max_examples=25, deadline=None)
@given(d=st.integers(1, 9), k=st.integers(1, 9), data=st.data(),
       alpha=st.floats(0.25, 4.0), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_lora_linear_equals_dense_formula_any_shape(d, k, data, alpha, bias, seed):
    """For any shape and rank, forward == x (W + alpha B A)^T + b, and merged forward agrees (float64)."""
    r = data.draw(st.integers(1, min(d, k)))
    torch.manual_seed(seed)
    m = lora.LoRALinear(nn.Linear(k, d, bias=bias).double(), rank=r, alpha=alpha)
    with torch.no_grad():
        m.lora_B.normal_()
    x = torch.randn(2, 3, k, dtype=torch.float64)
    w_eff = m.weight + alpha * m.lora_B @ m.lora_A
    expected = x @ w_eff.T + (m.bias if bias else 0)
    with torch.no_grad():
        # float64 with entries ~1 and sums of <= 9 terms: 1e-12 covers reordering.
        torch.testing.assert_close(m(x), expected, rtol=0, atol=1e-12)
        m.merged = False
        model = nn.Module()
        model.q = m
        lora.merge(model)
        torch.testing.assert_close(m(x), expected, rtol=0, atol=1e-12)


def test_gpt_from_models_injects_q_and_v():
    """On zerokit.models' tiny GPT: q and v of every block adapted, output unchanged, only adapters train."""
    models = pytest.importorskip("zerokit.models")
    base = models.build_model("tiny")
    model = copy.deepcopy(base)
    names = lora.inject(model)
    n_layer = base.cfg.n_layer
    assert names == sorted(f"blocks.{i}.attn.{t}" for i in range(n_layer) for t in "qv")
    idx = torch.randint(0, base.cfg.vocab_size, (2, min(8, base.cfg.block_size)),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(idx)[0], base(idx)[0])
    assert set(model.state_dict()) - set(base.state_dict()) == {f"{n}.lora_{ab}" for n in names for ab in "AB"}
    assert set(model.state_dict()) >= set(base.state_dict())
    _, loss = model(idx, idx)
    loss.backward()
    assert all((p.grad is not None) == ("lora_" in n) for n, p in model.named_parameters())
