"""reduce_dtype: gradients reduced in a dtype other than the params' (bf16 params, fp32 reductions).

One spawn per world size (2 and 3) runs every case; each rank asserts as it goes and returns
what it saw, so the parent asserts again on every rank's results:

* stages 1, 2, 3 equal stage 0 bit for bit (losses every step, the final state_dict) over
  8 steps of the tiny GPT under bf16 + reduce_dtype=fp32, and on the odd model under fp16
  (loss scaler) + fp32 reductions with two micro-steps per step;
* the reduced gradient is the fp32 average of the ranks' bf16 gradients with no bf16
  rounding in between (checked element for element at stages 0 and 1);
* the gradient reduction's logical bytes are exactly 2x those of the bf16-reduce run, and
  equal 4 bytes per padded element (x2 for stage 0's all-reduce);
* every tensor a training collective reads or writes is attributed by the ledger, either to
  a model-state category or to comm_buffers, at the moment the collective is issued; the
  reduce-dtype input is among `comm_buffer_tensors()` then; comm_buffers is 0 after step
  (and, at stage 0, exactly the reduce-dtype gradients, 4 bytes per element, before it);
* grads in the ledger follow the reduce dtype exactly (stage 1: 2Ψ + 4Ψ/N, stages 2 and 3:
  4Ψ/N, on the padded buffers), and `estimate(..., reduce_precision=)` predicts them.
"""
import pytest
import torch
import torch.distributed as dist

import zerokit as zk
from common import OddBlock, fixed_corpus, odd_batch, odd_model
from zerokit.commands.step import train_step
from zerokit.core.accounting.ledger import ledger
from zerokit.launch import run_ranks
from zerokit.models import Block, build_model

STAGES = (0, 1, 2, 3)
STEPS, BATCH, SEQ = 8, 4, 32
CHECKED_STEPS = 2  # steps whose every collective is checked for attribution (the check is slow-ish)
REDUCE = {"bf16": torch.bfloat16, "fp32": torch.float32}
GRAD_KIND = {0: "all_reduce", 1: "reduce_scatter", 2: "reduce_scatter", 3: "reduce_scatter"}


def _storage(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def _watch_collectives(engine, seen: list) -> list[bool]:
    """Wrap the engine's Comm so that every training collective checks the ledger as it is issued.

    Returns a one-element list: set its element to False to stop checking (the check is slow-ish).
    """
    comm = engine.comm
    watching = [True]

    def check(kind, phase, tensors, grad_input):
        if phase not in ("forward", "backward", "step") or not watching[0]:
            return
        model_states = {_storage(t) for ts in engine.memory_tensors().values() for t in ts if t is not None}
        reported = engine.comm_buffer_tensors()
        comm_storages = {_storage(t) for t in reported if t.untyped_storage().nbytes()} - model_states
        for t in tensors:
            assert _storage(t) in model_states | comm_storages, (
                f"stage {engine.stage}: a {kind} ({phase}) uses a tensor of {t.numel()} {t.dtype} that no ledger "
                "category holds")
        measured = ledger(engine)["measured"]["comm_buffers"]
        assert measured == sum(nbytes for _, nbytes in comm_storages), (measured, comm_storages)
        seen.append(dict(kind=kind, phase=phase, comm_buffers=measured, num_reported=len(reported),
                         input_is_comm_buffer=_storage(grad_input) in comm_storages if grad_input is not None
                         else None))

    all_reduce, reduce_scatter, all_gather = comm.all_reduce, comm.reduce_scatter, comm.all_gather

    def wrapped_all_reduce(tensor, op="sum", async_op=False, phase=None, label=None):
        check("all_reduce", phase, [tensor], tensor)
        return all_reduce(tensor, op=op, async_op=async_op, phase=phase, label=label)

    def wrapped_reduce_scatter(output, input, async_op=False, phase=None, label=None):
        check("reduce_scatter", phase, [output, input], input)
        return reduce_scatter(output, input, async_op=async_op, phase=phase, label=label)

    def wrapped_all_gather(output, input, async_op=False, phase=None, label=None):
        check("all_gather", phase, [output, input], None)
        return all_gather(output, input, async_op=async_op, phase=phase, label=label)

    all_gather_many = comm.all_gather_many

    def wrapped_all_gather_many(outputs, inputs, phase=None, labels=None, coalesce=True):  # each pair checked
        for output, input in zip(outputs, inputs):
            check("all_gather", phase, [output, input], None)
        return all_gather_many(outputs, inputs, phase=phase, labels=labels, coalesce=coalesce)

    comm.all_reduce, comm.reduce_scatter, comm.all_gather = wrapped_all_reduce, wrapped_reduce_scatter, wrapped_all_gather
    comm.all_gather_many = wrapped_all_gather_many
    return watching


def _train_gpt(rank, world_size, stage, precision, reduce_dtype, corpus):
    model = build_model("tiny", seed=0)
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, reduce_dtype=reduce_dtype,
                      lr=3e-3, weight_decay=0.1, bucket_numel=3000, wrap=(Block,))
    padded = sum(fp.padded_numel for fp in engine.flat_params if fp.requires_grad)
    seen: list = []
    watching = _watch_collectives(engine, seen)
    losses, grad_bytes, after_backward, after_step = [], [], [], []
    for step in range(STEPS):
        watching[0] = step < CHECKED_STEPS
        engine.zero_grad()
        before = engine.comm.stats_by_phase().get("backward", {}).get(GRAD_KIND[stage], 0)
        x, y = corpus.batch(BATCH, SEQ, step, rank, world_size)
        _, loss = engine(x, y)
        engine.backward(loss)
        after_backward.append(ledger(engine)["measured"]["comm_buffers"])
        grad_bytes.append(engine.comm.stats_by_phase()["backward"][GRAD_KIND[stage]] - before)
        engine.step()
        assert engine.comm_buffer_tensors() == [], f"stage {stage}: communication buffers outlive the step"
        after_step.append(ledger(engine)["measured"]["comm_buffers"])
        losses.append(loss.detach().float())
    result = ledger(engine)
    return dict(losses=torch.stack(losses), params=engine.state_dict(full=True), grad_bytes=grad_bytes,
                gather_bytes=engine.comm.stats()["all_gather"], seen=seen, after_backward=after_backward,
                after_step=after_step, padded=padded, ledger=result)


def _reduced_gradient_is_exact(rank, world_size, stage, corpus):
    """One backward: the reduced gradient equals the rank-ordered fp32 average of the ranks' bf16 gradients."""
    model = build_model("tiny", seed=0)
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision="bf16", reduce_dtype=torch.float32,
                      lr=3e-3, bucket_numel=3000)
    x, y = corpus.batch(BATCH, SEQ, 0, rank, world_size)
    _, loss = engine(x, y)
    engine.backward(loss)
    out = []
    for fp, got in zip([fp for fp in engine.flat_params if fp.requires_grad], engine.norm_shards()):
        # got: (shard_numel,) this rank's averaged range, what clipping and the optimizer read
        local = engine.flat_grads[fp.index]  # (padded_numel,) bf16: this rank's gradient, never overwritten
        assert local.dtype == torch.bfloat16
        everyone = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(everyone, local)
        expected = everyone[0].float().mul_(1.0 / world_size)  # cast first, then pre-divide, in fp32
        for g in everyone[1:]:  # rank order 0..N-1, as the ordered reduction sums
            expected.add_(g.float().mul_(1.0 / world_size))
        assert got.dtype == torch.float32, got.dtype
        exact = torch.equal(got, fp.shard_of(expected))
        if stage == 0:  # the whole averaged gradient lives in its all-reduce group's reduce-dtype buffer until step
            averaged = engine.full_grads.averaged(fp)
            buffers = {t.untyped_storage().data_ptr() for t in engine.comm_buffer_tensors()}
            exact = exact and torch.equal(averaged, expected) and averaged.untyped_storage().data_ptr() in buffers
        # The check can tell fp32 from bf16: some averages are not representable in bf16.
        rounding_visible = not torch.equal(expected, expected.bfloat16().float())
        assert exact and rounding_visible, (stage, fp.index, exact, rounding_visible)
        out.append(exact and rounding_visible)
    return out


def _cases(rank, world_size):
    torch.manual_seed(0)
    corpus = fixed_corpus()
    out = {}
    for reduce_name, reduce_dtype in REDUCE.items():
        for stage in STAGES:
            out[("gpt", reduce_name, stage)] = _train_gpt(rank, world_size, stage, "bf16", reduce_dtype, corpus)
    for stage in (0, 1):
        out[("exact", stage)] = _reduced_gradient_is_exact(rank, world_size, stage, corpus)
    for stage in STAGES:
        out[("odd", stage)] = _train_odd(rank, world_size, stage)
    return out


def _train_odd(rank, world_size, stage, steps=5, micro=2):
    """fp16 (dynamic loss scale) + fp32 reductions on the odd model (frozen, tied, odd-sized params).

    Two micro-steps per step, the first inside no_sync; stage 2 accumulates the full
    gradients locally then (accumulate="local"), so every stage's sum is stage 0's.
    """
    engine = zk.shard(odd_model(0), torch.optim.AdamW, stage=stage, precision="fp16", reduce_dtype=torch.float32,
                      lr=1e-2, bucket_numel=40, wrap=(OddBlock,), accumulate="local")
    losses, stepped = [], []
    for step in range(steps):
        batches = [odd_batch(step * micro + m, 3, rank, world_size) for m in range(micro)]
        result = train_step(engine, batches, lambda batch: engine(*batch))
        stepped.append(result.stepped)
        losses.append(result.loss.float())
    return dict(losses=torch.stack(losses), params=engine.state_dict(full=True), stepped=stepped,
                scale=engine.loss_scale)


@pytest.fixture(scope="module", params=[2, 3])
def runs(request, tmp_path_factory):
    return request.param, run_ranks(_cases, request.param, store_dir=str(tmp_path_factory.mktemp("rdzv")),
                                    timeout_s=200)


def test_stages_equal_stage0_bitwise_with_fp32_reductions_of_bf16_grads(runs):
    """bf16 params, fp32 reductions: stages 1-3 give stage 0's losses and state_dict bit for bit, on every rank."""
    _, results = runs
    for res in results:
        for reduce_name in REDUCE:
            ref = res[("gpt", reduce_name, 0)]
            for stage in STAGES[1:]:
                got = res[("gpt", reduce_name, stage)]
                assert torch.equal(got["losses"], ref["losses"]), (reduce_name, stage, got["losses"] - ref["losses"])
                for k in ref["params"]:
                    assert torch.equal(got["params"][k], ref["params"][k]), (reduce_name, stage, k)
        # ... and the reduce dtype really changed the arithmetic (else the comparison proves little).
        fp32, bf16 = res[("gpt", "fp32", 0)]["params"], res[("gpt", "bf16", 0)]["params"]
        assert any(not torch.equal(fp32[k], bf16[k]) for k in fp32)


def test_stages_equal_stage0_bitwise_under_fp16_with_fp32_reductions_and_accumulation(runs):
    """fp16 + loss scaler + fp32 reductions, two micro-steps (no_sync), odd model: stages 1-3 equal stage 0 bitwise."""
    _, results = runs
    for res in results:
        ref = res[("odd", 0)]
        for stage in STAGES[1:]:
            got = res[("odd", stage)]
            assert torch.equal(got["losses"], ref["losses"]), (stage, got["losses"] - ref["losses"])
            assert got["scale"] == ref["scale"] and got["stepped"] == ref["stepped"]
            for k in ref["params"]:
                assert torch.equal(got["params"][k], ref["params"][k]), (stage, k)


def test_reduced_gradient_is_the_fp32_average_without_bf16_rounding(runs):
    """Stages 0 and 1: the reduced gradient is exactly the rank-ordered fp32 average of the ranks' bf16 gradients."""
    _, results = runs
    for res in results:
        for stage in (0, 1):
            assert res[("exact", stage)] and all(res[("exact", stage)])


def test_fp32_reductions_count_exactly_twice_the_bytes(runs):
    """Gradient-reduction bytes per step: fp32 = 2x bf16 = 4 bytes per padded element (x2 for an all-reduce)."""
    world_size, results = runs
    for res in results:
        for stage in STAGES:
            wide, narrow = res[("gpt", "fp32", stage)], res[("gpt", "bf16", stage)]
            factor = 2 if stage == 0 else 1  # ZeRO accounting: an all-reduce counts 2B
            assert wide["grad_bytes"] == [factor * 4 * wide["padded"]] * STEPS, (stage, wide["grad_bytes"])
            assert [2 * b for b in narrow["grad_bytes"]] == wide["grad_bytes"], stage
            assert wide["gather_bytes"] == narrow["gather_bytes"], "parameter gathers stay in the param dtype"


def test_every_collective_tensor_is_in_the_ledger_and_comm_buffers_empty_after_step(runs):
    """Each training collective's tensors are attributed when issued; reduce-dtype inputs are comm_buffers; 0 after step."""
    world_size, results = runs
    for res in results:
        for reduce_name in REDUCE:
            for stage in STAGES:
                r = res[("gpt", reduce_name, stage)]
                grad_calls = [s for s in r["seen"] if s["kind"] == GRAD_KIND[stage]]
                assert grad_calls, (reduce_name, stage)
                if reduce_name == "fp32":  # the cast copy is the input, alive and reported while in flight
                    assert all(s["input_is_comm_buffer"] and s["comm_buffers"] > 0 for s in grad_calls), grad_calls
                elif stage in (0, 1):  # the bucket itself is the input: a model state, no comm buffer
                    assert all(not s["input_is_comm_buffer"] for s in grad_calls), grad_calls
                if stage in (1, 2):  # the post-step gathers are in place: no buffer of their own
                    gathers = [s for s in r["seen"] if s["kind"] == "all_gather" and s["phase"] == "step"]
                    assert gathers and all(s["comm_buffers"] == 0 for s in gathers), gathers
                assert r["after_step"] == [0] * STEPS, (reduce_name, stage, r["after_step"])
                # Between backward and step only stage 0 keeps a buffer: the averaged fp32 gradient.
                expected = 4 * r["padded"] if (stage == 0 and reduce_name == "fp32") else 0
                assert r["after_backward"] == [expected] * STEPS, (reduce_name, stage, r["after_backward"])


def test_grads_in_the_ledger_follow_the_reduce_dtype(runs):
    """Measured grads: stage 0 2Ψ, stage 1 2Ψ + 4Ψ/N, stages 2-3 4Ψ/N (padded, exact); estimate() agrees within 1%."""
    world_size, results = runs
    for res in results:
        for stage in STAGES:
            r = res[("gpt", "fp32", stage)]
            padded, shard = r["padded"], r["padded"] // world_size
            expected = {0: 2 * padded, 1: 2 * padded + 4 * shard, 2: 4 * shard, 3: 4 * shard}[stage]
            assert r["ledger"]["measured"]["grads"] == expected, (stage, r["ledger"]["measured"]["grads"], expected)
            # estimate() counts Ψ unpadded: padding (< N per flat buffer) is the only difference.
            assert abs(r["ledger"]["relative_error"]["grads"]) < 0.01, (stage, r["ledger"]["relative_error"])
