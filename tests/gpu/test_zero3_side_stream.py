"""Stage 3's side-stream gathers on CUDA: issued on `engine.gather_stream`, and waited for.

zerokit/core/params/unit.py gathers a unit on a side stream (`Unit.start_unshard`) and makes the
compute stream wait on a CUDA event before the parameters are used (`Unit.wait_unshard`).
A missing or misplaced wait does not crash: the compute stream silently reads a buffer the
gather has not written yet. tests/gpu/test_zero3_cuda.py checks that a CUDA stage-3 run trains
like stage 0, but on an idle GPU a small gather finishes long before the compute stream gets
there, so it would pass without the wait. Here the race is made certain:

* every freshly allocated unit buffer is filled with NaN on the compute stream (patching
  core/params/unit.py's `_alloc_storage`), before the side stream's `wait_stream`, so a read that
  does not wait for the gather sees NaN, not last step's (or, with luck, the right) values;
* every gather first sleeps on its stream (`torch.cuda._sleep`, tens of milliseconds),
  long after the CPU has queued the unit's forward or backward on the compute stream.

With both, stage 3 (prefetch 1 and 2, resharding after forward or not, fp32 and bf16) must
still train like stage 0 on the same GPU, every gather must have been issued on the side
stream, and every unit must be freed after the step. The control case removes the wait
(`torch.cuda.Stream.wait_event` made a no-op) and must then go wrong: it shows that the
check above can fail, i.e. that the sleep really opens the race window on this machine.

One process and no process group: world size 1, where `Comm.all_gather` is a local copy
issued on whatever stream is current, so the side stream carries the same kernels (and the
same allocate / wait / free sequence) as at N ranks, with or without NCCL. Skipped without
CUDA.
"""
from __future__ import annotations

import pytest
import torch

import zerokit as zk
import zerokit.core.params.unit as unit_module
from common import OddBlock, odd_batch, odd_model
from zerokit.commands.step import train_step

pytestmark = pytest.mark.gpus(1)

STEPS, BATCH = 3, 3
SGD = dict(lr=0.1, momentum=0.9)
# As in test_zero3_cuda.py: stage 0 and stage 3 hold the same weights at different offsets of
# different flat buffers, so cuBLAS may pick differently aligned kernels (a few ulps).
ATOL = {"fp32": 1e-5, "bf16": 2e-3}
# torch.cuda._sleep spins this many GPU clock cycles: about 25 ms at the H200's 1.98 GHz boost
# clock, longer at idle clocks. The CPU queues a unit's kernels in well under a millisecond.
SLEEP_CYCLES = 50_000_000


def _poisoned_alloc(original):
    def alloc(flat: torch.Tensor) -> None:
        original(flat)
        if flat.is_cuda:
            flat.fill_(float("nan"))  # on the current (compute) stream: ordered before the side stream's wait
    return alloc


def _train(stage: int, precision: str, slow_gathers: bool = False, **kw):
    """Train STEPS steps on cuda:0; (losses, full state dict on CPU, engine, streams the gathers ran on)."""
    device = torch.device("cuda", torch.cuda.current_device())
    model = odd_model().to(device)
    engine = zk.shard(model, torch.optim.SGD, stage=stage, precision=precision, wrap=(OddBlock,), **kw, **SGD)
    streams: list[tuple] = []  # (stream, phase, label) of each training gather
    if slow_gathers:
        original = engine.comm.all_gather  # the Comm every Unit holds (stages/zero3.py)

        def all_gather(output, input, *args, **kwargs):
            if kwargs.get("phase") != "state_dict":  # the full state_dict below gathers on the compute stream
                streams.append((torch.cuda.current_stream().cuda_stream, kwargs.get("phase"), kwargs.get("label")))
            torch.cuda._sleep(SLEEP_CYCLES)  # the gather below starts only after this, on the same stream
            return original(output, input, *args, **kwargs)

        engine.comm.all_gather = all_gather
    losses = []
    for step in range(STEPS):
        batch = [t.to(device) for t in odd_batch(step, BATCH)]
        losses.append(train_step(engine, [batch], lambda b: engine(*b)).loss.float())
    torch.cuda.synchronize()
    sd = {k: v.detach().float().cpu() for k, v in engine.state_dict(full=True).items()}
    return torch.stack(losses).cpu(), sd, engine, streams


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("prefetch,reshard", [(1, True), (2, False)])
def test_gathers_run_on_the_side_stream_and_compute_waits_for_them(monkeypatch, precision, prefetch, reshard):
    ref_losses, ref_sd, _, _ = _train(0, precision)
    monkeypatch.setattr(unit_module, "_alloc_storage", _poisoned_alloc(unit_module._alloc_storage))
    losses, sd, engine, streams = _train(3, precision, slow_gathers=True, prefetch=prefetch,
                                         reshard_after_forward=reshard)

    side = engine.gather_stream
    assert side is not None, "CUDA parameters must gather on a side stream"
    assert side.cuda_stream != torch.cuda.current_stream().cuda_stream
    assert len(streams) >= STEPS * len(engine.units), (len(streams), len(engine.units))  # each unit, each forward
    elsewhere = [(phase, label) for stream, phase, label in streams if stream != side.cuda_stream]
    assert not elsewhere, f"gathers ran on another stream than engine.gather_stream: {elsewhere[:5]}"
    assert engine.unsharded_param_bytes() == 0, "every unit is freed after the step"

    assert torch.isfinite(losses).all(), f"stage 3 read an unfinished gather (NaN): losses {losses.tolist()}"
    assert all(torch.isfinite(v).all() for v in sd.values()), "NaN reached the weights"
    loss_diff = (losses - ref_losses).abs().max().item()
    param_diff = _max_diff(sd, ref_sd)
    assert loss_diff <= ATOL[precision], (loss_diff, losses.tolist(), ref_losses.tolist())
    assert param_diff <= ATOL[precision], param_diff


def test_without_the_event_wait_the_compute_stream_reads_unfinished_gathers(monkeypatch):
    """The control: the same poisoned, slowed gathers with the compute stream's wait removed go wrong.

    If this fails, the sleep did not open a race window on this machine (the positive test
    above would then pass whether or not zerokit waits), or something else synchronises the
    streams: either way the positive test proves nothing here.
    """
    ref_losses, ref_sd, _, _ = _train(0, "fp32")
    monkeypatch.setattr(unit_module, "_alloc_storage", _poisoned_alloc(unit_module._alloc_storage))
    monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda self, event: None)
    losses, sd, _, streams = _train(3, "fp32", slow_gathers=True, prefetch=1, reshard_after_forward=True)
    torch.cuda.synchronize()
    assert streams, "no gather was issued"
    wrong = (not torch.isfinite(losses).all()) or (losses - ref_losses).abs().max().item() > ATOL["fp32"] \
        or not all(torch.isfinite(v).all() for v in sd.values()) or _max_diff(sd, ref_sd) > ATOL["fp32"]
    assert wrong, "without the event wait the run still matched stage 0: the sleep opened no race window"
