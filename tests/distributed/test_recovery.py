"""Recovery after an exception in forward or backward, at every stage (core/engine.py [Note: recovery
after an exception]), and a step with no backward after zero_grad.

The user's loop: at step 2 a user hook raises on every rank (a module's full backward hook, or a
forward pre-hook, which at stage 3 runs with the unit gathered and the next one being
prefetched); the loop catches it, calls `engine.zero_grad()` and goes on for 3 more steps.
torch DDP refuses to continue after a backward that raised ("Expected to have finished
reduction in the prior iteration before starting a new one", `test_torch_ddp_refuses_to_go_on`),
so the reference is torch DDP that simply skips step 2's update from the same state: it trains
on the batches of steps 0, 1, 3, 4, 5. Equality is bitwise at world size 2, as in the fp32
parity tests (test_stage0.py, test_zero3.py).

When only one rank raises, the ranks' collectives no longer pair up; under debug=True every rank
raises at its next collective, naming the exception and saying to rebuild the engine.
"""
from __future__ import annotations

import pytest
import torch

import zerokit as zk
from common import (CheckpointedOddModel, OddBlock, OddModel, _build_ddp, odd_batch, odd_model, params_of,
                    train_torch_ddp)
from zerokit.launch import run_ranks

STEPS, FAIL_STEP, BATCH = 6, 2, 3
OPT_KW = dict(lr=1e-2, weight_decay=0.1)
STAGES = (0, 1, 2, 3)




def _arm(model, where: str, raising: dict) -> None:
    """A user hook on blocks.1 that raises RuntimeError("boom ...") while raising["now"] is set."""
    def boom(*_):
        if raising["now"]:
            raise RuntimeError(f"boom in {where}")
    if where == "backward":
        model.blocks[1].register_full_backward_hook(boom)
    else:
        model.blocks[1].register_forward_pre_hook(boom)


def _recovering_loop(rank, world_size, stage, where, plain_backward=False, fail_ranks=None, model_cls=OddModel,
                     **shard_kw):
    """The user's loop; at FAIL_STEP the hook raises (on `fail_ranks`, default every rank), the loop catches
    it, calls engine.zero_grad() and goes on. Returns (losses of the steps taken, state_dict, errors)."""
    torch.manual_seed(0)
    model = model_cls()
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, wrap=(OddBlock,), bucket_numel=40, **OPT_KW,
                      **shard_kw)
    raising = {"now": False}
    _arm(model, where, raising)
    losses, errors = [], []
    for step in range(STEPS):
        x, y = odd_batch(step, BATCH, rank, world_size)
        raising["now"] = step == FAIL_STEP and (fail_ranks is None or rank in fail_ranks)
        try:
            loss = engine(x, y)
            loss.backward() if plain_backward else engine.backward(loss)
        except RuntimeError as exc:
            errors.append(str(exc))
            engine.zero_grad()
            # Clean: no unit left gathered (stage 3; engine.units is empty below it), no backward pending.
            left = [f"unit {u.name!r} {u.state.value}" for u in engine.units if u.state.value != "sharded"]
            errors += left + (["tracker in backward"] if engine.tracker.in_backward else [])
            continue
        engine.step()
        engine.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack(losses), {k: v.float() for k, v in engine.state_dict(full=True).items()}, errors


def _differences(got, ref) -> list[str]:
    out = [] if torch.equal(got[0], ref[0]) else [f"losses {got[0].tolist()} != {ref[0].tolist()}"]
    for k in ref[1]:
        if not torch.equal(got[1][k], ref[1][k]):
            out.append(f"{k}: max |diff| {(got[1][k] - ref[1][k]).abs().max().item():.3g}")
    return out


def _recovery_cases(rank, world_size):
    # torch DDP on the batches of every step but the one that raised: that step skipped from the same state
    ref = train_torch_ddp(rank, world_size, torch.optim.AdamW, OPT_KW, [s for s in range(STEPS) if s != FAIL_STEP],
                          BATCH)
    out = {}
    runs = [(stage, where, plain, {}) for stage in STAGES for where in ("backward", "forward")
            for plain in ((False, True) if where == "backward" else (False,))]
    runs += [(3, "backward", False, dict(reshard_after_forward=False)), (3, "forward", False, dict(prefetch=2)),
             (3, "backward", False, dict(model_cls=CheckpointedOddModel)),
             (0, "backward", False, dict(model_cls=CheckpointedOddModel))]
    for stage, where, plain, kw in runs:
        losses, state, errors = _recovering_loop(rank, world_size, stage, where, plain, **kw)
        key = (stage, where, "loss.backward()" if plain else "engine.backward", tuple(sorted(kw)))
        out[key] = dict(errors=errors, differences=_differences((losses, state), ref))
    return out


@pytest.fixture(scope="module")
def recovery(tmp_path_factory):
    return run_ranks(_recovery_cases, 2, timeout_s=280, collective_timeout_s=60,
                     store_dir=str(tmp_path_factory.mktemp("rdzv")))


def test_training_goes_on_after_an_exception_like_ddp_skipping_that_step(recovery):
    """Every stage, an exception in backward (engine.backward or loss.backward()) or in forward at step 2 on
    every rank, caught, engine.zero_grad(), 3 more steps: bitwise equal to torch DDP skipping step 2."""
    for rank, res in enumerate(recovery):
        for key, r in res.items():
            assert len(r["errors"]) == 1 and "boom" in r["errors"][0], (rank, key, r["errors"])
            assert r["differences"] == [], (rank, key, r["differences"])


def _ddp_refuses(rank, world_size):
    model = odd_model()
    ddp = _build_ddp(model)
    raising = {"now": True}
    _arm(model, "backward", raising)
    try:
        ddp(*odd_batch(0, BATCH, rank, world_size)).backward()
    except RuntimeError:
        pass
    raising["now"] = False
    try:
        ddp(*odd_batch(1, BATCH, rank, world_size)).backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_torch_ddp_refuses_to_go_on(tmp_path):
    """Why the reference skips the step rather than running DDP through the exception."""
    for message in run_ranks(_ddp_refuses, 2, timeout_s=120, store_dir=str(tmp_path)):
        assert message is not None and "Expected to have finished reduction in the prior iteration" in message


def test_fired_twice_message_names_both_causes():
    """Without engine.zero_grad() after the exception the next backward is refused, naming both possible causes."""
    model = odd_model()
    engine = zk.shard(model, torch.optim.AdamW, stage=0, **OPT_KW)
    raising = {"now": True}
    _arm(model, "backward", raising)
    x, y = odd_batch(0, BATCH)
    with pytest.raises(RuntimeError, match="boom"):
        engine.backward(engine(x, y))
    raising["now"] = False
    model.zero_grad()  # a torch idiom, not engine.zero_grad()
    with pytest.raises(RuntimeError, match="fired twice") as info:
        engine.backward(engine(x, y))
    assert "use_reentrant=False" in str(info.value) and "engine.zero_grad()" in str(info.value)
    engine.zero_grad()  # and then it goes on
    engine.backward(engine(x, y))
    assert engine.step()


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_on_the_gradients_of_a_backward_that_raised_is_refused(stage):
    """Without engine.zero_grad() after engine.backward raised, clip_grad_norm_ and step() refuse the partial
    gradients, naming the exception and zero_grad; after zero_grad the step goes on."""
    model = odd_model()
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, wrap=(OddBlock,), **OPT_KW)
    raising = {"now": True}
    _arm(model, "backward", raising)
    x, y = odd_batch(0, BATCH)
    with pytest.raises(RuntimeError, match="boom"):
        engine.backward(engine(x, y))
    for call in (lambda: engine.clip_grad_norm_(1.0), engine.step):
        with pytest.raises(RuntimeError, match=r"the last engine.backward raised \(RuntimeError: boom in backward\)"
                                               r".*call engine.zero_grad\(\) on every rank"):
            call()
    raising["now"] = False
    engine.zero_grad()
    engine.backward(engine(x, y))
    assert engine.step()


def test_zero_grad_between_forward_and_backward_keeps_what_backward_needs():
    """optimizer.zero_grad() placed between forward and backward (a torch habit): stage 3's units kept for
    backward stay gathered; training equals the usual loop's bitwise."""
    results = []
    for late in (False, True):
        engine = zk.shard(odd_model(), torch.optim.AdamW, stage=3, wrap=(OddBlock,), **OPT_KW)
        for step in range(3):
            x, y = odd_batch(step, BATCH)
            if not late:
                engine.zero_grad()
            loss = engine(x, y)
            if late:
                engine.zero_grad()
            engine.backward(loss)
            engine.step()
        results.append(engine.state_dict(full=True))
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def _one_rank_raises(rank, world_size):
    """Only rank 1's hook raises; debug=True. Each rank returns the first error other than the hook's own."""
    out = {}
    for stage, where in ((0, "backward"), (2, "backward"), (3, "backward"), (3, "forward")):
        torch.manual_seed(0)
        model = OddModel()
        engine = zk.shard(model, torch.optim.AdamW, stage=stage, wrap=(OddBlock,), bucket_numel=40, debug=True,
                          **OPT_KW)
        raising = {"now": False}
        _arm(model, where, raising)
        out[(stage, where)] = None
        for step in range(STEPS):
            raising["now"] = step == FAIL_STEP and rank == 1
            try:
                try:
                    engine.backward(engine(*odd_batch(step, BATCH, rank, world_size)))
                except RuntimeError as exc:
                    if not str(exc).startswith("boom"):
                        raise
                    engine.zero_grad()  # the user's recovery, on rank 1 only
                    continue
                engine.step()
                engine.zero_grad()
            except RuntimeError as exc:
                out[(stage, where)] = str(exc)
                break
    return out


def test_an_exception_on_one_rank_only_raises_on_every_rank_under_debug(tmp_path):
    """[Note: recovery after an exception]: the other rank went on issuing collectives; under debug=True both
    ranks raise at once, the message naming the original exception and saying to rebuild the engine."""
    results = run_ranks(_one_rank_raises, 2, timeout_s=200, collective_timeout_s=60, store_dir=str(tmp_path))
    for rank, res in enumerate(results):
        for key, message in res.items():
            assert message is not None, (rank, key)
            assert "boom in" in message and "rebuild the engine" in message, (rank, key, message)


# ----------------------------------------------------------------- a step with no backward after zero_grad
def _no_backward_step(rank, world_size, stage):
    """A real step, zero_grad(), step() with no backward, then a real step (every stage steps on zeros)."""
    engine = zk.shard(odd_model(), torch.optim.AdamW, stage=stage, wrap=(OddBlock,), bucket_numel=40, **OPT_KW)
    for step in range(3):
        engine.zero_grad()
        if step != 1:
            engine.backward(engine(*odd_batch(step, BATCH, rank, world_size)))
        engine.step()
    return {k: v.float() for k, v in engine.state_dict(full=True).items()}


def _ddp_no_backward_step(rank, world_size):
    """torch DDP doing the same, zeroing gradients in place so that the step without backward steps on zeros."""
    model = odd_model()
    ddp = _build_ddp(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT_KW)
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        if step != 1:
            ddp(*odd_batch(step, BATCH, rank, world_size)).backward()
        opt.step()
    return params_of(model)


def _no_backward_cases(rank, world_size):
    ref = _ddp_no_backward_step(rank, world_size)
    return {stage: [k for k in ref if not torch.equal(_no_backward_step(rank, world_size, stage)[k], ref[k])]
            for stage in STAGES}


def test_a_step_without_backward_after_zero_grad_steps_on_zeros_like_ddp(tmp_path):
    """zero_grad(); step() after a real step updates from zero gradients at every stage, bitwise as torch DDP
    with optimizer.zero_grad(set_to_none=False) (stage 3 frees its grad shards: they must come back as zeros)."""
    for res in run_ranks(_no_backward_cases, 2, timeout_s=200, store_dir=str(tmp_path)):
        assert res == {stage: [] for stage in STAGES}, res
