#!/usr/bin/env bash
# Set up, then run the main demonstration: every ZeRO stage (and torch DDP) on the same data
# on 2 CPU ranks, one table (loss, bytes per rank by category, communication, step time).
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
python -m zerokit compare --nproc 2 "$@"
