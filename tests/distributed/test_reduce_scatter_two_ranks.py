"""The ordered reduce-scatter at 2 ranks exchanges halves (core/comm.py `Comm._exchange_halves`).

One spawn of 2 gloo ranks. For each dtype and comm (rank order, tree), a reduce-scatter in place (the
output is this rank's half of the input, as at stage 1) and one into an output of its own (stages 2
and 3) are checked bit for bit against the N-row recipe used at 3+ ranks and against the sum computed
from both ranks' inputs; the all-to-all is watched: it sends only the peer's half, receives into a
buffer of the output's size (the N-row recipe's is the input's), and that buffer's storage is freed
by the time wait() returns.
"""
import pytest
import torch
import torch.distributed as dist

from zerokit.core.comm import Comm
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
            comm._rows_reduce_scatter(rows_way, local.clone(), async_op=True).wait()
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
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_cases, 2, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=120)


def test_two_ranks_exchange_halves_and_get_the_sums_bits(results):
    for rank, out in enumerate(results):
        assert len(out) == 6
        for case, r in out.items():
            assert r["right"] == [True, True, True], (rank, case, r["right"])
            assert r["peer_half_untouched"], (rank, case)
            assert r["sent"] == [1537, 1537], (rank, case, r["sent"])  # the peer's half only, not the (B,) input
            assert r["received_numel"] == [1537, 1537], (rank, case)  # (B/2,), not the N-row recipe's (B,)
            assert r["received_bytes_after"] == [0, 0], (rank, case)  # freed by the time wait() returned
