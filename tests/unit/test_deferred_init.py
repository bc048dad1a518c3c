"""`zk.deferred_init()` records a construction and zk.shard replays it with an eager build's bits (core/params/deferred.py).

Each case seeds, builds the model eagerly and reads its state and the next random draw; seeds again, builds
it inside `zk.deferred_init()`, wraps it with zk.shard (one process) and compares `engine.state_dict()` and
the next draw: both bitwise equal, at every stage. Hugging Face models are the reason this exists: their
constructors initialize in an order no after-the-fact replay reproduces (core/params/materialize.py cannot), and
they skip their init under `torch.device("meta")`. The 2-rank cases are in tests/distributed/test_meta_init_ranks.py.
"""
import os

import pytest
import torch
from torch import nn

import zerokit as zk
from zerokit.core.params.deferred import LazyTensor, is_lazy, value
from zerokit.models import GPT, Block, preset

from common import TorchModules

transformers = pytest.importorskip("transformers")


class Idioms(nn.Module):
    """Init idioms people write: a randn parameter, an arange buffer, a tensor kept as an attribute, an
    explicit generator, trunc_normal_/orthogonal_, `.data =`, a value read with .item(), a tie, a dtype cast."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(6) * 0.02 + 1)
        self.register_buffer("pos", torch.arange(6).float() / 6)
        self.table = torch.linspace(0, 1, 6)  # a plain attribute: made real by zk.shard
        self.a = nn.Linear(6, 6)
        nn.init.trunc_normal_(self.a.weight, std=0.02)
        self.b = nn.Linear(6, 6)
        nn.init.orthogonal_(self.b.weight)
        self.b.bias.data = torch.randn(6)
        self.c = nn.Linear(6, 6)
        nn.init.normal_(self.c.weight, generator=torch.Generator().manual_seed(7))
        self.c.weight.data.div_(self.c.weight.abs().max().item())
        self.emb = nn.Embedding(9, 6)
        self.head = nn.Linear(6, 9, bias=False)
        self.head.weight = self.emb.weight
        self.half = nn.Linear(6, 6).to(torch.bfloat16).float()

    def forward(self, idx):
        h = self.emb(idx) * self.scale + self.pos + self.table
        return self.head(self.half(self.c(self.b(self.a(h)))))


def _hf_gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _hf_llama(tied=False):
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, tie_word_embeddings=tied, pad_token_id=1,
                                   bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _gpt_lora():
    model = GPT(preset("tiny"))
    zk.lora.inject(model, targets=("q", "v"), rank=2)  # adapters drawn for real, after the recorded base
    return model


CASES = {  # name: (build, wrap at stage 3)
    "torch modules": (TorchModules, None),
    "init idioms": (Idioms, None),
    "zerokit GPT": (lambda: GPT(preset("tiny")), (Block,)),
    "zerokit GPT + LoRA": (_gpt_lora, (Block,)),
    "HF GPT-2 (tied head)": (_hf_gpt2, None),
    "HF Llama": (_hf_llama, None),
    "HF Llama (tied, padding_idx)": (lambda: _hf_llama(tied=True), None),
}


def _wrap(model, wrap):
    if wrap is None and hasattr(model, "model"):
        wrap = (type(model.model.layers[0]),)
    if wrap is None and hasattr(model, "transformer"):
        wrap = (type(model.transformer.h[0]),)
    return wrap


def _eager(build):
    torch.manual_seed(3)
    model = build()
    return model, {k: v.clone() for k, v in model.state_dict().items()}, torch.rand(4)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_deferred_build_equals_eager(case, stage):
    build, wrap = CASES[case]
    eager, reference, next_draw = _eager(build)
    torch.manual_seed(3)
    with zk.deferred_init():
        model = build()
    assert any(is_lazy(p) for p in model.parameters())
    assert torch.equal(torch.rand(4), next_draw), "the recording must move the generator as an eager build does"
    torch.manual_seed(11)
    after = torch.rand(4)
    torch.manual_seed(11)
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, lr=1e-3, wrap=_wrap(model, wrap))
    assert torch.equal(torch.rand(4), after), "zk.shard's replay must leave the generator as it found it"
    got = engine.state_dict()
    assert sorted(got) == sorted(reference)
    for name, v in reference.items():
        assert got[name].dtype == v.dtype and torch.equal(got[name], v), name
    for (name, a), (_, b) in zip(eager.named_buffers(), model.named_buffers()):  # non-persistent ones too
        assert not is_lazy(b) and torch.equal(a, b), name
    for m_eager, m in zip(eager.modules(), model.modules()):  # tensors kept as plain attributes
        for key, v in vars(m).items():
            if isinstance(v, torch.Tensor):
                assert not is_lazy(v) and torch.equal(v, vars(m_eager)[key]), key


def test_hf_llama_trains_as_eager():
    """3 steps at stage 3 (bf16), through HF's own loss (the output object): equal to the eager build's, bitwise."""
    runs = []
    for deferred in (False, True):
        torch.manual_seed(0)
        with zk.deferred_init() if deferred else torch.device("cpu"):
            model = _hf_llama()
        engine = zk.shard(model, torch.optim.AdamW, stage=3, precision="bf16", lr=1e-3,
                          wrap=(type(model.model.layers[0]),))
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            idx = torch.randint(0, 96, (2, 8), generator=g)
            loss = engine(input_ids=idx, labels=idx).loss
            loss.backward()
            engine.step()
            model.zero_grad()
            losses.append(loss.item())
        runs.append((losses, {k: v.clone() for k, v in engine.state_dict().items()}))
    assert runs[0][0] == runs[1][0]
    for k, v in runs[0][1].items():
        assert torch.equal(v, runs[1][1][k]), k


def test_the_recording_is_not_a_meta_device_context():
    """HF decides whether to run its init from `torch.tensor([]).device`; the model's code sees CPU tensors."""
    with zk.deferred_init():
        assert torch.tensor([]).device == torch.device("cpu")
        w = torch.empty(3, 4)
        assert isinstance(w, LazyTensor) and w.device == torch.device("cpu") and not w.is_meta
        w.normal_()
        assert float(w.abs().max()) > 0  # a Python value: computed from the recording, for real
    assert "LazyTensor(shape=(3, 4)" in repr(w)
    torch.manual_seed(0)
    eager = torch.empty(3, 4).normal_().t()[1:]
    torch.manual_seed(0)
    with zk.deferred_init():
        lazy = torch.empty(3, 4).normal_()
    assert torch.equal(value(lazy.t()[1:]), eager)  # recording goes on outside the block


def test_recording_holds_no_parameter_memory():
    """8 x 16 MiB of parameters recorded: the process holds none of it afterwards (each draw's scratch freed)."""
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with zk.deferred_init():
        nn.Linear(8, 8)  # warm up: the allocator setting and imports
    before = rss()
    with zk.deferred_init():
        model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)])
    grown = rss() - before
    assert sum(p.numel() * 4 for p in model.parameters()) == 8 * 16 * 2**20
    assert grown < 8 * 2**20, f"recording grew the process by {grown / 2**20:.1f} MiB"


class Uninitialized(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.extra = nn.Parameter(torch.empty(4))  # nothing writes it: garbage in an eager build too


def test_refusals_name_the_fix():
    with zk.deferred_init():
        model = Uninitialized()
    with pytest.raises(ValueError, match="parameter 'extra' was recorded .* as uninitialized memory"):
        zk.shard(model, torch.optim.SGD, lr=0.1)
    with zk.deferred_init():
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="call param_init_fn inside the deferred_init"):
        zk.shard(model, torch.optim.SGD, lr=0.1, param_init_fn=lambda m: None)
    with zk.deferred_init():
        w = torch.empty(4)
        with pytest.raises(RuntimeError, match="changes a recorded tensor's shape or storage in place"):
            w.resize_(8)
