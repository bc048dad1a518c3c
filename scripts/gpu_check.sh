#!/usr/bin/env bash
# The GPU tier in one run on one CUDA GPU, written for an NVIDIA H200 and 8 minutes.
#
#   scripts/gpu_check.sh [OUT_DIR]            # OUT_DIR: else $OUT, else benchmarks/results/gpu/
#   scripts/gpu_check.sh --dry-run [OUT_DIR]  # CPU, tiny models: checks the script, measures nothing
#
# Steps, each under its own `timeout` (a hang costs at most that step); a failing step is
# recorded in summary.md and the next one runs:
#   0 preflight    a python whose torch sees CUDA (else: say so, exit 3), nvidia-smi, versions
#   1 tests        python -m pytest -q tests/gpu                                  -> tests_gpu.xml
#   2 side stream  python -m pytest -q tests/gpu/test_zero3_side_stream.py        -> side_stream.xml
#                  (stage 3's gathers on engine.gather_stream, poisoned and slowed so that a
#                  missing event wait shows; runs again on its own so a hang in 1 cannot hide it)
#   3 memory       benchmarks/memory.py --device cuda --model gpt2-xl --world-sizes 8 64
#                  -> memory_per_stage_<gpu>_gpt2-xl.{json,md}: per stage, simulated rank 0 of 8
#                  and of 64, bf16 + AdamW, 1 x 1024 tokens; ledger and allocator vs zk.estimate
#   3b phases      benchmarks/build_memory.py --gpu --device cuda
#                  -> build_memory_cuda.{json,md}: gpt2-xl built on the meta device, simulated rank 0
#                  of 64 (stage 3) and of 8 (stages 3, 2, 1); each phase's allocator peak (build, step,
#                  save, load) beside its bound; rows written as they finish
#   4 speed        benchmarks/speed.py --peers plain --nproc 1 --model gpt2-medium ...
#                  -> speed_vs_torch_plain_cuda.{json,md}: each stage at world size 1, bf16,
#                  against plain torch (autocast bf16; bf16 params), median of 10 steps x 2 rounds
#   5 scaling      benchmarks/scaling.py --sizes 50M 124M --world-sizes 1 ... (NCCL, one rank)
#                  -> scaling_cuda.{json,md,png}: the sweep's largest sizes, each stage beside
#                  DDP, ZeroRedundancyOptimizer, FSDP1 and FSDP2, fp32 and bf16
# Everything goes to one folder, 13 files: summary.md, log.txt (every step's output), 2 junit
# XML, 4 results sets (command, date, commit, machine and versions in each, through
# zerokit/provenance.py). Exit status: 0 when every step passed, 3 without a CUDA torch, else 1.
#
# Installs nothing: it uses the first of $PYTHON, .venv/bin/python, python3, python whose torch
# sees a GPU, and runs zerokit from this checkout (PYTHONPATH), so a CUDA torch already on the
# machine is what runs. Needs: torch with CUDA, numpy, tqdm, safetensors, pytest (pytest-timeout
# is used when present). Environment: PYTHON; GPU_CHECK_TIMEOUT_{PREFLIGHT,TESTS,SIDE,MEMORY,PHASES,SPEED,SCALING}
# (seconds, defaults 30/120/60/100/120/150, and SCALING 300: 880 s in all); ZEROKIT_GIT_COMMIT (the commit, when this
# tree is a copy without .git: the results then say so instead of "unknown").
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY_RUN=1
  shift
fi
case "${1:-}" in
  -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  -*) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
esac
OUT_DIR="${1:-${OUT:-$ROOT/benchmarks/results/gpu}}"
mkdir -p "$OUT_DIR" || exit 1
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SUMMARY="$OUT_DIR/summary.md"
LOG="$OUT_DIR/log.txt"
: >"$LOG"

T_PREFLIGHT="${GPU_CHECK_TIMEOUT_PREFLIGHT:-30}"
T_TESTS="${GPU_CHECK_TIMEOUT_TESTS:-120}"
T_SIDE="${GPU_CHECK_TIMEOUT_SIDE:-60}"
T_MEMORY="${GPU_CHECK_TIMEOUT_MEMORY:-100}"
T_PHASES="${GPU_CHECK_TIMEOUT_PHASES:-120}"
T_SPEED="${GPU_CHECK_TIMEOUT_SPEED:-150}"
T_SCALING="${GPU_CHECK_TIMEOUT_SCALING:-300}"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # zerokit from this checkout, in spawned ranks too
export PYTHONUNBUFFERED=1
START_EPOCH=$(date +%s)
START_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)

say() { echo "[gpu_check] $*" | tee -a "$LOG"; }

# ---------------------------------------------------------------------------- the commit
if head=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null); then
  if [ -n "$(git -C "$ROOT" status --porcelain 2>/dev/null)" ]; then head="$head-dirty"; fi
  COMMIT="$head"
elif [ -n "${ZEROKIT_GIT_COMMIT:-}" ]; then
  COMMIT="$ZEROKIT_GIT_COMMIT (given by ZEROKIT_GIT_COMMIT: no git checkout here)"
else
  COMMIT="unknown (no git checkout here; set ZEROKIT_GIT_COMMIT to record it)"
fi

# ---------------------------------------------------------------------------- step 0: preflight
# A python whose torch sees CUDA; in a dry run, any python with torch.
PROBE='import sys, torch; ok = torch.cuda.is_available(); print(f"torch {torch.__version__} (CUDA build {torch.version.cuda}), torch.cuda.is_available() = {ok}"); sys.exit(0 if ok else 1)'
[ "$DRY_RUN" = 1 ] && PROBE='import torch; print(f"torch {torch.__version__} (CUDA build {torch.version.cuda}), torch.cuda.is_available() = {torch.cuda.is_available()}")'
PY=""
PROBES=""
for candidate in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
  [ -n "$candidate" ] || continue
  command -v "$candidate" >/dev/null 2>&1 || [ -x "$candidate" ] || continue
  if answer=$(timeout -k 5 "$T_PREFLIGHT" "$candidate" -c "$PROBE" 2>&1); then
    PY="$candidate"
    PROBES+="- $candidate: ${answer##*$'\n'}"$'\n'
    break
  fi
  PROBES+="- $candidate: $(echo "$answer" | tail -n 1)"$'\n'
done

write_header() {
  {
    echo "# zerokit GPU check$([ "$DRY_RUN" = 1 ] && echo ' (DRY RUN: CPU, tiny models, no GPU figures)')"
    echo
    echo "- command (from the repository root): \`scripts/gpu_check.sh$([ "$DRY_RUN" = 1 ] && echo ' --dry-run') $OUT_DIR\`"
    echo "- started: $START_DATE; commit: $COMMIT"
    echo "- host: $(hostname 2>/dev/null || echo unknown), $(nproc 2>/dev/null || echo '?') CPUs, $(uname -srm)"
    echo "- python candidates (the first whose torch sees CUDA is used):"
    printf '%s' "$PROBES" | sed 's/^/  /'
  } >"$SUMMARY"
}

write_header
if [ -z "$PY" ]; then
  {
    echo
    echo "**No CUDA**: no python here has a torch for which \`torch.cuda.is_available()\` is True (see above)."
    echo "Nothing was run. This script installs nothing: run it where a CUDA build of torch is importable,"
    echo "or pass PYTHON=/path/to/python."
  } >>"$SUMMARY"
  say "no python with a CUDA torch found:"
  printf '%s' "$PROBES" | tee -a "$LOG"
  say "exiting (3) without running anything; see $SUMMARY"
  exit 3
fi
say "python: $PY ($("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])' 2>&1))"

{
  echo "- python: \`$("$PY" -c 'import sys; print(sys.executable)' 2>&1)\`"
  timeout -k 5 "$T_PREFLIGHT" "$PY" - <<'EOF' 2>&1
import importlib.util
import torch
import torch.distributed as dist
cuda = torch.cuda.is_available()
try:
    nccl = torch.cuda.nccl.version() if cuda and dist.is_nccl_available() else None
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
except Exception as exc:  # reported, not fatal
    nccl = f"unknown ({type(exc).__name__})"
print(f"- torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version() if cuda else None}, NCCL {nccl}")
for i in range(torch.cuda.device_count() if cuda else 0):
    p = torch.cuda.get_device_properties(i)
    print(f"- GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}, "
          f"{p.multi_processor_count} SMs")
# zerokit's tensor collectives go by torch 2.13's names, else the older ones (core/collectives/gather.py).
names = [f if hasattr(dist, f) else old for f, old in (("all_gather_single", "all_gather_into_tensor"),
                                                      ("reduce_scatter_single", "reduce_scatter_tensor"))]
print("- torch.distributed tensor collectives used: " + " / ".join(names))
mods = {m: importlib.util.find_spec(m) is not None for m in ("numpy", "tqdm", "safetensors", "pytest",
                                                             "pytest_timeout", "hypothesis", "matplotlib")}
print("- python packages: " + ", ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in mods.items()))
import zerokit
print(f"- zerokit imported from {zerokit.__file__}")
EOF
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "- nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm \
      --format=csv,noheader 2>&1 | head -n 4 | tr '\n' ';')"
  else
    echo "- nvidia-smi: not on PATH"
  fi
} >>"$SUMMARY"
cat "$SUMMARY" >>"$LOG"

TIMEOUT_FLAG=()
if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then
  TIMEOUT_FLAG=(--timeout=90)  # per test, inside the step's own timeout
fi

# ---------------------------------------------------------------------------- steps 1-4
ROWS=()
FAILED=0

# run_step NAME TIMEOUT_S CMD...: output to log.txt and the terminal; one summary row.
run_step() {
  local name="$1" limit="$2"
  shift 2
  local t0 rc secs verdict
  t0=$(date +%s)
  {
    echo
    echo "=================== $name (timeout ${limit} s): $*"
  } | tee -a "$LOG"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  secs=$(( $(date +%s) - t0 ))
  case "$rc" in
    0) verdict="passed" ;;
    124|137) verdict="TIMED OUT after ${limit} s" ;;
    *) verdict="FAILED" ;;
  esac
  echo "=================== $name: exit $rc after ${secs} s ($verdict)" | tee -a "$LOG"
  [ "$rc" = 0 ] || FAILED=1
  LAST_ROW="| $name | \`$*\` | $limit | $rc | $secs | $verdict |"
}

# junit_counts FILE: "tests T, failures F, errors E, skipped S", with " ALLSKIPPED" appended when T == S > 0.
junit_counts() {
  [ -f "$1" ] || { echo "no junit file (killed before pytest wrote it?)"; return; }
  "$PY" - "$1" <<'EOF' 2>&1
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(f"tests {n['tests']}, failures {n['failures']}, errors {n['errors']}, skipped {n['skipped']}"
      + (" ALLSKIPPED" if n["tests"] and n["tests"] == n["skipped"] else ""))
EOF
}

add_pytest_row() {  # after run_step for a pytest step: append the junit counts to the row
  local counts
  counts=$(junit_counts "$1")
  case "$counts" in
    *" ALLSKIPPED")
      counts="${counts% ALLSKIPPED}"
      if [ "$DRY_RUN" = 0 ]; then
        FAILED=1
        counts="$counts: EVERY TEST SKIPPED (nothing was checked on the GPU)"
      fi ;;
  esac
  ROWS+=("${LAST_ROW% |}; $counts |")
}

if [ "$DRY_RUN" = 1 ]; then
  MEMORY_ARGS=(--device cpu --model tiny --world-sizes 8 64 --stages 0 1 2 3 --precision bf16 --batch-size 1
               --seq-len 32 --steps 2)
  SPEED_ARGS=(--peers plain --nproc 1 --model tiny --precision bf16 --batch-size 8 --steps 4 --warmup 1 --rounds 2
              --bucket-numel 4194304)
  SCALING_ARGS=(--sizes 1M --world-sizes 1 --precisions fp32 --batch-size 1)
else
  # 1.56e9 parameters, 16 bytes each at stage 0: ~25 GB of model states; 1 x 1024 tokens of activations.
  MEMORY_ARGS=(--device cuda --model gpt2-xl --world-sizes 8 64 --stages 0 1 2 3 --precision bf16 --batch-size 1
               --seq-len 1024 --steps 2)
  # 355M parameters, 8 x 1024 tokens per step; buckets of zerokit's default size (4Mi elements).
  SPEED_ARGS=(--peers plain --nproc 1 --model gpt2-medium --precision bf16 --batch-size 8 --steps 15 --warmup 5
              --rounds 2 --bucket-numel 4194304)
  # the CPU sweep's two largest sizes, 8 x 64 tokens per step, one rank (one GPU)
  SCALING_ARGS=(--sizes 50M 124M --world-sizes 1 --precisions fp32 bf16 --batch-size 8)
fi

run_step "1 tests/gpu" "$T_TESTS" "$PY" -m pytest -q -p no:cacheprovider -rs ${TIMEOUT_FLAG[@]+"${TIMEOUT_FLAG[@]}"} \
  --junitxml="$OUT_DIR/tests_gpu.xml" tests/gpu
add_pytest_row "$OUT_DIR/tests_gpu.xml"

run_step "2 stage-3 side stream" "$T_SIDE" "$PY" -m pytest -q -p no:cacheprovider -rs ${TIMEOUT_FLAG[@]+"${TIMEOUT_FLAG[@]}"} \
  --junitxml="$OUT_DIR/side_stream.xml" tests/gpu/test_zero3_side_stream.py
add_pytest_row "$OUT_DIR/side_stream.xml"

run_step "3 memory per stage" "$T_MEMORY" "$PY" benchmarks/memory.py "${MEMORY_ARGS[@]}" --out "$OUT_DIR"
ROWS+=("${LAST_ROW% |}; writes \`memory_per_stage_*_$([ "$DRY_RUN" = 1 ] && echo tiny || echo gpt2-xl).{json,md}\` |")

if [ "$DRY_RUN" = 1 ]; then PHASES_ARGS=(--gpu --model tiny --device cpu --out "$OUT_DIR/build_memory_cpu_dry")
else PHASES_ARGS=(--gpu --device cuda --out "$OUT_DIR/build_memory_cuda"); fi
run_step "3b per-phase memory" "$T_PHASES" "$PY" benchmarks/build_memory.py "${PHASES_ARGS[@]}"
ROWS+=("${LAST_ROW% |}; writes \`build_memory_$([ "$DRY_RUN" = 1 ] && echo cpu_dry || echo cuda).{json,md}\` |")

run_step "4 step time vs plain torch" "$T_SPEED" "$PY" benchmarks/speed.py "${SPEED_ARGS[@]}" --out "$OUT_DIR"
ROWS+=("${LAST_ROW% |}; writes \`speed_vs_torch_plain_*.{json,md}\` |")

run_step "5 scaling beside the peers" "$T_SCALING" "$PY" benchmarks/scaling.py "${SCALING_ARGS[@]}" \
  --out "$OUT_DIR/scaling_$([ "$DRY_RUN" = 1 ] && echo cpu_dry || echo cuda)"
ROWS+=("${LAST_ROW% |}; writes \`scaling_*.{json,md,png}\` |")

# ---------------------------------------------------------------------------- summary
TOTAL=$(( $(date +%s) - START_EPOCH ))
{
  echo
  echo "| step | command | timeout s | exit | seconds | result |"
  echo "|---|---|---:|---:|---:|---|"
  printf '%s\n' "${ROWS[@]}"
  echo
  echo "- finished: $(date -u +%Y-%m-%dT%H:%M:%SZ), ${TOTAL} s in all; exit 124/137 = the step's timeout killed it"
  echo "- every step's output: log.txt; files here:"
  for f in "$OUT_DIR"/*; do [ -e "$f" ] && echo "  - $(basename "$f")"; done
  for md in "$OUT_DIR"/memory_per_stage_*.md "$OUT_DIR"/build_memory_*.md "$OUT_DIR"/speed_vs_torch_plain_*.md "$OUT_DIR"/scaling_*.md; do
    [ -f "$md" ] || continue
    echo
    echo "## $(basename "$md")"
    echo
    grep '^|' "$md"
  done
} >>"$SUMMARY"
echo
cat "$SUMMARY"
if [ "$FAILED" = 0 ]; then
  say "all steps passed in ${TOTAL} s; results in $OUT_DIR"
  exit 0
fi
say "some step failed (see the table above) after ${TOTAL} s; results in $OUT_DIR"
exit 1
