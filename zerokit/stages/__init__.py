"""One file per ZeRO stage, read in order: ddp.py (0), zero1.py, zero2.py, zero3.py.

Each adds exactly one idea to the one before; `scripts/stage_diff.sh` shows the diffs.
"""
