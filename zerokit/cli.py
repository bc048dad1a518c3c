"""The `zerokit` command line: one subcommand per module, imported only when chosen.

Each command module (zerokit/commands/) defines `add_arguments(parser)` and `run(args) -> int`,
and types its numeric options with `int_in_range` / `float_in_range` below, so a number out of
range is refused by argparse (exit 2) with the valid range in the message, before anything
runs. Parameter counts and memory sizes (`zerokit memory`, `zerokit plan`) are typed with
`parse_count` / `parse_bytes`, and `--model` presets resolved with `model_preset`, below too.

Errors: a user mistake found while running — an unknown model, a missing or refused
checkpoint, found here or inside a rank — raises ValueError, TypeError or OSError; `main`
prints it as one line on stderr and returns 1. `--verbose` (or ZEROKIT_VERBOSE=1) prints the
full traceback instead, every failing rank's. Any other exception is a bug and always
keeps its traceback. Ctrl-C returns 130 and SIGTERM 143, after every `finally` has run (the
process group is destroyed); an error caused by the signal (a peer left a collective) is
reported as the interruption.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import signal
import sys
import threading
import traceback
from decimal import Decimal, InvalidOperation
from typing import Any, Callable

# name -> (module, one-line help). Order is the order `zerokit --help` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("zerokit.commands.train", "train the built-in small GPT on the built-in corpus at any ZeRO stage"),
    "compare": ("zerokit.commands.compare", "every stage on the same data: loss, memory, communication, time"),
    "memory": ("zerokit.commands.memory", "per-rank memory by category for each stage (the table of CS224N lecture 12)"),
    "timeline": ("zerokit.commands.timeline", "one training step's per-rank memory, by category, at every event"),
    "plan": ("zerokit.commands.plan", "CS224N lecture 12's decision flow, answered with bytes"),
    "explain": ("zerokit.commands.explain", "where each parameter lands: rank, offset, padding, buckets, units"),
    "formats": ("zerokit.commands.formats", "fp32 / fp16 / bf16 bit layouts and limits; --underflow measures gradients"),
}


# ----------------------------------------------------------------------------- argument types
def _range_text(low: float | None, high: float | None, low_open: bool = False) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"<= {high:g}"
    return f"between {low:g} and {high:g}"


def int_in_range(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse `type=`: an integer in [low, high] (None: unbounded); the error names the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {_range_text(low, high)}, got {value}")
        return value
    parse.__name__ = "int"  # argparse names the type in its own messages
    return parse


def float_in_range(low: float | None = None, high: float | None = None, *,
                   low_open: bool = False) -> Callable[[str], float]:
    """An argparse `type=`: a finite float in [low, high], or (low, ...] with low_open; the error names the range."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if value != value or value in (float("inf"), float("-inf")) or too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be a number {_range_text(low, high, low_open)}, got {text}")
        return value
    parse.__name__ = "float"
    return parse


positive_int = int_in_range(1)
non_negative_int = int_in_range(0)
non_negative_float = float_in_range(0.0)
positive_float = float_in_range(0.0, low_open=True)

# Decimal units first: they are what `auto` chooses from, matching the GB of CS224N lecture 12.
UNITS: dict[str, int] = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
_COUNT_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_NUMBER = r"([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)"


def parse_count(text: str) -> int:
    """A parameter count: "7.5e9", "7_500_000_000", "7.5B", "350M", "125k" -> int (must be whole)."""
    match = re.fullmatch(_NUMBER + r"\s*([kKmMbBgGtT]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (try 7.5e9 or 7.5B)")
    try:
        value = Decimal(match.group(1).replace("_", "")) * _COUNT_SUFFIXES[match.group(2).upper()]
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r}") from None
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"parameter count {text!r} is not a whole number")
    return int(value)


def parse_bytes(text: str) -> int:
    """A memory size: "80" (GB, 10^9 bytes), "80GB", "80GiB", "512MiB" -> bytes."""
    match = re.fullmatch(_NUMBER + r"\s*([KMGT]i?B|B)?", text.strip(), flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (try 80, 80GB or 80GiB)")
    unit = match.group(2) or "GB"
    # Case-insensitive lookup, but keep the 'i' meaning binary: "gib" -> "GiB".
    canonical = {u.lower(): u for u in UNITS}[unit.lower()]
    value = Decimal(match.group(1).replace("_", "")) * UNITS[canonical]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"memory size must be positive, got {text!r}")
    return int(value)


def model_preset(command: str, name: str) -> tuple[Any, int]:
    """`--model NAME` of `zerokit <command>`: (the models.py preset's GPTConfig, its parameter count Ψ).

    An unknown name exits with one line naming the command and the presets.
    """
    from zerokit import models  # lazy: torch is only needed when a preset is asked for

    try:
        cfg = models.preset(name)
    except ValueError as err:
        raise SystemExit(f"zerokit {command}: --model: {err}") from None
    return cfg, models.num_params(cfg)


# ----------------------------------------------------------------------------- errors
def verbose_requested(args: argparse.Namespace | None = None) -> bool:
    """--verbose on the command line, or ZEROKIT_VERBOSE set to anything but '' or '0'."""
    return bool(getattr(args, "verbose", False)) or os.environ.get("ZEROKIT_VERBOSE", "") not in ("", "0")


def one_line(message: str) -> str:
    """A multi-line error message on one line; per-rank lines that say the same thing are merged.

    "cannot load X:\n  rank 0: f is corrupted\n  rank 1: f is corrupted" becomes
    "cannot load X: ranks 0, 1: f is corrupted".
    """
    parts, ranks_of = [], {}
    for line in str(message).splitlines():
        line = line.strip()
        match = re.fullmatch(r"rank (\d+): (.*)", line)
        if match is None:
            if line:
                parts.append(line)
        elif match.group(2) in ranks_of:
            ranks_of[match.group(2)].append(match.group(1))
        else:
            ranks_of[match.group(2)] = [match.group(1)]
            parts.append(match.group(2))
    for i, part in enumerate(parts):
        if part in ranks_of:
            ranks = ranks_of[part]
            parts[i] = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}: {part}"
    text = ""
    for part in parts:
        text += part if not text else (" " if text.endswith(":") else "; ") + part
    return text.removeprefix("zerokit: ")


def report_error(command: str, exc: BaseException, verbose: bool) -> int:
    """Print `exc` for the user; return the exit status (1)."""
    from zerokit.launch import USER_ERRORS, RankFailed

    if isinstance(exc, RankFailed):  # a rank's failure, carried back by zerokit.launch
        if verbose or not exc.user_error:
            print(str(exc), file=sys.stderr)
            return 1
        where = f" (rank {exc.rank} of {exc.world_size})" if exc.rank is not None else ""
        print(f"zerokit {command}: error{where}: {one_line(exc.message)}", file=sys.stderr)
        return 1
    if verbose or not isinstance(exc, USER_ERRORS):
        traceback.print_exception(exc, file=sys.stderr)
        return 1
    print(f"zerokit {command}: error: {one_line(exc)}", file=sys.stderr)
    return 1


class _Signalled(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM (torchrun stopping the other ranks after one failed)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_raise():
    """SIGINT and SIGTERM raise _Signalled in the main thread, so every `finally` runs (the process
    group is destroyed); the signal is remembered, so an error it causes (a collective whose peer
    left) is reported as the interruption it is."""
    received: list[int] = []

    def handler(signum, frame):
        received.append(signum)
        for s in (signal.SIGINT, signal.SIGTERM):  # once: a second Ctrl-C must not cut the teardown short
            signal.signal(s, signal.SIG_IGN)
        raise _Signalled(signum)
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="zerokit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = argv[0] if argv else None
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(p)
            p.add_argument("--verbose", action="store_true",
                           help="on an error, print full tracebacks (every failing rank's) instead of one line; "
                                "also ZEROKIT_VERBOSE=1")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    with _signals_raise() as received:
        try:
            return int(module.run(args) or 0)
        except (KeyboardInterrupt, Exception) as exc:  # noqa: BLE001 -- reported here, see the module docstring
            signum = received[0] if received else (signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None)
            if signum is None:
                return report_error(args.command, exc, verbose_requested(args))
            if verbose_requested(args):
                traceback.print_exception(exc, file=sys.stderr)
            print(f"zerokit {args.command}: {'interrupted' if signum == signal.SIGINT else 'stopped'} "
                  f"({signal.Signals(signum).name})", file=sys.stderr)
            return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
