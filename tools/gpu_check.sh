#!/usr/bin/env bash
# The prepared GPU check: one command, < 8 minutes on one H200.
#
#   tools/gpu_check.sh OUT_DIR [run_all.py flags, e.g. --budget-s 300 --only plan_llama3-70b]
#
# Uses the machine's python3 (PYTHON=... to choose another) and its PyTorch. megatron-core comes
# from the wheels in .whl/ (git-ignored; fetch them here with tools/gpu_check/fetch_wheels.sh and
# carry .whl to the device), installed with --no-index --no-deps into a private --target folder
# when python3 cannot import megatron.core already. Writes OUT_DIR/gpu_check.json (every part's
# result, status, seconds) and OUT_DIR/gpu_check.log. Parts run independently
# (tools/gpu_check/run_all.py); a failing part is recorded, never aborts the rest.
set -u
if [ $# -lt 1 ]; then
    echo "usage: tools/gpu_check.sh OUT_DIR [run_all.py flags]" >&2
    exit 2
fi
OUT_DIR=$1
shift
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
SITE=${MECHMON_GPU_SITE:-/tmp/mechmon-gpu-site}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
echo "gpu_check: $(date -u '+%Y-%m-%d %H:%M:%S') UTC, root $ROOT, python $PY" >"$LOG"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >>"$LOG" 2>&1

if ! "$PY" -c 'import megatron.core' >/dev/null 2>&1; then
    shopt -s nullglob
    wheels=("$ROOT"/.whl/*.whl)
    if [ ${#wheels[@]} -gt 0 ]; then
        echo "installing ${#wheels[@]} carried wheel(s) into $SITE" >>"$LOG"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "${wheels[@]}" >>"$LOG" 2>&1 || echo "wheel install FAILED (see above)" >>"$LOG"
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "megatron-core is not importable and .whl/ holds no wheels: run tools/gpu_check/fetch_wheels.sh" \
             "here and carry .whl (the A/B part will fail)" >>"$LOG"
    fi
fi
# The GPU machine runs a copy of the tree that is not pip-installed: the checkout (the package with
# its research / testing code) and the example trainer go on PYTHONPATH here, so the Python tools
# import them as they import the editable installs of `make venv`, without editing sys.path.
export PYTHONPATH="$ROOT:$ROOT/examples/pretrain_scripts${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" "$ROOT/tools/gpu_check/run_all.py" --out "$OUT_DIR" --python "$PY" "$@"
