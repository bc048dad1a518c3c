"""`zerokit train` end to end: every precision on CPU, the spawning path, checkpointing and accumulation."""
import re

import pytest

from zerokit.cli import main


def _train(capsys, *args):
    assert main(["train", "--model", "tiny", "--no-progress", *args]) == 0
    out = capsys.readouterr().out
    first, final = map(float, re.search(r"loss: first ([\d.]+)\s+final ([\d.]+)", out).groups())
    return out, first, final


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 3])
def test_train_runs_on_cpu_in_every_precision(capsys, precision, stage):
    """One process, 12 steps: bf16 and fp16 run on CPU, report the four memory categories, and the loss falls."""
    out, first, final = _train(capsys, "--nproc", "1", "--stage", str(stage), "--precision", precision,
                               "--steps", "12", "--lr", "1e-2")
    assert final < first - 0.3, out
    for category in ("params", "grads", "master_params", "optimizer_states"):
        assert category in out
    if precision == "fp16":
        assert "loss scale" in out


def test_train_spawns_two_gloo_ranks_with_fp16_checkpointing_and_accumulation(capsys):
    """--nproc 2 spawns ranks itself; fp16 + activation checkpointing + 2 micro-steps at stage 2 trains."""
    out, first, final = _train(capsys, "--nproc", "2", "--stage", "2", "--precision", "fp16", "--checkpointing",
                               "--accumulate", "2", "--steps", "10", "--lr", "1e-2")
    assert "2 rank(s)" in out and "rank 1" in out
    assert final < first - 0.3, out


def test_train_with_the_tree_reduction_gives_the_same_weights_at_every_nproc(capsys):
    """--reduction tree: 1 rank x 4 micro-steps at stage 3 and 2 x 2 at stage 1 print one weights digest
    (tests/distributed/test_tree_reduction.py checks every stage and world size, and the control)."""
    digests = set()
    for nproc, accumulate, stage in (("1", "4", "3"), ("2", "2", "1")):
        out, _, _ = _train(capsys, "--reduction", "tree", "--nproc", nproc, "--accumulate", accumulate,
                           "--stage", stage, "--steps", "3", "--batch-size", "2")
        digests.add(re.search(r"weights sha256: ([0-9a-f]{64})", out).group(1))
    assert len(digests) == 1, digests


def test_train_refuses_a_tree_over_three_ranks(capsys):
    assert main(["train", "--model", "tiny", "--reduction", "tree", "--nproc", "3"]) != 0  # before any spawn
    assert "power of two" in capsys.readouterr().err
