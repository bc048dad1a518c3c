"""Where stage 1's step time goes beside torch's ZeroRedundancyOptimizer over DDP: phase by phase.

    python benchmarks/investigations/stage1_phases.py                 # 2 gloo ranks, model small, bucket 65536, 4 rounds
    python benchmarks/investigations/stage1_phases.py --nproc 2 --model small --steps 30 --warmup 5 --rounds 4 --bucket-numel 65536

The same runs as benchmarks/speed.py's stage 1 pair (same weights, batches, AdamW with
the decay / no-decay split, bucket size; ZeroRedundancyOptimizer with `parameters_as_bucket_view`
over DDP with `gradient_as_bucket_view`), timed phase by phase through stage0_phases.py's loop:
zero_grad, the forward, the backward including the wait for its gradient collectives, and the
optimizer step including the parameters' way back to every rank (zerokit: one coalesced
all-gather of the updated shards; torch: one broadcast per rank's parameter bucket). Medians over
the steps after `--warmup`, then over rounds (which alternate the order), on the slowest rank.
"gradient collectives per step": zerokit's reduce-scatters (one per trainable bucket, each as it
is released in backward), for stage 1 as it is (buckets close once full, DDP's rule) and with
buckets capped at `--bucket-numel` (stage 1 before that change, run alongside); torch's DDP
all-reduces (`_get_ddp_logging_data()`'s `rebuilt_bucket_sizes`).

Writes benchmarks/results/stage1_phases.json and .md (command, date, commit, machine, versions).
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from zerokit.bench import no_decay  # noqa: E402
import speed as S  # noqa: E402  (the peers' construction, the data, the no-decay split)
import stage0_phases as P  # noqa: E402  (the phase-timing loop, the summary and the table)
from zerokit.provenance import provenance_lines  # noqa: E402

ZK, ZERO = "zerokit stage 1", "torch ZeroRedundancyOptimizer"
CAPPED = "zerokit stage 1, buckets capped (before)"
RUNS = (ZK, ZERO, CAPPED)
COLLECTIVES = "gradient collectives per step"


def _capped(build_flat_params, *args, close_when_full, **kwargs):
    """Stage 1's buckets as they were: none above `bucket_numel` (stage 0's and stage 2's rule)."""
    return build_flat_params(*args, close_when_full=False, **kwargs)


def _build(name: str, cfg: dict):
    """(zero_grad, forward -> loss, backward(loss), step, gradient collectives per step)."""
    import zerokit as zk
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    from zerokit.models import Block

    model = S._initial_model(cfg)
    if name in (ZK, CAPPED):
        import zerokit.stages.zero1 as zero1

        build_flat_params = zero1.build_flat_params
        if name == CAPPED:
            zero1.build_flat_params = functools.partial(_capped, build_flat_params)
        try:
            engine = zk.shard(model, torch.optim.AdamW, stage=1, lr=cfg["lr"], weight_decay=0.1,
                              bucket_numel=cfg["bucket_numel"], wrap=(Block,), param_groups=no_decay)
        finally:
            zero1.build_flat_params = build_flat_params
        return (engine.zero_grad, lambda x, y: engine(x, y)[1], engine.backward, engine.step,
                lambda: len(engine.trainable))
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_numel"] * 4 / 2**20, gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(S._param_groups(model), optimizer_class=torch.optim.AdamW,
                                  parameters_as_bucket_view=True, lr=cfg["lr"], weight_decay=0.1, foreach=True)
    return (lambda: opt.zero_grad(set_to_none=False), lambda x, y: ddp(x, y)[1], lambda loss: loss.backward(),
            opt.step, lambda: P.ddp_all_reduces(ddp))


def main(argv: list[str] | None = None) -> int:
    return P.main(argv, script=__file__, doc=__doc__, build=_build, runs=RUNS, peer=ZERO, collectives=COLLECTIVES,
                  markdown=_markdown)


def _markdown(r: dict) -> str:
    c = r["config"]
    return "\n".join([
        "# Stage 1 beside torch ZeroRedundancyOptimizer, phase by phase", "", *provenance_lines(r),
        f"- {r['nproc']} gloo ranks, model {c['model']}, {c['batch_size']} x {c['block_size']} tokens per rank per "
        f"step, fp32 AdamW (lr {c['lr']}, weight decay 0.1, none on biases/LayerNorms), bucket {c['bucket_numel']} "
        f"elements (DDP: bucket_cap_mb = that x 4 bytes, gradient_as_bucket_view; ZeroRedundancyOptimizer: "
        f"parameters_as_bucket_view); {c['rounds']} rounds of {c['steps']} steps, the first {c['warmup']} of each "
        f"left out; medians, slowest rank",
        "", *P.table(r["rows"], peer=ZERO, collectives=COLLECTIVES), "",
        "Each phase is timed on its own; \"sum\" adds the phases' medians, \"whole step\" is the median of each "
        "step's four phases together (what benchmarks/speed.py times): the two differ where a phase varies. \"backward\" "
        "includes waiting for the gradient collectives: zerokit reduce-scatters each bucket as it is released (on "
        "gloo an all-to-all and a sum in rank order: core/collectives/ordered.py [Note: ordered reduction]), torch's DDP "
        "all-reduces its buckets, which close once they reach the cap. Stage 1's buckets follow DDP's rule too (a "
        "bucket closes once it holds `bucket_numel` elements or more: zerokit/stages/zero1.py [Note: stage 1's "
        f"buckets]); \"{CAPPED}\" is the same engine with buckets that never exceed the cap, stage 0's and stage 2's "
        "rule and stage 1's before the change, run alongside to show what the change is worth. \"step\" includes "
        "bringing the updated parameters to every "
        "rank: zerokit's one coalesced all-gather of every bucket's shard, torch's one broadcast per rank (its "
        "parameters for each rank lie in one bucket)."]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
