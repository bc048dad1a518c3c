"""The GPT and the built-in corpus: counts, tying, determinism, low precision, checkpointing, data sharding."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from zerokit.models import GPT, PRESETS, Block, CharCorpus, GPTConfig, build_model, num_params, preset


@pytest.fixture(scope="module")
def corpus() -> CharCorpus:
    return CharCorpus.load()


def _checkpointed(forward):
    return lambda h: checkpoint(forward, h, use_reentrant=False)


def _random_tokens(cfg: GPTConfig, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) drawn uniformly and independently, so no input says anything about its target."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(cfg.vocab_size, (2, batch_size, cfg.block_size), generator=gen)
    return x, y


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("cfg", [
    preset("tiny"),
    preset("small"),
    GPTConfig(vocab_size=13, block_size=7, n_layer=3, n_head=3, n_embd=15, mlp_ratio=2, bias=False),
])
def test_num_params_equals_module_parameter_count(cfg: GPTConfig) -> None:
    """The analytic Ψ equals the number of elements model.parameters() yields (tied weight once)."""
    assert num_params(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


@pytest.mark.parametrize("name, millions", [("gpt2-small", 124), ("gpt2-medium", 355), ("gpt2-xl", 1558),
                                            ("gpt3-6.7b", 6658)])
def test_gpt2_presets_have_published_sizes(name: str, millions: int) -> None:
    """GPT-2 shapes give the published 124M / 355M / 1558M, analytically and as built on the meta device; the
    GPT-3 6.7B shape (GPT-2's vocabulary, tied head) 6,658,404,352."""
    cfg = preset(name)
    with torch.device("meta"):  # shapes only, no memory
        built = sum(p.numel() for p in GPT(cfg).parameters())
    assert built == num_params(cfg)
    assert round(num_params(cfg) / 1e6) == millions
    if name == "gpt3-6.7b":
        assert num_params(cfg) == 6_658_404_352


def test_lm_head_weight_is_wte_weight() -> None:
    """lm_head and wte share one Parameter, which parameters() yields once and both uses update."""
    model = build_model("tiny")
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    assert len({id(p) for p in model.parameters()}) == len(names)


def test_forward_shapes_and_no_loss_without_targets(corpus: CharCorpus) -> None:
    """forward gives (B, T, vocab) logits, a scalar loss with targets and None without."""
    cfg = preset("tiny")
    model = build_model(cfg)
    x, y = corpus.batch(3, 5, step=0)  # T < block_size is allowed
    logits, loss = model(x, y)
    assert logits.shape == (3, 5, cfg.vocab_size) and loss.shape == ()
    assert model(x)[1] is None


def test_sequence_longer_than_block_size_is_rejected(corpus: CharCorpus) -> None:
    """A sequence longer than block_size raises a ValueError naming block_size."""
    model = build_model("tiny")
    x, _ = corpus.batch(1, model.cfg.block_size + 1, step=0)
    with pytest.raises(ValueError, match="block_size"):
        model(x)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_initial_loss_is_near_log_vocab(name: str) -> None:
    """At init the prediction is near uniform, so the loss on unrelated targets is close to ln(vocab_size)."""
    cfg = preset(name)
    _, loss = build_model(cfg)(*_random_tokens(cfg, 16))
    # std-0.02 weights give logits of std 0.02 * sqrt(n_embd) ~ 0.1-0.2, which raise the loss by
    # about half their variance: a few hundredths. (Real text is not used here: in source code a
    # space often follows a space, and at init a token's own logit is its largest, so the loss
    # on corpus batches drifts with the corpus content.)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1


def test_build_model_depends_only_on_seed_and_keeps_global_rng() -> None:
    """Equal seeds give equal weights, different seeds different ones; the global RNG is untouched."""
    state = torch.get_rng_state()
    a, b, c = build_model("tiny", seed=1), build_model("tiny", seed=1), build_model("tiny", seed=2)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("bias") and "ln" not in name:  # zeros/ones are seed-independent
            assert not torch.equal(pa, pc), name


def test_init_is_normal_002_with_zero_biases() -> None:
    """Linear and Embedding weights are N(0, 0.02), Linear biases are zero."""
    model = build_model("small")
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and module.weight.numel() > 1000:
            assert abs(module.weight.std().item() - 0.02) < 0.002  # sampling error of std on >1000 draws
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            assert not module.bias.any()


def test_two_identical_steps_give_bitwise_equal_grads(corpus: CharCorpus) -> None:
    """forward + backward is deterministic on CPU: the same inputs give bitwise equal gradients."""
    x, y = corpus.batch(4, 32, step=3)
    runs = []
    for _ in range(2):
        model = build_model("tiny", seed=0)
        model(x, y)[1].backward()
        runs.append(_grads(model))
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model_trains_without_dtype_errors(dtype: torch.dtype) -> None:
    """With every parameter in bf16/fp16, forward/backward run; the loss is fp32, grads in the param dtype."""
    model = build_model("tiny").to(dtype)
    logits, loss = model(*_random_tokens(model.cfg, 4))
    loss.backward()
    assert logits.dtype == dtype and loss.dtype == torch.float32
    assert model.lm_head.weight is model.wte.weight  # .to() keeps the tie
    # bf16 keeps ~3 significant digits, fp16 ~4: the loss sits near ln(97) as in fp32.
    assert abs(loss.item() - math.log(CharCorpus.vocab_size)) < 0.1
    for name, p in model.named_parameters():
        assert p.grad.dtype == dtype and torch.isfinite(p.grad).all(), name


def test_checkpointed_blocks_give_bitwise_equal_grads(corpus: CharCorpus) -> None:
    """Recomputing each Block under non-reentrant checkpoint gives bitwise the same grads as storing it."""
    x, y = corpus.batch(4, 32, step=5)
    plain = build_model("tiny")
    plain(x, y)[1].backward()

    ckpt = build_model("tiny")
    for block in ckpt.blocks:
        # Replace forward on the instance so parameter names stay those of the plain model.
        block.forward = _checkpointed(block.forward)
    assert all(isinstance(b, Block) for b in ckpt.blocks)
    ckpt(x, y)[1].backward()

    expected = _grads(plain)
    for name, grad in _grads(ckpt).items():
        assert torch.equal(grad, expected[name]), name


def test_corpus_vocabulary_is_fixed_and_round_trips() -> None:
    """97 symbols; printable ASCII and newline round-trip, anything else becomes the replacement."""
    c = CharCorpus("")
    assert c.vocab_size == 97 == preset("tiny").vocab_size == preset("small").vocab_size
    text = "def f(x):\n\treturn x ~ {}"  # tab is not in the vocabulary
    assert c.decode(c.encode(text)) == text.replace("\t", CharCorpus.REPLACEMENT)
    assert c.decode(torch.tensor(c.encode("π≈3"))) == CharCorpus.REPLACEMENT * 2 + "3"


def test_corpus_is_zerokit_source(corpus: CharCorpus) -> None:
    """load() reads the package's own Python files, this model file included."""
    text = corpus.decode(corpus.data)
    assert "class CharCorpus" in text and "def build_model" in text
    assert corpus.data.dtype == torch.int64 and corpus.data.dim() == 1
    assert int(corpus.data.max()) < corpus.vocab_size


def test_batch_targets_are_inputs_shifted_and_repeatable(corpus: CharCorpus) -> None:
    """y is x shifted by one character; a step gives the same batch each time, another step a different one."""
    x, y = corpus.batch(6, 16, step=7)
    assert x.shape == y.shape == (6, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(corpus.batch(6, 16, step=7)[0], x)
    assert not torch.equal(corpus.batch(6, 16, step=8)[0], x)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_batches_concatenate_to_the_single_process_batch(corpus: CharCorpus, world_size: int) -> None:
    """The N ranks' batches of a step, stacked by rank, are the world_size=1 batch of N*batch_size rows."""
    for step in (0, 1, 11):
        full_x, full_y = corpus.batch(3 * world_size, 16, step=step)
        parts = [corpus.batch(3, 16, step=step, rank=r, world_size=world_size) for r in range(world_size)]
        assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
        assert torch.equal(torch.cat([p[1] for p in parts]), full_y)


def test_batch_rejects_bad_rank_and_oversized_block() -> None:
    """A rank outside [0, world_size) or a window longer than the corpus raises ValueError."""
    c = CharCorpus("hello world")
    with pytest.raises(ValueError, match="rank"):
        c.batch(2, 4, step=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="block_size"):
        c.batch(2, 11, step=0)


def test_preset_lookup_and_config_validation() -> None:
    """Unknown preset names list the valid ones; n_embd not divisible by n_head is refused."""
    with pytest.raises(ValueError) as err:
        preset("gpt5")
    assert all(name in str(err.value) for name in PRESETS)
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=3, n_embd=16)


def test_small_preset_loss_falls_in_50_adamw_steps(corpus: CharCorpus) -> None:
    """One process training "small" for 50 AdamW steps lowers the loss well below its starting value."""
    cfg = preset("small")
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(50):
        _, loss = model(*corpus.batch(16, cfg.block_size, step=step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Learning character frequencies alone takes the loss from ln(97) ~ 4.57 toward the corpus's
    # unigram entropy (~3.3 nats); requiring a drop of 1.0 asks for most of that within 50 steps.
    # Averaging the last five steps smooths batch-to-batch noise.
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
