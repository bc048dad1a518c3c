"""`zerokit train`'s progress display: tqdm's bar on a terminal, plain lines every few seconds in a log."""
import io

from zerokit.commands.progress import PlainProgress, progress


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_log_gets_one_plain_line_per_interval_and_one_at_the_end():
    out, clock = io.StringIO(), Clock()
    bar = PlainProgress(total=300, initial=100, desc="stage 2 x2 fp32", every_s=10.0, file=out, clock=clock)
    for step in range(200):
        clock.now += 0.25  # 4 steps a second: a line every 40 steps
        bar.set_postfix(loss=f"{3.0 - step / 1000:.3f}")
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 6, lines  # after the first step, then at 10.25, 20.25, ... s, then the end
    assert lines[0] == "stage 2 x2 fp32: step 101/300 (34%), 0.2 s, 4.00 step/s, loss=3.000"
    assert lines[1] == "stage 2 x2 fp32: step 141/300 (47%), 10.2 s, 4.00 step/s, loss=2.960"
    assert lines[-1].startswith("stage 2 x2 fp32: step 300/300 (100%), 50.0 s, 4.00 step/s")


def test_close_prints_the_final_state_once():
    out, clock = io.StringIO(), Clock()
    bar = PlainProgress(total=3, desc="d", every_s=10.0, file=out, clock=clock)
    bar.update(1)
    bar.close()
    assert out.getvalue().splitlines() == ["d: step 1/3 (33%), 0.0 s"]  # printed at the first step, once


def test_not_a_terminal_means_plain_lines(capsys):
    bar = progress(10, desc="x")  # pytest's captured stderr is not a terminal
    assert isinstance(bar, PlainProgress)
