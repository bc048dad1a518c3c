"""Accounting: what memory and communication should cost, and what they did.

`estimate.py` (the per-rank formulas, torch-free) and `ledger.py` (the measured ledger of a live
engine). Reads core/params (to count what a flat param holds) and core/collectives; nothing in
core/ but the engine's callers imports it.
"""
