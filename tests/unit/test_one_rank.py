"""One rank: stages 2-3 copy nothing a single process does not need, and keep stage 0's bits.

At world size 1 a shard is the whole flat param. Stage 3 keeps each unit's flat buffer as its param
shard (core/params/unit.py [Note: one rank]), and stages 2-3 make the full gradient the grad shard
(core/grads/grad_reduce.py [Note: one rank's grad shard]). What that could break, each checked
against stage 0 bit for bit: a shard freed with its buffer, a second synced backward or a no_sync
micro-step overwriting a grad shard instead of adding to it, summon_full_params's write-back
comparing the shards with themselves (under bf16 a change would silently never reach the fp32
master), and a parameter outside forward that stops refusing reads at one rank only.
"""
import pytest
import torch

import zerokit as zk
from zerokit.core.params.sharded_tensors import ShardedGrad
from common import OddBlock, odd_batch, odd_model

ADAMW = dict(lr=3e-2, weight_decay=0.1)
STEPS, BATCH = 3, 3


def _engine(stage: int, precision: str):
    model = odd_model()
    return model, zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, wrap=(OddBlock,), **ADAMW)


def _train(stage: int, precision: str, how: str) -> dict:
    """STEPS steps of the odd model; `how` says what each step does between zero_grad and step."""
    model, engine = _engine(stage, precision)
    losses, grads = [], []
    for step in range(STEPS):
        engine.zero_grad()
        x, y = odd_batch(step, BATCH)
        if how == "no_sync":  # a micro-step inside no_sync, then a synced one
            with engine.no_sync():
                engine.backward(engine(x, y))
            x, y = odd_batch(step + 100, BATCH)
        loss = engine(x, y)
        engine.backward(loss)
        if how == "twice":  # a second synced backward adds onto the grad shard
            engine.backward(engine(*odd_batch(step + 200, BATCH)))
        if how == "clip":
            engine.clip_grad_norm_(0.05)
        grads.append({n: _values(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        engine.step()
        losses.append(loss.detach().float())
    return dict(losses=torch.stack(losses), grads=grads, params=engine.state_dict(full=True))


def _values(grad: torch.Tensor) -> torch.Tensor:
    """A `.grad`'s values as fp32: a ShardedGrad's local elements are all of them at one rank."""
    local = grad.local if isinstance(grad, ShardedGrad) else grad
    return local.detach().float().reshape(-1).clone()


def _assert_bitwise(got: dict, ref: dict, what: str) -> None:
    assert torch.equal(got["losses"], ref["losses"]), what
    for step, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
        assert g.keys() == r.keys(), (what, step)
        for name in r:
            assert torch.equal(g[name], r[name]), (what, step, name)
    for name in ref["params"]:
        assert torch.equal(got["params"][name], ref["params"][name]), (what, name)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("how", ["plain", "clip", "no_sync", "twice"])
def test_one_rank_stages_keep_stage0s_bits(precision, how):
    ref = _train(0, precision, how)
    for stage in (1, 2, 3):
        if how == "twice" and stage == 1:
            continue  # stage 1 refuses a second synced backward (its grad shard lives in the full gradient)
        _assert_bitwise(_train(stage, precision, how), ref, f"stage {stage}")


def test_stage3_at_one_rank_computes_on_its_shards_and_holds_no_working_set():
    model, engine = _engine(3, "fp32")
    seen = []

    def check(module, args, output):  # inside the unit's forward: its params are views of its shards
        shard_ptrs = {s.untyped_storage().data_ptr() for s in engine.param_shards}
        seen.append(all(p.untyped_storage().data_ptr() in shard_ptrs for p in module.parameters()))
        seen.append(engine.unsharded_param_bytes() == 0 and "unsharded_params" not in engine.memory())

    for block in model.blocks:
        block.register_forward_hook(check)
    for step in range(2):
        engine.zero_grad()
        engine.backward(engine(*odd_batch(step, BATCH)))
        engine.step()
    assert seen and all(seen), seen
    with pytest.raises(RuntimeError, match="summon_full_params"):  # outside forward it refuses reads, as at N > 1
        model.blocks[0].fc1.weight.sum()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_summon_write_reaches_the_master_at_one_rank(precision):
    """Written inside summon_full_params, 0.25 (exact in bf16) must be what the next step starts from."""
    out = {}
    for stage in (0, 3):
        model, engine = _engine(stage, precision)
        with engine.summon_full_params():
            with torch.no_grad():
                model.blocks[1].fc2.bias.fill_(0.25)
        written = engine.state_dict(full=True)["blocks.1.fc2.bias"]
        assert torch.equal(written, torch.full_like(written, 0.25)), stage
        for step in range(2):
            engine.zero_grad()
            engine.backward(engine(*odd_batch(step, BATCH)))
            engine.step()
        out[stage] = engine.state_dict(full=True)
    for name in out[0]:
        assert torch.equal(out[3][name], out[0][name]), name
