#!/usr/bin/env python
"""Count measured figures left in zerokit's comments and docstrings.

A measured figure is a number with a unit of time (ns, us, ms, s, min), size (B, KB, KiB, MB,
MiB, GB, GiB, TB, TiB), rate (GB/s, MB/s, it/s, tokens/s), a speed ratio ("0.62x") or a
percentage, written in a comment or a docstring (a string that is a statement of its own) of a
file under zerokit/. Such a figure goes stale at the next run; it belongs in a results file the
comment cites (docs/style.md).

Not counted, because they are formulas or definitions, not measurements: any line that holds Ψ
(16Ψ/N and its worked examples), "≈" (a formula's value), a power such as 10^9, "e.g." (a
format example), or the words "default", "per element", "bytes per", "element size" or "by
definition"; a bare "B" counts only after a space ("0 B" is bytes, "7.5B" a parameter count); and
code itself (string literals that are not docstrings, such as
help texts and error messages, are not counted either).

    python scripts/count_figures.py          # total and per file
    python scripts/count_figures.py --all    # every hit: file:line: figure | line
"""
from __future__ import annotations

import argparse
import io
import re
import sys
import tokenize
from pathlib import Path

UNIT = (r"(?:ns|us|µs|ms|s|sec|secs|seconds|min|minutes|(?<=\s)B|KB|KiB|kB|MB|MiB|GB|GiB|TB|TiB"
        r"|GB/s|MB/s|GiB/s|it/s|tokens/s|steps/s)")
FIGURE = re.compile(rf"(?<![\w.^/])(\d+(?:\.\d+)?)(?:\s?{UNIT}(?![\w/])|x(?![\w])|\s?%)")
NOT_MEASURED = re.compile(r"Ψ|≈|\d\^\d|\bdefault|per element|bytes per|element size|by definition|e\.g\.",
                          re.IGNORECASE)


def text_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every comment line and docstring line of one file."""
    out: list[tuple[int, str]] = []
    source = path.read_text()
    prev = tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT,
                                                      tokenize.DEDENT, tokenize.NL):
            for i, line in enumerate(tok.string.splitlines()):
                out.append((tok.start[0] + i, line))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
        elif tok.type == tokenize.NL and prev == tokenize.NEWLINE:
            prev = tokenize.NEWLINE
    return out


def hits(path: Path) -> list[tuple[int, str, str]]:
    found = []
    for lineno, line in text_lines(path):
        if NOT_MEASURED.search(line):
            continue
        for m in FIGURE.finditer(line):
            found.append((lineno, m.group(0), line.strip()))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="list every hit")
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent.parent / "zerokit"))
    args = ap.parse_args(argv)
    root = Path(args.root)
    total = 0
    for path in sorted(root.rglob("*.py")):
        found = hits(path)
        if not found:
            continue
        total += len(found)
        rel = path.relative_to(root.parent)
        print(f"{len(found):4d}  {rel}")
        if args.all:
            for lineno, fig, line in found:
                print(f"      {rel}:{lineno}: {fig} | {line[:110]}")
    print(f"{total:4d}  measured figures in comments and docstrings under {root.name}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
