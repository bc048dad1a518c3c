"""The `zerokit` command line: one subcommand per module, imported only when chosen.

Each command module defines `add_arguments(parser)` and `run(args) -> int`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Order is the order `zerokit --help` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("zerokit.train", "train the built-in small GPT on the built-in corpus at any ZeRO stage"),
    "compare": ("zerokit.compare", "every stage on the same data: loss, memory, communication, time"),
    "memory": ("zerokit.memory_cmd", "per-rank memory by category for each stage (the lecture's table)"),
    "plan": ("zerokit.plan", "the lecture's decision flow, answered with bytes"),
    "explain": ("zerokit.explain", "where each parameter lands: rank, offset, padding, buckets, units"),
    "formats": ("zerokit.formats", "fp32 / fp16 / bf16 bit layouts and limits; --underflow measures gradients"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="zerokit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = argv[0] if argv else None
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
