"""The model and data every zerokit demo, test and benchmark trains: a small GPT and a built-in corpus.

The model is a GPT-2 style decoder (after nanoGPT) with three choices made for zerokit's needs:

- Attention has four separate `nn.Linear` layers named `q`, `k`, `v`, `o`, so LoRA can target
  `("q", "v")` by name; the residual stack is `blocks: nn.ModuleList[Block]`, so ZeRO-3 can wrap
  each `Block` as one unit and activation checkpointing can recompute one `Block` at a time.
- No dropout and no randomness in `forward`: two identical steps give bitwise identical gradients,
  which the stage-parity tests rely on. (CPU `scaled_dot_product_attention` is deterministic;
  tests/unit/test_models.py checks it.)
- `lm_head.weight` IS `wte.weight` (one Parameter), so `model.parameters()` yields it once and
  Ψ counts it once. `state_dict()` still lists both keys, as for any tied torch model.

The loss is computed from fp32 logits even when the parameters are bf16/fp16: the softmax over
the vocabulary is the one place low precision visibly hurts the loss value.

The corpus is zerokit's own source code, read as characters: nothing to download, and the same
bytes on every rank. Its vocabulary is fixed (printable ASCII, newline, one replacement symbol),
so `vocab_size` never changes when the source does.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int  # longest sequence the position embedding covers
    n_layer: int
    n_head: int
    n_embd: int
    mlp_ratio: int = 4  # hidden width of the MLP = mlp_ratio * n_embd
    bias: bool = True  # biases in every Linear (except lm_head) and LayerNorm

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.o = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (lin(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for lin in (self.q, self.k, self.v))
        # is_causal builds the mask inside the kernel, so there is no mask tensor whose dtype or
        # device could disagree with the parameters.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: the unit ZeRO-3 shards and checkpointing recomputes."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # Tie after init: one Parameter, registered first under the name "wte.weight".
        self.lm_head.weight = self.wte.weight
        # Activation checkpointing: keep only each block's input and recompute the block in
        # backward (non-reentrant, so gradient hooks fire once). `zerokit train --checkpointing`.
        self.checkpointing = False

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) int64 token ids -> logits (B, T, vocab_size), mean cross-entropy or None."""
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,) int64: an index, so no float dtype to match
        x = self.wte(idx) + self.wpe(pos)  # (B, T, n_embd)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab_size), in the parameter dtype
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss


def num_params(cfg: GPTConfig) -> int:
    """Ψ for `cfg`, counted analytically; the tied wte/lm_head weight counts once."""
    C, H, b = cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, int(cfg.bias)
    layernorm = C + b * C
    attn = 4 * (C * C + b * C)
    mlp = (C * H + b * H) + (H * C + b * C)
    block = 2 * layernorm + attn + mlp
    return cfg.vocab_size * C + cfg.block_size * C + cfg.n_layer * block + layernorm


class CharCorpus:
    """Character-level text with a fixed vocabulary: "\\n", printable ASCII, then a replacement symbol."""

    REPLACEMENT = "\ufffd"  # stands for every character outside the vocabulary
    VOCAB = "\n" + "".join(chr(c) for c in range(32, 127)) + REPLACEMENT
    vocab_size = len(VOCAB)  # 97

    def __init__(self, text: str) -> None:
        self._stoi = {ch: i for i, ch in enumerate(self.VOCAB)}
        self.data = torch.tensor(self.encode(text), dtype=torch.int64)  # (num_chars,)

    @classmethod
    def load(cls) -> CharCorpus:
        """zerokit's own *.py files, sorted by path inside the package, concatenated."""
        package_dir = Path(__file__).resolve().parent
        paths = sorted(package_dir.rglob("*.py"), key=lambda p: p.relative_to(package_dir).as_posix())
        return cls("".join(p.read_text(encoding="utf-8", errors="replace") for p in paths))

    def encode(self, text: str) -> list[int]:
        unknown = self._stoi[self.REPLACEMENT]
        return [self._stoi.get(ch, unknown) for ch in text]

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.flatten().tolist()
        return "".join(self.VOCAB[i] for i in ids)

    def batch(self, batch_size: int, block_size: int, step: int, rank: int = 0,
              world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (x, y), each (batch_size, block_size) int64, y = x shifted by one character.

        The global batch of `step` has batch_size * world_size rows, drawn from a generator seeded
        with `step` alone; rank r takes rows [r * batch_size, (r + 1) * batch_size). So N ranks
        together see exactly the batch one process sees with world_size=1 and N * batch_size rows.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        num_starts = len(self.data) - block_size  # a window needs block_size + 1 characters
        if num_starts < 1:
            raise ValueError(f"block_size={block_size} needs a corpus longer than {len(self.data)} characters")
        gen = torch.Generator().manual_seed(step)
        starts = torch.randint(num_starts, (batch_size * world_size,), generator=gen)  # (global rows,)
        starts = starts[rank * batch_size:(rank + 1) * batch_size]  # (batch_size,)
        window = self.data[starts[:, None] + torch.arange(block_size + 1)]  # (batch_size, block_size + 1)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


PRESETS: dict[str, GPTConfig] = {
    # tests: a training step in a few milliseconds on one CPU core
    "tiny": GPTConfig(vocab_size=CharCorpus.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32),
    # demos: a few hundred steps on 2 CPU ranks in about a minute
    "small": GPTConfig(vocab_size=CharCorpus.vocab_size, block_size=64, n_layer=4, n_head=4, n_embd=96),
    # GPT-2 shapes, for memory arithmetic only (never trained here); 50257 = GPT-2's BPE vocabulary
    "gpt2-small": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-xl": GPTConfig(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    # GPT-3 6.7B's shape (Brown et al. 2020, Table 2.1) with GPT-2's vocabulary and a tied head: Ψ = 6,658,404,352.
    "gpt3-6.7b": GPTConfig(vocab_size=50257, block_size=2048, n_layer=32, n_head=32, n_embd=4096),
}


def preset(name: str) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid names: {', '.join(PRESETS)}")
    return PRESETS[name]


def build_model(cfg_or_name: GPTConfig | str, seed: int = 0) -> GPT:
    """A GPT whose initial weights depend only on `seed`; the global RNG state is left untouched."""
    cfg = preset(cfg_or_name) if isinstance(cfg_or_name, str) else cfg_or_name
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)
