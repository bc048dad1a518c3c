"""The collective recorder and debug mode (core/collectives/recorder.py, core/collectives/recorder.py [Note: debug mode]).

Every collective is recorded in ZeRO terms ("bucket 3 (blocks.2.*)", "unit blocks.0"); with
`debug=True` ranks that are about to issue different collectives fail at once, on every rank,
naming what each was doing, instead of hanging until the process group's timeout; without it a
collective that fails (a timeout) prints the rank's last records before the error propagates.
Each spawn runs on 2 gloo ranks; the divergence cases run one spawn per stage, so a hang at one
stage cannot leave the next one's collectives misaligned.
"""
from __future__ import annotations

import io
import re
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import zerokit as zk
from common import OddBlock, fixed_corpus, odd_batch, odd_model
from zerokit.commands.step import train_step
from zerokit.core.collectives.comm import Comm, Handle
from zerokit.launch import RankFailed, run_ranks
from zerokit.models import Block, build_model

BATCH = 3
DIVERGE_WITHIN_S = 30.0  # the claim: every rank raises within this (the group's own timeout is 60 s)
GROUP_TIMEOUT_S = 60.0


# -- (a) a rank that skips its reductions: every rank raises at once, naming both sides -------------
def _one_rank_under_no_sync(rank, world_size, stage):
    """Rank 1 runs its backward under no_sync(), rank 0 does not; returns (error text or None, seconds)."""
    # Stage 2 reduce-scatters under no_sync() too by default (accumulate="reduce_scatter"): no divergence
    # there by design, so it runs with accumulate="local", which keeps the gradient until a synced backward.
    engine = zk.shard(odd_model(), torch.optim.AdamW, stage=stage, wrap=(OddBlock,), accumulate="local", lr=1e-2,
                      debug=True)
    x, y = odd_batch(0, BATCH, rank, world_size)
    start = time.monotonic()
    try:
        loss = engine(x, y)
        if rank == 1:
            with engine.no_sync():
                engine.backward(loss)
        else:
            engine.backward(loss)
        engine.step()
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


# What each rank was about to do when they diverged. Rank 0 reduces its first bucket in backward;
# rank 1, whose backward communicated nothing (or, at stage 3, only gathered units), reaches the
# optimizer step: the sync point that stands for "no collective left" (core/collectives/recorder.py [Note: debug mode]).
RANK0_DOING = {0: "all-reducing bucket ", 1: "reduce-scattering bucket ", 2: "reduce-scattering bucket ",
               3: "reduce-scattering flat param "}  # stage 3's flat params are not buckets
RANK1_DOING = "starting optimizer step 1"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_debug_mode_names_both_ranks_when_one_skips_its_reductions(tmp_path, stage):
    """With debug=True, one rank under no_sync() and the other not: both raise within 30 s (the group's timeout
    is 60 s), with one message naming rank 0's reduction of a bucket (stage 3: a flat param) and rank 1's optimizer step."""
    results = run_ranks(_one_rank_under_no_sync, 2, stage, store_dir=str(tmp_path), timeout_s=150,
                        collective_timeout_s=GROUP_TIMEOUT_S)
    for rank, (message, seconds) in enumerate(results):
        assert message is not None, f"rank {rank} did not raise at stage {stage}"
        assert seconds < DIVERGE_WITHIN_S, (rank, seconds, message)
        assert message.startswith("zerokit debug: collective #") and "diverges between ranks" in message, message
        assert f"(raised on rank {rank})" in message, message
        sides = dict(re.findall(r"^  rank (\d) is (.*)$", message, flags=re.M))
        assert sides.keys() == {"0", "1"}, message
        assert sides["0"].startswith(RANK0_DOING[stage]), message
        assert re.match(r"[a-z-]+ (bucket|flat param) \d+ \(.+\) \[#\d+: \d+ x float32, backward\]$", sides["0"]), message
        assert sides["1"].startswith(RANK1_DOING), message
    # the same text on both ranks, but for who raised it
    assert results[0][0].replace("rank 0)", "rank 1)", 1) == results[1][0]


# -- (b) labels in ZeRO terms, and (d) debug mode leaves training bitwise unchanged ------------------
def _labels_and_training(rank, world_size):
    """Per (stage, debug): one step's records (op, label, phase) and, after 3 steps, losses and state_dict."""
    corpus = fixed_corpus()
    out = {}
    for stage in (2, 3):
        for debug in (False, True):
            torch.manual_seed(0)
            model = build_model("tiny")
            engine = zk.shard(model, torch.optim.AdamW, stage=stage, wrap=(Block,), bucket_numel=13_000, lr=1e-3,
                              debug=debug)
            records = []
            engine.comm.recorder.listeners.append(records.append)
            losses = []
            for step in range(3):
                x, y = corpus.batch(2, model.cfg.block_size, step, rank, world_size)
                losses.append(train_step(engine, [(x, y)], lambda b: engine(*b)[1], clip=1.0).loss)
                if step == 0:
                    step_records = [(r.op, r.label, r.phase) for r in records]
            out[(stage, debug)] = dict(records=step_records, losses=torch.stack(losses),
                                       state=engine.state_dict(full=True),
                                       buckets={fp.index: [n[0] for n in fp.names] for fp in engine.flat_params})
    return out


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    return run_ranks(_labels_and_training, 2, store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=240)


def _names_match(summary: str, names: list[str]) -> bool:
    """Whether `summary` ("blocks.1.mlp.*, blocks.2.*") covers exactly these names' groups (".." hides some)."""
    patterns = [p for p in summary.split(", ") if p != ".."]
    covered = lambda n: any(n.startswith(p[:-1]) if p.endswith(".*") else n == p for p in patterns)  # noqa: E731
    return all(covered(n) for n in names) or ".." in summary.split(", ")


def test_stage2_labels_reductions_by_bucket_and_param_names(labelled):
    """Stage 2: each reduce-scatter is labelled "bucket k (<its parameters' common prefix>)"; the step's gathers
    "updated params of bucket k (...)"; the clip norm, the model check and the init broadcasts by what they are."""
    for rank, result in enumerate(labelled):
        got = result[(2, False)]
        buckets = got["buckets"]
        scatters = [label for op, label, phase in got["records"] if op == "reduce_scatter"]
        assert len(scatters) == len(buckets) > 1, scatters  # bucket_numel=13_000 cuts the tiny model up
        for label in scatters:
            k, summary = re.fullmatch(r"bucket (\d+) \((.+)\)", label).groups()
            assert _names_match(summary, buckets[int(k)]), (label, buckets[int(k)])
        # in backward order; a whole block is one prefix, a bucket across a block boundary one per block
        assert scatters == ["bucket 0 (blocks.0.mlp.proj.bias, blocks.1.*, ln_f.*)", "bucket 1 (blocks.0.*)",
                            "bucket 2 (wte.weight, wpe.weight)"], scatters
        gathers = [label for op, label, _ in got["records"] if op == "all_gather"]
        assert gathers and all(g.startswith("updated params of bucket ") for g in gathers), gathers
        assert ("all_reduce_scalars", "gradient norm partials (clip_grad_norm_)", "other") in got["records"]


def test_stage3_labels_gathers_by_unit(labelled):
    """Stage 3: every all-gather is labelled by its unit ("unit <root>", "unit blocks.0", "unit blocks.1") in the
    forward and (but the root's) in the backward; reduce-scatters by flat param, "flat param k (blocks.1.*)"."""
    for result in labelled:
        records = result[(3, False)]["records"]
        forward = [label for op, label, phase in records if op == "all_gather" and phase == "forward"]
        backward = [label for op, label, phase in records if op == "all_gather" and phase == "backward"]
        assert forward == ["unit <root>", "unit blocks.0", "unit blocks.1"], forward
        assert sorted(backward) == ["unit blocks.0", "unit blocks.1"], backward
        scatters = [label for op, label, _ in records if op == "reduce_scatter"]
        assert [re.sub(r"flat param \d+ ", "flat param k ", s) for s in scatters] == [
            "flat param k (blocks.1.*)", "flat param k (blocks.0.*)",
            "flat param k (wte.weight, wpe.weight, ln_f.*)"], scatters


@pytest.mark.parametrize("stage", [2, 3])
def test_debug_mode_changes_neither_training_nor_the_collectives(labelled, stage):
    """debug=True trains bitwise like debug=False (losses, full state_dict after 3 steps) and issues the same
    collectives: its checks are separate exchanges, never recorded."""
    for result in labelled:
        plain, debug = result[(stage, False)], result[(stage, True)]
        assert torch.equal(plain["losses"], debug["losses"])
        assert plain["state"].keys() == debug["state"].keys()
        assert all(torch.equal(plain["state"][k], debug["state"][k]) for k in plain["state"])
        assert plain["records"] == debug["records"]


# -- (c) without debug mode: a rank that stops makes the other time out, and it says where it was ---
STOP_TIMEOUT_S = 3.0


def _one_rank_stops(rank, world_size):
    """Both ranks train a step in a group with a 3 s timeout; then rank 1 stops issuing collectives (it sleeps)
    and rank 0 runs another forward. Returns rank 0's (error text, what it wrote to stderr)."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=STOP_TIMEOUT_S))  # every rank, in order
    torch.manual_seed(0)
    model = build_model("tiny")
    engine = zk.shard(model, torch.optim.AdamW, stage=3, wrap=(Block,), lr=1e-3, group=group)
    x, y = fixed_corpus().batch(2, model.cfg.block_size, 0, rank, world_size)
    train_step(engine, [(x, y)], lambda b: engine(*b)[1])
    if rank == 1:
        time.sleep(3 * STOP_TIMEOUT_S)  # alive, but issuing nothing: rank 0's gather times out, not "closed"
        return None
    stderr, sys.stderr = sys.stderr, io.StringIO()  # what Comm.report_failure prints goes here
    error = None
    try:
        engine(x, y)
    except RuntimeError as exc:
        error = str(exc)
    finally:
        stderr, sys.stderr = sys.stderr, stderr
    return error, stderr.getvalue()


def test_a_collective_that_times_out_prints_the_last_records(tmp_path):
    """Without debug mode, rank 0's gather of the root unit times out (rank 1 stopped); before the error
    propagates rank 0 prints its last collectives, the timed-out one last, in ZeRO terms."""
    error, stderr = run_ranks(_one_rank_stops, 2, store_dir=str(tmp_path), timeout_s=120)[0]
    # gloo says "Timed out ..." (a receive) or "Application timeout caused pair closure" (a send: the root
    # gather is broadcasts on gloo, core/collectives/gather.py [Note: gloo's all-gather temporary], and rank 0's own row
    # goes out first); under TORCH_DISTRIBUTED_DEBUG=DETAIL torch's wrapper finds the missing rank first:
    # "Ranks 1 failed to pass monitoredBarrier in 3000 ms".
    assert error is not None and any(s in error.lower() for s in ("timed out", "timeout", "monitoredbarrier")), error
    assert "zerokit rank 0: a collective failed (" in stderr, stderr
    assert "zerokit rank 0: last 8 collectives (oldest first):" in stderr, stderr
    lines = stderr.strip().splitlines()
    assert re.search(r"#\d+ all_gather of unit <root> \(\d+ x float32, forward\)$", lines[-1]), stderr
    assert any("reduce_scatter of flat param" in line for line in lines), stderr  # stage 3: not buckets


class _FailingWork:
    """A torch.distributed Work whose wait() fails as gloo's does when the peer is gone."""

    def wait(self):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")


def test_handle_wait_reports_the_records_once_then_raises(capsys):
    """Handle.wait on a failing collective prints the rank's last records to stderr once (nested waits do not
    repeat it) and re-raises the error unchanged."""
    comm = Comm()
    comm.all_gather(torch.zeros(4), torch.zeros(4), phase="forward", label="unit blocks.0")
    comm.reduce_scatter(torch.zeros(4), torch.zeros(4), phase="backward", label="bucket 2 (blocks.1.*)")
    outer = Handle(None, Handle(_FailingWork(), comm=comm).wait, comm=comm)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        outer.wait()
    err = capsys.readouterr().err
    assert err.count("a collective failed (RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed") == 1
    assert "#0 all_gather of unit blocks.0 (4 x float32, forward)" in err, err
    assert err.strip().endswith("#1 reduce_scatter of bucket 2 (blocks.1.*) (4 x float32, backward)"), err


def _gather_many_beside_an_all_reduce(rank, world_size):
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL
    if rank == 0:
        Comm().all_gather_many([torch.empty(4 * world_size), torch.empty(2 * world_size)],
                               [torch.zeros(4), torch.zeros(2)]).wait()
    else:
        dist.all_reduce(torch.ones(6))


def test_torch_detail_checks_the_gathers_all_gather_many_issues(tmp_path, monkeypatch):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective, but not a coalesced one: all_gather_many then
    issues its gathers one by one, so a rank doing something else is reported at once, not after a timeout."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    start = time.monotonic()
    with pytest.raises(RankFailed, match="Detected mismatch between collectives"):
        run_ranks(_gather_many_beside_an_all_reduce, 2, store_dir=str(tmp_path), timeout_s=60,
                  collective_timeout_s=20)
    assert time.monotonic() - start < 20


# -- (e) the same op and label with different sizes is a divergence too -----------------------------
def _same_label_different_sizes(rank, world_size):
    """Rank 0 all-reduces 4 elements, rank 1 6, under one label; returns the error text (None if none)."""
    comm = Comm(debug=True)
    try:
        comm.all_reduce(torch.ones(4 + 2 * rank), phase="backward", label="bucket 0 (fc.*)")
    except RuntimeError as exc:
        return str(exc)
    return None


def test_debug_mode_tells_apart_sizes_under_one_label(tmp_path):
    """The fingerprint holds the element count: one collective, same op and label, 4 elements on rank 0 and 6 on
    rank 1, fails the check on both ranks, naming both sizes, and is never issued (gloo would have aborted)."""
    for rank, message in enumerate(run_ranks(_same_label_different_sizes, 2, store_dir=str(tmp_path), timeout_s=60,
                                             collective_timeout_s=20)):
        assert message is not None and "diverges between ranks" in message, message
        assert f"(raised on rank {rank})" in message, message
        assert "rank 0 is all-reducing bucket 0 (fc.*) [#0: 4 x float32, backward]" in message, message
        assert "rank 1 is all-reducing bucket 0 (fc.*) [#0: 6 x float32, backward]" in message, message
