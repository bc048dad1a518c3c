#!/usr/bin/env bash
# Set up, then train the small GPT for 300 steps on 2 CPU ranks, then run the main
# demonstration: every ZeRO stage (and torch DDP) on the same data
# on 2 CPU ranks, one table (loss, bytes per rank by category, communication, step time), in fp32
# and again in bf16 with fp32 masters.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
# 1. a few hundred steps of the small GPT at stage 2 on 2 ranks: the loss falls from ~4.6 to ~2.7
python -m zerokit train --stage 2 --nproc 2 --steps 300
# 2. every stage side by side
python -m zerokit compare --nproc 2 "$@"
# 3. the lecture's mixed-precision row: bf16 params and grads (2Ψ + 2Ψ) with fp32 masters and Adam states
#    (4Ψ + 8Ψ = 12Ψ) at stage 0, each sharded in turn, measured by the ledger beside the formula
python -m zerokit compare --nproc 2 --precision bf16 --steps 20 --out out/compare_bf16
