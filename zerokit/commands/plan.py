"""`zerokit plan`: CS224N lecture 12's "what should I use" decision flow, answered with bytes.

The flow (lecture, last slide), cheapest remedy first:

1. Always train in mixed precision: bf16 where the GPU supports it (Ampere or newer), else fp16
   with a dynamic loss scaler. Both cost 2 + 2 + 12 = 16 bytes of model state per parameter.
2. Try batch size 1 with ZeRO stage 2, which is free (same communication as DDP). If it fits,
   use it and grow the batch until memory runs out.
3. If not, ZeRO stage 3 / FSDP (3Ψ of communication per step against DDP's 2Ψ), then activation checkpointing
   (recompute each block in backward: more compute, far fewer saved activations).
4. If even that fails, LoRA: freeze the base, adapt q and v with r = 8, α = 1. Frozen weights
   cost 2 bytes each; only the adapters carry grads, fp32 masters and Adam states.

5. If LoRA still does not fit, quantize the frozen base (QLoRA: `zk.quantize(model, "nf4")`, about
   0.516 bytes per frozen parameter instead of 2, zerokit/quant.py) and train LoRA on top, at the
   same stages: ZeRO-3 shards the quantized bytes too.

With one GPU there is nothing to shard across, so ZeRO cannot help: the flow checks plain
training (with and without checkpointing), then LoRA, then LoRA over an NF4 base.

On several nodes (`--nodes K`, the --gpus GPUs spread evenly, G = N / K per node) the flow above
picks its option with flat sharding over all N GPUs, as on one node; then it checks whether the
same option sharded within one node (hybrid sharding, `zk.shard(..., shard_group_size=G)`: a GPU
holds what a GPU of a world of G holds) still fits. If it does, the plan proposes hybrid: only the
all-reduce of each GPU's 1/G gradient shard crosses nodes, 2·ceil(Ψ_t/G)·g bytes per step,
instead of every collective of the flat run. If it does not, the plan stays flat and says why.
Both byte figures come from `core.estimate.comm_bytes_by_group` ([Note: hybrid sharding bytes]);
the flat one counts all of a flat run's bytes as crossing nodes, an upper bound ("at most").

`plan()` is the pure decision function (bytes in, a `Plan` out, with one reasoning line per
check); the command wraps it with the model shape: `--model NAME` takes it from models.py, or a
GPT-3-like shape is guessed from Ψ (`guess_shape`, stated in the output). Each check compares
model states (`core.estimate.estimate`) + the stage-3 working set + activations
(`core.estimate.activation_bytes_estimate`) with the GPU's memory. Not counted: the CUDA context,
communication buckets, allocator fragmentation; leave headroom for them.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from zerokit.cli import model_preset, parse_bytes, parse_count, positive_int
from zerokit.core.accounting.estimate import (
    activation_bytes_estimate,
    bytes_per_param,
    comm_bytes_by_group,
    quantized_weight_bytes,
    estimate,
    per_rank_formula,
    zero3_working_set_bytes,
)

LORA_TARGETS: tuple[str, ...] = ("q", "v")
LORA_RANK = 8
LORA_ALPHA = 1.0
MAX_BATCH_SIZE = 1 << 20  # the batch search stops here; activations that never grow would loop forever
DEFAULT_SEQ_LEN = 1024  # sequence length assumed when neither --seq-len nor --model gives one
GPT2_VOCAB_SIZE = 50257  # vocabulary assumed for a guessed shape (GPT-2's BPE)

# (batch_size, checkpointing) -> activation bytes per GPU
ActivationFn = Callable[[int, bool], int]


@dataclass(frozen=True)
class GPTShape:
    """A GPTConfig-like shape (the attributes core.estimate reads), for a model known only by Ψ."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    mlp_ratio: int = 4


def guess_shape(num_params: int, seq_len: int = DEFAULT_SEQ_LEN) -> GPTShape:
    """A GPT-3-like shape with about `num_params` parameters in its blocks.

    GPT-3's larger models keep d_model ≈ 128 · n_layer (6.7B: 4096 / 32, 175B: 12288 / 96) and
    heads of width 128. A block has ≈ 12·d² weights, so Ψ ≈ 12 · L · d² = 12 · d³ / 128 gives
    d = cbrt(128 Ψ / 12), rounded to a multiple of 128, and L = Ψ / (12 d²). Only the activation
    and LoRA estimates use this shape; the model-state bytes always use the Ψ given.
    """
    if num_params < 1:
        raise ValueError(f"num_params must be >= 1, got {num_params}")
    d = max(128, 128 * round((128 * num_params / 12) ** (1 / 3) / 128))
    n_layer = max(1, round(num_params / (12 * d * d)))
    return GPTShape(vocab_size=GPT2_VOCAB_SIZE, block_size=seq_len, n_layer=n_layer, n_head=d // 128, n_embd=d)


def lora_adapter_params(cfg: Any, rank: int = LORA_RANK, targets: tuple[str, ...] = LORA_TARGETS) -> int:
    """Adapter parameters LoRA adds to zerokit's GPT: r·(d + k) per adapted (d x k) matrix.

    q, k, v and o are all n_embd x n_embd, so each adapted matrix adds 2·r·n_embd, per block.
    """
    unknown = set(targets) - {"q", "k", "v", "o"}
    if unknown:
        raise ValueError(f"targets must name attention projections q, k, v, o; got {sorted(unknown)}")
    return cfg.n_layer * len(targets) * rank * 2 * cfg.n_embd


@dataclass(frozen=True)
class Plan:
    """The answer: what to run, what it costs per GPU, and the reasoning that led there."""

    decision: str  # "zero2" | "zero3" | "single_gpu" | "lora" | "qlora" | "does_not_fit"
    precision: str  # "bf16" | "fp16"
    loss_scaler: bool  # fp16 needs a dynamic loss scaler, bf16 does not
    stage: int | None  # ZeRO stage to run; None when nothing fits
    checkpointing: bool
    lora: bool
    batch_size: int  # per-GPU batch the checks were made at
    max_batch_size: int | None  # largest per-GPU batch that fits the choice; None: unknown or nothing fits
    bytes_per_gpu: int  # model states + working set + activations at batch_size (of the last option tried if none fits)
    reasons: tuple[str, ...]
    nodes: int = 1  # the GPUs are spread evenly over this many nodes
    shard_group_size: int | None = None  # zk.shard's shard_group_size: the GPUs per node for hybrid; None: flat
    bytes_across_nodes_per_step: int | None = None  # logical bytes one GPU sends between nodes per step under the
    #   choice (hybrid: its replicate-group all-reduce; flat: at most all it sends); None on one node or if nothing fits
    flat_bytes_across_nodes_per_step: int | None = None  # the same for flat sharding over all GPUs, for comparison
    quantize: str | None = None  # "nf4": the frozen base quantized (decision "qlora")


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB"


@dataclass(frozen=True)
class _Option:
    """One configuration the flow tries."""

    stage: int
    checkpointing: bool
    lora: bool
    quantize: str | None = None  # the frozen base quantized (QLoRA): "nf4"

    def label(self) -> str:
        tuned = f"LoRA over an {self.quantize.upper()} base (QLoRA)" if self.quantize else "LoRA"
        parts = [tuned if self.lora else "full fine-tuning", f"ZeRO-{self.stage}" if self.stage else "no ZeRO"]
        if self.checkpointing:
            parts.append("activation checkpointing")
        return " + ".join(parts)


def _cost_note(opt: _Option) -> str:
    """What the chosen option costs besides memory, as the lecture ranks them."""
    notes = []
    if opt.stage in (1, 2):
        notes.append("ZeRO-1/2 are free: reduce-scatter + all-gather move the bytes DDP's all-reduce moves")
    if opt.stage == 3:
        notes.append("ZeRO-3 moves 1.5x DDP's bytes (an extra all-gather), hidden by prefetch when layers are big")
    if opt.checkpointing:
        notes.append("checkpointing recomputes each block's forward in backward")
    return f" ({'; '.join(notes)})" if notes else ""


def plan(num_params: int | float, num_gpus: int, gpu_memory_bytes: int, bf16: bool = True,
         activation_bytes: ActivationFn | None = None, *, batch_size: int = 1,
         lora_trainable_params: int | None = None, working_set_bytes: int = 0,
         optimizer: str = "adam", num_nodes: int = 1) -> Plan:
    """Walk the lecture's decision flow for Ψ = num_params on num_gpus GPUs of gpu_memory_bytes each.

    activation_bytes(batch_size, checkpointing) -> bytes per GPU; None counts activations as 0
    (and then no batch limit can be given). lora_trainable_params: adapter parameters LoRA adds;
    None guesses them from a GPT-3-like shape (`guess_shape`). working_set_bytes: the stage-3
    unsharded units alive at once, weights and gradients (`core.estimate.zero3_working_set_bytes`),
    added at stage 3 only, and halved under LoRA, whose frozen weights have no gradient.

    num_nodes: K nodes of num_gpus / K GPUs each (K must divide num_gpus). With K > 1, the option
    the flow picks is checked once more sharded within one node (hybrid sharding, shard groups of
    num_gpus / K GPUs), and proposed that way when it fits (the module docstring says why).
    num_nodes=1 gives exactly the single-node plan.
    """
    psi = int(num_params)
    if psi != num_params or psi < 1:
        raise ValueError(f"num_params must be a whole number >= 1, got {num_params!r}")
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"num_gpus must be an int >= 1, got {num_gpus!r}")
    if gpu_memory_bytes <= 0:
        raise ValueError(f"gpu_memory_bytes must be > 0, got {gpu_memory_bytes!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if working_set_bytes < 0:
        raise ValueError(f"working_set_bytes must be >= 0, got {working_set_bytes!r}")
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_nodes={num_nodes} does not divide num_gpus={num_gpus}: the plan assumes the same "
                         f"number of GPUs on every node; give a GPU count that is a multiple of the node count")
    gpus_per_node = num_gpus // num_nodes

    precision = "bf16" if bf16 else "fp16"
    per = bytes_per_param(precision, optimizer)
    per_total = per.params + per.grads + per.master_params + per.optimizer_states
    reasons: list[str] = []
    if bf16:
        reasons.append(f"mixed precision: bf16 (fp32's exponent range, so no loss scaler); model states "
                       f"{per.params} + {per.grads} + {per.master_params + per.optimizer_states} = "
                       f"{per_total} B/param before sharding")
    else:
        reasons.append(f"mixed precision: fp16 + dynamic loss scaler (no bf16 here; fp16's narrow range "
                       f"underflows small gradients unless the loss is scaled); model states "
                       f"{per.params} + {per.grads} + {per.master_params + per.optimizer_states} = "
                       f"{per_total} B/param before sharding")
    where = f" ({num_nodes} nodes of {gpus_per_node})" if num_nodes > 1 else ""
    reasons.append(f"Ψ = {psi:,} parameters on {num_gpus} GPU(s){where} of {_gb(gpu_memory_bytes)}, "
                   f"per-GPU batch {batch_size}")
    if activation_bytes is None:
        reasons.append("activations not estimated (counted as 0 B): the batch limit is unknown")
    if lora_trainable_params is None:
        shape = guess_shape(psi)
        lora_t = lora_adapter_params(shape)
        lora_note = (f"Ψ_t = {lora_t:,} adapter params, assuming a GPT-3-like shape "
                     f"(L = {shape.n_layer}, d = {shape.n_embd}): {len(LORA_TARGETS)}·2·r·d per block")
    else:
        lora_t = int(lora_trainable_params)
        lora_note = f"Ψ_t = {lora_t:,} adapter params"

    def breakdown(opt: _Option, batch: int, shard_group: int | None = None) -> tuple[int, int, int]:
        """(model-state bytes, stage-3 working set, activation bytes) per GPU for `opt` at `batch`.

        shard_group: S GPUs that shard the states (hybrid sharding); None: all num_gpus (flat).
        """
        if opt.lora:  # the adapters are extra parameters; only they train (over a quantized base: all of Ψ)
            states = estimate(psi + lora_t, num_gpus, opt.stage, precision, optimizer, trainable_params=lora_t,
                              shard_group_size=shard_group, quantize=opt.quantize)
        else:
            states = estimate(psi, num_gpus, opt.stage, precision, optimizer, shard_group_size=shard_group)
        ws = 0
        if opt.stage == 3:
            # working_set_bytes counts gathered weights and their gradients equally; frozen weights
            # get no gradient, so under LoRA only the weight half remains (adapters are negligible).
            ws = working_set_bytes // 2 if opt.lora else working_set_bytes
            if opt.quantize:  # the gathered frozen weights are quantized bytes
                ws = math.ceil(ws * quantized_weight_bytes(10**6, opt.quantize) / (10**6 * per.params))
        a = 0 if activation_bytes is None else int(activation_bytes(batch, opt.checkpointing))
        return states.total, ws, a

    def need(opt: _Option, batch: int, shard_group: int | None = None) -> int:
        return sum(breakdown(opt, batch, shard_group))

    def explain(opt: _Option, shard_group: int | None = None) -> tuple[bool, int, str]:
        """Does `opt` fit at batch_size, sharded over shard_group GPUs (None: all)? (fits, bytes, reasoning line)."""
        states, ws, a = breakdown(opt, batch_size, shard_group)
        if opt.quantize:
            per_q = quantized_weight_bytes(10**6, opt.quantize) / 10**6
            what = (f"states {_gb(states)} (frozen base {opt.quantize} {per_q:.3f} B/param; adapters "
                    f"{per_total} B/param)")
        elif opt.lora:
            what = f"states {_gb(states)} (frozen base {per.params} B/param; adapters {per_total} B/param)"
        elif shard_group is None:
            what = f"states {per_rank_formula(opt.stage, precision, optimizer)} = {_gb(states)}"
        else:
            what = f"states {per_rank_formula(opt.stage, precision, optimizer).replace('/N', '/S')} = {_gb(states)}"
        if ws:
            what += f" + working set {_gb(ws)}"
        total = states + ws + a
        fits = total <= gpu_memory_bytes
        tried = f"try {opt.label()}"
        if shard_group is not None:
            tried = (f"{num_nodes} nodes: try {opt.label()} sharded within one node (hybrid: shard group "
                     f"S = {shard_group} GPUs, replicated {num_gpus // shard_group} times)")
        line = (f"{tried} at batch {batch_size}: {what} + activations {_gb(a)} = {_gb(total)} "
                f"{'<=' if fits else '>'} {_gb(gpu_memory_bytes)}: {'fits' if fits else 'does not fit'}")
        return fits, total, line

    def largest_batch(opt: _Option, shard_group: int | None = None) -> int | None:
        """Largest batch >= batch_size that fits, by bisection (activations grow with the batch)."""
        if activation_bytes is None:
            return None
        lo, hi = batch_size, MAX_BATCH_SIZE
        if need(opt, hi, shard_group) <= gpu_memory_bytes:
            return hi
        while hi - lo > 1:  # invariant: lo fits, hi does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(opt, mid, shard_group) <= gpu_memory_bytes else (lo, mid)
        return lo

    def across_nodes(opt: _Option, shard_group: int | None) -> int:
        """Logical bytes one GPU sends between nodes per step: hybrid's replicate group, or all of a flat run's."""
        total_params, trainable = (psi + lora_t, lora_t) if opt.lora else (psi, psi)
        sent = comm_bytes_by_group(total_params, opt.stage, per.params, per.grads, num_gpus, shard_group,
                                   trainable_params=trainable)
        # Flat: every collective spans all nodes; all of it is counted as crossing (an upper bound).
        return sent["replicate_group"] if shard_group is not None else sent["shard_group"]

    def multi_node(opt: _Option, total: int) -> tuple[int | None, int, str, str]:
        """On K > 1 nodes, for `opt`, which fits flat: (shard_group_size, bytes per GPU, what the "-> use"
        line adds, the line on bytes across nodes). Hybrid when one node's GPUs hold it, else flat."""
        flat_across = across_nodes(opt, None)
        assumption = (f"every collective of a flat run spans the {num_nodes} nodes, so all it sends is counted as "
                      f"crossing them, an upper bound")
        flat_line = f"across nodes each GPU sends at most {_gb(flat_across)} per step ({assumption})"
        if gpus_per_node == 1:
            reasons.append("1 GPU per node: a shard group of one GPU shards nothing (hybrid sharding would be DDP "
                           "across nodes), so there is no hybrid option")
            return None, total, f", flat over all {num_gpus} GPUs", flat_line
        fits, hybrid_total, line = explain(opt, gpus_per_node)
        reasons.append(line)
        if not fits:
            return None, total, (f", flat over all {num_gpus} GPUs: not hybrid, one node's {gpus_per_node} GPUs "
                                 f"cannot hold it ({_gb(hybrid_total)} > {_gb(gpu_memory_bytes)})"), flat_line
        use = (f", hybrid sharding: zk.shard(..., shard_group_size={gpus_per_node}), sharded within each node, "
               f"replicated across the {num_nodes} nodes")
        bytes_line = (f"across nodes each GPU sends {_gb(across_nodes(opt, gpus_per_node))} per step hybrid (the "
                      f"all-reduce of its 1/{gpus_per_node} grad shard across the {num_nodes} nodes), against at "
                      f"most {_gb(flat_across)} flat over all {num_gpus} GPUs ({assumption}); the price: "
                      f"{_gb(hybrid_total)} per GPU instead of {_gb(total)}")
        return gpus_per_node, hybrid_total, use, bytes_line

    def choose(decision: str, opt: _Option, total: int) -> Plan:
        shard_group, across, flat_across = None, None, None
        use = f"-> use {opt.label()}, {precision}{_cost_note(opt)}"
        if num_nodes > 1:
            shard_group, total, how, bytes_line = multi_node(opt, total)
            across, flat_across = across_nodes(opt, shard_group), across_nodes(opt, None)
            reasons.extend([use + how, bytes_line])
        else:
            reasons.append(use)
        max_batch = largest_batch(opt, shard_group)
        if max_batch is not None:
            if max_batch == batch_size:
                reasons.append(f"-> the batch cannot grow: {batch_size + 1} would need "
                               f"{_gb(need(opt, batch_size + 1, shard_group))}; reach larger batches by gradient "
                               f"accumulation")
            else:
                cap = "at least " if max_batch == MAX_BATCH_SIZE else ""
                reasons.append(f"-> grow the batch: the largest per-GPU batch that fits is {cap}{max_batch} "
                               f"({_gb(need(opt, max_batch, shard_group))})")
        return Plan(decision=decision, precision=precision, loss_scaler=not bf16, stage=opt.stage,
                    checkpointing=opt.checkpointing, lora=opt.lora, batch_size=batch_size,
                    max_batch_size=max_batch, bytes_per_gpu=total, reasons=tuple(reasons), nodes=num_nodes,
                    shard_group_size=shard_group, bytes_across_nodes_per_step=across,
                    flat_bytes_across_nodes_per_step=flat_across, quantize=opt.quantize)

    if num_gpus == 1:
        reasons.append("1 GPU: ZeRO shards model states across GPUs, so with one GPU it cannot help; "
                       f"training holds all {per_total} B/param")
        full = [_Option(0, False, False), _Option(0, True, False)]
        lora = [_Option(0, False, True), _Option(0, True, True)]
    else:
        full = [_Option(2, False, False), _Option(3, False, False), _Option(3, True, False)]
        lora = [_Option(2, False, True), _Option(3, False, True), _Option(3, True, True)]

    total = 0
    for opt in full:
        fits, total, line = explain(opt)
        reasons.append(line)
        if fits:
            decision = "single_gpu" if num_gpus == 1 else f"zero{opt.stage}"
            return choose(decision, opt, total)

    reasons.append(f"full fine-tuning does not fit even at batch {batch_size}: use LoRA on "
                   f"{', '.join(LORA_TARGETS)} with r = {LORA_RANK}, α = {LORA_ALPHA:g}; {lora_note}")
    for opt in lora:
        fits, total, line = explain(opt)
        reasons.append(line)
        if fits:
            return choose("lora", opt, total)

    q_bytes = quantized_weight_bytes(psi, "nf4")
    reasons.append(f"LoRA does not fit: quantize the frozen base to NF4 (QLoRA, zk.quantize(model, 'nf4') before "
                   f"zk.lora.inject: {_gb(q_bytes)} instead of {_gb(per.params * psi)}) and train LoRA on top")
    for opt in [_Option(o.stage, o.checkpointing, True, "nf4") for o in lora]:
        fits, total, line = explain(opt)
        reasons.append(line)
        if fits:
            return choose("qlora", opt, total)

    advice = "the base quantized to NF4 included"
    if num_gpus > 1:
        advice = f"use more GPUs (sharded states shrink as 1/N) or shorter sequences ({advice})"
    else:
        advice = f"use more GPUs with ZeRO-3, or shorter sequences ({advice})"
    reasons.append(f"nothing fits: {advice}")
    return Plan(decision="does_not_fit", precision=precision, loss_scaler=not bf16, stage=None,
                checkpointing=True, lora=True, batch_size=batch_size, max_batch_size=None,
                bytes_per_gpu=total, reasons=tuple(reasons), nodes=num_nodes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=parse_count, metavar="P", help="parameter count Ψ, e.g. 7.5e9 or 7.5B")
    what.add_argument("--model", metavar="NAME",
                      help="a models.py preset (tiny, small, gpt2-small, gpt2-medium, gpt2-xl, gpt3-6.7b): Ψ and shape")
    parser.add_argument("--gpus", type=positive_int, required=True, metavar="G", help="number of GPUs (>= 1)")
    parser.add_argument("--nodes", type=positive_int, default=1, metavar="K",
                        help="the --gpus GPUs sit on K nodes, G/K each (default 1); with K > 1 the plan weighs "
                             "hybrid sharding (shard within a node, replicate across nodes) against flat")
    parser.add_argument("--gpu-memory", type=parse_bytes, required=True, metavar="GB",
                        help="memory per GPU: a number is GB (10^9 bytes); 80GiB for binary units")
    parser.add_argument("--no-bf16", action="store_true",
                        help="the GPU has no bf16 (pre-Ampere): fp16 with a loss scaler")
    parser.add_argument("--batch-size", type=positive_int, default=1, metavar="B",
                        help="per-GPU batch the checks are made at (default 1, as CS224N lecture 12 says)")
    parser.add_argument("--seq-len", type=positive_int, metavar="S",
                        help=f"tokens per sequence (default: the model's block_size, else {DEFAULT_SEQ_LEN})")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the plan as JSON")


def run(args: argparse.Namespace) -> int:
    precision = "fp16" if args.no_bf16 else "bf16"
    nodes = getattr(args, "nodes", 1)
    if args.gpus % nodes:
        raise SystemExit(f"zerokit plan: --nodes {nodes} does not divide --gpus {args.gpus}: --gpus counts the GPUs "
                         f"of all nodes together (e.g. --nodes 2 --gpus 16 for 2 nodes of 8)")
    if args.model is not None:
        cfg, num_params = model_preset("plan", args.model)
        seq_len = args.seq_len or cfg.block_size
        if seq_len > cfg.block_size:
            raise SystemExit(f"zerokit plan: --seq-len {seq_len} exceeds {args.model}'s block_size {cfg.block_size}")
        shape_line = (f"shape of {args.model}: L = {cfg.n_layer}, d = {cfg.n_embd}, H = {cfg.n_head}, "
                      f"V = {cfg.vocab_size}, T = {seq_len}")
    else:
        num_params = args.params
        seq_len = args.seq_len or DEFAULT_SEQ_LEN
        cfg = guess_shape(num_params, seq_len)
        shape_line = (f"no --model: activations, working set and LoRA use a guessed GPT-3-like shape "
                      f"L = {cfg.n_layer}, d = {cfg.n_embd}, H = {cfg.n_head}, V = {cfg.vocab_size}, T = {seq_len}")

    result = plan(
        num_params, args.gpus, args.gpu_memory, bf16=not args.no_bf16,
        activation_bytes=lambda b, ckpt: activation_bytes_estimate(cfg, b, precision, ckpt, seq_len=seq_len),
        batch_size=args.batch_size, lora_trainable_params=lora_adapter_params(cfg),
        working_set_bytes=zero3_working_set_bytes(cfg, precision), num_nodes=nodes,
    )
    print(shape_line)
    for i, line in enumerate(result.reasons, 1):
        print(f"{i:2d}. {line}")
    if nodes == 1 or result.stage is None:
        print(f"decision: {result.decision}")
    elif result.shard_group_size is not None:
        print(f"decision: {result.decision}, hybrid sharding with shard_group_size={result.shard_group_size}: "
              f"{_gb(result.bytes_across_nodes_per_step)} across nodes per GPU per step (flat: at most "
              f"{_gb(result.flat_bytes_across_nodes_per_step)})")
    else:
        print(f"decision: {result.decision}, flat over all {args.gpus} GPUs: at most "
              f"{_gb(result.bytes_across_nodes_per_step)} across nodes per GPU per step")
    if args.json is not None:
        record = {"num_params": num_params, "gpus": args.gpus, "gpus_per_node": args.gpus // nodes,
                  "gpu_memory_bytes": args.gpu_memory, "model": args.model, "seq_len": seq_len, **asdict(result)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
