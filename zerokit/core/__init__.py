"""Shared machinery: collectives, partition math, flat params, buckets, hooks, precision, memory.

Stages import from here; nothing here imports a stage.
"""
