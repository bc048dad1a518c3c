"""Collectives that avoid copies: the ordered reduce-scatter at 2 ranks exchanges halves
(core/collectives/ordered.py `exchange_halves`), and an all-gather may take this rank's own row of its output as its
input (core/collectives/gather.py [Note: in-place gathers]).

One spawn of 2 gloo ranks. For each dtype and comm (rank order, tree), a reduce-scatter in place (the
output is this rank's half of the input, as at stage 1) and one into an output of its own (stages 2
and 3) are checked bit for bit against the N-row recipe used at 3+ ranks and against the sum computed
from both ranks' inputs; the all-to-all is watched: it sends only the peer's half, receives into a
buffer of the output's size (the N-row recipe's is the input's), and that buffer's storage is freed
by the time wait() returns. In-place gathers, every path (one output: on gloo at 2 ranks one all-to-all;
several: coalesced, or not; simulated), give the rows a gather of separate inputs gives; an input that
overlaps its output anywhere else is refused before anything is issued. A gather at 2 ranks is watched too
(core/collectives/gather.py [Note: gloo's all-gather temporary]): one all-to-all per output (or per packed group), no
broadcast, the own row sent as it is and the peer's received in place, nothing allocated beside a packed
group's staging.
"""
import pytest
import torch
import torch.distributed as dist

from common import allocations_while, assert_callers_buffers_freed, callers_buffers_cases
from zerokit.core.collectives.comm import Comm, Simulated
from zerokit.core.collectives.ordered import rows_reduce_scatter
from zerokit.launch import run_ranks


def _watching_all_to_all(seen: list):
    original = dist.all_to_all_single

    def wrapper(output, input, *args, **kwargs):
        seen.append((output, input.numel()))
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = wrapper
    return lambda: setattr(dist, "all_to_all_single", original)


def _cases(rank, world_size):
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(100 + rank)
        numel = 2 * 1537
        local = torch.randn(numel, generator=g).to(dtype)  # (B,) this rank's contribution
        both = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(both, local)
        expected = (both[0] + both[1])[rank * (numel // 2):(rank + 1) * (numel // 2)]  # one addition per element
        for name, comm in (("ordered", Comm(ordered=True)), ("tree", Comm(tree=True))):
            rows_way = torch.empty(numel // 2, dtype=dtype)
            rows_reduce_scatter(comm, rows_way, local.clone(), async_op=True).wait()
            seen = []
            restore = _watching_all_to_all(seen)
            try:
                own_output = torch.empty(numel // 2, dtype=dtype)
                comm.reduce_scatter(own_output, local.clone(), async_op=True).wait()
                in_place = local.clone()
                mine = in_place.view(2, -1)[rank]
                comm.reduce_scatter(mine, in_place)  # synchronous, in place
            finally:
                restore()
            out[(str(dtype), name)] = dict(
                right=[torch.equal(t, expected) for t in (own_output, mine, rows_way)],
                peer_half_untouched=torch.equal(in_place.view(2, -1)[1 - rank], local.view(2, -1)[1 - rank]),
                sent=[n for _, n in seen], received_numel=[t.numel() for t, _ in seen],
                received_bytes_after=[t.untyped_storage().nbytes() for t, _ in seen])
    out["gathers"] = _in_place_gathers(rank, world_size)
    out["exchanges"] = _gathers_by_exchange(rank, world_size)
    out["callers"] = callers_buffers_cases(rank, world_size)  # tests/common.py
    return out


def _in_place_gathers(rank, world_size):
    comm = Comm()
    sizes = (6, 1000, 4)
    expected = [torch.cat([torch.arange(k, dtype=torch.float32) + 100 * r for r in range(world_size)]) for k in sizes]

    def outputs_with_own_rows():
        outs = [torch.full((world_size * k,), float("nan")) for k in sizes]
        for out, k in zip(outs, sizes):
            out.view(world_size, -1)[rank].copy_(torch.arange(k, dtype=torch.float32) + 100 * rank)
        return outs, [out.view(world_size, -1)[rank] for out in outs]

    right = {}
    outs, rows = outputs_with_own_rows()
    comm.all_gather(outs[0], rows[0])
    right["one"] = torch.equal(outs[0], expected[0])
    for coalesce in (True, False):
        outs, rows = outputs_with_own_rows()
        comm.all_gather_many(outs, rows, coalesce=coalesce).wait()
        right[f"many, coalesce={coalesce}"] = all(torch.equal(o, e) for o, e in zip(outs, expected))
    simulated = Comm(simulate=Simulated(rank=1, world_size=4))
    flat = torch.zeros(8)
    flat.view(4, -1)[1].copy_(torch.tensor([1.0, 2.0]))
    simulated.all_gather(flat, flat.view(4, -1)[1])
    right["simulated"] = torch.equal(flat, torch.tensor([1.0, 2.0] * 4))
    refused = []
    out = torch.zeros(2 * world_size)
    for wrong in (out.view(world_size, -1)[1 - rank], out[1:3]):  # the peer's row; straddling two rows
        try:
            comm.all_gather(out, wrong)
            refused.append(None)
        except ValueError as exc:
            refused.append(str(exc))
    return dict(right=right, refused=refused)


def _gathers_by_exchange(rank, world_size):
    """What a 2-rank gather issues (all-to-alls: (what it receives into, the peer's row's address, what it
    sends, this rank's own row's address); broadcasts counted) and allocates, for one output and for several,
    packed or not; and whether the rows are right."""
    comm, peer = Comm(), 1 - rank
    sizes, dtypes = (700, 1500, 300), (torch.float32, torch.bfloat16, torch.float32)
    out = {}
    for case in ("one", "packed", "not packed"):
        n = 1 if case == "one" else len(sizes)
        outputs = [torch.full((2 * k,), float("nan"), dtype=dt) for k, dt in zip(sizes[:n], dtypes[:n])]
        for o, k in zip(outputs, sizes):
            o.view(2, -1)[rank].copy_(torch.arange(k) + 1000 * rank)
        inputs = [o.view(2, -1)[rank] for o in outputs]
        exchanges, broadcasts = [], []
        originals = dist.all_to_all_single, dist.broadcast

        def a2a(output, input, *args, **kwargs):
            exchanges.append((output.numel(), output.data_ptr(), input.numel(), input.data_ptr()))
            return originals[0](output, input, *args, **kwargs)

        def broadcast(tensor, *args, **kwargs):
            broadcasts.append(tensor.numel())
            return originals[1](tensor, *args, **kwargs)

        dist.all_to_all_single, dist.broadcast = a2a, broadcast
        try:
            if case == "one":
                seen = allocations_while(lambda: comm.all_gather(outputs[0], inputs[0], async_op=True).wait())
            else:
                seen = allocations_while(
                    lambda: comm.all_gather_many(outputs, inputs, coalesce=case == "packed").wait())
        finally:
            dist.all_to_all_single, dist.broadcast = originals
        rows = [(o.view(2, -1)[peer].numel(), o.view(2, -1)[peer].data_ptr(), o.view(2, -1)[rank].data_ptr())
                for o in outputs]
        right = all(torch.equal(o, torch.cat([torch.arange(k) + 1000 * r for r in range(2)]).to(o.dtype))
                    for o, k in zip(outputs, sizes))
        staging = sorted(2 * sum(k for k, d in zip(sizes, dtypes) if d == dt) * torch.empty((), dtype=dt).element_size()
                         for dt in set(dtypes))
        out[case] = dict(right=right, exchanges=exchanges, broadcasts=broadcasts, rows=rows, staging=staging,
                         allocated=sorted(b for b, _ in seen if b >= 300 * 4))  # DETAIL's checks allocate less
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_cases, 2, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=120)


def test_two_ranks_exchange_halves_and_get_the_sums_bits(results):
    for rank, out in enumerate(results):
        cases = {case: r for case, r in out.items() if case not in ("gathers", "callers", "exchanges")}
        assert len(cases) == 6
        for case, r in cases.items():
            assert r["right"] == [True, True, True], (rank, case, r["right"])
            assert r["peer_half_untouched"], (rank, case)
            assert r["sent"] == [1537, 1537], (rank, case, r["sent"])  # the peer's half only, not the (B,) input
            assert r["received_numel"] == [1537, 1537], (rank, case)  # (B/2,), not the N-row recipe's (B,)
            assert r["received_bytes_after"] == [0, 0], (rank, case)  # freed by the time wait() returned


def test_a_gather_takes_its_own_row_as_input_and_refuses_any_other_overlap(results):
    for rank, out in enumerate(results):
        gathers = out["gathers"]
        assert gathers["right"] == {"one": True, "many, coalesce=True": True, "many, coalesce=False": True,
                                    "simulated": True}, (rank, gathers["right"])
        assert len(gathers["refused"]) == 2 and all(gathers["refused"]), (rank, gathers["refused"])
        assert all("this rank's own row" in msg for msg in gathers["refused"]), gathers["refused"]


def test_a_completed_collective_at_two_ranks_holds_none_of_the_callers_bytes(results):
    """As tests/distributed/test_fixed_point_frees.py checks at 3 ranks, here for 2 ranks' own recipes (the
    exchange of halves; a native all-reduce for the ordered one): once the caller drops its input, nothing
    else holds its bytes, though the Handle, and so the Work, is still alive."""
    assert_callers_buffers_freed(results)


def test_a_gather_at_two_ranks_is_one_exchange_in_place(results):
    """One all-to-all per output (one per dtype when packed), never a broadcast: at 2 ranks one rendezvous fills
    the peer's row (benchmarks/collectives.py times the two). Without packing the all-to-all
    sends the own row where it lies and receives straight into the peer's row, allocating nothing; packed, the
    one staging buffer per dtype is the only allocation of a row's size."""
    for rank, out in enumerate(results):
        cases = out["exchanges"]
        for case, r in cases.items():
            assert r["right"], (rank, case)
            assert r["broadcasts"] == [], (rank, case, r["broadcasts"])
        for case in ("one", "not packed"):
            r = cases[case]
            assert r["exchanges"] == [(m, peer_row, m, own_row) for m, peer_row, own_row in r["rows"]], (rank, case, r)
            assert r["allocated"] == [], (rank, case, r["allocated"])
        packed = cases["packed"]
        assert len(packed["exchanges"]) == 2, (rank, packed["exchanges"])  # fp32 and bf16 groups
        assert packed["allocated"] == packed["staging"], (rank, packed["allocated"], packed["staging"])
