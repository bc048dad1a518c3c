"""Stage 0 at one and two ranks: torch's own all-reduce (or none), and still the bits every stage and DDP give.

core/collectives/ordered.py [Note: ordered reduction] says why an all-reduce at N = 2 needs no ordering (one
addition per element, a + b == b + a) and core/collectives/comm.py `Comm.all_reduce` is where that is chosen.
These cases check both halves of that claim on gloo: the claim itself (gloo's all-reduce of two
ranks is exactly a + b on both ranks, fp32 and bf16, and equals the ordered reduce-scatter's
bits stages 1-3 get), and its consequence (stage 0 issues a native all-reduce and no all-to-all
at N = 2, nothing at all at N = 1, and trains bit for bit like stages 1-3 and torch DDP).
"""
import pytest
import torch
import torch.distributed as dist

from common import odd_batch, train_torch_ddp, train_zerokit
from zerokit.core.collectives.comm import Comm
from zerokit.launch import run_ranks

STEPS, BATCH = 4, 3
ADAMW = (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))
SGD = (torch.optim.SGD, dict(lr=0.1, momentum=0.9))  # lr x gradient: carries the averaging check
# the torch.distributed calls a reduction could be made of; each is counted while a step runs
SPIED = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
         "broadcast", "send", "recv", "isend", "irecv")


class Spy:
    """Counts calls of torch.distributed's collectives (zerokit calls them as `dist.<name>`)."""

    def __init__(self):
        self.calls, self._saved = {}, {}

    def __enter__(self):
        for name in SPIED:
            original = self._saved[name] = getattr(dist, name)

            def counted(*args, __name=name, __original=original, **kwargs):
                self.calls[__name] = self.calls.get(__name, 0) + 1
                return __original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


def _lengths():
    """Lengths of both parities, around gloo's ring chunking, and large enough for several chunks."""
    return (2, 6, 1000, 4098, 1 << 20)


def _raw_sum_cases(rank: int, world_size: int) -> dict:
    """gloo's all-reduce at two ranks against a + b computed here from both ranks' inputs, and
    against zerokit's ordered reduce-scatter (stages 1-3) of the same input."""
    out = {}
    comm = Comm(ordered=True)
    for dtype in (torch.float32, torch.bfloat16):
        for n in _lengths():
            g = torch.Generator().manual_seed(1000 * n + rank)
            mine = (torch.randn(n, generator=g) * torch.logspace(-30, 30, n)).to(dtype)  # every magnitude
            mine.mul_(0.5)  # the 1/N pre-division, as every stage makes it
            both = torch.empty(2 * n, dtype=dtype)
            dist.all_gather_into_tensor(both, mine)
            expected = both[:n] + both[n:]  # rank 0's + rank 1's: one addition, rounded once
            summed = mine.clone()
            with Spy() as spy:
                comm.all_reduce(summed)
            shard = torch.empty(n // 2, dtype=dtype)
            comm.reduce_scatter(shard, mine.clone())
            mine_range = slice(rank * (n // 2), (rank + 1) * (n // 2))
            out[(str(dtype), n)] = dict(
                equal_to_a_plus_b=torch.equal(summed, expected),
                reversed_order=torch.equal(expected, both[n:] + both[:n]),
                ordered_shard_equal=torch.equal(shard, summed[mine_range]),
                calls=dict(spy.calls), summed=summed)
    return out


def _train_cases(rank: int, world_size: int) -> dict:
    """Stage 0 traced (which torch.distributed calls one synced step makes), then stages 0-3 and DDP trained."""
    out = {}
    for precision in ("fp32", "bf16"):
        for reduce_dtype in ((None,) if precision == "fp32" else (None, torch.bfloat16)):
            kw = {} if reduce_dtype is None else {"reduce_dtype": reduce_dtype}
            # one step traced, after the engine is built (construction broadcasts rank 0's weights)
            _, _, engine = train_zerokit(rank, world_size, 0, *ADAMW, 1, BATCH, bucket_numel=40, precision=precision,
                                         **kw)
            assert len(engine.groups) > 2, "the case must exercise several all-reduce groups"
            x, y = odd_batch(7, BATCH, rank, world_size)
            with Spy() as spy:
                engine.zero_grad()
                engine.backward(engine(x, y))
                engine.step()
            out[("calls", precision, str(reduce_dtype))] = dict(spy.calls)
            out[("groups", precision, str(reduce_dtype))] = len(engine.groups)
            for opt_name, (cls, okw) in {"adamw": ADAMW, "sgd": SGD}.items():
                for stage in (0, 1, 2, 3):
                    losses, params, _ = train_zerokit(rank, world_size, stage, cls, okw, STEPS, BATCH, bucket_numel=40,
                                                      precision=precision, **kw)
                    out[(opt_name, precision, str(reduce_dtype), stage)] = (losses, params)
    for opt_name, (cls, okw) in {"adamw": ADAMW, "sgd": SGD}.items():
        out[(opt_name, "ddp")] = train_torch_ddp(rank, world_size, cls, okw, STEPS, BATCH)
    return out


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs by {(a[k] - b[k]).abs().max().item():.3e}"


@pytest.fixture(scope="module")
def raw_sums(tmp_path_factory):
    return run_ranks(_raw_sum_cases, 2, store_dir=str(tmp_path_factory.mktemp("rdzv")))


@pytest.fixture(scope="module", params=[1, 2])
def trained(request, tmp_path_factory):
    return request.param, run_ranks(_train_cases, request.param, store_dir=str(tmp_path_factory.mktemp("rdzv")))


def test_gloo_all_reduce_of_two_ranks_is_exactly_a_plus_b_on_both(raw_sums):
    """fp32 and bf16, every length: the native sum is the one addition, the same on both ranks, and the
    ordered reduce-scatter (exchange_halves) of the same input gives each rank that sum's range."""
    for key, case in raw_sums[0].items():
        for rank in (0, 1):
            seen = raw_sums[rank][key]
            assert seen["equal_to_a_plus_b"], f"rank {rank}, {key}: gloo's all-reduce is not a + b"
            assert seen["reversed_order"], key
            assert seen["ordered_shard_equal"], f"rank {rank}, {key}: ordered reduce-scatter differs from all-reduce"
            assert seen["calls"] == {"all_reduce": 1}, (key, seen["calls"])  # the native one, once
        assert torch.equal(raw_sums[0][key]["summed"], raw_sums[1][key]["summed"]), key


def test_stage0_makes_one_native_all_reduce_per_group_at_two_ranks_and_none_at_one(trained):
    world_size, results = trained
    for rank, res in enumerate(results):
        for key, calls in res.items():
            if key[0] != "calls":
                continue
            if world_size == 1:
                assert calls == {}, f"one rank, {key}: collectives issued: {calls}"
            else:  # one all-reduce per group, no all-to-all or all-gather (the ordered recipe's)
                assert calls == {"all_reduce": res[("groups",) + key[1:]]}, f"rank {rank}, {key}: {calls}"


def test_stage0_trains_bit_for_bit_like_stages_1_to_3_and_torch_ddp(trained):
    world_size, results = trained
    for rank, res in enumerate(results):
        for key in [k for k in res if len(k) == 4 and k[3] == 0]:
            losses0, params0 = res[key]
            for stage in (1, 2, 3):
                losses, params = res[key[:3] + (stage,)]
                assert torch.equal(losses, losses0), (rank, key, stage)
                _assert_same(params, params0, f"rank {rank}, {key[:3]}: stage {stage} vs stage 0")
            if key[1] == "fp32":  # torch DDP is an fp32 model: the fp32 runs equal it
                ref_losses, ref_params = res[(key[0], "ddp")]
                assert torch.equal(losses0, ref_losses), (rank, key)
                _assert_same(params0, ref_params, f"rank {rank}, {key[:3]}: stage 0 vs torch DDP")
        if rank:  # ranks agree
            for key in [k for k in res if len(k) == 4]:
                _assert_same(res[key][1], results[0][key][1], f"rank {rank} vs rank 0, {key}")
