"""Shared by the distributed tests: the odd model, its data, reference training loops, and the collectives'
checks that run at more than one world size (`callers_buffers_cases` and its assertion,
`allocations_while`).

The odd model has every shape that breaks naive flattening: odd sizes such as (7, 15),
a frozen parameter, an embedding tied to the output head, a 1-element parameter and a
zero-initialised bias, arranged in `OddBlock`s so stage 3 can wrap them as units.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from zerokit.models import CharCorpus

VOCAB, DIM, HIDDEN, SEQ = 11, 7, 15, 5


class OddBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)  # weight (15, 7)
        self.frozen = nn.Linear(HIDDEN, HIDDEN)  # never trained: no grad, master or state
        self.frozen.requires_grad_(False)
        self.fc2 = nn.Linear(HIDDEN, DIM)  # weight (7, 15)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.frozen(torch.tanh(self.fc1(x)))))


class OddModel(nn.Module):
    def __init__(self, num_blocks: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(OddBlock() for _ in range(num_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.gain = nn.Parameter(torch.full((1,), 1.5))  # the 1-element parameter
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, two names

    def forward(self, idx, targets):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h) * self.gain)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class CheckpointedOddModel(OddModel):
    """OddModel whose blocks run under non-reentrant activation checkpointing."""

    def forward(self, idx, targets):
        from torch.utils.checkpoint import checkpoint
        h = self.emb(idx)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        logits = self.head(self.norm(h) * self.gain)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def odd_model(seed: int = 0) -> OddModel:
    torch.manual_seed(seed)
    return OddModel()


def odd_batch(step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's rows of the global batch of `batch_size * world_size` rows for `step`."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (batch_size * world_size, SEQ + 1), generator=g)
    rows = data[rank * batch_size:(rank + 1) * batch_size]
    return rows[:, :-1], rows[:, 1:]


# Words of the fixed corpus: a vocabulary of the lecture's own terms, so the text reads like the project.
_WORDS = ("the a of to in and is each rank shard shards gathers reduces scatters sums its every one all "
          "gradient gradients parameter parameters optimizer state states master weight weights loss scale "
          "bucket buckets unit units forward backward step stage zero sharded flat view hook hooks prefetch "
          "memory bytes fp32 fp16 bf16 adam moment activation checkpoint lora adapter frozen model layer "
          "block head embedding tied norm clip overflow skip update before after while then").split()


@functools.lru_cache(maxsize=1)
def fixed_corpus() -> CharCorpus:
    """Text that does not change when zerokit's source does, for tests whose bounds depend on the batches.

    `CharCorpus.load()` reads zerokit's own *.py files, so any edit under zerokit/ moves every batch
    drawn from it: a cosmetic edit once moved the fp16-vs-fp32 drift of test_mixed_precision past
    its bound. These are sentences of a fixed vocabulary drawn by a fixed linear congruential
    generator (plain integers: the same text on every platform and torch version), about 250k
    characters; the char-level statistics are learnable, so the loss falls fast on it."""
    state, lines, words = 12345, [], []
    for _ in range(40_000):
        state = (1103515245 * state + 12345) % 2 ** 31
        words.append(_WORDS[(state >> 16) % len(_WORDS)])
        if (state >> 8) % 11 == 0:  # a sentence ends about every 11 words
            lines.append(" ".join(words).capitalize() + ".")
            words = []
    return CharCorpus("\n".join(lines) + "\n")


class ConvBlock(nn.Module):
    """conv + BatchNorm2d: the buffers of a stage-3 unit (tests/distributed/test_model_contract.py)."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class BNNet(nn.Module):
    """conv + BatchNorm2d blocks (stage 3 units hold BatchNorm buffers), then linear + BatchNorm1d."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ConvBlock(3, 4), ConvBlock(4, 4)])
        self.fc = nn.Linear(4 * 4 * 4, 8)
        self.bn1 = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        h = F.relu(self.bn1(self.fc(x.flatten(1))))
        return F.cross_entropy(self.head(h).float(), y)


def bn_net(seed: int = 0) -> BNNet:
    torch.manual_seed(seed)
    return BNNet()


def bn_batch(step: int, rank: int, batch_size: int = 6):
    """Each rank its own data, scaled differently per rank so that BatchNorm statistics differ."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch_size, 3, 4, 4, generator=g) * (1 + rank), torch.randint(0, 3, (batch_size,), generator=g)


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def _build_ddp(model, **ddp_kwargs):
    """torch's DDP. Under TORCH_DISTRIBUTED_DEBUG=DETAIL its constructor segfaults on torch 2.13
    with gloo (in the logger, on the debug-wrapped process group), so there the reference gets
    its own process group created without the wrapper; zerokit's collectives keep DETAIL's
    consistency checks on the default group."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    level = dist.get_debug_level()
    if level != dist.DebugLevel.DETAIL:
        return DDP(model, **ddp_kwargs)
    dist.set_debug_level(dist.DebugLevel.INFO)
    try:
        group = dist.new_group(backend="gloo")  # every rank calls this, in the same order
    finally:
        dist.set_debug_level(level)
    return DDP(model, process_group=group, **ddp_kwargs)


def train_torch_ddp(rank: int, world_size: int, optimizer_cls, opt_kwargs: dict, steps, batch_size: int,
                    seed: int = 0, clip: float | None = None, param_groups=None):
    """torch's own DistributedDataParallel: the reference every stage is measured against.

    `steps`: a count, or the step indices whose batches to train on (a step left out is skipped from
    the same state); `param_groups(model)`: the torch optimizer's groups (default: every trainable param)."""
    model = odd_model(seed)
    ddp = _build_ddp(model) if world_size > 1 else model
    groups = param_groups(model) if param_groups else [p for p in model.parameters() if p.requires_grad]
    opt = optimizer_cls(groups, **opt_kwargs)
    losses = []
    for step in (range(steps) if isinstance(steps, int) else steps):
        x, y = odd_batch(step, batch_size, rank, world_size)
        opt.zero_grad(set_to_none=True)
        loss = ddp(x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        losses.append(loss.detach().clone())
    return torch.stack(losses), params_of(model)


def train_zerokit(rank: int, world_size: int, stage: int, optimizer_cls, opt_kwargs: dict, steps: int,
                  batch_size: int, seed: int = 0, clip: float | None = None, accumulate: int = 1, **shard_kwargs):
    """The same loop through zk.shard (zerokit's train_step); returns (losses, params, engine)."""
    import zerokit as zk
    from zerokit.commands.step import train_step
    model = odd_model(seed)
    shard_kwargs.setdefault("wrap", (OddBlock,))
    engine = zk.shard(model, optimizer_cls, stage=stage, **shard_kwargs, **opt_kwargs)
    losses = []
    for step in range(steps):
        micro_batches = [odd_batch(step * accumulate + micro, batch_size, rank, world_size)
                         for micro in range(accumulate)]
        loss = train_step(engine, micro_batches, lambda batch: engine(*batch), clip=clip).loss
        losses.append(loss.float().clone())
    return torch.stack(losses), engine.state_dict(full=True), engine


class TorchModules(nn.Module):
    """torch's built-in modules with their own reset_parameters (MultiheadAttention reaches into its child):
    the meta and deferred builds must give their eager values (test_meta_init.py, test_deferred_init.py)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 16, padding_idx=0)
        self.mha = nn.MultiheadAttention(16, 4)
        self.conv = nn.Conv1d(16, 8, 3)
        self.bn = nn.BatchNorm1d(8)
        self.gru = nn.GRU(8, 8)
        self.ln = nn.LayerNorm(8)
        self.lin = nn.Linear(8, 10)

    def forward(self, x):
        return self.lin(self.ln(x))


def train_on_tokens(engine, steps: int, seed: int, vocab: int) -> list[float]:
    """`steps` plain training steps of a GPT engine on random (2, 8) token batches from `seed`: the losses."""
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, vocab, (2, 8), generator=g)
        _, loss = engine(idx, idx)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


def allocations_while(fn) -> list[tuple[int, str]]:
    """(bytes, op) of every allocation torch.profiler sees while `fn` runs: this thread's, and gloo's worker
    threads' (they run a collective with the issuing thread's profiler state)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    found = []

    def walk(node, parent):
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            if node.extra_fields.alloc_size > 0:
                found.append((node.extra_fields.alloc_size, parent))
        for child in node.children:
            walk(child, node.name)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, "")
    return found


def storage_refs(storage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


def callers_buffers_cases(rank: int, world_size: int) -> dict:
    """core/collectives/gather.py [Note: frees at a fixed point], the caller's buffers: every reduce-scatter and all-reduce
    path (ordered and native, into its own output and in place, asynchronous and not), with its Handle still
    alive (so its Work too), right after the wait. For each: (the result is right, the references left on the
    input's storage once the caller has dropped the input: 1 is this check's own, so the caller's last
    reference freed the bytes; more is the Work still holding them)."""
    from zerokit.core.collectives.comm import Comm

    n, total = world_size, float(sum(range(1, world_size + 1)))
    out = {}
    for ordered in (True, False):
        comm = Comm(ordered=ordered)
        for way in ("own output", "in place", "all-reduce", "all-reduce max"):
            for async_op in (True, False):
                full = torch.full((4 * n,), float(rank + 1))
                storage = full.untyped_storage()
                if way == "own output":
                    result = torch.empty(4)
                    handle = comm.reduce_scatter(result, full, async_op=async_op)
                    expected = torch.full((4,), total)
                elif way == "in place":
                    result = full.view(n, -1)[rank]
                    handle = comm.reduce_scatter(result, full, async_op=async_op)
                    expected = torch.full((4,), total)
                else:
                    op = "max" if way.endswith("max") else "sum"
                    result = full
                    handle = comm.all_reduce(full, op=op, async_op=async_op)
                    expected = torch.full((4 * n,), float(n) if op == "max" else total)
                handle.wait()
                right = torch.equal(result, expected)
                del full, result
                out[(ordered, way, async_op)] = (right, storage_refs(storage))
                del handle
    return out


def assert_callers_buffers_freed(results: list[dict]) -> None:
    """Every rank's `callers_buffers_cases` (under "callers"): all 16 paths right, and 1 reference left on the
    dropped input's storage (the check's own), so nothing but the caller held its bytes."""
    for rank, out in enumerate(results):
        cases = out["callers"]
        assert len(cases) == 16
        assert all(right for right, _ in cases.values()), (rank, cases)
        assert all(refs == 1 for _, refs in cases.values()), (rank, cases)


def assert_session_gone(pid: int, what: str) -> None:
    """Every process of the session led by `pid` (ranks, multiprocessing's resource tracker) exits within 5 s."""
    import subprocess
    import time

    import pytest
    for _ in range(50):
        if subprocess.run(["pgrep", "-s", str(pid)], capture_output=True).returncode != 0:
            return
        time.sleep(0.1)
    left = subprocess.run(["pgrep", "-a", "-s", str(pid)], capture_output=True, text=True).stdout
    pytest.fail(f"processes left behind{what}: {left}")
