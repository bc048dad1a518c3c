"""Per-rank memory and communication of ZeRO training, by category: the formulas that predict them.

[Note: memory formulas]
Ψ = number of parameters, N = ranks. Training keeps four kinds of "model state" per parameter
(bytes per parameter, before any sharding):

    category           fp32 training            mixed precision (bf16 / fp16)
    params             4  (fp32 weights)        2  (the weights forward and backward run on)
    grads              4                        2
    master_params      0  (params ARE fp32)     4  (fp32 copy the optimizer updates)
    optimizer_states   Adam 8 (m, v in fp32), SGD with momentum 4, plain SGD 0 — in both

so mixed-precision Adam costs the 2 + 2 + 12 = 16 bytes per parameter. ZeRO stage k
shards one more category than stage k - 1 across the N ranks:

    stage  sharded                          bytes per rank (mixed, Adam)
    0      nothing (DDP)                    16Ψ
    1      optimizer states + master        4Ψ + 12Ψ/N
    2      + grads                          2Ψ + 14Ψ/N
    3      + params                         16Ψ/N         (+ the working set, see below)

For Ψ = 7.5e9, N = 64 that is 120 / 31.4 / 16.6 / 1.9 GB (GB = 10^9 bytes, as the ZeRO paper
and CS224N lecture 12 count).

Up to padding. A sharded category lives in a flat buffer padded with zeros to a multiple of N
(core/params/partition.py), so a rank holds ceil(Ψ/N) elements of it, not Ψ/N. `estimate` uses that
padded count, so its results are exact integers and at most (N - 1) elements per buffer above
the real-valued formula. A real engine may pad several buffers (one per parameter group, or per
ZeRO-3 unit); each adds less than N elements.

Frozen parameters (the LoRA base) have weights only: no grad, no master copy, no optimizer state.
With Ψ_t trainable of Ψ, the trainable part follows the table above and the frozen Ψ - Ψ_t cost
their weight bytes, sharded only at stage 3. Trainable and frozen weights sit in separate flat
buffers (one needs gradients, the other does not), so each is padded on its own.

[Note: a quantized base]
A base quantized by zk.quantize (zerokit/quant.py) is frozen and stored as bytes: per weight of n
elements in blocks of B, `quantized_weight_bytes` = codes (n/2 for NF4, n for int8) + absmax
constants (n/B bytes double-quantized, + 4·ceil(n/(256B)) + 4; else 4n/B). NF4 at B = 64 is about
0.516 bytes per element against bf16's 2. With Ψ_q quantized elements holding Q bytes, `estimate`
reports Q as "quantized_params" (Q at stages 0-2, ceil(Q/N) at stage 3, which shards the bytes) and
"params" covers the other Ψ - Ψ_q; stage 3 all-gathers Q bytes where it gathered Ψ_q·p.

What is not here. Activations are not model states and no ZeRO stage shards them: they grow with
batch size and sequence length; `activation_bytes_estimate` gives a rough figure for zerokit's GPT.
Stage 3 also holds its working set, the unsharded units being computed and prefetched (see
docs/design.md); communication buffers, the CUDA context and allocator fragmentation are not counted.
Nor are the model's buffers (BatchNorm statistics, ...): every rank holds them whole, at every stage.

[Note: hybrid sharding bytes]
Hybrid sharding (`shard_group_size=S`, S dividing N) splits the N ranks two ways: ranks
[kS, (k+1)S) form a shard group (typically one node), and ranks at the same position in their
shard groups form a replicate group, R = N / S of them. Stages 1-3 shard over the shard group
only, so a rank holds exactly what a rank of a world of S holds: the table above with N = S
(`estimate(Ψ, N, k, shard_group_size=S) == estimate(Ψ, S, k)`). Stage 0 shards nothing and
ignores S. Per optimizer step a rank sends (`comm_bytes_by_group`, ZeRO accounting):

    within its shard group      what a flat run at N = S sends (`comm_bytes_per_step`;
                                0 when S = 1, a group of one has nothing to exchange)
    across its replicate group  an all-reduce of its (ceil(Ψ_t/S),) grad shard:
                                2·ceil(Ψ_t/S)·g (0 when R = 1)

Worked example: Ψ = 1.5e9, bf16 (p = g = 2), stage 3, N = 16 ranks on 2 nodes of 8; per rank
per step:

    flat, S = 16     9.0 GB, in collectives that span both nodes       states 16Ψ/16 = 1.5 GB
    hybrid, S = 8    9.0 GB within the node + 0.75 GB across nodes     states 16Ψ/8  = 3.0 GB

The hybrid rank puts 0.75 / 9.0 = 1/12 of flat stage 3's bytes on the links between nodes
(2·ceil(Ψ/S)·g against 3Ψg: about 2/(3S) in general), for twice the model-state memory. How much
of the flat run's bytes really crosses nodes depends on the collective's algorithm: in a ring
laid out node by node every link, those between nodes included, carries (N - 1)/N of what each
rank sends; hierarchical or tree algorithms send less over them. Counting all of it as crossing
is therefore an upper bound, which `zerokit plan` states as "at most".
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from numbers import Integral
from typing import Any

from zerokit.core.collectives.groups import resolve_shard_group_size

# Analytic formulas only: pure integer arithmetic, no process group, no tensors. What a rank
# really holds, measured beside these, is core/accounting/ledger.py.

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")

# Optimizer state bytes per trainable parameter; states are fp32 under every precision policy.
OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adam": 8,  # exp_avg + exp_avg_sq
    "adamw": 8,  # same states as Adam; weight decay is applied to the weights, not stored
    "sgd_momentum": 4,  # momentum_buffer
    "sgd": 0,
}

CATEGORIES: tuple[str, ...] = ("params", "grads", "master_params", "optimizer_states", "activations")

QUANT_FORMATS: tuple[str, ...] = ("nf4", "int8")
DOUBLE_QUANT_BLOCK = 256  # absmax constants per second-level block (zerokit/quant.py)

STAGE_NAMES: dict[int, str] = {0: "DDP baseline", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes held by one rank, by category. `total` is the sum; `as_dict()` has one key per category."""

    params: int
    grads: int
    master_params: int
    optimizer_states: int
    activations: int = 0
    quantized_params: int = 0  # a quantized base's bytes ([Note: a quantized base])

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.master_params + self.optimizer_states + self.activations
                + self.quantized_params)

    def as_dict(self) -> dict[str, int]:
        """Category -> bytes, categories only (so the values sum to `total`), same keys as engine.memory()
        ("quantized_params" only when there is a quantized base, as there)."""
        out = asdict(self)
        if not self.quantized_params:
            del out["quantized_params"]
        return out


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter of each model-state category, before sharding."""

    params: int
    grads: int
    master_params: int
    optimizer_states: int


def bytes_per_param(precision: str = "bf16", optimizer: str = "adam") -> BytesPerParam:
    """The per-parameter cost of each category under `precision` and `optimizer` (table in the module docstring)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}")
    states = OPTIMIZER_STATE_BYTES[optimizer]
    if precision == "fp32":
        # The fp32 params are what the optimizer updates, so there is no separate master copy.
        return BytesPerParam(params=4, grads=4, master_params=0, optimizer_states=states)
    return BytesPerParam(params=2, grads=2, master_params=4, optimizer_states=states)


def quantized_weight_bytes(numel: int, fmt: str = "nf4", block_size: int = 64, double_quant: bool = True) -> int:
    """Bytes of one weight of `numel` elements quantized by zk.quantize: [Note: a quantized base]."""
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"quantize must be one of {QUANT_FORMATS} (or None), got {fmt!r}")
    blocks = -(-numel // block_size)  # a count of many weights together need not be a multiple: rounded up
    codes = -(-numel // 2) if fmt == "nf4" else numel
    if double_quant:
        return codes + blocks + 4 * -(-blocks // DOUBLE_QUANT_BLOCK) + 4
    return codes + 4 * blocks


def _quantized(quantized_params, fmt: str, block_size: int, double_quant: bool) -> tuple[int, int]:
    """(Ψ_q elements, Q bytes) from one count or a list of per-weight counts."""
    counts = [quantized_params] if isinstance(quantized_params, (Integral, float)) else list(quantized_params)
    counts = [_as_count(c, "quantized_params") for c in counts]
    return sum(counts), sum(quantized_weight_bytes(c, fmt, block_size, double_quant) for c in counts)


def _as_count(value: int | float, name: str) -> int:
    """An integral, non-negative count from an int or an integral float like 7.5e9."""
    if isinstance(value, bool) or not isinstance(value, (Integral, float)):
        raise TypeError(f"{name} must be an int (or an integral float such as 7.5e9), got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be a whole number of parameters, got {value!r}")
    count = int(value)
    if count < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return count


def _check_stage(stage: int) -> None:
    if isinstance(stage, bool) or not isinstance(stage, Integral) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, Integral) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")


def _shard_numel(numel: int, world_size: int) -> int:
    """Elements per rank of a buffer of `numel` padded to a multiple of world_size: ceil(numel / N)."""
    return -(-numel // world_size)  # integer ceil: exact for any size, unlike float division


def estimate(num_params: int | float, world_size: int, stage: int, precision: str = "bf16",
             optimizer: str = "adam", trainable_params: int | float | None = None,
             reduce_precision: str | None = None, shard_group_size: int | None = None,
             quantize: str | None = None, quantized_params=None, block_size: int = 64, double_quant: bool = True,
             lora: int | float | None = None) -> MemoryEstimate:
    """Model-state bytes on one rank for ZeRO `stage` at `world_size` ranks, up to padding.

    num_params: Ψ, all parameters (trainable and frozen). trainable_params: Ψ_t, defaults to Ψ;
    the Ψ - Ψ_t frozen ones (LoRA base weights) cost only their weights. `activations` is 0: add
    an activation estimate yourself (dataclasses.replace) since it depends on batch and sequence.

    reduce_precision: the dtype gradients are reduced in (None: `precision`). When it differs,
    the grad shards live in it (r bytes per element, core/grads/grad_reduce.py): stage 1 keeps a
    ceil(Ψ_t/N)·r shard of its own beside its full param-dtype gradient, stages 2 and 3 hold
    ceil(Ψ_t/N)·r instead of ·g. Stage 0's reduce-dtype buffers live only from backward to
    step: they are communication buffers, not counted here.

    shard_group_size: S, the ranks stages 1-3 shard over (hybrid sharding; None: all world_size
    ranks). It must divide world_size. A hybrid rank holds exactly what a rank of a world of S
    holds, so every "N" above is S; stage 0 shards nothing and is unchanged ([Note: hybrid
    sharding bytes]).

    lora: Ψ_t under its LoRA name (the adapters' parameter count); give it or trainable_params.
    quantize ("nf4" | "int8"): the frozen base is quantized ([Note: a quantized base]).
    quantized_params: how many of the frozen elements are quantized (default all Ψ - Ψ_t), as one
    count or as a list of each quantized weight's element count (exact: the constants are per weight).
    """
    psi = _as_count(num_params, "num_params")
    if lora is not None:
        if trainable_params is not None:
            raise ValueError("give lora= or trainable_params=, not both (they are the same count)")
        trainable_params = lora
    psi_t = psi if trainable_params is None else _as_count(trainable_params, "trainable_params")
    if psi_t > psi:
        raise ValueError(f"trainable_params={psi_t} exceeds num_params={psi}")
    psi_q, q_bytes = 0, 0
    if quantize is not None:
        psi_q, q_bytes = _quantized(psi - psi_t if quantized_params is None else quantized_params, quantize,
                                    block_size, double_quant)
        if psi_q > psi - psi_t:
            raise ValueError(f"quantized_params={psi_q} exceeds the frozen parameters Ψ - Ψ_t = {psi - psi_t}")
    elif quantized_params is not None:
        raise ValueError("quantized_params= needs quantize='nf4' or 'int8'")
    _check_world_size(world_size)
    shard_ranks = resolve_shard_group_size(shard_group_size, world_size)  # S: N when sharding is flat
    _check_stage(stage)
    per = bytes_per_param(precision, optimizer)
    psi_f = psi - psi_t - psi_q  # frozen and not quantized
    reduce_precision = precision if reduce_precision is None else reduce_precision
    if reduce_precision not in PRECISIONS:
        raise ValueError(f"reduce_precision must be one of {PRECISIONS}, got {reduce_precision!r}")

    # Element counts per rank, trainable part: full Ψ_t when replicated, ceil(Ψ_t / S) when sharded
    # (S = N unless hybrid; stage 0 never reads S).
    full_t, shard_t = psi_t, _shard_numel(psi_t, shard_ranks)
    states_numel = shard_t if stage >= 1 else full_t  # master + optimizer states go together at stage 1
    grads_numel = shard_t if stage >= 2 else full_t
    params_numel = (shard_t + _shard_numel(psi_f, shard_ranks)) if stage >= 3 else psi - psi_q

    grads = per.grads * grads_numel
    if reduce_precision != precision:
        r = bytes_per_param(reduce_precision, optimizer).grads
        grads = {0: per.grads * full_t, 1: per.grads * full_t + r * shard_t}.get(stage, r * shard_t)
    return MemoryEstimate(
        params=per.params * params_numel,
        grads=grads,
        master_params=per.master_params * states_numel,
        optimizer_states=per.optimizer_states * states_numel,
        quantized_params=_shard_numel(q_bytes, shard_ranks) if stage >= 3 else q_bytes,
    )


def per_rank_formula(stage: int, precision: str = "bf16", optimizer: str = "adam") -> str:
    """The bytes-per-rank formula as text, e.g. "4Ψ+12Ψ/N" for stage 1, mixed precision, Adam."""
    _check_stage(stage)
    per = bytes_per_param(precision, optimizer)
    # Categories in sharding order: stage k shards the last k groups of this list.
    groups = [per.params, per.grads, per.master_params + per.optimizer_states]
    replicated = sum(groups[: 3 - stage])
    sharded = sum(groups[3 - stage:])
    terms = []
    if replicated:
        terms.append(f"{replicated}Ψ")
    if sharded:
        terms.append(f"{sharded}Ψ/N")
    return "+".join(terms) or "0"


def _attr(cfg: Any, name: str) -> int:
    value = getattr(cfg, name, None)
    if value is None:
        raise TypeError(f"cfg needs a GPTConfig-like attribute {name!r}; got {type(cfg).__name__}")
    return int(value)


def activation_bytes_estimate(cfg: Any, batch_size: int, precision: str, checkpointing: bool = False,
                              seq_len: int | None = None) -> int:
    """Rough bytes of activations saved for backward on one rank, for zerokit's GPT (models.py).

    `cfg` is any object with vocab_size, block_size, n_layer, n_head, n_embd, mlp_ratio;
    B = batch_size (per rank), T = seq_len (default cfg.block_size), d = n_embd, m = mlp_ratio,
    H = n_head, V = vocab_size, L = n_layer, e = element bytes (4 for fp32, 2 for bf16/fp16).

    Per block, the tensors autograd keeps (pre-LayerNorm block, fused scaled-dot-product
    attention, no dropout), in elements:
        ln_1 input, ln_1 output (shared input of q, k, v)     2·B·T·d
        q, k, v (kept by attention)                           3·B·T·d
        attention output (o's input is a view of it)          1·B·T·d
        ln_2 input, ln_2 output                               2·B·T·d
        fc output (GELU input), GELU output (proj input)      2·m·B·T·d
    i.e. B·T·d·(8 + 2m) elements of e bytes, plus fp32 side tensors: attention's log-sum-exp
    (B·H·T) and each LayerNorm's mean and rstd (B·T each; fp32 as CUDA keeps them, while CPU
    kernels keep them in the compute dtype: 4·B·T bytes less per LayerNorm at 16 bits). A fused
    attention kernel never stores the T x T score matrix; a non-fused one would add B·H·T²
    elements per block.
    Head: ln_f input and output 2·B·T·d and the logits B·T·V at e bytes, plus the fp32
    log-softmax B·T·V the loss keeps.

        no checkpointing:  L · block + head
        checkpointing:     (L - 1) · B·T·d·e + block + head
    With checkpointing each block keeps only its input; during backward one block at a time is
    recomputed, so one block's full set is alive on top of the other L - 1 inputs.

    Without checkpointing this is, tensor for tensor, what a forward pass of models.GPT saves
    (tests/unit/test_memory_formulas.py measures it: exact at fp32 on CPU, and at 16 bits up to
    the LayerNorm statistics above). It is still rough as a peak: it ignores the gradient buffers
    alive during backward, allocator rounding, integer tensors (token ids) and the scalar loss.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    V, L, H, d, m = (_attr(cfg, n) for n in ("vocab_size", "n_layer", "n_head", "n_embd", "mlp_ratio"))
    T = _attr(cfg, "block_size") if seq_len is None else seq_len
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    e = 4 if precision == "fp32" else 2
    tokens = batch_size * T
    fp32 = 4
    block = tokens * d * (8 + 2 * m) * e + batch_size * H * T * fp32 + 2 * (2 * tokens) * fp32
    head = tokens * 2 * d * e + tokens * V * e + tokens * V * fp32 + 2 * tokens * fp32
    if not checkpointing:
        return L * block + head
    return (L - 1) * tokens * d * e + block + head


def zero3_working_set_bytes(cfg: Any, precision: str = "bf16", prefetch: int = 1) -> int:
    """Rough peak bytes of unsharded ZeRO-3 units on one rank, for zerokit's GPT wrapped per Block.

    Assumes the root unit (token and position embeddings, final LayerNorm; the head is tied to
    the token embedding) stays gathered through forward and backward, and Block units are gathered
    one at a time plus `prefetch` ahead. Each gathered element costs its weight and, in backward,
    its unsharded gradient until the reduce-scatter, both in the parameter dtype:

        (root + (1 + prefetch) · block) · 2 · e,   block = 4d² + 2m·d² (+ biases and LayerNorms)
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    V, T, d, m = (_attr(cfg, n) for n in ("vocab_size", "block_size", "n_embd", "mlp_ratio"))
    b = int(getattr(cfg, "bias", True))
    layernorm = d + b * d
    block = 2 * layernorm + 4 * (d * d + b * d) + (d * m * d + b * m * d) + (m * d * d + b * d)
    root = V * d + T * d + layernorm
    e = 4 if precision == "fp32" else 2
    return (root + (1 + prefetch) * block) * 2 * e


def tied_head_grad_bytes(cfg: Any, precision: str = "bf16") -> int:
    """Gradient bytes autograd holds for a tied embedding/head beyond the gradient buffer a stage counts.

    The weight is used twice, by the head (a matmul) and by the embedding (a lookup), so its one
    AccumulateGrad node gets two (V, d) gradients in the parameter dtype: the head's, computed first
    and held in autograd's input buffer until the embedding's dense one arrives (embedding backward
    scatters into a dense (V, d) zero tensor); the two are summed into a third (V, d) tensor, which
    becomes the weight's .grad or is copied into the gradient buffer the stage counts (stage 3: the root unit's
    unsharded grad, in `zero3_working_set_bytes`; stage 2: the embedding's bucket, in
    `stage2_in_flight_grad_bytes`; stages 0-1: the full gradient among the model states). So
    two (V, d) tensors live beside that buffer's worth for a moment (measured, three alive at once in a
    plain torch backward: tests/unit/test_memory_formulas.py):

        2 · V · d · e,   e = 4 (fp32) or 2 (bf16 / fp16)

    0 for a config whose head is not tied (`tie_weights` False, where there is such a field).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if not getattr(cfg, "tie_weights", True):
        return 0
    e = 4 if precision == "fp32" else 2
    return 2 * _attr(cfg, "vocab_size") * _attr(cfg, "n_embd") * e


def stage2_in_flight_grad_bytes(bucket_numels: "list[int] | tuple[int, ...]", max_in_flight: int = 2,
                                grad_bytes: int = 2) -> int:
    """Peak bytes of full-size gradient buckets a stage-2 rank holds inside backward: not a model state.

    Stage 2 keeps only grad shards (2Ψ/N) between steps, but inside backward a bucket's full-size
    gradient lives from just before its first gradient arrives until its reduce-scatter completes,
    and a gradient hook waits only once `max_in_flight` reduce-scatters are running
    (stages/zero2.py: "Full-size gradient memory alive at once"). So alive at once are at most
    `max_in_flight` buckets in flight plus the two autograd may be filling (a module straddling a
    bucket boundary starts the next before the current one completes): the (max_in_flight + 2)
    buckets. A parameter larger than `bucket_numel` (the tied embedding of a GPT: V·d elements, 80M
    for gpt2-xl against a 4 Mi cap) is a bucket of its own, so the bound sums the largest ones, not
    a multiple of the cap:

        g · (sum of the max_in_flight + 2 largest padded bucket sizes)

    with g = grad_bytes, the larger of the param and the reduce dtype's bytes (a reduce-dtype copy
    replaces the param-dtype bucket once it is ready; counting every bucket at the larger size
    bounds both). `bucket_numels`: each bucket's padded elements (`[fp.padded_numel for fp in
    engine.flat_params]` at stage 2).
    """
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 0:
        raise ValueError(f"max_in_flight must be an int >= 0, got {max_in_flight!r}")
    if isinstance(grad_bytes, bool) or not isinstance(grad_bytes, int) or grad_bytes < 1:
        raise ValueError(f"grad_bytes must be an int >= 1, got {grad_bytes!r}")
    sizes = sorted((_as_count(n, "bucket_numels") for n in bucket_numels), reverse=True)
    return grad_bytes * sum(sizes[:max_in_flight + 2])


def comm_bytes_per_step(num_params: int, stage: int, param_bytes: int, grad_bytes: int,
                        trainable_params: int | None = None, quantize: str | None = None, quantized_params=None,
                        block_size: int = 64, double_quant: bool = True) -> int:
    """Logical bytes one rank sends per optimizer step (ZeRO accounting, core/collectives/comm.py), up to padding.

    g = grad_bytes (the reduce dtype), p = param_bytes, Ψ_t trainable of Ψ parameters:
        stage 0      all-reduce of the gradients                           2·Ψ_t·g
        stage 1, 2   reduce-scatter of the gradients + all-gather params   Ψ_t·g + Ψ_t·p
        stage 3      all-gather params in forward and again in backward    2·Ψ·p + Ψ_t·g
                     (frozen ones too) + reduce-scatter of the gradients
    A quantized base (`quantize`, `quantized_params` as for `estimate`) is gathered as its Q bytes:
    stage 3 sends 2·(Ψ - Ψ_q)·p + 2·Q + Ψ_t·g.
    With p = g that is 2Ψg for stages 0-2 and 3Ψg (1.5x) for stage 3.
    Buffers are not included: with `broadcast_buffers=True` (the default) every forward that DDP
    would sync adds a broadcast of the model's buffer bytes B (at any stage; 0 for a model without
    buffers), which the comm ledger counts under phase "buffers" (core/params/model_guard.py).
    """
    psi = _as_count(num_params, "num_params")
    psi_t = psi if trainable_params is None else _as_count(trainable_params, "trainable_params")
    _check_stage(stage)
    if stage == 0:
        return 2 * psi_t * grad_bytes
    if stage in (1, 2):
        return psi_t * grad_bytes + psi_t * param_bytes
    psi_q, q_bytes = 0, 0
    if quantize is not None:
        psi_q, q_bytes = _quantized(psi - psi_t if quantized_params is None else quantized_params, quantize,
                                    block_size, double_quant)
    return 2 * (psi - psi_q) * param_bytes + 2 * q_bytes + psi_t * grad_bytes


def comm_bytes_by_group(num_params: int, stage: int, param_bytes: int, grad_bytes: int, world_size: int,
                        shard_group_size: int | None = None,
                        trainable_params: int | None = None) -> dict[str, int]:
    """Logical bytes one rank sends per optimizer step, by the group the collectives run in.

    Returns {"shard_group": ..., "replicate_group": ...} in ZeRO accounting (core/collectives/comm.py [Note:
    byte accounting]), up to padding; [Note: hybrid sharding bytes] derives them. With S =
    shard_group_size (None: world_size, flat) and R = world_size / S:

        stages 1-3   "shard_group"      comm_bytes_per_step(...): the flat formula, run within
                                        the S ranks (0 when S = 1)
                     "replicate_group"  2·ceil(Ψ_t/S)·g: the all-reduce of the grad shard across
                                        the R replicate ranks (0 when R = 1)
        stage 0      "shard_group"      2·Ψ_t·g, DDP's one all-reduce (0 when N = 1). DDP shards
                                        nothing and ignores S, so this all-reduce spans all N
                                        ranks, across nodes too; it is reported here, not split
                     "replicate_group"  0

    At S = N this is {"shard_group": comm_bytes_per_step(...), "replicate_group": 0} for N > 1.
    """
    psi = _as_count(num_params, "num_params")
    psi_t = psi if trainable_params is None else _as_count(trainable_params, "trainable_params")
    if psi_t > psi:
        raise ValueError(f"trainable_params={psi_t} exceeds num_params={psi}")
    _check_world_size(world_size)
    shard_ranks = resolve_shard_group_size(shard_group_size, world_size)
    _check_stage(stage)
    if stage == 0:
        world = comm_bytes_per_step(psi, 0, param_bytes, grad_bytes, trainable_params=psi_t) if world_size > 1 else 0
        return {"shard_group": world, "replicate_group": 0}
    replicas = world_size // shard_ranks  # R
    within = comm_bytes_per_step(psi, stage, param_bytes, grad_bytes, trainable_params=psi_t) if shard_ranks > 1 else 0
    across = 2 * _shard_numel(psi_t, shard_ranks) * grad_bytes if replicas > 1 else 0
    return {"shard_group": within, "replicate_group": across}
