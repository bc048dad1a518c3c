"""Sharded checkpoints: every rank writes what it owns; any world size, stage or precision reads it back.

`engine.save(dir)` / `engine.load(dir)` come from the `Checkpointing` mixin below. The package
splits by seam:

    format.py    names, file layout, piece keys, meta.json and current.json, digests; no process
                 group (the directory layout and [Note: pieces keyed by name and range] are there)
    commit.py    `save`: agreement across ranks, atomic writes, fsync, the commit pointer
                 ([Note: the commit protocol])
    loading.py   `load`: verify every file, plan which saved pieces each rank reads, install
                 ([Note: loading], [Note: hyperparameters]); `load_full_state_dict` for no process group
    weights.py   `load_weights`: pretrained weights (safetensors, HF sharded index) read by slices
                 ([Note: loading pretrained weights])

A checkpoint of format version 1 (files directly in the directory, no checksums) is refused
with a message.
"""
from __future__ import annotations

import os

from zerokit.checkpoint.commit import save
from zerokit.checkpoint.format import (FORMAT, HASH, META_FILE, MODEL_FILE, MODEL_INDEX_FILE, POINTER_FILE, VERSION,
                                       piece_key, rank_file)
from zerokit.checkpoint.loading import committed_snapshot, load, load_full_state_dict

__all__ = ["save", "load", "load_full_state_dict", "committed_snapshot", "rank_file", "piece_key", "Checkpointing",
           "POINTER_FILE", "META_FILE", "MODEL_FILE", "MODEL_INDEX_FILE", "FORMAT", "VERSION", "HASH"]


class Checkpointing:
    """`engine.save(dir)` / `engine.load(dir)`: mixed into every stage's engine (before core's Engine).

    Generic over stages: everything goes through the engine interface (`flat_params`, the
    optimizer's master shards and states, `load_flat_params`), so core never imports this package.
    """

    def save(self, directory: str | os.PathLike, extra: dict | None = None,
             max_shard_size: int | str | None = None) -> None:
        """Write a sharded checkpoint (every rank its own range; rank 0 the model and meta). A collective.
        `max_shard_size` ("5GB", or bytes): the model as Hugging Face's sharded files and index (format.py)."""
        save(self, directory, extra=extra, max_shard_size=max_shard_size)

    def load(self, directory: str | os.PathLike) -> dict:
        """Load a checkpoint saved at any world size, stage or precision; returns its meta (with `extra`)."""
        return load(self, directory)

    def load_weights(self, path: str | os.PathLike, strict: bool = True) -> dict:
        """Pretrained weights (a .safetensors file, a directory with model.safetensors, or a Hugging Face index),
        each rank reading only the ranges it keeps; optimizer state starts afresh (checkpoint/weights.py)."""
        from zerokit.checkpoint.weights import load_weights
        return load_weights(self, path, strict=strict)
