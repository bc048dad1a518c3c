"""The `zerokit` subcommands, one module each (zerokit/cli.py imports only the one chosen).

  train     `zerokit train`: the built-in GPT on the built-in corpus at any ZeRO stage
  compare   `zerokit compare`: every stage and torch's DDP on the same data, side by side
  memory    `zerokit memory`: per-rank model-state bytes for each stage, or measured (--simulate)
  plan      `zerokit plan`: CS224N lecture 12's decision flow, answered with bytes
  explain   `zerokit explain`: where each parameter lands (rank, offset, padding, buckets, units)
  formats   `zerokit formats`: fp32 / fp16 / bf16 bit layouts and limits, fp16 underflow
  step      `train_step`: one optimizer step (micro-batches, backward, clip, step), shared by
            train, compare, the benchmarks and the tests
"""
