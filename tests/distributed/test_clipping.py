"""engine.clip_grad_norm_ at every stage, against torch.nn.utils.clip_grad_norm_.

The norm is summed over shards (padding is zero, a tied parameter is stored once) with
one rank-ordered reduction, so it is the same number on every rank and at every stage;
it must equal torch's norm of the averaged gradient on the unsharded single-process
reference. One spawn per world size runs every stage.
"""
import pytest
import torch

import zerokit as zk
from common import OddBlock, fixed_corpus, odd_batch, odd_model, train_torch_ddp, train_zerokit
from zerokit.commands.step import train_step
from zerokit.launch import run_ranks

STEPS, BATCH, BUCKET = 3, 3, 40
MAX_NORM = 0.5  # below the odd model's gradient norm (~1-2), so clipping really scales the update
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}
# The reference takes the mean loss over the global batch in one process; the engine
# averages per-rank means and sums squares per shard instead of per parameter. Same
# numbers in a different order: a few ulps of fp32 in the norm (observed ~1e-7 relative).
NORM_RTOL = 1e-6
# torch DDP + clip vs zerokit + clip: the all-reduce order (see test_zero12.DDP_ATOL) and
# the norm's summation order (above) differ by a few ulps; after a few steps on O(1)
# weights that stays orders of magnitude below 1e-5.
DDP_ATOL = 1e-5


# Every stage, listed: a stage whose module fails to import fails these tests, never skips them.
STAGES = (0, 1, 2, 3)


def _clip_cases(rank, world_size):
    out = {}
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    for stage in STAGES:
        # 1. the returned norm, every step, against torch on the unsharded reference
        cls, kw = OPTIMIZERS["adamw"]
        engine = zk.shard(odd_model(), cls, stage=stage, bucket_numel=BUCKET, wrap=(OddBlock,), **kw)
        reference = odd_model()
        norms = []
        for step in range(STEPS):
            reference.load_state_dict(engine.state_dict(full=True))  # a collective at some stages
            reference.zero_grad(set_to_none=True)
            x, y = odd_batch(step, BATCH * world_size)  # the global batch, in one process
            reference(x, y).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(trainable(reference), MAX_NORM)
            engine.zero_grad()
            x, y = odd_batch(step, BATCH, rank, world_size)
            engine.backward(engine(x, y))
            norm = engine.clip_grad_norm_(MAX_NORM)
            assert abs(norm.item() - ref_norm.item()) <= NORM_RTOL * ref_norm.item(), (rank, stage, step,
                                                                                      norm, ref_norm)
            engine.step()
            norms.append((norm.item(), ref_norm.item()))
        out[("norms", stage)] = norms
        # 2. training with clipping on
        for name, (cls, kw) in OPTIMIZERS.items():
            losses, params, _ = train_zerokit(rank, world_size, stage, cls, kw, STEPS, BATCH, clip=MAX_NORM,
                                              bucket_numel=BUCKET)
            out[("train", name, stage)] = (losses, params)
    for name, (cls, kw) in OPTIMIZERS.items():
        out[("ddp", name)] = train_torch_ddp(rank, world_size, cls, kw, STEPS, BATCH, clip=MAX_NORM)
        for stage in STAGES[1:]:
            assert torch.equal(out[("train", name, stage)][0], out[("train", name, 0)][0]), (rank, name, stage)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def results(request, tmp_path_factory):
    world_size = request.param
    return world_size, run_ranks(_clip_cases, world_size, store_dir=str(tmp_path_factory.mktemp("rdzv")))


@pytest.mark.parametrize("stage", STAGES)
def test_clip_grad_norm_returns_torchs_norm_on_every_rank(results, stage):
    """clip_grad_norm_ returns torch's clip_grad_norm_ on the unsharded reference within 1e-6 relative, every rank."""
    _, res = results
    for rank, r in enumerate(res):
        norms = r[("norms", stage)]
        assert any(ref > MAX_NORM for _, ref in norms), "clipping must engage in at least one step"
        for step, (norm, ref) in enumerate(norms):
            assert abs(norm - ref) <= NORM_RTOL * ref, (rank, step, norm, ref)
    for r in res[1:]:  # one rank-ordered reduction: the same float on every rank
        assert r[("norms", stage)] == res[0][("norms", stage)]


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("stage", STAGES)
def test_training_with_clipping_matches_torch_ddp_and_stage_0(results, stage, opt):
    """With clipping on, every stage trains like torch DDP + clip_grad_norm_ (DDP_ATOL) and like stage 0 bit for bit."""
    _, res = results
    for rank, r in enumerate(res):
        losses, params = r[("train", opt, stage)]
        ref_losses, ref_params = r[("ddp", opt)]
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=DDP_ATOL)
        for k in ref_params:
            torch.testing.assert_close(params[k], ref_params[k], rtol=0, atol=DDP_ATOL, msg=k)
        stage0_losses, stage0_params = r[("train", opt, 0)]
        assert torch.equal(losses, stage0_losses), (rank, stage)
        for k in stage0_params:
            assert torch.equal(params[k], stage0_params[k]), (rank, stage, k)


def _clipped_gpt_cases(rank, world_size):
    from zerokit.models import Block, build_model
    corpus = fixed_corpus()
    out = {}
    for precision in ("fp32", "bf16"):
        for stage in STAGES:
            engine = zk.shard(build_model("tiny"), torch.optim.AdamW, stage=stage, precision=precision, lr=3e-3,
                              wrap=(Block,), bucket_numel=3000)
            trace = []
            for step in range(6):
                result = train_step(engine, [corpus.batch(4, 32, step, rank, world_size)],
                                    lambda batch: engine(*batch)[1], clip=0.3)  # well below the norm: every step clips
                trace.append(torch.stack([result.loss.float(), result.grad_norm.float()]))
            out[(precision, stage)] = (torch.stack(trace), engine.state_dict(full=True))
    return out


def test_clipped_gpt_training_is_bitwise_equal_across_all_stages(tmp_path):
    """Tiny GPT, clip 0.3 every step, fp32 and bf16, 3 ranks: norms, losses and weights equal stage 0's bit for bit.

    Stage 3 groups elements into per-unit shards, stages 0-2 into buckets; the norm's squares are
    summed in fp64 (exact squares, ~1e-16 relative sum error), so the fp32 norm is the same number.
    """
    results = run_ranks(_clipped_gpt_cases, 3, store_dir=str(tmp_path), timeout_s=240)
    for res in results:
        for precision in ("fp32", "bf16"):
            ref_trace, ref_params = res[(precision, 0)]
            assert (ref_trace[:, 1] > 0.3).all(), "the clip must be active"
            for stage in STAGES[1:]:
                trace, params = res[(precision, stage)]
                assert torch.equal(trace, ref_trace), (precision, stage, trace - ref_trace)
                for k in ref_params:
                    assert torch.equal(params[k], ref_params[k]), (precision, stage, k)
