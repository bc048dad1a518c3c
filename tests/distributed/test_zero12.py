"""Stages 1 and 2 against zerokit's stage 0 (bitwise) and torch's DDP, on gloo, world sizes 1-4.

One spawn per world size runs every case: both optimizers, gradient accumulation under
both stage-2 policies, per-group weight decay, the memory ledger, the communication
ledger and stage 2's full-size gradient high-water mark. Each rank asserts as it goes
and returns what it saw, so the parent asserts again and checks that replicas agree.
"""
import pytest
import torch
from torch import nn

import zerokit as zk
from common import odd_batch, odd_model, train_torch_ddp
from zerokit.commands.step import train_step
from zerokit.core.collectives.comm import Comm
from zerokit.core.config import ShardConfig
from zerokit.core.params.partition import padded_numel
from zerokit.core.precision import make_policy
from zerokit.core.params.sharded_tensors import ShardedGrad
from zerokit.launch import run_ranks
from zerokit.stages.zero2 import Zero2Engine

STEPS, BATCH, MICRO = 3, 3, 4
BUCKET = 40  # elements: the odd model's ~560 trainable params fall into many buckets
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}
# torch DDP at world size >= 3: gloo's ring adds an element's N contributions in an order
# that depends on the element's position, and divides by N where zerokit multiplies by
# 1/N (not exact for N = 3), so an averaged gradient may differ in its last bit (~6e-8
# relative). After a few steps on O(1) weights that is a few 1e-7 (observed <= 1.8e-7);
# 1e-5 is far above that and far below any real bug (a wrong scale or a dropped bucket
# moves weights by ~1e-3). At world size 1 and 2 the sums are the same (a + b == b + a,
# and 1/2 is exact), so there the bar is bitwise.
DDP_ATOL = 1e-5
# Stage 2, accumulate="reduce_scatter": each micro-step is averaged over ranks first and
# the micro-steps summed after, where stage 0 sums the micro-steps locally first (and the
# same for two synced backwards without zero_grad at stages 1 and 2). Same reasoning and
# size of rounding difference as DDP_ATOL (observed <= 7.5e-8).
REORDER_ATOL = 1e-5


def _no_decay_on_1d(name, p):
    return {"weight_decay": 0.0} if p.dim() == 1 else {}


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in engine.state_dict(full=True).items()}


def _train(engine, rank, world_size, steps=STEPS, micro=1):
    """train_step: zero_grad, `micro` backwards (all but the last inside no_sync), step; losses and params every step."""
    losses, params = [], []
    for step in range(steps):
        batches = [odd_batch(step * micro + m, BATCH, rank, world_size) for m in range(micro)]
        losses.append(train_step(engine, batches, lambda batch: engine(*batch)).loss.clone())
        params.append(_snapshot(engine))
    return torch.stack(losses), params


def _assert_same_run(got, ref, what):
    """Bitwise: every step's loss and every parameter after every step."""
    losses, params = got
    ref_losses, ref_params = ref
    assert torch.equal(losses, ref_losses), (what, losses - ref_losses)
    for step, (p, q) in enumerate(zip(params, ref_params)):
        assert p.keys() == q.keys(), what
        for k in q:
            assert torch.equal(p[k], q[k]), (what, step, k, (p[k] - q[k]).abs().max().item())


def _deep_mlp(seed=0, depth=12, width=32):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _zero2(model, cls, kw, **engine_kwargs):
    """A stage-2 engine built directly (as zk.shard builds it) from a ShardConfig."""
    return Zero2Engine(model, cls, kw, comm=Comm(), policy=make_policy("fp32"), scaler=None,
                       config=ShardConfig(stage=2, **engine_kwargs))


def _stage2_gradient_high_water(rank, world_size, bucket_numel, max_in_flight, aligned):
    """Largest sum of live full-size gradient buckets seen from any gradient hook during one backward.

    `aligned`: bucket boundaries fall between layers (bucket_numel = one Linear(32, 32)).
    """
    model = _deep_mlp()
    engine = _zero2(model, torch.optim.SGD, dict(lr=0.1), bucket_numel=bucket_numel, max_in_flight=max_in_flight)
    samples = []

    def sample(*_):
        samples.append(sum(g.untyped_storage().nbytes() for g in engine.flat_grads if g is not None))

    # Registered after the engine's own hooks, so the pre-hook samples right after a bucket
    # is allocated (the high-water mark) and the post-hook right after any release.
    for p in model.parameters():
        p.register_hook(sample)
        p.register_post_accumulate_grad_hook(sample)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 32, generator=g)
    engine.backward(engine(x).pow(2).mean())
    bucket_bytes = [4 * fp.padded_numel for fp in engine.flat_params]
    return dict(peak=max(samples), bucket_bytes=bucket_bytes, total=sum(bucket_bytes),
                after=sum(g is not None for g in engine.flat_grads),
                grads_none=all(p.grad is None or isinstance(p.grad, ShardedGrad) for p in model.parameters()),
                max_in_flight=max_in_flight,
                aligned=aligned)


def _cases(rank, world_size):
    out = {}
    # 1. both optimizers: stages 1, 2 == stage 0 bitwise; stage 0 vs torch DDP
    for name, (cls, kw) in OPTIMIZERS.items():
        ref = train_torch_ddp(rank, world_size, cls, kw, STEPS, BATCH)
        runs = {}
        for stage in (0, 1, 2):
            engine = zk.shard(odd_model(), cls, stage=stage, bucket_numel=BUCKET, **kw)
            assert sum(fp.requires_grad for fp in engine.flat_params) > 5, "the case must exercise many buckets"
            runs[stage] = _train(engine, rank, world_size)
        for stage in (1, 2):
            _assert_same_run(runs[stage], runs[0], (name, stage, rank))
        out[name] = dict(runs={s: (r[0], r[1][-1]) for s, r in runs.items()}, ref=ref)

    # 2. accumulation over MICRO micro-steps with per-group weight decay
    cls, kw = OPTIMIZERS["adamw"]
    acc = {}
    for key, stage, extra in [("0", 0, {}), ("1", 1, {}), ("2-local", 2, dict(accumulate="local")),
                              ("2-reduce_scatter", 2, dict(accumulate="reduce_scatter"))]:
        engine = zk.shard(odd_model(), cls, stage=stage, bucket_numel=BUCKET, param_groups=_no_decay_on_1d,
                          **extra, **kw)
        engine.comm.reset_stats()
        acc[key] = _train(engine, rank, world_size, micro=MICRO)
        acc[key + "/comm"] = engine.comm_stats()
    _assert_same_run(acc["1"], acc["0"], ("accumulate", 1, rank))
    _assert_same_run(acc["2-local"], acc["0"], ("accumulate", "2-local", rank))
    for p, q in zip(acc["2-reduce_scatter"][1], acc["0"][1]):
        for k in q:
            torch.testing.assert_close(p[k], q[k], rtol=0, atol=REORDER_ATOL, msg=k)
    out["accumulate"] = acc

    # two synced backwards without zero_grad (no no_sync): gradients add up, as in torch, at
    # stage 2; stage 1 keeps its grad shard inside the gradient bucket and refuses instead.
    twice = {}
    for stage in (0, 1, 2):
        engine = zk.shard(odd_model(), cls, stage=stage, bucket_numel=BUCKET, **kw)
        try:
            for step in range(2):
                engine.zero_grad()
                for m in range(2):
                    x, y = odd_batch(2 * step + m, BATCH, rank, world_size)
                    engine.backward(engine(x, y))
                engine.step()
        except RuntimeError as exc:
            assert stage == 1 and "no_sync" in str(exc), (stage, exc)
            twice["stage1_error"] = str(exc)
            continue
        twice[stage] = _snapshot(engine)
    for stage in (2,):
        for k, v in twice[0].items():
            torch.testing.assert_close(twice[stage][k], v, rtol=0, atol=REORDER_ATOL, msg=k)
    out["twice"] = twice

    # 3. per-group weight decay without accumulation: its own flat buffers, still bitwise
    pg = {}
    for stage in (0, 1, 2):
        engine = zk.shard(odd_model(), cls, stage=stage, bucket_numel=BUCKET, param_groups=_no_decay_on_1d, **kw)
        assert {fp.options.get("weight_decay") for fp in engine.flat_params if fp.requires_grad} == {0.0, None}
        pg[stage] = _train(engine, rank, world_size)
    for stage in (1, 2):
        _assert_same_run(pg[stage], pg[0], ("param_groups", stage, rank))
    out["param_groups"] = {s: r[1][-1] for s, r in pg.items()}

    # 4. ledgers: memory after a backward, communication of one step
    for name, (cls, kw) in OPTIMIZERS.items():
        for stage in (0, 1, 2):
            model = odd_model()
            engine = zk.shard(model, cls, stage=stage, bucket_numel=BUCKET, **kw)
            x, y = odd_batch(0, BATCH, rank, world_size)
            engine.backward(engine(x, y))
            engine.step()  # creates the optimizer states
            engine.zero_grad()
            if stage == 2:  # core/grads/grad_reduce.py [Note: grad shards]: gone until the next backward reduce-scatters
                assert all(s.grad_shard is None for s in engine.states), "stage 2's zero_grad frees the grad shards"
                assert all(p.grad is None for p in model.parameters()), "`.grad` is None after zero_grad, as in torch"
                assert engine.memory().get("grads", 0) == 0, engine.memory()
            engine.comm.reset_stats()
            engine.backward(engine(x, y))
            memory = engine.memory()  # measured after backward, before the step
            if stage == 2:
                # `.grad` shows this rank's shard (a ShardedGrad holds no bytes of its own), nothing full-size
                assert all(g is None for g in engine.flat_grads), "stage 2 freed every full gradient"
                assert all(isinstance(p.grad, ShardedGrad) for p in model.parameters() if p.requires_grad)
            engine.step()
            out[("ledger", name, stage)] = dict(
                memory=memory, comm=engine.comm_stats(),
                psi=sum(p.numel() for p in model.parameters()),
                psi_trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                flats=[(fp.numel, fp.requires_grad) for fp in engine.flat_params])

    # 5. stage 2's full-size gradient high-water mark on a 12-bucket model
    layer = 32 * 32 + 32
    out["high_water"] = [_stage2_gradient_high_water(rank, world_size, bucket_numel, k, aligned)
                         for bucket_numel, k, aligned in [(layer, 1, True), (layer, 2, True), (layer + 44, 1, False)]]
    for hw in out["high_water"]:
        _assert_high_water(hw)
    return out


def _assert_high_water(hw):
    # zero2.py's bound: (max_in_flight + 2) buckets' worth, + 1 only when aligned; never the whole gradient.
    bound = (hw["max_in_flight"] + (1 if hw["aligned"] else 2)) * max(hw["bucket_bytes"])
    assert len(hw["bucket_bytes"]) >= 12, hw["bucket_bytes"]
    assert min(hw["bucket_bytes"]) <= hw["peak"] <= bound, (hw["peak"], bound)
    assert hw["peak"] < hw["total"] / 3, (hw["peak"], hw["total"])
    assert hw["after"] == 0 and hw["grads_none"], "nothing full-size survives the end of backward"


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def results(request, tmp_path_factory):
    world_size = request.param
    return world_size, run_ranks(_cases, world_size, store_dir=str(tmp_path_factory.mktemp("rdzv")))


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_stages_1_and_2_equal_stage_0_bitwise_every_step(results, opt):
    """Stages 1 and 2 give stage 0's losses and parameters bit for bit (checked every step on every rank)."""
    world_size, res = results
    for rank, r in enumerate(res):
        runs = r[opt]["runs"]
        for stage in (1, 2):
            assert torch.equal(runs[stage][0], runs[0][0]), (rank, stage)
            for k in runs[0][1]:
                assert torch.equal(runs[stage][1][k], runs[0][1][k]), (rank, stage, k)
    for r in res[1:]:  # replicas agree with each other bit for bit
        for k, v in res[0][opt]["runs"][2][1].items():
            assert torch.equal(r[opt]["runs"][2][1][k], v), k


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_stages_1_and_2_train_like_torch_ddp(results, opt):
    """Stages 1 and 2 end where torch DDP ends: bitwise at world size 1 and 2, within DDP_ATOL at 3 and 4."""
    world_size, res = results
    for rank, r in enumerate(res):
        ref_losses, ref_params = r[opt]["ref"]
        for stage in (1, 2):
            losses, params = r[opt]["runs"][stage]
            if world_size <= 2:
                assert torch.equal(losses, ref_losses), (rank, stage)
                for k in ref_params:
                    assert torch.equal(params[k], ref_params[k]), (rank, stage, k)
            else:
                torch.testing.assert_close(losses, ref_losses, rtol=0, atol=DDP_ATOL)
                for k in ref_params:
                    torch.testing.assert_close(params[k], ref_params[k], rtol=0, atol=DDP_ATOL, msg=k)


def test_accumulation_local_is_bitwise_and_reduce_scatter_is_close(results):
    """4 micro-steps under no_sync: stages 1 and 2 "local" equal stage 0 bitwise; "reduce_scatter" within tolerance."""
    world_size, res = results
    for r in res:
        acc = r["accumulate"]
        for key in ("1", "2-local"):
            assert torch.equal(acc[key][0], acc["0"][0]), key
            for k, v in acc["0"][1][-1].items():
                assert torch.equal(acc[key][1][-1][k], v), (key, k)
        for k, v in acc["0"][1][-1].items():
            torch.testing.assert_close(acc["2-reduce_scatter"][1][-1][k], v, rtol=0, atol=REORDER_ATOL, msg=k)


def test_accumulation_policies_cost_what_the_docstring_says(results):
    """Per step of MICRO micro-steps: "local" sends B + B like stage 0; "reduce_scatter" sends MICRO*B + B."""
    world_size, res = results
    for r in res:
        acc = r["accumulate"]
        stage0 = acc["0/comm"]["all_reduce"]  # 2B per step, counted over STEPS steps
        assert acc["2-local/comm"]["reduce_scatter"] == acc["2-local/comm"]["all_gather"] == stage0 // 2
        assert acc["2-reduce_scatter/comm"]["reduce_scatter"] == MICRO * stage0 // 2
        assert acc["2-reduce_scatter/comm"]["all_gather"] == stage0 // 2
        if world_size > 1:
            assert stage0 > 0


def test_backward_twice_without_no_sync_accumulates_like_stage_0(results):
    """Two synced backwards without zero_grad: stage 2 adds them up like stage 0; stage 1 refuses, naming no_sync."""
    _, res = results
    for r in res:
        assert "no_sync" in r["twice"]["stage1_error"]
        for stage in (2,):
            for k, v in r["twice"][0].items():
                torch.testing.assert_close(r["twice"][stage][k], v, rtol=0, atol=REORDER_ATOL, msg=k)


def test_per_group_weight_decay_stays_bitwise(results):
    """param_groups (no weight decay on 1-D params): stages 1 and 2 still equal stage 0 bit for bit."""
    _, res = results
    for r in res:
        pg = r["param_groups"]
        for stage in (1, 2):
            for k, v in pg[0].items():
                assert torch.equal(pg[stage][k], v), (stage, k)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_memory_after_backward_matches_the_stage_formulas(results, opt):
    """fp32: stage 1 params 4Ψ, grads 4Ψ, states 8Ψ/N (Adam; 4Ψ/N SGD); stage 2 grads 4Ψ/N. Exact bytes."""
    world_size, res = results
    states_per_elt = {"adamw": 8, "sgd_momentum": 4}[opt]
    for r in res:
        for stage in (0, 1, 2):
            led = r[("ledger", opt, stage)]
            padded_all = sum(padded_numel(n, world_size) for n, _ in led["flats"])
            padded = sum(padded_numel(n, world_size) for n, trainable in led["flats"] if trainable)
            shard = padded // world_size
            assert padded_all - led["psi"] < world_size * len(led["flats"]), "padding < N per bucket"
            assert padded - led["psi_trainable"] < world_size * len(led["flats"])
            expected = {
                0: dict(params=4 * padded_all, grads=4 * padded, master_params=0,
                        optimizer_states=states_per_elt * padded),
                1: dict(params=4 * padded_all, grads=4 * padded, master_params=0,
                        optimizer_states=states_per_elt * shard),
                2: dict(params=4 * padded_all, grads=4 * shard, master_params=0,
                        optimizer_states=states_per_elt * shard),
            }[stage]
            assert {k: led["memory"][k] for k in expected} == expected, (stage, led["memory"], expected)


def test_comm_bytes_per_step_equal_stage_0(results):
    """comm_stats() for one step: stages 1 and 2 send reduce-scatter B + all-gather B = stage 0's all-reduce 2B,
    B counted over each stage's own padded buckets (stage 1's close at the cap, DDP's rule: other buckets, other
    padding, < N elements each; the same elements)."""
    world_size, res = results
    for r in res:
        for opt in OPTIMIZERS:
            stage0 = sum(r[("ledger", opt, 0)]["comm"].values())
            padded = sum(padded_numel(n, world_size) for n, t in r[("ledger", opt, 0)]["flats"] if t)
            assert stage0 == (2 * 4 * padded if world_size > 1 else 0)
            for stage in (1, 2):
                flats = r[("ledger", opt, stage)]["flats"]
                own = 4 * sum(padded_numel(n, world_size) for n, t in flats if t) if world_size > 1 else 0
                assert sum(n for n, t in flats if t) == sum(n for n, t in r[("ledger", opt, 0)]["flats"] if t)
                comm = r[("ledger", opt, stage)]["comm"]
                assert comm["all_reduce"] == 0 and comm["broadcast"] == 0, comm
                assert comm["reduce_scatter"] == comm["all_gather"] == own, (stage, comm, own)


def test_stage2_full_gradient_memory_stays_within_the_docstring_bound(results):
    """Stage 2's backward on a 12-bucket model holds <= max_in_flight + 2 (+ 1 if aligned) full gradient buckets."""
    _, res = results
    for r in res:
        for hw in r["high_water"]:
            _assert_high_water(hw)
