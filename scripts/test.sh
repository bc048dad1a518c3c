#!/usr/bin/env bash
# The whole test suite: unit (no process group), distributed (gloo ranks on CPU), gpu (NCCL;
# skipped without GPUs). Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit -x`.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
# Every test has a hard deadline (pytest-timeout) so a hang fails fast.
python -m pytest -q -p no:cacheprovider --timeout=300 "${@:-tests}"
