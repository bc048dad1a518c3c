"""Stage 3 (FSDP): parity with stage 0 and torch DDP, working set, activation checkpointing, ledgers.

World size 1 runs in this process (no process group: every collective is a local copy,
but gathering, freeing, hooks and prefetch run exactly as at N ranks); world sizes 2-4 run
one spawn each, every case inside it, every rank returning what it saw.
"""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import zerokit as zk
from common import CheckpointedOddModel, OddBlock, OddModel, odd_batch, train_torch_ddp, train_zerokit
from zerokit.commands.step import train_step
from zerokit.launch import run_ranks
from zerokit.core.params.unit import UnitState
from zerokit.models import Block, build_model, preset

STEPS, BATCH = 3, 3
ADAMW = (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))
SGD = (torch.optim.SGD, dict(lr=0.1))  # the update is lr x gradient: see DDP_ATOL
# torch DDP reduces with gloo's ring: at world size >= 3 an element's N contributions are
# added in an order that depends on its position, zerokit adds them in rank order, so an
# averaged gradient may differ in its last bit (~6e-8 relative). After 3 steps on O(1)
# weights that is at most a few 1e-7 in the parameters (observed <= 6e-8); 1e-5 is far above
# that. AdamW normalises each update by the gradient's own RMS and is nearly blind to a
# gradient-scale bug: an injected 1/(N+1) averaging bug moves AdamW's weights by only 3.6e-7
# (N = 3) and 5.1e-6 (N = 4) in 3 steps, inside DDP_ATOL, while plain SGD at lr 0.1 moves them
# by 0.19 and 0.14. The torch DDP comparison therefore runs both optimizers.
DDP_ATOL = 1e-5
# (prefetch, reshard_after_forward, activation checkpointing): the full grid runs at world
# sizes 1 and 3 (3 is where a ring's summation order would first break bitwise equality);
# 2 and 4 run a cover in which every value of every option appears, to keep the file fast.
GRID = [(k, r, c) for k in (0, 1, 2) for r in (True, False) for c in (False, True)]
GRID_COVER = [(0, True, False), (1, False, True), (2, True, True), (2, False, False)]




class TwiceOddModel(OddModel):
    """OddModel that calls its first block twice per forward (blocks 0, 1, 0)."""

    def forward(self, idx, targets):
        h = self.emb(idx)
        for block in (self.blocks[0], self.blocks[1], self.blocks[0]):
            h = block(h)
        logits = self.head(self.norm(h) * self.gain)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _model(cls=OddModel, seed: int = 0, **kw) -> OddModel:
    torch.manual_seed(seed)
    return cls(**kw)


def _train(rank, world_size, stage, model_cls=OddModel, steps=STEPS, optimizer=ADAMW, **kw):
    """zerokit's loop (train_step) on the odd model (or a variant); returns (losses, full state_dict, engine)."""
    cls, opt_kw = optimizer
    kw.setdefault("wrap", (OddBlock,))
    engine = zk.shard(_model(model_cls), cls, stage=stage, **kw, **opt_kw)
    losses = []
    for step in range(steps):
        batch = odd_batch(step, BATCH, rank, world_size)
        losses.append(train_step(engine, [batch], lambda b: engine(*b)).loss.float())
    return torch.stack(losses), engine.state_dict(full=True), engine


def _differences(a, b) -> list[str]:
    """Where two (losses, state_dict) results are not bitwise equal (empty list: equal)."""
    out = []
    if not torch.equal(a[0], b[0]):
        out.append(f"losses {a[0].tolist()} != {b[0].tolist()}")
    if a[1].keys() != b[1].keys():
        out.append(f"keys {sorted(a[1])} != {sorted(b[1])}")
    for k in a[1]:
        if a[1][k].dtype != b[1][k].dtype or not torch.equal(a[1][k], b[1][k]):
            out.append(f"{k}: max |diff| {(a[1][k].float() - b[1][k].float()).abs().max().item():.3g}")
    return out


def _one_step_ledgers(rank, world_size, stage, **kw):
    """Comm bytes by phase, the collective trace and memory for one measured step."""
    cls, opt_kw = ADAMW
    kw.setdefault("wrap", (OddBlock,))
    model = _model()
    engine = zk.shard(model, cls, stage=stage, **kw, **opt_kw)
    x, y = odd_batch(0, BATCH, rank, world_size)
    engine.backward(engine(x, y))
    engine.step()  # warm-up: the optimizer states now exist
    engine.comm.reset_stats()
    with engine.comm.recorder.recording() as trace:
        engine.zero_grad()
        engine.backward(engine(x, y))
        engine.step()
    return dict(by_phase=engine.comm.stats_by_phase(), stats=engine.comm_stats(), trace=list(trace),
                memory=engine.memory(), engine=engine)


def _layout(engine) -> dict:
    """Padded element counts of the stage 3 engine's flat params, by role."""
    root = [fp for fp in engine.units[0].flat_params]
    return dict(
        all=sum(fp.padded_numel for fp in engine.flat_params),
        root=sum(fp.padded_numel for fp in root),
        trainable=sum(fp.padded_numel for fp in engine.flat_params if fp.requires_grad),
        frozen=sum(fp.padded_numel for fp in engine.flat_params if not fp.requires_grad),
        psi=sum(fp.numel for fp in engine.flat_params),
        psi_trainable=sum(fp.numel for fp in engine.flat_params if fp.requires_grad),
        num_flat=len(engine.flat_params),
    )


def _zero3_cases(rank, world_size):
    out = {}
    ref = _train(rank, world_size, 0, bucket_numel=40)[:2]  # several small buckets: another layout
    out["grid"] = {case: _differences(_train(rank, world_size, 3, prefetch=case[0], reshard_after_forward=case[1],
                                             model_cls=CheckpointedOddModel if case[2] else OddModel)[:2], ref)
                   for case in (GRID if world_size == 3 else GRID_COVER)}
    for name, optimizer in (("adamw", ADAMW), ("sgd", SGD)):
        out[("torch_ddp", name)] = train_torch_ddp(rank, world_size, *optimizer, STEPS, BATCH)
        out[("zero3", name)] = _train(rank, world_size, 3, prefetch=1, optimizer=optimizer)[:2]
    out["mixed"] = {}
    for precision in ("bf16", "fp16"):
        ref_mp = _train(rank, world_size, 0, precision=precision, bucket_numel=40)[:2]
        out["mixed"][precision] = {
            case: _differences(_train(rank, world_size, 3, precision=precision, prefetch=case[0],
                                      reshard_after_forward=case[1],
                                      model_cls=CheckpointedOddModel if case[2] else OddModel)[:2], ref_mp)
            for case in [(1, True, False), (2, False, True)]}
    cls, opt_kw = ADAMW
    out["no_sync"] = _differences(
        train_zerokit(rank, world_size, 3, cls, opt_kw, STEPS, BATCH, accumulate=2, prefetch=1)[:2],
        train_zerokit(rank, world_size, 0, cls, opt_kw, STEPS, BATCH, accumulate=2, bucket_numel=40)[:2])
    twice_ref = _train(rank, world_size, 0, model_cls=TwiceOddModel)[:2]
    out["twice"] = _differences(_train(rank, world_size, 3, model_cls=TwiceOddModel, prefetch=1)[:2], twice_ref)
    # ledgers
    ledgers = {}
    for name, kw in {"reshard": dict(prefetch=1), "keep": dict(prefetch=1, reshard_after_forward=False)}.items():
        led = _one_step_ledgers(rank, world_size, 3, **kw)
        led["layout"] = _layout(led.pop("engine"))
        ledgers[name] = led
    ddp = _one_step_ledgers(rank, world_size, 0)
    ddp["trainable"] = sum(fp.padded_numel for fp in ddp.pop("engine").flat_params if fp.requires_grad)
    ledgers["stage0"] = ddp
    for precision in ("bf16", "fp32"):
        led = _one_step_ledgers(rank, world_size, 3, precision=precision)
        ledgers[f"memory_{precision}"] = dict(memory=led["memory"], layout=_layout(led.pop("engine")))
    out["ledgers"] = ledgers
    return out


@pytest.fixture(scope="module", params=[2, 3, 4])
def zero3_results(request, tmp_path_factory):
    world_size = request.param
    return world_size, run_ranks(_zero3_cases, world_size, timeout_s=300,
                                 store_dir=str(tmp_path_factory.mktemp("rdzv")))


# ---------------------------------------------------------------------- parity


def test_stage3_equals_stage0_bitwise_at_world_size_1():
    """World size 1: stage 3 equals stage 0 bit for bit for every prefetch / reshard / checkpointing case."""
    ref = _train(0, 1, 0, bucket_numel=40)[:2]
    for k, r, c in GRID:
        got = _train(0, 1, 3, prefetch=k, reshard_after_forward=r,
                     model_cls=CheckpointedOddModel if c else OddModel)[:2]
        assert _differences(got, ref) == [], (k, r, c)


def test_stage3_equals_stage0_bitwise_for_every_prefetch_reshard_and_checkpointing(zero3_results):
    """World sizes 2-4: every rank's stage 3 run equals stage 0 bit for bit (losses and full params), all cases."""
    world_size, results = zero3_results
    for rank, res in enumerate(results):
        for case, diffs in res["grid"].items():
            assert diffs == [], (world_size, rank, case, diffs)


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_stage3_trains_like_torch_ddp(zero3_results, opt):
    """Stage 3 equals torch DDP under AdamW and plain SGD: bitwise at world size 2, within DDP_ATOL at 3 and 4."""
    world_size, results = zero3_results
    for rank, res in enumerate(results):
        ref_losses, ref_params = res[("torch_ddp", opt)]
        losses, params = res[("zero3", opt)]
        atol = 0.0 if world_size <= 2 else DDP_ATOL
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=atol)
        for k in ref_params:
            torch.testing.assert_close(params[k], ref_params[k], rtol=0, atol=atol, msg=f"rank {rank} {k}")


def test_stage3_equals_stage0_bitwise_under_bf16_and_fp16(zero3_results):
    """Under bf16 and fp16 (loss scaler) stage 3 equals stage 0 with the same precision, bit for bit."""
    world_size, results = zero3_results
    for rank, res in enumerate(results):
        for precision, cases in res["mixed"].items():
            for case, diffs in cases.items():
                assert diffs == [], (world_size, rank, precision, case, diffs)


def test_a_unit_called_twice_in_one_forward_trains_like_stage0(zero3_results):
    """A block called twice per forward (gathered until its last call) trains exactly like stage 0."""
    world_size, results = zero3_results
    for rank, res in enumerate(results):
        assert res["twice"] == [], (world_size, rank, res["twice"])


def test_gradient_accumulation_with_no_sync_trains_like_stage0(zero3_results):
    """Two micro-batches, the first under no_sync (unsharded gradients kept): equal to stage 0 bit for bit."""
    world_size, results = zero3_results
    for rank, res in enumerate(results):
        assert res["no_sync"] == [], (world_size, rank, res["no_sync"])


# ---------------------------------------------------------------------- ledgers


def test_collective_sequence_is_identical_on_every_rank(zero3_results):
    """Every rank issues the same collectives (kind, size, phase) in the same order."""
    world_size, results = zero3_results
    for name in ("reshard", "keep", "stage0"):
        traces = [res["ledgers"][name]["trace"] for res in results]
        assert traces[0], name
        for rank, trace in enumerate(traces[1:], start=1):
            assert trace == traces[0], (name, rank)


def test_comm_per_step_is_two_gathers_and_a_reduce_scatter(zero3_results):
    """Per step: all-gather fwd Ψp + bwd (Ψ - root)p + reduce-scatter Ψg, ~1.5x DDP; kept units skip the bwd gather."""
    world_size, results = zero3_results
    e = 4  # fp32 bytes per element
    for rank, res in enumerate(results):
        led = res["ledgers"]
        lay = led["reshard"]["layout"]
        phases = led["reshard"]["by_phase"]
        assert phases["forward"] == {"all_gather": lay["all"] * e}, phases
        assert phases["backward"] == {"all_gather": (lay["all"] - lay["root"]) * e,
                                      "reduce_scatter": lay["trainable"] * e}, phases
        keep = led["keep"]["by_phase"]
        assert keep["forward"] == {"all_gather": lay["all"] * e}, keep
        assert keep["backward"] == {"reduce_scatter": lay["trainable"] * e}, keep
        # against zerokit's DDP on the same model: 1.5x up to what the root and the frozen
        # weights change (the root is gathered once; frozen weights are gathered, not reduced)
        ddp_total = sum(led["stage0"]["stats"].values())
        assert ddp_total == 2 * led["stage0"]["trainable"] * e
        total = sum(led["reshard"]["stats"].values())
        # Unpadded prediction; padding (< N elements per flat buffer, a few per cent on this
        # tiny model) is what the tolerance allows for.
        frozen = lay["psi"] - lay["psi_trainable"]
        predicted = 1.5 + (2 * frozen - lay["root"]) / (2 * lay["psi_trainable"])
        assert total / ddp_total == pytest.approx(predicted, abs=0.05), (rank, total, ddp_total, predicted)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_persistent_memory_is_16_psi_over_n(zero3_results, precision):
    """params + grads + master + optimizer states = 16Ψ/N bytes per rank up to padding (frozen weights: params only)."""
    world_size, results = zero3_results
    for rank, res in enumerate(results):
        led = res["ledgers"][f"memory_{precision}"]
        mem, lay = led["memory"], led["layout"]
        n = world_size
        e = 2 if precision == "bf16" else 4
        trainable_shard, frozen_shard = lay["trainable"] // n, lay["frozen"] // n
        assert mem["params"] == (trainable_shard + frozen_shard) * e, mem
        assert mem["grads"] == trainable_shard * e, mem
        assert mem["master_params"] == (trainable_shard * 4 if precision == "bf16" else 0), mem
        assert mem["optimizer_states"] == trainable_shard * 8, mem
        assert "unsharded_params" not in mem and "unsharded_grads" not in mem, mem
        model_states = mem["params"] + mem["grads"] + mem["master_params"] + mem["optimizer_states"]
        # 16 bytes per trainable element, e per frozen one; padding adds < N elements to a flat
        # param, so < 1 element (<= 16 bytes) to each rank's shard of it
        exact = 16 * lay["psi_trainable"] / n + e * (lay["psi"] - lay["psi_trainable"]) / n
        assert 0 <= model_states - exact < 16 * lay["num_flat"], (model_states, exact)


# ---------------------------------------------------------------------- working set


def _peak_unsharded(model_cls, num_blocks, prefetch, reshard, steps=2):
    """Largest parameter bytes of the units gathered or gathering during forward and during backward (measured at
    every module call, every saved-tensor use and every gradient accumulation), and the unit sizes.

    One process, so one rank: each unit's flat buffer is its shard (core/params/unit.py [Note: one rank]) and
    allocates nothing; its state says what it would hold at N > 1, where gathering allocates."""
    model = _model(model_cls, num_blocks=num_blocks)
    engine = zk.shard(model, torch.optim.AdamW, stage=3, wrap=(OddBlock,), prefetch=prefetch,
                      reshard_after_forward=reshard, lr=1e-2)
    params = list(model.parameters())
    peak = collections.Counter()

    def sample(*_):
        alive = sum(flat.numel() * flat.element_size() for unit in engine.units
                    if unit.state is not UnitState.SHARDED for flat in unit.flat_data)
        phase = "backward" if engine.tracker.in_backward else "forward"
        peak[phase] = max(peak[phase], alive)

    for m in model.modules():
        m.register_forward_pre_hook(sample)
        m.register_forward_hook(sample)
    for p in params:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(sample)

    def unpack(t):
        sample()
        return t

    for step in range(steps):
        x, y = odd_batch(step, BATCH)
        engine.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            engine.backward(engine(x, y))
        engine.step()
    unit_bytes = {sum(engine.flat_data[fp.index].numel() * 4 for fp in u.flat_params) for u in engine.units[1:]}
    root_bytes = sum(engine.flat_data[fp.index].numel() * 4 for fp in engine.units[0].flat_params)
    assert len(unit_bytes) == 1, unit_bytes  # every OddBlock unit has the same size
    assert engine.unsharded_param_bytes() == 0
    return peak, root_bytes, unit_bytes.pop()


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("model_cls", [OddModel, CheckpointedOddModel])
def test_working_set_is_root_plus_one_plus_prefetch_units(prefetch, model_cls):
    """reshard_after_forward=True: at most root + (1 + prefetch) units are unsharded at once, and prefetch reaches it."""
    blocks = 5
    peak, root, unit = _peak_unsharded(model_cls, blocks, prefetch, reshard=True)
    bound = root + min(1 + prefetch, blocks) * unit
    # The bound is reached in both passes: prefetch really runs ahead, in reverse order in backward.
    assert peak["forward"] == bound, (peak, root, unit)
    assert peak["backward"] == bound, (peak, root, unit)


def test_keeping_units_after_forward_holds_every_unit():
    """reshard_after_forward=False: every unit stays gathered from its forward until its backward (ZeRO-2-like)."""
    blocks = 4
    peak, root, unit = _peak_unsharded(OddModel, blocks, 1, reshard=False)
    assert peak["forward"] == root + blocks * unit
    assert peak["backward"] == root + blocks * unit


def test_activation_checkpointing_lowers_saved_activation_bytes():
    """GPT (8 layers) under stage 3: checkpointing keeps < 1/3 of the activation bytes autograd keeps without it."""
    cfg = preset("tiny")
    saved = {}
    for checkpointing in (False, True):
        model = build_model(dataclasses.replace(cfg, n_layer=8), seed=0)
        model.checkpointing = checkpointing
        engine = zk.shard(model, torch.optim.AdamW, stage=3, wrap=(Block,), prefetch=1, lr=1e-3)
        storages: dict[int, int] = {}
        boundary: dict[int, int] = {}

        def pack(t):
            # Parameters are saved too (as views of unsharded buffers): not activations.
            ptr = t.untyped_storage().data_ptr()
            if ptr not in {u.untyped_storage().data_ptr() for u in engine.flat_data}:
                storages[ptr] = t.untyped_storage().nbytes()
            return t

        def count_block_input(module, args):
            # A checkpointed block's input is kept by checkpoint itself, outside autograd's saved tensors.
            if checkpointing and not engine.tracker.in_backward:
                boundary[args[0].untyped_storage().data_ptr()] = args[0].untyped_storage().nbytes()

        for block in model.blocks:
            block.register_forward_pre_hook(count_block_input)
        x, y = torch.randint(0, cfg.vocab_size, (2, 2, cfg.block_size)).unbind(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = engine(x, y)
        saved[checkpointing] = sum({**storages, **boundary}.values())
        engine.backward(loss)  # recomputation works: gradients arrive
        engine.step()
        assert engine.memory()["grads"] > 0
    assert saved[True] < saved[False] / 3, saved


# ---------------------------------------------------------------------- API


def test_summon_full_params_gives_writable_full_params():
    """summon_full_params shows the full weights; a write inside is kept in the shards and in state_dict."""
    model = _model()
    engine = zk.shard(model, torch.optim.AdamW, stage=3, wrap=(OddBlock,), precision="bf16", lr=1e-2)
    before = engine.state_dict()
    with engine.summon_full_params():
        assert torch.equal(model.blocks[1].fc2.weight.float(), before["blocks.1.fc2.weight"].bfloat16().float())
        with torch.no_grad():
            model.blocks[1].fc2.bias.fill_(0.25)
    after = engine.state_dict()
    assert torch.equal(after["blocks.1.fc2.bias"], torch.full((7,), 0.25))
    # untouched weights keep their fp32 master values, not their bf16 roundings
    assert torch.equal(after["blocks.1.fc2.weight"], before["blocks.1.fc2.weight"])
    assert engine.unsharded_param_bytes() == 0
    x, y = odd_batch(0, BATCH)
    engine.backward(engine(x, y))
    assert engine.step()


def test_tie_across_two_units_is_rejected_with_both_names():
    """A parameter shared by two units raises ValueError naming both parameters."""
    model = _model()
    model.blocks[1].fc1.weight = model.blocks[0].fc1.weight
    with pytest.raises(ValueError, match=r"blocks\.0\.fc1\.weight.*blocks\.1\.fc1\.weight"):
        zk.shard(model, torch.optim.AdamW, stage=3, wrap=(OddBlock,))


def test_wrap_accepts_a_callable_and_rejects_other_types():
    """wrap may be a callable(module) -> bool; anything else but module classes is a TypeError."""
    engine = zk.shard(_model(), torch.optim.AdamW, stage=3, wrap=lambda m: type(m).__name__ == "OddBlock")
    assert [u.name for u in engine.units] == ["", "blocks.0", "blocks.1"]
    with pytest.raises(TypeError, match="wrap"):
        zk.shard(_model(), torch.optim.AdamW, stage=3, wrap="OddBlock")


def test_evaluation_forward_frees_everything():
    """A forward under no_grad leaves no unsharded parameters behind."""
    engine = zk.shard(_model(), torch.optim.AdamW, stage=3, wrap=(OddBlock,), prefetch=2)
    with torch.no_grad():
        engine(*odd_batch(0, BATCH))
    assert engine.unsharded_param_bytes() == 0
    assert "unsharded_params" not in engine.memory()


# ---------------------------------------------------------------------- grad shards: zero_grad frees them


class SometimesOddModel(OddModel):
    """OddModel whose last block is skipped while `skip` is set: a unit no backward reaches that step."""

    skip = False

    def forward(self, idx, targets):
        h = self.emb(idx)
        for block in self.blocks[:-1] if self.skip else self.blocks:
            h = block(h)
        logits = self.head(self.norm(h) * self.gain)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_zero_grad_frees_the_grad_shards_until_backward_reduces_into_them():
    """[Note: grad shards] in zerokit/core/grads/grad_reduce.py: zero_grad frees every grad shard and `.grad` is None,
    as after torch FSDP's zero_grad; each comes back with its unit's reduce-scatter."""
    cls, opt_kw = ADAMW
    engine = zk.shard(_model(), cls, stage=3, wrap=(OddBlock,), **opt_kw)
    x, y = odd_batch(0, BATCH)
    engine.backward(engine(x, y))
    engine.step()
    held = engine.memory()["grads"]
    assert held == 4 * sum(fp.shard_numel for fp in engine.trainable)
    assert all(p.grad is not None for p in engine.module.parameters() if p.requires_grad)
    engine.zero_grad()
    assert engine.memory().get("grads", 0) == 0
    assert all(p.grad is None for p in engine.module.parameters())
    engine.backward(engine(x, y))
    assert engine.memory()["grads"] == held
    assert all(p.grad is not None for p in engine.module.parameters() if p.requires_grad)


def test_a_unit_no_backward_reached_steps_like_stage0():
    """A unit skipped by a step's forward has no grad shard after zero_grad; the step updates it from zeros
    (AdamW: decayed weights, moments decaying), exactly as stage 0's zeroed flat gradient does."""
    cls, opt_kw = ADAMW
    results = []
    for stage in (0, 3):
        model = _model(SometimesOddModel, num_blocks=3)
        engine = zk.shard(model, cls, stage=stage, wrap=(OddBlock,), bucket_numel=40, **opt_kw)
        losses = []
        for step in range(4):
            model.skip = step % 2 == 1
            losses.append(train_step(engine, [odd_batch(step, BATCH)], lambda b: engine(*b)).loss.float())
        results.append((torch.stack(losses), engine.state_dict(full=True)))
    assert _differences(results[1], results[0]) == []


def test_a_units_gradients_are_autograds_own_until_its_backward_is_over():
    """[Note: gradients packed when complete] and [Note: reduce once the unit's backward is over] in
    zerokit/stages/zero3.py: no full-size gradient exists while a block's backward runs; until it is
    over each `.grad` is autograd's own tensor (its own storage, not a view of a unit-sized buffer).
    A block's gradients are reduce-scattered only after its parameters are freed, and on CPU each
    reduction is finished before the next block's backward goes on. After backward `.grad` shows the
    grad shard as before."""
    from zerokit.core.params.unit import UnitState

    cls, opt_kw = ADAMW
    engine = zk.shard(_model(), cls, stage=3, wrap=(OddBlock,), **opt_kw)
    seen = []  # (own storage?, full-size gradients in existence, root param?) as each gradient is accumulated
    reduced = []  # (unit index, its state) as each flat param's reduce-scatter is launched
    root_params = {id(p) for fp in engine.units[0].flat_params for p in fp.params}

    def look(p):
        own = p.grad.untyped_storage().nbytes() == p.numel() * p.element_size()
        seen.append((own, sum(g is not None for g in engine.flat_grads), id(p) in root_params))

    launch = engine.reduce_scatter_grad

    def watch(state):
        unit = engine.unit_of[state.fp.index]
        reduced.append((unit.index, unit.state))
        return launch(state)

    engine.reduce_scatter_grad = watch
    params = [p for p in engine.module.parameters() if p.requires_grad]
    for p in params:  # after zerokit's own hook
        p.register_post_accumulate_grad_hook(look)
    for step in range(2):
        seen.clear()
        reduced.clear()
        engine.zero_grad()
        engine.backward(engine(*odd_batch(step, BATCH)))
        assert len(seen) == len(params)
        assert seen[0][:2] == (True, 0), seen  # the first gradient of backward: nothing full-size allocated
        assert all(own for own, _, root in seen if not root), seen  # a block's: autograd's own, always
        assert sum(own for own, _, _ in seen) >= len(params) - len(engine.trainable), seen
        assert max(n for _, n, _ in seen) == 0, seen  # CPU: the block before was reduced and freed already
        assert len(reduced) == len(engine.trainable), reduced  # every flat param once
        assert all(state is UnitState.SHARDED for k, state in reduced if k != 0), reduced  # freed first
        assert [k for k, _ in reduced if k != 0] == sorted((k for k, _ in reduced if k != 0), reverse=True)
    assert all(p.grad is not None and p.grad.numel() == p.numel() for p in params)
