"""The measured ledger equals the formula: engine.memory() vs zk.estimate(), within 1%, on gloo.

Grid: every stage x precision (fp32, bf16, fp16), plus LoRA (frozen base, trainable
adapters) at bf16, x world size 1-4; one spawn per world size runs every case (world size 1 runs
in this process, without a process group). The model is
GPT "tiny" (Ψ = 29,600): a flat buffer pads fewer than N elements, at most 3 per buffer, so
padding stays < 0.2% even for the 1,024-element LoRA buffers of a ZeRO-3 unit — the 1%
tolerance is for padding, and everything else must be exact.
"""

import pytest
import torch

import zerokit as zk
from zerokit.launch import run_ranks

PRECISIONS = ("fp32", "bf16", "fp16")
MODEL_STATES = ("params", "grads", "master_params", "optimizer_states")
TOLERANCE = 0.01  # padding only: < N elements per flat buffer (see module docstring)


# Every stage, listed: a stage whose module fails to import fails these tests, never skips them.
STAGES = (0, 1, 2, 3)


def _ledger_cases(rank, world_size, stages):
    from zerokit.core.accounting.ledger import ledger
    from zerokit.models import Block, build_model
    from common import fixed_corpus

    corpus = fixed_corpus()
    out = {}
    for stage in stages:
        # LoRA (frozen base weights in their own buffers) once per stage, at bf16: the frozen
        # part's accounting does not depend on the precision of the trainable part.
        for precision, lora in [(p, False) for p in PRECISIONS] + [("bf16", True)]:
            model = build_model("tiny")
            if lora:
                zk.lora.inject(model, targets=("q", "v"), rank=8, alpha=1.0)
            # fp16: a small initial loss scale, so that the first step is not skipped for an
            # overflow (Adam allocates its states on the first step it takes).
            scaler = {"init_scale": 16.0} if precision == "fp16" else None
            engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, lr=1e-3,
                              wrap=(Block,), bucket_numel=4096, loss_scaler=scaler)  # several buckets
            x, y = corpus.batch(1, 8, 0, rank, world_size)
            _, loss = engine(x, y)
            engine.backward(loss)
            assert engine.step(), f"stage {stage} {precision}: the step was skipped"
            out[(stage, precision, lora)] = ledger(engine)
    return out


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def ledgers(request, tmp_path_factory):
    world_size = request.param
    if world_size == 1:  # no process group at all: zerokit's own world-size-1 path, no spawn needed
        return world_size, [_ledger_cases(0, 1, STAGES)]
    return world_size, run_ranks(_ledger_cases, world_size, STAGES,
                                 store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=240)


def _check(ledgers, stage, categories):
    world_size, results = ledgers
    for rank, per_case in enumerate(results):
        for (s, precision, lora), result in per_case.items():
            if s != stage:
                continue
            assert result["config"]["world_size"] == world_size and result["config"]["rank"] == rank
            for c in categories:
                measured, predicted = result["measured"][c], result["predicted"][c]
                assert abs(measured - predicted) <= TOLERANCE * predicted, \
                    (f"stage {stage} N={world_size} rank {rank} {precision} lora={lora} {c}: "
                     f"measured {measured} vs estimate {predicted}")


@pytest.mark.parametrize("stage", STAGES)
def test_ledger_equals_estimate_within_one_percent(ledgers, stage):
    """Measured params, grads, master and optimizer states equal zk.estimate within 1%, every precision, LoRA too."""
    _check(ledgers, stage, MODEL_STATES)


def test_comm_buffers_and_activations_are_reported(ledgers):
    """Every ledger has comm_buffers (bytes, >= 0) and an activations slot, and no unknown category is lost."""
    _, results = ledgers
    for per_case in results:
        for result in per_case.values():
            assert result["measured"]["comm_buffers"] >= 0
            assert "activations" in result["measured"]
            assert set(MODEL_STATES) <= set(result["measured"])
