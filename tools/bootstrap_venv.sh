#!/usr/bin/env bash
# Create (or top up) the project virtual environment used by `make test` and `make demo`.
#
# * If the interpreter that runs this script already imports torch (a user's CUDA build, say),
#   the venv sees it through --system-site-packages and torch is never reinstalled or replaced.
# * Otherwise the CPU build torch==$TORCH_CPU_VERSION is installed (on the project's CPU
#   machines it lies on disk and installs offline).
# * Everything else comes from tools/requirements/pinned-cpu.txt, with torch constrained to the
#   version present so no dependency can swap it out.
set -euo pipefail
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_CPU_VERSION="${TORCH_CPU_VERSION:-2.13.0}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "[bootstrap] reusing the torch of $PYTHON ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "[bootstrap] installing torch==$TORCH_CPU_VERSION (CPU build)"
  "${PIP[@]}" install -q "torch==$TORCH_CPU_VERSION"
fi
TORCH_HAVE="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH_HAVE" > "$CONSTRAINTS"
echo "[bootstrap] installing pinned requirements (torch stays at $TORCH_HAVE)"
"${PIP[@]}" install -q -c "$CONSTRAINTS" -r "$ROOT/tools/requirements/pinned-cpu.txt"
# The product and, as a second distribution, the example trainer (python -m gpt_trainer), both
# editable: the studies and the CPU shims (mechmon_megatron.research / .testing) are not in the
# wheel and import from this checkout through the editable install.
"${PIP[@]}" install -q -c "$CONSTRAINTS" --no-deps -e "$ROOT" -e "$ROOT/examples/pretrain_scripts"
echo "[bootstrap] ready: $VENV (torch $TORCH_HAVE)"
