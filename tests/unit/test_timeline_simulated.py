"""`zerokit timeline` without a process group: a simulated rank of 8, the argument checks, the label thinning."""
import json

import pytest

import zerokit as zk
from zerokit.cli import main
from zerokit.commands.timeline import BOUNDARIES, MAX_LABELLED_EVENTS, MODEL_STATES, _labelled


def test_simulated_rank_of_8_matches_the_formula_and_draws(tmp_path, capsys):
    """--simulate-world-size 8 at stage 3: one rank (0 of 8); after step its model states are zk.estimate's for N = 8."""
    out = tmp_path / "tl"
    assert main(["timeline", "--stage", "3", "--simulate-world-size", "8", "--model", "tiny", "--batch-size", "1",
                 "--device", "cpu", "--out", str(out)]) == 0
    capsys.readouterr()
    record = json.loads((out / "timeline.json").read_text())
    assert record["config"]["world_size"] == 8 and record["config"]["simulate_world_size"] == 8
    (rank,) = record["ranks"]
    assert rank["rank"] == 0
    assert [e["label"] for e in rank["events"] if e["kind"] == "boundary"] == list(BOUNDARIES)
    after_step = next(e for e in rank["events"] if e["label"] == "after step")
    est = zk.estimate(record["config"]["num_params"], 8, 3, "bf16")
    for c in MODEL_STATES:
        assert abs(after_step["bytes"][c] - getattr(est, c)) <= 0.01 * getattr(est, c), c
    assert any(e["kind"] == "collective" and e["op"] == "all_gather" for e in rank["events"])
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nproc_and_simulate_exclude_each_other(tmp_path, capsys):
    assert main(["timeline", "--stage", "1", "--nproc", "2", "--simulate-world-size", "4",
                 "--out", str(tmp_path)]) == 1
    assert "exclude each other" in capsys.readouterr().err


def test_stage_out_of_range_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["timeline", "--stage", "4"])
    assert exc.value.code == 2
    assert "between 0 and 3" in capsys.readouterr().err


def test_many_events_are_labelled_sparsely_but_boundaries_always():
    events = [{"index": i, "kind": "collective", "label": f"bucket {i}"} for i in range(400)]
    for i in (0, 150, 301, 398, 399):
        events[i]["kind"] = "boundary"
    chosen = _labelled(events, {123})
    assert len(chosen) <= MAX_LABELLED_EVENTS + 10
    assert {0, 150, 301, 398, 399, 123} <= set(chosen)
    assert _labelled(events[:20], set()) == list(range(20))
