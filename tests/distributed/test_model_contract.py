"""What the engine does to and checks about the user's model (core/params/model_guard.py), against torch DDP.

Buffers as DDP keeps them (a BatchNorm model, ranks fed different data, every stage, fp32 and
bf16, broadcast_buffers True and False); ranks agree before anything trains (a mismatched buffer
is refused fast on every rank; rank 1's own init never survives zk.shard); a model cast or moved
under the engine is refused at the next use; a model with nothing trainable is refused.
"""
import time
import warnings

import pytest
import torch
from torch import nn

import zerokit as zk
from common import ConvBlock, _build_ddp, bn_batch as batch, bn_net
from zerokit.launch import run_ranks

STEPS, BATCH = 5, 6
STAGES = (0, 1, 2, 3)
# bf16 against fp32 DDP: 5 SGD steps with momentum of a bf16 model (params and running statistics rounded to 8
# bits of mantissa, ~4e-3 relative) on O(1) weights; test_mixed_precision's TRACK_MAX_ATOL["bf16"] for 50 steps.
BF16_ATOL = 0.4


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def evaluate(wrapper, model) -> dict[str, torch.Tensor]:
    """An eval forward through the wrapper (a torch.no_grad() forward after a training one: DDP syncs buffers
    first), then the model's state. Right after a training forward each rank holds its own new statistics, under
    DDP too; from the next forward's sync on, rank 0's."""
    model.eval()
    with torch.no_grad():
        loss = wrapper(*batch(99, 0))  # the same input on every rank
    model.train()
    return dict({k: v.detach().float().clone() for k, v in model.named_buffers()}, eval_loss=loss.float().reshape(1))


def _train_ddp(rank, broadcast_buffers: bool):
    model = bn_net()
    warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)  # torch 2.13 still honours it
    ddp = _build_ddp(model, broadcast_buffers=broadcast_buffers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ddp(*batch(step, rank)).backward()
        opt.step()
    return dict(evaluate(ddp, model), **snapshot(model))


def _train_zerokit(rank, stage, precision="fp32", broadcast_buffers=True):
    model = bn_net()
    if precision == "bf16":  # torch's CPU batch_norm takes bf16 weights only with bf16 running statistics
        for mod in model.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                mod.running_mean, mod.running_var = mod.running_mean.bfloat16(), mod.running_var.bfloat16()
    engine = zk.shard(model, torch.optim.SGD, stage=stage, precision=precision, lr=0.1, momentum=0.9,
                      wrap=(ConvBlock,), broadcast_buffers=broadcast_buffers)
    before = engine.comm.stats_by_phase().get("buffers", {}).get("broadcast", 0)
    for step in range(STEPS):
        engine.zero_grad()
        engine.backward(engine(*batch(step, rank)))
        engine.step()
    buffer_bytes = engine.comm.stats_by_phase().get("buffers", {}).get("broadcast", 0) - before
    out = evaluate(engine, model)
    out.update({k: v.detach().float().clone() for k, v in engine.state_dict(full=True).items()})  # fp32 masters
    return out, buffer_bytes


def _count_syncs(rank):
    """Which forwards broadcast buffers, zerokit's engine against DDP, over a sequence mixing grad modes."""
    model = bn_net()
    ddp = _build_ddp(model)
    syncs = []
    original = ddp._distributed_broadcast_coalesced
    ddp._distributed_broadcast_coalesced = lambda *a, **k: (syncs.append(1), original(*a, **k))[1]
    engine = zk.shard(bn_net(), torch.optim.SGD, stage=0, lr=0.1)
    x, y = batch(0, rank)

    def sequence(run, no_sync):
        counts = []
        for mode in ["train", "train", "no_grad", "no_grad", "train", "no_sync", "train", "eval", "train"]:
            before = len(syncs) if run is ddp else engine.comm.calls["broadcast"]
            if mode == "no_grad":
                with torch.no_grad():
                    run(x, y)
            elif mode == "no_sync":
                with no_sync():
                    run(x, y).backward()
            else:
                (model if run is ddp else engine.module).train(mode != "eval")
                run(x, y).backward()
            counts.append((len(syncs) if run is ddp else engine.comm.calls["broadcast"]) - before)
        return counts
    return dict(ddp=sequence(ddp, ddp.no_sync), zerokit=[min(c, 1) for c in sequence(engine, engine.no_sync)],
                zerokit_calls=sequence(engine, engine.no_sync))


def _parity_cases(rank, world_size):
    out = {"ddp": _train_ddp(rank, True), "ddp_local": _train_ddp(rank, False)}
    for stage in STAGES:
        out[(stage, "fp32", True)] = _train_zerokit(rank, stage)
        out[(stage, "fp32", False)] = _train_zerokit(rank, stage, broadcast_buffers=False)
        out[(stage, "bf16", True)] = _train_zerokit(rank, stage, "bf16")
    out["syncs"] = _count_syncs(rank)
    out["buffer_bytes_per_forward"] = sum(b.numel() * b.element_size() for b in bn_net().buffers())
    return out


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    return run_ranks(_parity_cases, 2, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=240)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _buffer_keys(sd: dict) -> list[str]:
    return [k for k in sd if "running_" in k or "num_batches" in k]


def test_same_eval_input_gives_the_same_output_on_every_rank(parity):
    """After training, one eval input: every rank computes the same loss bit for bit (before: 0.59 apart)."""
    for stage in STAGES:
        for precision in ("fp32", "bf16"):
            a, b = (r[(stage, precision, True)][0]["eval_loss"] for r in parity)
            assert torch.equal(a, b), (stage, precision, a, b)


@pytest.mark.parametrize("stage", STAGES)
def test_buffers_and_weights_equal_ddp_bitwise_fp32(parity, stage):
    """fp32, broadcast_buffers=True: every buffer and weight equals torch DDP's bit for bit after 5 steps, on every
    rank, so the ranks equal each other too; the buffers' bytes are in the ledger, phase "buffers"."""
    for rank, r in enumerate(parity):
        got, buffer_bytes = r[(stage, "fp32", True)]
        assert got.keys() == r["ddp"].keys()
        for k in got:
            assert torch.equal(got[k], r["ddp"][k]), (stage, rank, k, (got[k] - r["ddp"][k]).abs().max())
        assert buffer_bytes == STEPS * r["buffer_bytes_per_forward"], (buffer_bytes, r["buffer_bytes_per_forward"])
    for k in parity[0]["ddp"]:
        assert torch.equal(parity[0][(stage, "fp32", True)][0][k], parity[1][(stage, "fp32", True)][0][k]), k


@pytest.mark.parametrize("stage", STAGES)
def test_broadcast_buffers_false_keeps_them_local_like_ddp(parity, stage):
    """broadcast_buffers=False: each rank keeps its own statistics, bit for bit those of
    DDP(broadcast_buffers=False) on that rank; the ranks' buffers differ, no buffer bytes are sent."""
    for rank, r in enumerate(parity):
        got, buffer_bytes = r[(stage, "fp32", False)]
        for k in got:
            assert torch.equal(got[k], r["ddp_local"][k]), (stage, rank, k)
        assert buffer_bytes == 0
    a, b = parity[0][(stage, "fp32", False)][0], parity[1][(stage, "fp32", False)][0]
    assert any(not torch.equal(a[k], b[k]) for k in _buffer_keys(a) if "num_batches" not in k)


@pytest.mark.parametrize("stage", STAGES)
def test_buffers_under_bf16_equal_between_ranks_and_track_ddp(parity, stage):
    """bf16 (as test_mixed_precision compares mixed precision): every stage equals zerokit's stage 0 under bf16 bit
    for bit, the ranks hold the same bits, and the run tracks fp32 DDP within BF16_ATOL."""
    for rank, r in enumerate(parity):
        got, ref = r[(stage, "bf16", True)][0], r[(0, "bf16", True)][0]
        for k in got:
            assert torch.equal(got[k], ref[k]), (stage, rank, k)
        assert _max_diff(got, r["ddp"]) < BF16_ATOL, _max_diff(got, r["ddp"])
    for k in parity[0]["ddp"]:
        assert torch.equal(parity[0][(stage, "bf16", True)][0][k], parity[1][(stage, "bf16", True)][0][k]), k


def test_buffers_sync_on_the_forwards_ddp_syncs(parity):
    """DDP's rule: the first forward, and any forward after one that ran with grad enabled outside no_sync();
    none after a forward under torch.no_grad() or inside no_sync(); model.eval() plays no part. One broadcast
    per buffer dtype (float32 statistics, int64 counters)."""
    for r in parity:
        assert r["syncs"]["zerokit"] == r["syncs"]["ddp"], r["syncs"]
        assert r["syncs"]["ddp"] == [1, 1, 1, 0, 0, 1, 0, 1, 1], r["syncs"]["ddp"]
        assert set(r["syncs"]["zerokit_calls"]) == {0, 2}, r["syncs"]["zerokit_calls"]


# ------------------------------------------------------------------ refusals
class WithBuffer(nn.Module):
    def __init__(self, numel=4, dtype=torch.float32, extra=False):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("stat", torch.arange(numel, dtype=dtype))
        if extra:
            self.register_buffer("extra", torch.zeros(2))

    def forward(self, x):
        return self.lin(x) + self.stat.float().sum()


def _refusal_cases(rank, world_size):
    out = {}

    def attempt(name, build, stage=0, **kw):
        t0 = time.perf_counter()
        try:
            zk.shard(build(), torch.optim.SGD, stage=stage, lr=0.1, **kw)
            out[name] = (None, time.perf_counter() - t0)
        except ValueError as exc:
            out[name] = (str(exc), time.perf_counter() - t0)

    attempt("extra_buffer", lambda: WithBuffer(extra=rank == 1))
    attempt("buffer_numel", lambda: WithBuffer(numel=6 if rank == 1 else 4))
    attempt("buffer_dtype", lambda: WithBuffer(dtype=torch.float64 if rank == 1 else torch.float32), stage=3)
    for stage in STAGES:
        def frozen():
            m = WithBuffer()
            m.requires_grad_(False)
            return m
        attempt(("frozen", stage), frozen, stage=stage)

    # Each rank initialises a param and a buffer its own way: after zk.shard they must be rank 0's.
    for stage in STAGES:
        torch.manual_seed(rank)
        m = WithBuffer()
        m.stat.uniform_()
        engine = zk.shard(m, torch.optim.SGD, stage=stage, lr=0.1, broadcast_buffers=False)
        out[("after_shard", stage)] = dict(buffers={k: v.clone() for k, v in m.named_buffers()},
                                           params=engine.state_dict(full=True))
    # SyncBatchNorm on CPU: torch's own refusal at the first forward, on every rank, at every stage (torch DDP refuses
    # it in its constructor: "SyncBatchNorm layers only work with GPU modules"); the group survives it.
    for stage in STAGES:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(bn_net())
        engine = zk.shard(model, torch.optim.SGD, stage=stage, lr=0.1, wrap=(ConvBlock,))
        try:
            engine(*batch(0, rank))
            out[("syncbn_cpu", stage)] = None
        except ValueError as exc:
            out[("syncbn_cpu", stage)] = str(exc)
    # after the refusals the group still works
    engine = zk.shard(WithBuffer(), torch.optim.SGD, stage=0, lr=0.1)
    engine.backward(engine(torch.ones(2, 3)).sum())
    engine.step()
    return out


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    return run_ranks(_refusal_cases, 2, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=60,
                     collective_timeout_s=20)


def test_mismatched_buffers_are_refused_fast_on_every_rank(refusals):
    """An extra buffer on rank 1, a buffer of 4 vs 6 elements, a different buffer dtype: every rank raises in under
    a second naming the buffer and rank 1 (before: a hang until the timeout; a silent partial copy)."""
    for r in refusals:
        for name, needle in [("extra_buffer", "'extra'"), ("buffer_numel", "'stat'"), ("buffer_dtype", "'stat'")]:
            msg, seconds = r[name]
            assert msg is not None and needle in msg and "rank 1" in msg, (name, msg)
            assert seconds < 1.0, (name, seconds)
        assert "(6,)" in r["buffer_numel"][0] and "(4,)" in r["buffer_numel"][0]
        assert "float64" in r["buffer_dtype"][0]


@pytest.mark.parametrize("stage", STAGES)
def test_rank1_init_never_survives_zk_shard(refusals, stage):
    """A param and a buffer initialised differently on each rank: right after zk.shard every rank holds rank 0's
    (planted bug "buffers broadcast at zk.shard skipped" fails this, and the value check refuses it)."""
    zero, one = refusals[0][("after_shard", stage)], refusals[1][("after_shard", stage)]
    for k in zero["buffers"]:
        assert torch.equal(zero["buffers"][k], one["buffers"][k]), k
    for k in zero["params"]:
        assert torch.equal(zero["params"][k], one["params"][k]), k


@pytest.mark.parametrize("stage", STAGES)
def test_a_model_with_nothing_trainable_is_refused(refusals, stage):
    for r in refusals:
        msg, _ = r[("frozen", stage)]
        assert msg is not None, stage
        assert "no parameter of this model requires grad (2 frozen parameters, 12 elements)" in msg, msg
        assert "zk.lora.inject" in msg


def test_sync_batchnorm_on_cpu_is_torchs_own_refusal_at_every_stage(refusals):
    """convert_sync_batchnorm on CPU: SyncBatchNorm's forward raises torch's ValueError on every rank at every stage,
    as DDP refuses it at construction; CUDA parity with DDP+SyncBatchNorm: tests/gpu/test_sync_batchnorm_cuda.py."""
    for r in refusals:
        for stage in STAGES:
            msg = r[("syncbn_cpu", stage)]
            assert msg is not None and "SyncBatchNorm expected input tensor to be on GPU" in msg, (stage, msg)


def _hybrid_cases(rank, world_size):
    """4 ranks, shard_group_size=2 (stages 1-3) and plain stage 0, beside DDP: buffers over the whole world."""
    out = {"ddp": _train_ddp(rank, True)}
    for stage in (1, 2, 3):
        model = bn_net()
        engine = zk.shard(model, torch.optim.SGD, stage=stage, lr=0.1, momentum=0.9, wrap=(ConvBlock,),
                          shard_group_size=2)
        for step in range(STEPS):
            engine.zero_grad()
            engine.backward(engine(*batch(step, rank)))
            engine.step()
        world = engine.comm_stats(by_group=True)["world"]["broadcast"]
        out[stage] = dict(evaluate(engine, model), **engine.state_dict(full=True)), world
    return out


def test_hybrid_sharding_syncs_buffers_over_every_replica(tmp_path):
    """shard_group_size=2 at 4 ranks: after training and an eval forward every rank (both nodes) holds rank 0's
    buffers bit for bit and the same eval loss; the broadcasts run over the world group; DDP within DDP_ATOL."""
    results = run_ranks(_hybrid_cases, 4, store_dir=str(tmp_path), timeout_s=180)
    per_forward = sum(b.numel() * b.element_size() for b in bn_net().buffers())
    for stage in (1, 2, 3):
        ref = results[0][stage][0]
        for rank, r in enumerate(results):
            got, world_bytes = r[stage]
            for k in ref:
                assert torch.equal(got[k].float(), ref[k].float()), (stage, rank, k)
            for k in r["ddp"]:
                torch.testing.assert_close(got[k].float(), r["ddp"][k], rtol=0, atol=1e-5, msg=f"{stage} {k}")
            # the initial broadcast of every param and buffer runs over the world too
            init = sum(t.numel() * t.element_size() for t in bn_net().state_dict().values())
            assert world_bytes == init + STEPS * per_forward, (stage, world_bytes, init, per_forward)


def _moved_cases(rank, world_size):
    """A model cast or moved after zk.shard, at every stage: where it is refused and with what message."""
    moves = {"half": lambda m: m.half(), "double": lambda m: m.double(), "bf16": lambda m: m.to(torch.bfloat16),
             "device": lambda m: m.to("meta"),  # a device move: the CPU-only stand-in for .cuda()
             "buffer": lambda m: setattr(m, "stat", m.stat.double())}
    out = {}
    for stage in STAGES:
        for name, move in moves.items():
            for clear in ("engine", "model", "after_backward"):
                m = WithBuffer()
                engine = zk.shard(m, torch.optim.SGD, stage=stage, lr=0.1, wrap=(nn.Linear,))
                x = torch.ones(2, 3)
                engine.backward(engine(x).sum())
                engine.step()
                if clear == "engine":
                    engine.zero_grad()
                elif clear == "model":
                    m.zero_grad()
                else:
                    engine.zero_grad()
                    engine.backward(engine(x).sum())
                where = "move"
                try:
                    move(m)
                    if clear == "after_backward":
                        where = "step"
                        engine.step()
                    else:
                        where = "forward"
                        engine(x)
                    out[(stage, name, clear)] = ("accepted", None)
                except RuntimeError as exc:
                    out[(stage, name, clear)] = (where, str(exc))
    return out


def test_a_model_moved_under_the_engine_is_refused_at_the_next_use():
    """model.half() / .double() / .to(bf16), a device move of a parameter, a buffer's dtype change, after zk.shard:
    refused at every stage (at the move itself where stages 1-3 hold sharded tensors, else at the next forward or
    step), naming the parameter or buffer and the fix. Before: stage 0 trained on stale weights silently."""
    results = run_ranks(_moved_cases, 2, timeout_s=120, collective_timeout_s=30)
    for r in results:
        for (stage, name, clear), (where, msg) in r.items():
            assert where != "accepted", (stage, name, clear)
            assert "before zk.shard" in msg, (stage, name, clear, where, msg)
            assert ("'stat'" if name == "buffer" else "'lin.") in msg, (stage, name, clear, msg)
        assert all(r[(0, name, "engine")][0] in ("forward",) for name in ("half", "double", "bf16", "device"))


class HalfFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.head = nn.Linear(3, 1)
        self.head.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)))


def _flipped_cases(rank, world_size):
    """A parameter frozen or unfrozen after zk.shard, at every stage: where it is refused and with what message."""
    flips = {"unfreeze": lambda m: m.head.weight.requires_grad_(True),
             "freeze": lambda m: m.lin.weight.requires_grad_(False)}
    out = {}
    for stage in STAGES:
        for name, flip in flips.items():
            torch.manual_seed(0)
            m = HalfFrozen()
            engine = zk.shard(m, torch.optim.SGD, stage=stage, lr=0.1, wrap=(nn.Linear,))
            x = torch.ones(2, 3)
            engine.backward(engine(x).sum())
            engine.step()
            engine.zero_grad()
            try:
                flip(m)
                engine.backward(engine(x).sum())
                engine.step()
                out[(stage, name)] = "accepted"
            except RuntimeError as exc:
                out[(stage, name)] = str(exc)
    return out


def test_a_parameter_frozen_or_unfrozen_after_zk_shard_is_refused_at_the_next_use():
    """Unfreezing after zk.shard would leave the parameter untrained without a word (it has no gradient
    storage, hook or optimizer state); freezing would keep stepping it. Both are refused at the next forward, naming
    the parameter and the fix, at every stage."""
    results = run_ranks(_flipped_cases, 2, timeout_s=120, collective_timeout_s=30)
    for r in results:
        for (stage, name), msg in r.items():
            assert msg != "accepted", (stage, name)
            assert ("'head.weight'" if name == "unfreeze" else "'lin.weight'") in msg, (stage, name, msg)
            assert "before zk.shard" in msg and "requires_grad" in msg, (stage, name, msg)


def report_max_differences(parity: list[dict]) -> None:
    """The BatchNorm figures: every buffer and weight against DDP after the steps, and between the ranks.

        PYTHONPATH=tests:tests/distributed python tests/distributed/test_model_contract.py
    """
    for stage in STAGES:
        for precision in ("fp32", "bf16"):
            got = [r[(stage, precision, True)][0] for r in parity]
            vs_ddp = max(_max_diff(g, r["ddp"]) for g, r in zip(got, parity))
            between = _max_diff(got[0], got[1])
            bufs = _buffer_keys(got[0])
            vs_ddp_buf = max(max((g[k] - r["ddp"][k]).abs().max().item() for k in bufs)
                             for g, r in zip(got, parity))
            print(f"stage {stage} {precision}: max |zk - DDP| all {vs_ddp:.3g} buffers {vs_ddp_buf:.3g}; "
                  f"between ranks {between:.3g}")
        local = [r[(stage, "fp32", False)][0] for r in parity]
        print(f"stage {stage} broadcast_buffers=False: vs DDP(False) "
              f"{max(_max_diff(g, r['ddp_local']) for g, r in zip(local, parity)):.3g}, between ranks "
              f"{_max_diff(local[0], local[1]):.3g}")


if __name__ == "__main__":  # the ranks import the cases by this module's own name (PYTHONPATH above)
    import test_model_contract as cases
    report_max_differences(run_ranks(cases._parity_cases, 2, timeout_s=240))
