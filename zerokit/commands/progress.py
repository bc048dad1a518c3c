"""A progress display that suits where the output goes: tqdm's bar on a terminal, plain lines elsewhere.

A tqdm bar redraws itself with carriage returns; written into a file, a pipe or a CI log (`nohup`, `| tee`)
every redraw piles onto one line of many kilobytes. Where stderr is not a terminal, `progress` prints one
plain line after the first step, then one every `every_s` seconds and one at the end, as Accelerate and
Hugging Face's trainers do (the rate in tqdm's words, so whoever waits for "step/s" finds it either way):

    stage 2 x2 fp32: step 120/300 (40%), 31.2 s, 3.85 step/s, loss=3.121, tok_s=5,120
"""
from __future__ import annotations

import sys
import time


class PlainProgress:
    """tqdm's `update` / `set_postfix` / `close`, printed as a line at most every `every_s` seconds."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", every_s: float = 10.0, file=None,
                 clock=time.monotonic):
        self.total, self.n, self.desc, self.every_s = total, initial, desc, every_s
        self.file = file if file is not None else sys.stderr
        self.clock = clock
        self.start = self.last = clock()
        self.postfix: dict[str, str] = {}
        self.initial = initial
        self.printed_at: int | None = None

    def set_postfix(self, **values) -> None:
        self.postfix = {k: str(v) for k, v in values.items()}

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if self.printed_at is None or now - self.last >= self.every_s:
            self.last = now
            self._print(now)

    def close(self) -> None:
        if self.printed_at != self.n:
            self._print(self.clock())

    def line(self, now: float) -> str:
        share = f" ({self.n / self.total:.0%})" if self.total else ""
        seconds = now - self.start
        rate = f", {(self.n - self.initial) / seconds:.2f} step/s" if seconds > 0 else ""
        extra = "".join(f", {k}={v}" for k, v in self.postfix.items())
        return f"{self.desc}: step {self.n}/{self.total}{share}, {seconds:.1f} s{rate}{extra}"

    def _print(self, now: float) -> None:
        print(self.line(now), file=self.file, flush=True)
        self.printed_at = self.n


def progress(total: int, initial: int = 0, desc: str = "", every_s: float = 10.0):
    """tqdm's bar when stderr is a terminal, else a `PlainProgress` (see the module docstring)."""
    if sys.stderr.isatty():
        from tqdm import tqdm
        return tqdm(total=total, initial=initial, unit="step", desc=desc)
    return PlainProgress(total, initial, desc, every_s)
