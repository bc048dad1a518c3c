"""What checkpoint checksums cost per GB: hashing speed of the stdlib's strong hashes, and sha256 inside
engine.save / engine.load.

    python benchmarks/investigations/checksum_cost.py                     # 64M-parameter model, ~1 GB of checkpoint
    python benchmarks/investigations/checksum_cost.py --params-millions 16 --repeats 2   # quicker

Two measurements, each warmed up once and then repeated (the median is reported):

* in memory: GB/s of every strong hash in `hashlib` (and sha1 / md5, not collision-resistant, for
  scale) over one 256 MiB buffer: why zerokit uses sha256;
* in a checkpoint: one process (world size 1, stage 0, AdamW after one step) saves and loads a
  model of `--params-millions` fp32 parameters; beside the whole save / load time, the time to read
  back and sha256 every file of the checkpoint (what the save's and the load's digests do), per GB.
  It measures the current code only: an earlier version timed the digest inside save / load by
  patching zerokit's private digest function; benchmarks/results/checksum_cost.json holds that run.

The files are hashed right after they are written, so they come from the page cache: the cost is
the hash, not the disk. A cold load pays the disk once either way: the checksum pass reads the
files, and safetensors then reads them from the cache.

Writes benchmarks/results/checksum_cost.json and .md (command, date, commit, machine, versions).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import zerokit as zk  # noqa: E402
from zerokit import checkpoint  # noqa: E402  (its HASH: the hash zerokit uses)
from zerokit.provenance import command_line, provenance, provenance_lines, write_pair  # noqa: E402

STRONG = ["sha256", "blake2b", "blake2s", "sha512", "sha3_256"]
WEAK = ["sha1", "md5"]  # collision attacks known: listed for scale only
GB = 1e9


def hash_speeds(buffer_bytes: int, repeats: int) -> dict[str, float]:
    """GB/s of each hash over one buffer (median of `repeats`, after one warm-up)."""
    data = torch.randint(0, 256, (buffer_bytes,), dtype=torch.uint8).numpy().tobytes()
    out = {}
    for name in STRONG + WEAK:
        hashlib.new(name, data[:1 << 20]).hexdigest()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            hashlib.new(name, data).hexdigest()
            times.append(time.perf_counter() - t0)
        out[name] = buffer_bytes / statistics.median(times) / GB
    return out


def _hash_files(directory: str) -> tuple[float, int]:
    """Seconds and bytes to read back and sha256 every file under `directory`, as a checkpoint's digest does."""
    t0, nbytes = time.perf_counter(), 0
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            h = hashlib.sha256()
            with open(os.path.join(root, name), "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
                    nbytes += len(chunk)
    return time.perf_counter() - t0, nbytes


def _model(params_millions: float) -> nn.Module:
    width = 2048
    layers = max(1, round(params_millions * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def checkpoint_cost(params_millions: float, repeats: int, directory: str) -> dict:
    """Save and load one single-process checkpoint `repeats` times (after a warm-up); digest share of each."""
    model = _model(params_millions)
    numel = sum(p.numel() for p in model.parameters())
    engine = zk.shard(model, torch.optim.AdamW, stage=0, lr=1e-3)
    engine.backward(engine(torch.randn(2, 2048)).square().mean())
    engine.step()  # AdamW state exists: the rank file holds master, exp_avg, exp_avg_sq
    rows = {"save": [], "load": []}
    for i in range(repeats + 1):
        for kind, fn in (("save", lambda: engine.save(directory)), ("load", lambda: engine.load(directory))):
            t0 = time.perf_counter()
            fn()
            total = time.perf_counter() - t0
            digest_s, digest_bytes = _hash_files(directory)  # the same files, from the page cache
            if i > 0:  # the first round warms up
                rows[kind].append({"total_s": total, "digest_s": digest_s, "digest_bytes": digest_bytes})
    out = {"params": numel}
    for kind, runs in rows.items():
        total = statistics.median(r["total_s"] for r in runs)
        digest = statistics.median(r["digest_s"] for r in runs)
        nbytes = runs[0]["digest_bytes"]
        out[kind] = {"total_s": total, "digest_s": digest, "digest_bytes": nbytes,
                     "digest_s_per_gb": digest / (nbytes / GB), "digest_share": digest / total, "runs": runs}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-millions", type=float, default=64.0, help="fp32 parameters of the checkpointed model")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds (after one warm-up)")
    p.add_argument("--buffer-mib", type=int, default=256, help="buffer size for the in-memory hash speeds")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "checksum_cost",
                   help="results path without extension (.json and .md are written)")
    args = p.parse_args(argv)
    record = provenance(command_line(__file__, argv))
    record["torch_threads"] = torch.get_num_threads()

    speeds = hash_speeds(args.buffer_mib << 20, args.repeats)
    print(f"{'hash':>10} {'GB/s':>6} {'s/GB':>6}")
    for name, gbps in speeds.items():
        print(f"{name:>10} {gbps:6.2f} {1 / gbps:6.2f}{'   (not collision-resistant)' if name in WEAK else ''}")

    with tempfile.TemporaryDirectory(prefix="zerokit-checksum-") as tmp:
        cost = checkpoint_cost(args.params_millions, args.repeats, tmp)
    print(f"\ncheckpoint of {cost['params'] / 1e6:.1f}M fp32 params (AdamW), world size 1, stage 0:")
    print(f"{'':>5} {'files GB':>8} {'total s':>8} {'sha256 s':>8} {'sha256 s/GB':>11} {'share':>6}")
    for kind in ("save", "load"):
        c = cost[kind]
        print(f"{kind:>5} {c['digest_bytes'] / GB:8.3f} {c['total_s']:8.2f} {c['digest_s']:8.2f} "
              f"{c['digest_s_per_gb']:11.2f} {c['digest_share']:6.1%}")

    result = {**record, "hash_gb_per_s": speeds, "buffer_bytes": args.buffer_mib << 20, "checkpoint": cost,
              "repeats": args.repeats}
    write_pair(args.out, result, _markdown(result))
    return 0


def _markdown(r: dict) -> str:
    c = r["checkpoint"]
    lines = ["# What checkpoint checksums cost per GB", "", *provenance_lines(r),
             f"- torch threads: {r['torch_threads']}; median of {r['repeats']} rounds after one warm-up", "",
             f"## Hash speed in memory ({r['buffer_bytes'] >> 20} MiB buffer)", "",
             "| hash | GB/s | s per GB | |", "|---|---|---|---|"]
    for name, gbps in r["hash_gb_per_s"].items():
        note = "used by zerokit" if name == checkpoint.HASH else ("not collision-resistant" if name in WEAK else "")
        lines.append(f"| {name} | {gbps:.2f} | {1 / gbps:.2f} | {note} |")
    lines += ["", f"## sha256 inside engine.save / engine.load ({c['params'] / 1e6:.1f}M fp32 params, AdamW, "
              "world size 1, stage 0)", "",
              "Files hashed right after they are written (page cache): the cost of the hash, not of the disk. "
              "save: every file read back and hashed once; load: every file hashed once before it is used.", "",
              "| | files GB | whole call s | sha256 s | sha256 s per GB | share of the call |", "|---|---|---|---|---|---|"]
    for kind in ("save", "load"):
        k = c[kind]
        lines.append(f"| {kind} | {k['digest_bytes'] / GB:.3f} | {k['total_s']:.2f} | {k['digest_s']:.2f} | "
                     f"{k['digest_s_per_gb']:.2f} | {k['digest_share']:.0%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
