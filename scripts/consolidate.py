"""Turn a zerokit checkpoint directory into one plain, unsharded safetensors state_dict.

    python scripts/consolidate.py CHECKPOINT_DIR OUT.safetensors

The output has exactly the unwrapped model's state_dict keys (tied names each hold their own
copy), with fp32 master values for trained parameters: what `engine.state_dict(full=True)`
returns, loadable with `model.load_state_dict(safetensors.torch.load_file(OUT))`. No process
group and no GPU are needed; optimizer state is left out (resume from the directory itself).
It reads the snapshot CHECKPOINT_DIR/current.json names, after checking meta.json and the model
file (or, saved with max_shard_size, its shards and index) against their sha256 (zerokit/checkpoint/format.py [Note: checksums]); a missing, corrupted or
old-format checkpoint exits with status 2 and one line naming the file, and OUT is not written.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from safetensors.torch import save_file  # noqa: E402

from zerokit.checkpoint import load_full_state_dict  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="directory written by engine.save / zerokit train --save")
    parser.add_argument("out", help="output .safetensors file")
    args = parser.parse_args(argv)
    try:
        state = load_full_state_dict(args.checkpoint)
    except ValueError as exc:
        print(f"consolidate: {exc}", file=sys.stderr)
        return 2
    # safetensors refuses two keys on one storage: each tied name gets its own copy.
    save_file({k: v.contiguous().clone() for k, v in state.items()}, args.out, metadata={"format": "pt"})
    numel = sum(v.numel() for v in state.values())
    print(f"wrote {args.out}: {len(state)} tensors, {numel:,} elements")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
