#!/usr/bin/env bash
# Create (or top up) the "current" virtual environment used by `make test-current`:
# Python 3.12, torch from the package index, megatron-core 0.19.x, DeepSpeed, the test tools.
#
# * The interpreter: $PYTHON_CURRENT if set, else `python3.12` on PATH (a pyenv shim counts only
#   if it runs), else the newest `$(pyenv root)/versions/3.12.*`. None found: a message says how
#   to get one, and the script exits with 2.
# * torch==$TORCH_CURRENT_VERSION from the package index. For Python 3.12 the index serves the
#   CUDA build (about 4.7 GB in the venv with its nvidia-* runtime wheels); it runs on the CPU.
# * Everything else comes from tools/requirements/pinned-current.txt, with torch constrained to
#   the version present so no dependency can swap it out; then the project, editable, no deps.
set -euo pipefail
VENV="${1:-.venv-current}"
TORCH_CURRENT_VERSION="${TORCH_CURRENT_VERSION:-2.13.0}"
WANT="3.12"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"

is_wanted() {  # $1 runs and is CPython $WANT
  [ -n "$1" ] && "$1" -c "import sys; sys.exit(0 if '%d.%d' % sys.version_info[:2] == '$WANT' else 1)" >/dev/null 2>&1
}

find_python() {
  if [ -n "${PYTHON_CURRENT:-}" ]; then
    if is_wanted "$PYTHON_CURRENT"; then echo "$PYTHON_CURRENT"; return 0; fi
    echo "[bootstrap-current] PYTHON_CURRENT=$PYTHON_CURRENT is not a working Python $WANT" >&2
    return 1
  fi
  local cand
  cand="$(command -v "python$WANT" || true)"
  if is_wanted "$cand"; then echo "$cand"; return 0; fi
  if command -v pyenv >/dev/null 2>&1; then
    # A pyenv shim runs only when that version is selected: ask pyenv for the real binary.
    local root
    root="$(pyenv root 2>/dev/null || true)"
    for cand in $(ls -d "$root"/versions/"$WANT".* 2>/dev/null | sort -V -r || true); do
      if is_wanted "$cand/bin/python$WANT"; then echo "$cand/bin/python$WANT"; return 0; fi
    done
  fi
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  if ! PY="$(find_python)"; then
    cat >&2 <<EOF
[bootstrap-current] no Python $WANT found (megatron-core >= 0.17 is published for Python >= 3.12 only).
  Get one of:
    pyenv install $WANT            # then re-run: pyenv's versions/$WANT.* are found by themselves
    apt-get install python$WANT python$WANT-venv   # where your distribution has it
  or point PYTHON_CURRENT at a Python $WANT interpreter:  make test-current PYTHON_CURRENT=/path/to/python$WANT
EOF
    exit 2
  fi
  echo "[bootstrap-current] creating $VENV with $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# The package index's file:// mirrors that are absent on some machines make pip print one warning
# per package; keep errors, drop those lines.
quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file://" >&2); }
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "[bootstrap-current] installing torch==$TORCH_CURRENT_VERSION from the package index (CUDA build, ~4.7 GB; runs on CPU)"
  quiet "${PIP[@]}" install -q "torch==$TORCH_CURRENT_VERSION"
fi
TORCH_HAVE="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
# Without the local label (2.13.0+cu130 -> 2.13.0): the index lists the wheel as plain 2.13.0,
# and pip's resolver finds no torch for `torch==2.13.0+cu130`; `==2.13.0` still admits only it.
echo "torch==${TORCH_HAVE%%+*}" > "$CONSTRAINTS"
echo "[bootstrap-current] installing pinned requirements (torch stays at $TORCH_HAVE)"
quiet "${PIP[@]}" install -q -c "$CONSTRAINTS" -r "$ROOT/tools/requirements/pinned-current.txt"
# The product and, as a second distribution, the example trainer (python -m gpt_trainer), both
# editable: the studies and the CPU shims (mechmon_megatron.research / .testing) are not in the
# wheel and import from this checkout through the editable install.
quiet "${PIP[@]}" install -q -c "$CONSTRAINTS" --no-deps -e "$ROOT" -e "$ROOT/examples/pretrain_scripts"
echo "[bootstrap-current] ready: $VENV (Python $("$VENV/bin/python" -c 'import sys; print(sys.version.split()[0])'), torch $TORCH_HAVE, megatron-core $("$VENV/bin/python" -m pip show megatron-core 2>/dev/null | sed -n 's/^Version: //p'))"
