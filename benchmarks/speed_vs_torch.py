"""Step time of zerokit's stages beside torch's own DDP, ZeroRedundancyOptimizer and FSDP.

    python benchmarks/speed_vs_torch.py                    # 2 gloo ranks, model small, 30 steps, fp32
    python benchmarks/speed_vs_torch.py --nproc 2 --model small --steps 30 --warmup 5 --precision fp32

docs/design.md ("Speed, from the first line") names torch's implementations as the yardstick. One
spawn of `--nproc` ranks trains, in turn, each configuration below from the same initial
weights (`build_model(seed)`) on the same batches (`CharCorpus.batch`), with the same AdamW
hyperparameters (lr, betas, weight decay 0.1 on matrices and 0 on biases/LayerNorms), through
one loop body (`_timed_steps`), and the pairs are compared:

    zerokit stage 0  vs  torch DistributedDataParallel
    zerokit stage 1  vs  torch ZeroRedundancyOptimizer over DDP (DDP all-reduces the grads,
                         each rank steps its own params, then broadcasts them: torch's recipe)
    zerokit stage 2  vs  torch DDP (torch has no stage-2 peer: FSDP's SHARD_GRAD_OP shards
                         grads but also keeps params sharded between steps; DDP stands in)
    zerokit stage 3  vs  torch FSDP: FSDP2 `fully_shard` per Block plus the root; FSDP1
                         `FullyShardedDataParallel(device_id=None)` only if FSDP2 fails.
                         A peer that cannot run here is recorded with its exact error, no number.

Every run is repeated `--rounds` times from fresh weights, odd rounds in reverse order, so
slow drift of the machine favours neither side. Per run, round and rank: the time of every
step (forward + backward + optimizer step + zero_grad, up to the loss read back to the host),
the local loss of every step, and the model-state bytes this rank holds after the last
optimizer step (zerokit: `engine.memory()`; torch: the storages of the local params, grads and
optimizer states, counted once each; on CUDA also the allocator's peak). A row's step time is
the median over every round's steps after its `--warmup`, on the slowest rank; tokens/s is the
global batch (batch size x block size x ranks) divided by it; the loss check is the largest
|zerokit loss - peer loss| over all steps, rounds and ranks. ZeroRedundancyOptimizer and FSDP
may reduce in another order than zerokit, so they are held to a stated tolerance, not to
equality (at 2 ranks they do agree bit for bit: a sum of two values has only one order).

torch's optimizers get `foreach=True`: on CPU their default is a Python loop over parameters,
which would time torch's loop rather than its design (zerokit's sharded optimizer steps a few
flat buffers, so it has no such loop to lose). With `--precision bf16/fp16` only zerokit changes
precision; the torch peers stay fp32, as in `zerokit compare`.

With CUDA available the ranks use NCCL, one GPU each, and time with `torch.cuda.synchronize()`;
results go to speed_vs_torch_cuda.*. Without it: gloo on CPU, speed_vs_torch_cpu.*.

    python benchmarks/speed_vs_torch.py --peers plain --nproc 1 --model gpt2-medium --precision bf16 \
        --batch-size 8 --steps 15 --warmup 5 --rounds 2 --bucket-numel 4194304

`--peers plain` (world size 1 only) compares every zerokit stage with plain torch on one device
instead: no process group, no wrapper, `torch.optim.AdamW` (foreach, the same decay / no-decay
groups and hyperparameters) over the model's parameters, `loss.backward()`, `opt.step()`,
`opt.zero_grad()` (set_to_none, torch's default). Everything runs in this one process. Under
`--precision bf16` there are two such peers, since plain torch has two common bf16 recipes:

    torch autocast bf16   fp32 params, forward under torch.autocast(dtype=torch.bfloat16),
                          fp32 grads and AdamW states (16 bytes/param, as zerokit's 2+2+4+8)
    torch bf16 params     model.to(torch.bfloat16): bf16 params, grads and AdamW states, no fp32
                          master (8 bytes/param; not the same numerics as zerokit's fp32 master)

under fp32 one, `torch fp32`. zerokit at world size 1 issues no collective, so the ratio is
its per-step overhead (hooks, flat buffers, the sharded optimizer's fp32 master update) over
torch's own loop. Results go through benchmarks/_results.py (`provenance`, `write_pair`) to
speed_vs_torch_plain_<cpu | cuda>.json and .md.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from zerokit.commands.compare import _no_decay, _unique_bytes, available_stages, environment  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from _results import command_line, git_commit, provenance, provenance_lines, write_pair  # noqa: E402
# (benchmarks/_results.py, beside this script)

# Largest |Δloss| accepted between a pair at fp32. The DDP pairs sum gradients in the same
# order and may agree exactly; ZeroRedundancyOptimizer and FSDP reduce in other orders
# (per-parameter broadcasts, reduce-scatter), which moves the last bits of each step's
# update, and over tens of steps that drift stays around 1e-6..1e-5 on the loss.
FP32_LOSS_TOLERANCE = 1e-4
MODEL_STATES = ("params", "grads", "master_params", "optimizer_states")
ORDERED = {"default": None, "ordered": True, "native": False}  # --reduction -> zk.shard(ordered_reduction=)
DDP, ZERO, FSDP = "torch DDP", "torch ZeroRedundancyOptimizer", "torch FSDP"
# zerokit stage -> (peer, why this peer)
PEERS = {
    0: (DDP, "same idea: replicated model, bucketed gradient all-reduce"),
    1: (ZERO, "optimizer states sharded; torch shards whole params and broadcasts them after the step"),
    2: (DDP, "torch has no stage-2 peer, so DDP stands in (FSDP's SHARD_GRAD_OP / reshard_after_forward=False "
             "also keeps params sharded between steps, which ZeRO-2 does not)"),
    3: (FSDP, "parameters sharded, one unit per Block plus the root"),
}
# --peers plain: torch on one device, no wrapper (world size 1)
PLAIN_FP32, PLAIN_AUTOCAST, PLAIN_BF16 = "torch fp32", "torch autocast bf16", "torch bf16 params"
PLAIN = {
    PLAIN_FP32: "plain torch loop, fp32 params, grads and AdamW states",
    PLAIN_AUTOCAST: "plain torch loop, fp32 params under torch.autocast(bfloat16): fp32 grads and AdamW states",
    PLAIN_BF16: "plain torch loop, model.to(bfloat16): bf16 params, grads and AdamW states, no fp32 master",
}


def peers_for(stage: int, cfg: dict) -> list[tuple[str, str]]:
    """The torch runs a zerokit stage is compared with: (name, why), one pair each."""
    if cfg.get("peers", "default") != "plain":
        return [PEERS[stage]]
    names = [PLAIN_FP32] if cfg["precision"] == "fp32" else [PLAIN_AUTOCAST, PLAIN_BF16]
    return [(name, PLAIN[name]) for name in names]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--model", default="small", help="model preset (default small)")
    p.add_argument("--steps", type=int, default=30, help="steps per run, warm-up included (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps of each round left out of the median (default 5)")
    p.add_argument("--rounds", type=int, default=3,
                   help="times every run is repeated, from fresh weights, in alternating order (default 3)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="zerokit's precision; the torch peers always run fp32 (default fp32)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bucket-numel", type=int, default=1 << 16,
                   help="elements per gradient bucket, zerokit and DDP alike (default 65536)")
    p.add_argument("--reduction", default="default", choices=["default", "ordered", "native"],
                   help="zerokit's gradient reduction: its default (ordered on gloo, native on NCCL), the ordered "
                        "all-to-all + rank-order sum + all-gather, or the native all-reduce / reduce-scatter "
                        "(see zerokit/core/comm.py [Note: ordered reduction])")
    p.add_argument("--peers", default="default", choices=["default", "plain"],
                   help="default: torch DDP / ZeroRedundancyOptimizer / FSDP on --nproc ranks; plain: torch on one "
                        "device without a wrapper, in this process (needs --nproc 1; see the module docstring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the ranks are killed")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args(argv)
    if min(args.nproc, args.steps, args.batch_size, args.rounds) < 1 or not 0 <= args.warmup < args.steps:
        p.error("--nproc, --steps, --batch-size, --rounds must be >= 1 and 0 <= --warmup < --steps")
    if args.peers == "plain" and args.nproc != 1:
        p.error("--peers plain compares world size 1 runs: pass --nproc 1")
    if args.peers == "plain" and args.precision == "fp16":
        p.error("--peers plain has no fp16 peer (plain torch would need a GradScaler); use fp32 or bf16")
    return args


# ----------------------------------------------------------------------------- one rank
def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a tensor: the local shard of an FSDP2 DTensor, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _torch_memory(params: list[torch.nn.Parameter], state: dict) -> dict[str, int]:
    """Bytes this rank holds for a torch peer, by zerokit's categories (fp32: no master copy)."""
    return {
        "params": _unique_bytes(_local(p) for p in params),
        "grads": _unique_bytes(_local(p.grad) for p in params if p.grad is not None),
        "master_params": 0,
        "optimizer_states": _unique_bytes(_local(t) for s in state.values() for t in s.values()
                                          if torch.is_tensor(t) and t.dim() > 0),
    }


def _param_groups(model: torch.nn.Module) -> list[dict]:
    """The same decay / no-decay split as zerokit's `param_groups=_no_decay`."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if not _no_decay("", p)]},
            {"params": [p for p in params if _no_decay("", p)], "weight_decay": 0.0}]


def _timed_steps(cfg: dict, rank: int, world_size: int, device: torch.device,
                 train_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], zero_grad: Callable[[], None],
                 memory: Callable[[], dict[str, int]]) -> dict:
    """The one loop every run goes through: each step's loss and milliseconds, and this rank's bytes.

    `train_step(x, y)` runs forward, backward and the optimizer step and returns the loss;
    `zero_grad()` ends the step (timed too; a no-op for zerokit, whose step, zerokit/commands/
    step.py, clears the gradients at its start). `memory()` is read once, after the last optimizer
    step and before its zero_grad, so that gradients count for every run alike (FSDP frees its
    sharded grads at zero_grad; zerokit and DDP keep theirs in flat buffers).
    """
    from zerokit.models import CharCorpus

    corpus = CharCorpus.load()
    block = cfg["block_size"]
    batches = [tuple(t.to(device) for t in corpus.batch(cfg["batch_size"], block, i, rank, world_size))
               for i in range(cfg["steps"])]  # made before timing: data loading is not what is compared
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times, held = [], [], {}
    for i, (x, y) in enumerate(batches):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = train_step(x, y)
        if i == len(batches) - 1:
            pause = time.perf_counter()
            held = memory()  # not part of the step: its time is taken out below
            start += time.perf_counter() - pause
        zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's kernels, not just their launch
        loss_value = float(loss.detach())  # a sync point on every device; inside the timed region
        times.append(1e3 * (time.perf_counter() - start))
        losses.append(loss_value)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"losses": losses, "step_ms": times, "peak_bytes": peak, "memory": held}


_INITIAL: dict[tuple[str, int], torch.nn.Module] = {}


def _initial_model(cfg: dict) -> torch.nn.Module:
    """`build_model(model, seed)` on the CPU: the same initial weights for every run.

    With --peers plain every run happens in this one process, so the model is built once and
    each run gets a deep copy (bitwise the same weights; gpt2-medium takes seconds to initialise
    on a CPU core). The multi-rank runs build afresh, as they always did.
    """
    from zerokit.models import build_model

    if cfg.get("peers", "default") != "plain":
        return build_model(cfg["model"], seed=cfg["seed"])
    key = (cfg["model"], cfg["seed"])
    if key not in _INITIAL:
        _INITIAL[key] = build_model(cfg["model"], seed=cfg["seed"])
    return copy.deepcopy(_INITIAL[key])


def _run_zerokit(rank: int, world_size: int, cfg: dict, device: torch.device, stage: int) -> dict:
    import zerokit as zk
    from zerokit.commands.step import train_step
    from zerokit.models import Block

    model = _initial_model(cfg).to(device)
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=cfg["precision"], lr=cfg["lr"],
                      weight_decay=0.1, bucket_numel=cfg["bucket_numel"], wrap=(Block,), param_groups=_no_decay,
                      ordered_reduction=ORDERED[cfg["reduction"]])

    def step(x, y):  # zerokit's one step, zero_grad first (commands/step.py): nothing left to end the step
        return train_step(engine, [(x, y)], lambda batch: engine(*batch)[1]).loss

    return _timed_steps(cfg, rank, world_size, device, step, lambda: None,
                        lambda: {c: engine.memory().get(c, 0) for c in MODEL_STATES})


def _run_torch_ddp(rank: int, world_size: int, cfg: dict, device: torch.device, zero: bool) -> dict:
    """torch DDP; with `zero`, ZeroRedundancyOptimizer over it (torch's documented ZeRO-1 recipe)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from zerokit.models import build_model

    model = build_model(cfg["model"], seed=cfg["seed"]).to(device)
    # gradient_as_bucket_view: grads live in the all-reduce buckets, as zerokit's live in its
    # flat buffers (no copy after the all-reduce); the bucket size is zerokit's.
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  bucket_cap_mb=cfg["bucket_numel"] * 4 / 2**20, gradient_as_bucket_view=True)
    groups = _param_groups(model)
    if zero:
        # parameters_as_bucket_view: one broadcast per bucket of params instead of one per
        # param, the closest torch gets to zerokit's flat all-gather.
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=True,
                                      lr=cfg["lr"], weight_decay=0.1, foreach=True)
    else:
        opt = torch.optim.AdamW(groups, lr=cfg["lr"], weight_decay=0.1, foreach=True)

    def train_step(x, y):
        _, loss = ddp(x, y)
        loss.backward()
        opt.step()
        return loss

    # ZeroRedundancyOptimizer keeps this rank's states in its local optimizer
    return _timed_steps(cfg, rank, world_size, device, train_step,
                        lambda: opt.zero_grad(set_to_none=False),  # keep the grads as bucket views
                        lambda: _torch_memory(list(model.parameters()), opt.optim.state if zero else opt.state))


def _run_torch_plain(rank: int, world_size: int, cfg: dict, device: torch.device, variant: str) -> dict:
    """Plain torch on one device: AdamW over the model's parameters, the loop a user writes without zerokit."""
    model = _initial_model(cfg).to(device)
    if variant == PLAIN_BF16:
        model = model.to(torch.bfloat16)
    autocast = variant == PLAIN_AUTOCAST
    opt = torch.optim.AdamW(_param_groups(model), lr=cfg["lr"], weight_decay=0.1, foreach=True)

    def train_step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(x, y)  # models.GPT takes the loss from fp32 logits in every variant
        loss.backward()
        opt.step()
        return loss

    return _timed_steps(cfg, rank, world_size, device, train_step, opt.zero_grad,
                        lambda: _torch_memory(list(model.parameters()), opt.state))


def _fsdp2(model: torch.nn.Module, world_size: int, device: torch.device) -> torch.nn.Module:
    """FSDP2: `fully_shard` on every Block (one unit each, as zerokit's wrap=(Block,)), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp1(model: torch.nn.Module, world_size: int, device: torch.device) -> torch.nn.Module:
    """FSDP1: FullyShardedDataParallel with one unit per Block; device_id=None on CPU."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from zerokit.models import Block

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                    device_id=device.index if device.type == "cuda" else None)


def _run_torch_fsdp(rank: int, world_size: int, cfg: dict, device: torch.device) -> dict:
    """FSDP2, or FSDP1 if FSDP2 fails (to wrap or to train); if both fail, their exact errors instead of a time."""
    from zerokit.models import build_model

    errors = []
    for variant, wrap in (("FSDP2 fully_shard", _fsdp2), ("FSDP1 FullyShardedDataParallel", _fsdp1)):
        try:
            wrapped = wrap(build_model(cfg["model"], seed=cfg["seed"]).to(device), world_size, device)
            # parameters() after wrapping: FSDP2's are DTensor shards, FSDP1's flat shards
            opt = torch.optim.AdamW(_param_groups(wrapped), lr=cfg["lr"], weight_decay=0.1, foreach=True)

            def train_step(x, y, wrapped=wrapped, opt=opt):
                _, loss = wrapped(x, y)
                loss.backward()
                opt.step()
                return loss

            # zero_grad sets grads to None: FSDP's reduce-scatter makes fresh sharded grads every step
            out = _timed_steps(cfg, rank, world_size, device, train_step, opt.zero_grad,
                               lambda: _torch_memory(list(wrapped.parameters()), opt.state))
        except Exception as exc:  # recorded in the results (the fallback's reason, or the row's)
            errors.append(f"{variant}: {type(exc).__name__}: {exc}")
            continue
        out["variant"], out["fallback_errors"] = variant, errors
        return out
    return {"error": "; ".join(errors)}


def speed_rank(rank: int, world_size: int, cfg: dict) -> dict[str, list[dict]]:
    """Every run on this rank, `rounds` times: name -> one result per round.

    Each zerokit stage runs right beside its peer, and odd rounds go through the list
    backwards, so that a machine slowly warming up (or a neighbour's load) favours neither side.
    """
    device = torch.device("cuda", rank) if cfg["device"] == "cuda" else torch.device("cpu")
    order: dict[str, Callable[[], dict]] = {}
    for stage in cfg["stages"]:
        order[f"zerokit stage {stage}"] = lambda stage=stage: _run_zerokit(rank, world_size, cfg, device, stage)
        for peer, _ in peers_for(stage, cfg):
            if peer in PLAIN:
                order.setdefault(peer, lambda peer=peer: _run_torch_plain(rank, world_size, cfg, device, peer))
            elif peer == FSDP:
                order.setdefault(peer, lambda: _run_torch_fsdp(rank, world_size, cfg, device))
            else:
                order.setdefault(peer, lambda zero=peer == ZERO: _run_torch_ddp(rank, world_size, cfg, device, zero))
    runs: dict[str, list[dict]] = {name: [] for name in order}
    for round_index in range(cfg["rounds"]):
        names = list(order) if round_index % 2 == 0 else list(reversed(order))
        for name in names:
            runs[name].append(order[name]())
    return runs


# ----------------------------------------------------------------------------- the parent
def summarize(per_rank: list[dict[str, list[dict]]], cfg: dict) -> dict:
    """Runs (all ranks' and rounds' numbers) and one pair per zerokit stage: ms, ratio, tokens/s, |Δloss|, bytes.

    A run's step time is the median of its timed steps (every round's, after each round's
    warm-up) on each rank, then the largest over ranks: the slowest rank sets the pace.
    """
    tokens_per_step = cfg["batch_size"] * cfg["block_size"] * cfg["nproc"]
    runs = {}
    for name, first_rounds in per_rank[0].items():
        first = first_rounds[0]
        if "error" in first:
            runs[name] = {"error": first["error"]}
            continue
        ranks = [r[name] for r in per_rank]  # [rank][round]
        median = max(statistics.median(t for rnd in rounds for t in rnd["step_ms"][cfg["warmup"]:])
                     for rounds in ranks)
        runs[name] = {
            "step_ms_median": median, "tokens_per_s": tokens_per_step / (median / 1e3),
            "step_ms": [[rnd["step_ms"] for rnd in rounds] for rounds in ranks],  # [rank][round][step]
            "losses": [[rnd["losses"] for rnd in rounds] for rounds in ranks],  # [rank][round][step]
            "memory": [rounds[0]["memory"] for rounds in ranks],  # [rank]
            "peak_bytes": [rounds[0]["peak_bytes"] for rounds in ranks],  # [rank], CUDA only
            **({k: first[k] for k in ("variant", "fallback_errors") if k in first}),  # FSDP only
        }
    pairs = []
    for stage in cfg["stages"]:
        for peer, note in peers_for(stage, cfg):
            name = f"zerokit stage {stage}"
            zk_run, peer_run = runs[name], runs[peer]
            pair = {"stage": stage, "zerokit": name, "peer": peer, "note": note,
                    "zerokit_ms": zk_run["step_ms_median"], "zerokit_tokens_per_s": zk_run["tokens_per_s"],
                    "zerokit_memory": zk_run["memory"][0], "peer_ms": None, "peer_tokens_per_s": None, "ratio": None,
                    "peer_memory": None, "max_abs_loss_diff": None, "loss_tolerance": None,
                    "loss_within_tolerance": None, "peer_error": peer_run.get("error")}
            if "error" not in peer_run:
                diff = max(abs(a - b) for zk_rounds, peer_rounds in zip(zk_run["losses"], peer_run["losses"])
                           for zr, pr in zip(zk_rounds, peer_rounds) for a, b in zip(zr, pr))
                tolerance = FP32_LOSS_TOLERANCE if cfg["precision"] == "fp32" else None
                pair.update(peer=f"{peer} ({peer_run['variant']})" if "variant" in peer_run else peer,
                            peer_ms=peer_run["step_ms_median"], peer_tokens_per_s=peer_run["tokens_per_s"],
                            ratio=zk_run["step_ms_median"] / peer_run["step_ms_median"],
                            peer_memory=peer_run["memory"][0], max_abs_loss_diff=diff, loss_tolerance=tolerance,
                            loss_within_tolerance=None if tolerance is None else bool(diff <= tolerance))
            pairs.append(pair)
    return {"runs": runs, "pairs": pairs}


def _kb(memory: dict | None, keys: tuple[str, ...]) -> str:
    return "-" if memory is None else f"{sum(memory[k] for k in keys) / 1e3:,.1f}"


def table(pairs: list[dict]) -> list[str]:
    """The markdown table, one row per pair; KB = 1000 bytes, rank 0's."""
    rows = ["| zerokit | torch peer | zerokit ms | peer ms | ratio (zk/peer) | zerokit tok/s | peer tok/s "
            "| max abs Δloss | opt states KB (zk / peer) | model states KB (zk / peer) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in pairs:
        if p["peer_error"]:
            peer_ms = ratio = peer_tps = loss = "-"
        else:
            peer_ms, ratio = f"{p['peer_ms']:.1f}", f"{p['ratio']:.2f}"
            peer_tps, loss = f"{p['peer_tokens_per_s']:,.0f}", f"{p['max_abs_loss_diff']:.1e}"
        rows.append(f"| {p['zerokit']} | {p['peer']} | {p['zerokit_ms']:.1f} | {peer_ms} | {ratio} "
                    f"| {p['zerokit_tokens_per_s']:,.0f} | {peer_tps} | {loss} "
                    f"| {_kb(p['zerokit_memory'], ('optimizer_states',))} / "
                    f"{_kb(p['peer_memory'], ('optimizer_states',))} "
                    f"| {_kb(p['zerokit_memory'], MODEL_STATES)} / {_kb(p['peer_memory'], MODEL_STATES)} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    from zerokit.models import preset

    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and args.nproc > torch.cuda.device_count():
        raise SystemExit(f"--nproc {args.nproc} needs {args.nproc} GPUs (NCCL: one per rank); "
                         f"{torch.cuda.device_count()} visible")
    commit = git_commit()  # taken before the run: the code that produced the numbers
    plain = args.peers == "plain"
    prov = provenance(command_line(__file__, argv)) if plain else None  # likewise, before the run
    stages, skipped = available_stages([0, 1, 2, 3])
    for stage, why in skipped.items():
        print(f"zerokit stage {stage} skipped: {why}")
    cfg = {"model": args.model, "block_size": preset(args.model).block_size, "nproc": args.nproc,
           "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "precision": args.precision,
           "batch_size": args.batch_size, "lr": args.lr, "bucket_numel": args.bucket_numel, "seed": args.seed,
           "stages": stages, "device": device, "reduction": args.reduction, "peers": args.peers,
           # what --reduction default means here: core/comm.py orders the sum on gloo, not on NCCL
           "reduction_used": {"default": "ordered" if device == "cpu" else "native"}.get(args.reduction,
                                                                                          args.reduction)}
    if plain:  # world size 1 in this process, no process group: zerokit issues no collective
        cfg["reduction_used"] = "none"
    start = time.perf_counter()
    if plain:
        per_rank = [speed_rank(0, 1, cfg)]
    else:
        per_rank = run_ranks(speed_rank, args.nproc, cfg, timeout_s=args.timeout,
                             backend="nccl" if device == "cuda" else "gloo")
    result = summarize(per_rank, cfg)

    meta = environment()
    meta["command"] = " ".join(["python", str(Path(__file__).resolve().relative_to(REPO))]
                               + (sys.argv[1:] if argv is None else list(argv)))
    meta["seconds"] = round(time.perf_counter() - start, 1)
    meta["commit"] = commit
    try:
        with open("/proc/cpuinfo") as f:
            meta["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                                     None)
    except OSError:
        meta["cpu_model"] = None
    record = {"meta": meta, "config": cfg, "skipped_stages": {str(k): v for k, v in skipped.items()}, **result}
    if plain:
        record = {"provenance": prov, **record}

    backend = "NCCL" if device == "cuda" else "gloo"
    lines = table(result["pairs"])
    print(f"{'one process, no process group' if plain else f'{args.nproc} {backend} rank(s)'}, model {args.model}, "
          f"{args.rounds} rounds of {args.steps} steps ({args.warmup} warm-up) of "
          f"{args.batch_size}x{cfg['block_size']} tokens per rank, AdamW; zerokit {args.precision}, "
          + ("peers: " + ", ".join(peer for peer, _ in peers_for(stages[0], cfg)) if plain and stages
             else "torch fp32"))
    print("\n".join(lines))
    for p in result["pairs"]:
        if p["peer_error"]:
            print(f"{p['peer']} did not run: {p['peer_error']}")

    if plain:
        write_pair(args.out / f"speed_vs_torch_plain_{device}", record, "\n".join(markdown(record)) + "\n")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.out / f"speed_vs_torch_{device}.json", args.out / f"speed_vs_torch_{device}.md"
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    md_path.write_text("\n".join(markdown(record)) + "\n")
    print(f"wrote {json_path} and {md_path} ({meta['seconds']} s)")
    return 0


def markdown(record: dict) -> list[str]:
    """The results page: provenance, the table, what each column means and what it does not show."""
    meta, cfg = record["meta"], record["config"]
    hw = meta["cpu_model"] or meta["processor"]
    if meta["cuda"]:
        hw += f", GPU: {meta['cuda']}"
    if "provenance" in record:  # --peers plain: written through benchmarks/_results.py
        head = [f"# zerokit vs plain torch: step time at world size 1 ({cfg['device']})", "",
                *provenance_lines(record["provenance"]), f"- total: {meta['seconds']} s",
                f"- setup: one process, no process group (world size 1: zerokit issues no collective), model "
                f"`{cfg['model']}`, {cfg['batch_size']} x {cfg['block_size']} tokens per step, AdamW (lr {cfg['lr']}, "
                f"weight decay 0.1, none on biases/LayerNorms), {cfg['rounds']} rounds of {cfg['steps']} steps (the "
                f"first {cfg['warmup']} of each warm-up; rounds alternate the run order), zerokit bucket "
                f"{cfg['bucket_numel']} elements; zerokit {cfg['precision']}"
                + (" (bf16 params and grads, fp32 master and AdamW states)" if cfg["precision"] == "bf16" else "")
                + "; torch: `torch.optim.AdamW(..., foreach=True)` over the model's parameters, `loss.backward()`, "
                "`opt.step()`, `opt.zero_grad()` (set_to_none)", ""]
    else:
        head = [f"# zerokit vs torch: step time ({cfg['device']})", "",
                f"- command (from the repository root): `{meta['command']}`",
                f"- date: {meta['date']} ({meta['seconds']} s)",
                f"- commit: {meta.get('commit', 'not recorded')}",
                f"- hardware: {hw}, {meta['cpu_count']} CPU cores; {meta['platform']}",
                f"- versions: Python {meta['python']}, torch {meta['torch']}",
                f"- setup: {cfg['nproc']} {'NCCL' if cfg['device'] == 'cuda' else 'gloo'} ranks, model "
                f"`{cfg['model']}`, "
                f"{cfg['batch_size']} x {cfg['block_size']} tokens per rank per step, AdamW (lr {cfg['lr']}, weight "
                f"decay 0.1, none on biases/LayerNorms), {cfg['rounds']} rounds of {cfg['steps']} steps "
                f"(the first {cfg['warmup']} of each "
                f"warm-up; rounds alternate the run order), bucket "
                f"{cfg['bucket_numel']} elements; zerokit {cfg['precision']}, torch peers fp32 with `foreach=True`",
                "- zerokit's gradient reduction: " + (
                    "ordered (zerokit's gloo default, so that every stage is bitwise equal at any world size: each "
                    "reduce-scatter is an all-to-all plus a sum in rank order, and stage 0's all-reduce is that plus "
                    "an all-gather, two collectives per bucket where DDP launches one, except at 2 ranks, where it is "
                    "the native all-reduce (one addition per element: the same bits in any order); `--reduction "
                    "native` times the plain collectives instead)"
                    if cfg["reduction_used"] == "ordered" else
                    "native (torch's all-reduce / reduce-scatter, as DDP and FSDP use)"), ""]
    md = head + [
          *table(record["pairs"]), "",
          "- ms: median step time (forward + backward + optimizer step + zero_grad) over every round's timed "
          "steps, on the slowest rank; ratio > 1 means zerokit is slower. tok/s: global tokens per step / that time.",
          "- max abs Δloss: largest |zerokit loss - peer loss| over every step, round and rank, same weights and "
          "batches; 0 means bit for bit. "
          + ("zerokit and the torch peers compute in different precisions or recipes here, so it is informational."
             if "provenance" in record and cfg["precision"] != "fp32" else
             f"Tolerance {FP32_LOSS_TOLERANCE:g}: ZeroRedundancyOptimizer and FSDP may reduce in another order "
             "than zerokit (at 2 ranks a sum of two has one order, so they can still agree exactly)."
             if cfg["precision"] == "fp32" else "zerokit runs a lower precision here, so it is informational."),
          "- KB: rank 0's bytes after the last optimizer step, before its zero_grad (10^3 bytes); "
          "zerokit from `engine.memory()`, torch by counting "
          "the storages of its local params, grads and optimizer states (the allocator's peak is recorded in "
          "the JSON on CUDA only).", ""]
    md += [f"- {p['zerokit']} vs {p['peer']}: {p['note']}"
           + ("" if p["loss_within_tolerance"] in (None, True) else " — LOSS OUTSIDE TOLERANCE")
           + (f". Did not run: `{p['peer_error']}`" if p["peer_error"] else "") for p in record["pairs"]]
    fsdp = record["runs"].get(FSDP, {})
    if fsdp.get("fallback_errors"):
        md.append(f"- FSDP fallbacks taken: {'; '.join(fsdp['fallback_errors'])}")
    if cfg["device"] == "cpu" and "provenance" not in record:
        md += ["", f"On {meta['cpu_count']} CPU cores with {cfg['nproc']} ranks (one thread each) and a model this "
               "small, these timings mostly measure Python overhead per step (hooks, per-tensor bookkeeping, "
               "collective launches) and gloo's latency, not arithmetic or bandwidth; they say which implementation "
               "does less work per step around the math, not how either scales on GPUs."]
    return md


if __name__ == "__main__":
    sys.exit(main())
