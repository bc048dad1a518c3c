#!/usr/bin/env bash
# What each ZeRO stage adds to the one before: diff -u of the stage files, in reading
# order ddp.py -> zero1.py -> zero2.py -> zero3.py (the last pair only once zero3.py exists).
# Usage: scripts/stage_diff.sh [--color]   (extra arguments go to diff)
set -u
stages_dir="$(cd "$(dirname "$0")/../zerokit/stages" && pwd)"
files=(ddp.py zero1.py zero2.py zero3.py)
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
