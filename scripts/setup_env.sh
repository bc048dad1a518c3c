# Sourced by demo.sh and test.sh: create or reuse .venv and install zerokit into it.
#
# The venv sees system site-packages, so a torch you already have (say a CUDA build) is
# kept; torch is installed only when it is not importable, and then pinned to the CPU
# wheel torch==2.13.0 (never an unpinned torch, which would pull a multi-GB CUDA build).
set -euo pipefail
ZK_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ZK_VENV="${ZK_VENV:-$ZK_ROOT/.venv}"
if [ ! -x "$ZK_VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv --system-site-packages "$ZK_VENV"
fi
# shellcheck disable=SC1091
source "$ZK_VENV/bin/activate"
if ! python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] torch is not importable: installing torch==2.13.0 (CPU)"
  python -m pip install -q "torch==2.13.0"
fi
# Checked from / so that the checkout itself (the current directory) does not count as installed.
if ! (cd / && python -c "import zerokit, pytest, pytest_timeout, hypothesis, matplotlib, tqdm, safetensors, transformers, peft") >/dev/null 2>&1 \
   || [ "$(cd / && python -c 'import zerokit, os; print(os.path.dirname(os.path.dirname(zerokit.__file__)))' 2>/dev/null)" != "$ZK_ROOT" ]; then
  echo "[setup] installing zerokit (editable) with test and plot extras"
  python -m pip install -q -e "$ZK_ROOT[test,plots]"
fi
cd "$ZK_ROOT"
