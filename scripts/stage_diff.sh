#!/usr/bin/env bash
# What each ZeRO stage adds to the one before: diff -u of the stage files, in reading
# order ddp.py -> zero1.py -> zero2.py -> zero3.py (the last pair only once zero3.py exists).
# Usage: scripts/stage_diff.sh [--color]   (extra arguments go to diff)
#        scripts/stage_diff.sh --stat      lines per stage file (all / code: docstrings, comments and
#                                          blank lines dropped) and the code lines each step changes,
#                                          as the Markdown table the README shows
set -u
stages_dir="$(cd "$(dirname "$0")/../zerokit/stages" && pwd)"
files=(ddp.py zero1.py zero2.py zero3.py)
if [ "${1:-}" = "--stat" ]; then
    python3 - "$stages_dir" "${files[@]}" <<'PY'
import ast, io, os, subprocess, sys, tempfile, tokenize

def code_lines(path):
    """The file's code lines: comments, docstrings and blank lines dropped, each line stripped."""
    src = open(path).read()
    drop = set()  # line numbers inside docstrings
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                drop.update(range(first.lineno, first.end_lineno + 1))
    lines = src.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:  # cut the comment off its line
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    return [line.strip() for n, line in enumerate(lines, 1) if n not in drop and line.strip()]

stages_dir, files = sys.argv[1], [f for f in sys.argv[2:] if os.path.exists(os.path.join(sys.argv[1], f))]
code = {}
for f in files:
    code[f] = code_lines(os.path.join(stages_dir, f))
changed = {}
for a, b in zip(files, files[1:]):
    with tempfile.TemporaryDirectory() as tmp:  # GNU diff: the minimal edit
        for f in (a, b):
            with open(os.path.join(tmp, f), "w") as out:
                out.write("\n".join(code[f]) + "\n")
        diff = subprocess.run(["diff", os.path.join(tmp, a), os.path.join(tmp, b)], capture_output=True, text=True).stdout
    changed[b] = (f"{a[:-3]} → {b[:-3]}", sum(1 for d in diff.splitlines() if d[:2] in ("< ", "> ")))
# the README's table, as it stands there (tests/unit/test_signposts.py checks that it is current)
print("| file | lines | code lines | step | changed code lines |")
print("|---|---|---|---|---|")
for f in files:
    step, n = changed.get(f, ("", ""))
    lines = len(open(os.path.join(stages_dir, f)).read().splitlines())
    print("|" + "|".join(f" {c} " if c != "" else " " for c in (f, lines, len(code[f]), step, n)) + "|")
PY
    exit $?
fi
prev=""
for f in "${files[@]}"; do
    [ -f "$stages_dir/$f" ] || break
    if [ -n "$prev" ]; then
        echo "==================== $prev -> $f ===================="
        # diff exits 1 when the files differ, which is the point here: not an error.
        diff -u "$@" --label "stages/$prev" --label "stages/$f" "$stages_dir/$prev" "$stages_dir/$f"
        [ $? -le 1 ] || exit 2
        echo
    fi
    prev="$f"
done
exit 0
