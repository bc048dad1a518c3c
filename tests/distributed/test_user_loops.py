"""Training loops written the way people write them, at every stage (gloo, world sizes 2 and 3).

Each loop clears gradients its own way — `model.zero_grad()` (set_to_none, torch's default)
in addition to or instead of `engine.zero_grad()`, `set_to_none=False`, a torch optimizer
built over `model.parameters()` whose `zero_grad()` the loop calls, `p.grad = None` — or
calls plain `loss.backward()`, and must train bitwise like the engine's own loop
(core/grads/user_grads.py [Note: param.grad belongs to the user]). `param.grad` after backward
means what it means under DDP (stage 0) or FSDP2 (stages 1-3: this rank's shard, whose
norms are reduced over ranks), so `torch.nn.utils.clip_grad_norm_(model.parameters(), c)`
gives `engine.clip_grad_norm_(c)`'s result. What cannot be honoured raises on every rank.
"""
import pytest
import torch

import zerokit as zk
from common import OddBlock, odd_batch, odd_model
from zerokit.core.params.sharded_tensors import ShardedGrad
from zerokit.launch import run_ranks

STEPS, BATCH = 3, 3
STAGES = (0, 1, 2, 3)
# SGD without momentum moves weights by lr * gradient: a gradient that is wrong in any way
# (zeros all-reduced, a stale accumulation) shows at once. AdamW with weight decay covers
# the optimizer-state path (and is insensitive to gradient scale, hence SGD first).
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.5)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}


def _clear_engine(engine, model, opt):
    engine.zero_grad()


def _clear_model_too(engine, model, opt):
    engine.zero_grad()
    model.zero_grad()


def _clear_model_only(engine, model, opt):
    model.zero_grad()


def _clear_model_in_place(engine, model, opt):
    model.zero_grad(set_to_none=False)


def _clear_torch_optimizer(engine, model, opt):
    opt.zero_grad()


def _clear_grad_none(engine, model, opt):
    for p in model.parameters():
        p.grad = None


CLEARS = {
    "engine.zero_grad": _clear_engine,
    "engine+model.zero_grad": _clear_model_too,
    "model.zero_grad": _clear_model_only,
    "model.zero_grad(set_to_none=False)": _clear_model_in_place,
    "torch_optimizer.zero_grad": _clear_torch_optimizer,
    "p.grad=None": _clear_grad_none,
}


def _loop(rank, world_size, stage, opt_name, clear, precision="fp32", plain_backward=False, micro=1,
          torch_clip=None, engine_clip=None, grad_scale=None, loss_mult=1.0, steps=STEPS,
          **shard_kwargs):
    """Train the odd model; the loop clears gradients with `clear` (a CLEARS key) before each forward."""
    optimizer_cls, opt_kwargs = OPTIMIZERS[opt_name]
    model = odd_model()
    if precision == "fp16":  # a scale that does not overflow on the first steps (the clip must act)
        shard_kwargs.setdefault("loss_scaler", dict(init_scale=2.0 ** 8))
    engine = zk.shard(model, optimizer_cls, stage=stage, precision=precision, bucket_numel=40, wrap=(OddBlock,),
                      **opt_kwargs, **shard_kwargs)
    # The outside loop's own optimizer handle over model.parameters(): only its zero_grad() is used.
    user_opt = torch.optim.SGD(model.parameters(), lr=0.0)
    losses, norms = [], []
    for step in range(steps):
        CLEARS[clear](engine, model, user_opt)
        for m in range(micro):
            x, y = odd_batch(step * micro + m, BATCH, rank, world_size)
            ctx = engine.no_sync() if m < micro - 1 else torch.enable_grad()
            with ctx:
                loss = engine(x, y) / micro * loss_mult
                (loss.backward() if plain_backward else engine.backward(loss))
        if grad_scale is not None:  # in place through param.grad: must reach the step
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        if torch_clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip).float())
        if engine_clip is not None:
            norms.append(engine.clip_grad_norm_(engine_clip).float())
        engine.step()
        losses.append(loss.detach().float())
    state = {k: v.float().clone() for k, v in engine.state_dict(full=True).items()}
    return torch.stack(losses), state, norms


def _same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


def _max_diff(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _user_loops_case(rank, world_size):
    report = {}
    for stage in STAGES:
        for opt_name in OPTIMIZERS:
            ref_losses, ref_state, _ = _loop(rank, world_size, stage, opt_name, "engine.zero_grad")
            # Every way of clearing under SGD (which shows any gradient error at once); under
            # AdamW the two that replace engine.zero_grad() by torch idioms.
            clears = CLEARS if opt_name == "sgd" else ("model.zero_grad", "torch_optimizer.zero_grad")
            for clear in clears:
                if clear == "engine.zero_grad":
                    continue
                losses, state, _ = _loop(rank, world_size, stage, opt_name, clear)
                assert torch.equal(losses, ref_losses) and _same(state, ref_state), (
                    f"stage {stage} {opt_name} {clear}: params differ by {_max_diff(state, ref_state):.3g}")
            # The outside training loop: its own torch optimizer over model.parameters(), its
            # zero_grad(), plain loss.backward(); only the step is the engine's.
            losses, state, _ = _loop(rank, world_size, stage, opt_name, "torch_optimizer.zero_grad",
                                     plain_backward=True)
            assert torch.equal(losses, ref_losses) and _same(state, ref_state), (stage, opt_name, "loss.backward")
        # accumulation under no_sync, cleared by model.zero_grad() only
        ref = _loop(rank, world_size, stage, "sgd", "engine.zero_grad", micro=2)
        got = _loop(rank, world_size, stage, "sgd", "model.zero_grad", micro=2)
        assert torch.equal(got[0], ref[0]) and _same(got[1], ref[1]), (stage, "no_sync")
        # bf16: the bucket and shard paths in the param dtype
        ref = _loop(rank, world_size, stage, "sgd", "engine.zero_grad", precision="bf16")
        got = _loop(rank, world_size, stage, "sgd", "torch_optimizer.zero_grad", precision="bf16")
        assert torch.equal(got[0], ref[0]) and _same(got[1], ref[1]), (stage, "bf16")
        report[stage] = "ok"
    return report


@pytest.mark.parametrize("world_size", [2, 3])
def test_user_gradient_clearing_trains_bitwise_like_engine_zero_grad(tmp_path, world_size):
    """Every stage: model.zero_grad() / optimizer.zero_grad() / p.grad = None / loss.backward() loops equal the engine's loop bitwise."""
    results = run_ranks(_user_loops_case, world_size, timeout_s=280, store_dir=str(tmp_path))
    assert all(r == {s: "ok" for s in STAGES} for r in results)


def _clip_case(rank, world_size):
    out = {}
    for stage in STAGES:
        for precision in ("fp32", "bf16", "fp16"):
            ref_losses, ref_state, ref_norms = _loop(rank, world_size, stage, "sgd", "model.zero_grad",
                                                     precision=precision, engine_clip=0.05)
            losses, state, norms = _loop(rank, world_size, stage, "sgd", "model.zero_grad", precision=precision,
                                         torch_clip=0.05)
            # The clip is active every step (norms ~1, max_norm 0.05), so a no-op or a local-only
            # norm would move weights by ~lr * gradient, far beyond these bounds.
            assert all(n > 0.05 for n in ref_norms), ref_norms
            # The first step's norm is computed on identical gradients; later ones on weights the
            # two clips may have rounded differently (bf16/fp16, below).
            norm_diff = (norms[0] - ref_norms[0]).abs().item() / ref_norms[0].item()
            diff = _max_diff(state, ref_state)
            out[(stage, precision)] = (norm_diff, diff, torch.equal(losses, ref_losses) and _same(state, ref_state))
            # Norms: the same fp64 sums of squares grouped differently (stages 1-3, and stage 0
            # under fp16, where .grad is a replicated ShardedGrad that unscales), or torch's own
            # per-parameter norms of plain .grad tensors (stage 0 fp32: a few fp32 ulps; stage 0
            # bf16: torch computes a bf16 gradient's norm in bf16, as it does under torch DDP,
            # so within bf16's relative precision 2^-8).
            norm_bound = 2 ** -8 if (stage, precision) == (0, "bf16") else 1e-6
            assert norm_diff < norm_bound, (stage, precision, norms, ref_norms)
            # Weights: the coefficient may differ by an ulp (stage 0), and under bf16 torch's path
            # scales the bf16 grad shard where the engine scales its fp32 copy: one bf16 rounding
            # of a clipped gradient times lr (0.5 * 0.05 * 2^-8 ~ 1e-4) per step, at most.
            assert diff < (1e-6 if precision == "fp32" else 5e-4), (stage, precision, diff)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_clip_grad_norm_equals_engine_clip_at_every_stage(tmp_path, world_size):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), c) gives engine.clip_grad_norm_(c)'s norm and update at every stage."""
    results = run_ranks(_clip_case, world_size, timeout_s=280, store_dir=str(tmp_path))
    for key, (norm_diff, diff, bitwise) in results[0].items():
        assert norm_diff < 2 ** -8 and diff < 5e-4, key
    # fp32 at the sharded stages: the same norm and the same multiply on the same shard: bitwise.
    assert all(results[0][(s, "fp32")][2] for s in (1, 2, 3)), results[0]


def _grad_semantics_case(rank, world_size):
    for stage in STAGES:
        # In-place changes through param.grad reach the step: halving every gradient equals
        # halving the loss (exact: a power of two), under SGD.
        ref = _loop(rank, world_size, stage, "sgd", "model.zero_grad", loss_mult=0.5)
        half = _loop(rank, world_size, stage, "sgd", "model.zero_grad", grad_scale=0.5)
        assert _same(half[1], ref[1]), (stage, _max_diff(half[1], ref[1]))

        model = odd_model()
        engine = zk.shard(model, torch.optim.SGD, stage=stage, lr=0.5, bucket_numel=40, wrap=(OddBlock,))
        x, y = odd_batch(0, BATCH, rank, world_size)
        engine.backward(engine(x, y))
        engine.finish_backward()
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if stage == 0:
            assert all(type(p.grad) is torch.Tensor for _, p in trainable)
        else:
            assert all(isinstance(p.grad, ShardedGrad) for _, p in trainable)
            with pytest.raises(RuntimeError, match="ShardedGrad"):
                trainable[0][1].grad + 1
            with pytest.raises(RuntimeError, match="ShardedGrad"):
                trainable[0][1].grad.sum()
        # The global norm read through p.grad equals the engine's (every rank calls it).
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        assert abs(total.item() - engine.clip_grad_norm_(1e9).item()) <= 1e-6 * total.item(), stage
        # .grad set to None between backward and step: refused on every rank.
        trainable[0][1].grad = None
        with pytest.raises(RuntimeError, match="set to None between backward and engine.step"):
            engine.step()
    # Stage 1: a second synced backward without clearing is refused (names the fix).
    model = odd_model()
    engine = zk.shard(model, torch.optim.SGD, stage=1, lr=0.5, bucket_numel=40)
    for _ in range(2):
        x, y = odd_batch(0, BATCH, rank, world_size)
        loss = engine(x, y)
        if _ == 0:
            engine.backward(loss)
        else:
            with pytest.raises(RuntimeError, match="model.zero_grad"):
                engine.backward(loss)
    return "ok"


@pytest.mark.parametrize("world_size", [2, 3])
def test_param_grad_means_what_it_means_under_ddp_or_fsdp2(tmp_path, world_size):
    """param.grad: DDP's averaged gradient at stage 0, a ShardedGrad at stages 1-3; in-place changes reach the step; None before step is refused."""
    assert run_ranks(_grad_semantics_case, world_size, timeout_s=280, store_dir=str(tmp_path)) == ["ok"] * world_size


def _partial_clear_loop(rank, world_size, stage):
    """Clear every other parameter's .grad (None) before each forward; the rest accumulate across steps."""
    from common import _build_ddp
    model = odd_model()
    if stage is None:  # torch's DDP: the reference for what a partial clear means
        runner = _build_ddp(model)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    else:
        runner = zk.shard(model, torch.optim.SGD, stage=stage, lr=0.1, bucket_numel=40, wrap=(OddBlock,))
    trainable = [p for p in model.parameters() if p.requires_grad]
    for step in range(STEPS):
        for p in trainable[::2]:
            p.grad = None
        x, y = odd_batch(step, BATCH, rank, world_size)
        runner(x, y).backward()
        (opt.step() if stage is None else runner.step())
    return {k: v.float().clone() for k, v in (model.state_dict() if stage is None
                                             else runner.state_dict(full=True)).items()}


def _partial_clear_case(rank, world_size):
    reference = _partial_clear_loop(rank, world_size, None)
    state = _partial_clear_loop(rank, world_size, 0)
    assert _same(state, reference), (0, _max_diff(state, reference))
    for stage in (2, 3):
        # The uncleared gradients accumulate across steps as a sum of averages (each step's
        # reduce-scatter adds into the grad shard) where DDP averages the sum: a few ulps apart
        # (observed 6e-8). Clearing the wrong parameters, all or none, moves weights by ~lr * grad ~ 1e-2.
        state = _partial_clear_loop(rank, world_size, stage)
        assert _max_diff(state, reference) < 1e-6, (stage, _max_diff(state, reference))
    with pytest.raises(RuntimeError, match="clear all of them"):  # stage 1 cannot add onto an average
        _partial_clear_loop(rank, world_size, 1)
    return "ok"


def test_clearing_some_gradients_accumulates_the_others_like_torch_ddp(tmp_path):
    """p.grad = None on every other parameter each step: stage 0 equals torch DDP bitwise, stages 2 and 3 within 1e-6 (2 ranks); stage 1 refuses."""
    assert run_ranks(_partial_clear_case, 2, timeout_s=200, store_dir=str(tmp_path)) == ["ok", "ok"]
