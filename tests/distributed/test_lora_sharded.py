"""LoRA composed with every ZeRO stage, on 2 gloo ranks.

The tiny GPT gets LoRA adapters on q and v (r = 8, alpha = 1); every base weight is frozen.
One spawn of 2 ranks runs every stage's case (so a missing or broken stage fails its own
tests, not the others'), then runs `zerokit train --lora` for every stage inside the same
ranks. The parent process then checks, for every rank:

* only adapters get optimizer state: AdamW's two fp32 moments cost exactly 8 bytes per element
  of the trainable flat buffers this rank updates (the whole padded buffer at stage 0, its
  shard at stages >= 1), within 1% of the formula 8·Ψ_trainable(/N);
* only adapters get gradients; under fp32 there is no master copy, under bf16 the master copy
  (4 bytes/element) covers the adapters' shards only;
* the frozen base weights come out of training bitwise equal to the pretrained ones;
* merging the trained adapters into W changes no output beyond 1e-5;
* training equals a single-process LoRA reference (global batch, torch AdamW on the adapters);
* stages 1-3 equal stage 0 bit for bit (losses and every trained value).

Batches are random token ids from a generator seeded by the step, not corpus text: the
corpus is the package's own source, which may change between two reads.
"""
from __future__ import annotations

import contextlib
import io
import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import zerokit as zk
from zerokit.core.collectives.comm import Comm, Simulated
from zerokit.launch import run_ranks
from zerokit.models import Block, CharCorpus, build_model

STAGES = (0, 1, 2, 3)
WORLD_SIZE = 2
STEPS = 4
BATCH = 2  # sequences per rank; the reference sees WORLD_SIZE * BATCH
SEQ = 16
LR, WEIGHT_DECAY = 1e-2, 0.1  # lr large enough that B (zero at start) moves by ~1e-2 per step
BUCKET_NUMEL = 600  # several buckets, each a few adapters: exercises bucket boundaries
ADAPTER_SEED = 1
CLI_STEPS = 5

# Reference tolerance. zerokit averages two per-rank gradients (each rank's mean over its
# BATCH rows, pre-divided by 2 and summed in rank order); the reference backpropagates the
# mean over all 2 * BATCH rows at once, so the matmuls that reduce over the batch add the
# same products in a different order and the gradients differ in their last bits (~1e-7
# relative). AdamW then divides each element by the root of its second moment, which turns
# a small relative error of a small gradient into the same relative error of an O(lr)
# update. Observed after 4 steps: losses differ by one fp32 ulp (4.8e-7 at loss 4.5),
# adapters by up to 7.3e-7. 1e-5 leaves a margin of ~14x and is still three orders below
# what a real bug moves (a missing 1/N or a skipped bucket changes the adapters by ~lr =
# 1e-2 per step).
REFERENCE_ATOL = 1e-5
# Merged vs unmerged: W + α·B·A is formed in fp32 and rounded once per element, so the two
# forward passes differ by rounding in fp32 only (observed 1.5e-7 on logits of magnitude < 1).
MERGE_ATOL = 1e-5


def lora_gpt() -> torch.nn.Module:
    """The pretrained tiny GPT (seed 0) with adapters on q and v from seed ADAPTER_SEED."""
    model = build_model("tiny", seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ADAPTER_SEED)
        zk.lora.inject(model, targets=("q", "v"), rank=8, alpha=1.0)
    return model


def token_batch(step: int, rank: int = 0, world_size: int = 1, batch_size: int = BATCH):
    """Rank r's rows of step's global batch of batch_size * world_size random sequences."""
    vocab = CharCorpus.vocab_size
    g = torch.Generator().manual_seed(500 + step)
    data = torch.randint(0, vocab, (batch_size * world_size, SEQ + 1), generator=g)
    rows = data[rank * batch_size:(rank + 1) * batch_size]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def flat_extents(engine) -> dict[str, int]:
    """Trainable/frozen element counts of the engine's flat buffers, padded and per shard."""
    trainable = [fp for fp in engine.flat_params if fp.requires_grad]
    return {
        "trainable_numel": sum(fp.numel for fp in trainable),
        "trainable_padded": sum(fp.padded_numel for fp in trainable),
        "trainable_shard": sum(fp.shard_numel for fp in trainable),
        "num_trainable_buffers": len(trainable),
        "num_frozen_buffers": len(engine.flat_params) - len(trainable),
    }


# ---------------------------------------------------------------------------- in the ranks
def _train_case(rank: int, world_size: int, stage: int) -> dict:
    model = lora_gpt()
    pretrained = {k: v.detach().clone() for k, v in model.state_dict().items() if not is_adapter(k)}
    trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, lr=LR, weight_decay=WEIGHT_DECAY,
                      bucket_numel=BUCKET_NUMEL, wrap=(Block,))
    losses, frozen_with_grad, grads_after_backward = [], set(), []
    for step in range(STEPS):
        engine.zero_grad()
        x, y = token_batch(step, rank, world_size)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.finish_backward()
        frozen_with_grad |= {n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None}
        # Every gradient category (stage 3 also names its unsharded gradient buffers).
        grads_after_backward.append(sum(v for c, v in engine.memory().items() if "grads" in c))
        engine.step()
        losses.append(loss.detach().clone())
    full = engine.state_dict(full=True)
    return {
        "losses": torch.stack(losses),
        "state_dict": {k: v.detach().clone() for k, v in full.items()},
        "pretrained": pretrained,
        "memory": engine.memory(),
        "grads_after_backward": grads_after_backward,
        "frozen_with_grad": sorted(frozen_with_grad),
        "trainable_params": trainable_params,
        **flat_extents(engine),
    }


def _bf16_memory_case(rank: int, world_size: int, stage: int) -> dict:
    """One bf16 step: which buffers get an fp32 master copy and optimizer state."""
    model = lora_gpt()
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision="bf16", lr=LR,
                      bucket_numel=BUCKET_NUMEL, wrap=(Block,))
    x, y = token_batch(0, rank, world_size)
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return {"memory": engine.memory(), **flat_extents(engine)}


def _cli_case(rank: int, world_size: int, stage: int, store_dir: str) -> dict:
    """`zerokit train --lora` joining this process group the way it joins torchrun's.

    The ranks carry torchrun's environment variables, so `zerokit.cli.main` takes its
    torchrun path (zk.init_distributed() finds the group initialised), trains, and destroys
    the group at the end, as it must under torchrun; a fresh group is made for what follows.
    """
    from zerokit.cli import main
    env = {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            rc = main(["train", "--lora", "--stage", str(stage), "--nproc", str(world_size), "--steps",
                       str(CLI_STEPS), "--no-progress", "--model", "tiny", "--batch-size", "2"])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{store_dir}/cli_stage{stage}", rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=120))
    return {"rc": rc, "stdout": out.getvalue()}


def _guarded(fn, *args) -> dict:
    """Run one stage's case; a failure becomes that stage's result (the traceback)."""
    try:
        return {"ok": fn(*args)}
    except Exception:  # a broken stage fails its own tests; the other stages still run
        return {"error": traceback.format_exc()}


def _all_cases(rank: int, world_size: int, store_dir: str) -> dict:
    out = {}
    for stage in STAGES:
        out[("train", stage)] = _guarded(_train_case, rank, world_size, stage)
        out[("bf16", stage)] = _guarded(_bf16_memory_case, rank, world_size, stage)
    for stage in STAGES:  # last: each run tears the process group down and we rebuild it
        out[("cli", stage)] = _guarded(_cli_case, rank, world_size, stage, store_dir)
    return out


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict]:
    store_dir = str(tmp_path_factory.mktemp("rdzv"))
    return run_ranks(_all_cases, WORLD_SIZE, store_dir, store_dir=store_dir, timeout_s=240)


def results_for(rank_results: list[dict], kind: str, stage: int) -> list[dict]:
    """Every rank's result for one case, or a test failure carrying the rank's traceback."""
    found = []
    for rank, res in enumerate(rank_results):
        r = res[(kind, stage)]
        if "error" in r:
            pytest.fail(f"stage {stage} {kind} case failed on rank {rank}:\n{r['error']}", pytrace=False)
        found.append(r["ok"])
    return found


# ---------------------------------------------------------------------------- the reference
def train_reference() -> dict:
    """Single process, the global batch, torch AdamW over the adapter parameters only."""
    model = lora_gpt()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = token_batch(step, 0, 1, batch_size=BATCH * WORLD_SIZE)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return {"losses": torch.stack(losses), "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def reference() -> dict:
    return train_reference()


# ---------------------------------------------------------------------------- the claims
@pytest.mark.parametrize("stage", STAGES)
def test_lora_only_adapters_get_optimizer_state(rank_results, stage):
    """AdamW state is 8 bytes per trainable flat element this rank updates: 8·Ψ_lora at stage 0, 8·Ψ_lora/N above."""
    for rank, r in enumerate(results_for(rank_results, "train", stage)):
        assert r["trainable_numel"] == r["trainable_params"], (rank, r["trainable_numel"], r["trainable_params"])
        assert r["num_frozen_buffers"] > 0, "the frozen base must get flat buffers of its own"
        owned = r["trainable_padded"] if stage == 0 else r["trainable_shard"]
        measured = r["memory"]["optimizer_states"]
        assert measured == 8 * owned, (rank, stage, measured, 8 * owned)
        formula = 8 * r["trainable_params"] / (1 if stage == 0 else WORLD_SIZE)
        assert abs(measured - formula) <= 0.01 * formula, (rank, stage, measured, formula)


@pytest.mark.parametrize("stage", STAGES)
def test_lora_gradients_exist_only_for_adapters(rank_results, stage):
    """No frozen parameter ever holds a .grad, and gradient storage is bounded by the adapters' size."""
    for rank, r in enumerate(results_for(rank_results, "train", stage)):
        assert r["frozen_with_grad"] == [], (rank, r["frozen_with_grad"])
        # The most any stage keeps: full adapter buckets plus this rank's grad shards (stage 1).
        bound = 4 * (r["trainable_padded"] + r["trainable_shard"])
        for step, nbytes in enumerate(r["grads_after_backward"]):
            assert 0 < nbytes <= bound, (rank, step, nbytes, bound)


@pytest.mark.parametrize("stage", STAGES)
def test_lora_master_copy_only_for_adapters(rank_results, stage):
    """fp32 keeps no master copy; bf16 keeps 4 bytes of fp32 master + 8 of Adam per adapter shard element only."""
    for rank, r in enumerate(results_for(rank_results, "train", stage)):
        assert r["memory"]["master_params"] == 0, (rank, r["memory"])
    for rank, r in enumerate(results_for(rank_results, "bf16", stage)):
        owned = r["trainable_padded"] if stage == 0 else r["trainable_shard"]
        assert r["memory"]["master_params"] == 4 * owned, (rank, r["memory"], owned)
        assert r["memory"]["optimizer_states"] == 8 * owned, (rank, r["memory"], owned)


@pytest.mark.parametrize("stage", STAGES)
def test_lora_base_weights_bitwise_unchanged(rank_results, stage):
    """Every frozen base tensor in engine.state_dict(full=True) equals the pretrained one bit for bit; B moved."""
    for rank, r in enumerate(results_for(rank_results, "train", stage)):
        sd = r["state_dict"]
        assert set(sd) == set(r["pretrained"]) | {k for k in sd if is_adapter(k)}, (rank, sorted(sd))
        for k, v in r["pretrained"].items():
            assert torch.equal(sd[k], v), (rank, stage, k, (sd[k] - v).abs().max())
        moved = max(sd[k].abs().max().item() for k in sd if k.endswith(".lora_B"))
        assert moved > LR, f"rank {rank}: lora_B barely moved ({moved:.2e}); the test would not see a merge"


@pytest.mark.parametrize("stage", STAGES)
def test_lora_merged_model_matches_unmerged(rank_results, stage):
    """The trained adapters, loaded into a fresh model and merged into W, change no output beyond 1e-5."""
    sd = results_for(rank_results, "train", stage)[0]["state_dict"]
    model = lora_gpt()
    model.load_state_dict(sd, strict=True)
    x, _ = token_batch(99, batch_size=4)
    with torch.no_grad():
        unmerged, _ = model(x)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        zk.lora.merge(model)
        merged, _ = model(x)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and all(k.endswith((".q.weight", ".v.weight")) for k in changed), changed
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=MERGE_ATOL)


@pytest.mark.parametrize("stage", STAGES)
def test_lora_trains_like_single_process_reference(rank_results, reference, stage):
    """Every rank's adapters and the mean loss equal the single-process LoRA run within REFERENCE_ATOL."""
    results = results_for(rank_results, "train", stage)
    mean_loss = torch.stack([r["losses"] for r in results]).mean(0)  # equal rows per rank: the global mean
    torch.testing.assert_close(mean_loss, reference["losses"], rtol=0, atol=REFERENCE_ATOL)
    for rank, r in enumerate(results):
        assert set(r["state_dict"]) == set(reference["state_dict"])
        for k, v in reference["state_dict"].items():
            torch.testing.assert_close(r["state_dict"][k], v, rtol=0, atol=REFERENCE_ATOL,
                                       msg=lambda m, k=k, rank=rank: f"rank {rank}, {k}: {m}")


@pytest.mark.parametrize("stage", [s for s in STAGES if s > 0])
def test_lora_stage_equals_stage0_bitwise(rank_results, stage):
    """Stages 1-3 with LoRA give stage 0's losses and trained values bit for bit, on every rank."""
    base = results_for(rank_results, "train", 0)
    for rank, (r, r0) in enumerate(zip(results_for(rank_results, "train", stage), base)):
        assert torch.equal(r["losses"], r0["losses"]), (rank, r["losses"], r0["losses"])
        for k, v in r0["state_dict"].items():
            assert torch.equal(r["state_dict"][k], v), (rank, stage, k, (r["state_dict"][k] - v).abs().max())


@pytest.mark.parametrize("stage", STAGES)
def test_lora_optimizer_state_padded_at_simulated_world_size_3(stage):
    """Simulated rank 1 of 3: optimizer_states is 8 x the padded shard (not 8·Ψ/3 exactly), within 1% of it."""
    model = lora_gpt()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, lr=LR, bucket_numel=BUCKET_NUMEL, wrap=(Block,),
                      comm=Comm(simulate=Simulated(1, 3)))
    x, y = token_batch(0)
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    ext = flat_extents(engine)
    owned = ext["trainable_padded"] if stage == 0 else ext["trainable_shard"]
    measured = engine.memory()["optimizer_states"]
    assert measured == 8 * owned, (measured, owned)
    formula = 8 * trainable / (1 if stage == 0 else 3)
    assert ext["trainable_padded"] > trainable, "buckets of 256-element adapters must need padding at N = 3"
    assert measured != formula and abs(measured - formula) <= 0.01 * formula, (measured, formula)


@pytest.mark.parametrize("stage", STAGES)
def test_zerokit_train_lora_runs(rank_results, stage):
    """`zerokit train --lora --stage S --nproc 2 --steps 5 --model tiny` trains only the adapters and reports it."""
    results = results_for(rank_results, "cli", stage)
    assert [r["rc"] for r in results] == [0] * WORLD_SIZE
    text = results[0]["stdout"]
    model = lora_gpt()
    report = zk.lora.trainable_report(model)
    header = (f"stage {stage}, {WORLD_SIZE} rank(s), fp32, model tiny ({report['total_params']:,} params, "
              f"{report['trainable_params']:,} trainable)")
    assert header in text, text
    assert "loss: first" in text and "optimizer_states" in text, text
