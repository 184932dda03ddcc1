#!/usr/bin/env bash
# GPU check of runtime.device / runtime.precision (issue 14): CUDA tests, a run resumed from CUDA on the CPU and a
# `--runner dask --gpus 1` run (benchmarks/cross_device.py), then the pipeline cost in fp32 and bf16.
#
# Assumptions: run from anywhere inside the checkout (it cds to the repository root) on a machine with a CUDA
# GPU, where either
#   - a Python whose torch sees CUDA and which imports featcal's dependencies exists ($FEATCAL_PYTHON, the
#     checkout's .venv/bin/python or python3, first match wins), or
#   - the package index is reachable, so a venv at $FEATCAL_GPU_VENV (default /tmp/featcal-gpu-venv) can get a
#     CUDA torch + triton and `pip install -e .[test]` (it reuses an installed CUDA torch when python3 has one).
#   - or, on a machine with no package index (this workplace's GPU machines), wheels for the packages its Python
#     lacks lie in .whl/ (benchmarks/gpu_wheels.sh downloads them here for Python 3.12): they are installed with
#     --no-deps into $FEATCAL_GPU_SITE (default /tmp/featcal-gpu-site), which goes first on PYTHONPATH.
# Steps: `gpu_check.sh [tests] [official] [cost] [resume]` runs those named (default: all four). `official` runs
# benchmarks/vs_official.py on the GPU: the official code (a checkout of github.com/egangu/featcal whose path is given
# at run time in $OFFICIAL_CHECKOUT, never copied here) and ours in fp32 and bf16, ViT-B/32 shape 8 × 256, in one
# call (skipped, and reported, without $OFFICIAL_CHECKOUT); it comes second so a short session still gets it. Seen on an H200 (16 cores,
# 2026-12-04, benchmarks/results/gpu_check*.log): tests 111 s; the cost step's input build 43 s and one fp32 run 125 s,
# so fp32 + bf16 needs over 300 s; resume over 133 s. A 10-minute call holds one of cost or tests + resume.
# The whole stays within GPU_CHECK_SECONDS (default 470 s; under 8 minutes with the kill grace): each step has a
# time limit and the benchmark gets what the earlier steps left (skipped with under 60 s left). A failed or
# timed-out step is reported and the next still runs, so one GPU session yields both the tests and the table;
# the exit status is non-zero when any step failed. Everything printed also goes to $GPU_CHECK_LOG (default
# benchmarks/results/gpu_check.log); GPU_CHECK_THREADS (default 16) is the cost step's --threads.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
mkdir -p benchmarks/results
LOG=${GPU_CHECK_LOG:-benchmarks/results/gpu_check.log}
BUDGET=${GPU_CHECK_SECONDS:-470}
VENV=${FEATCAL_GPU_VENV:-/tmp/featcal-gpu-venv}
SITE=${FEATCAL_GPU_SITE:-/tmp/featcal-gpu-site}
STEPS=" ${*:-tests official resume cost} "
FAILED=()

step() {  # step NAME SECONDS CMD...: run under a time limit; a failure is logged and remembered, not fatal
  local name=$1 limit=$2 start=$SECONDS rc=0
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" || rc=$?
  echo "== $name: rc=$rc after $((SECONDS - start))s"
  if [ "$rc" -eq 124 ]; then FAILED+=("$name (timed out)"); elif [ "$rc" -ne 0 ]; then FAILED+=("$name (rc=$rc)"); fi
}

ready() {  # ready PYTHON: true when it runs, its torch sees CUDA and featcal with its test tools imports
  [ -x "$(command -v "$1" 2>/dev/null)" ] &&
    timeout 60 "$1" -c "import torch, pytest, featcal.devices; assert torch.cuda.is_available()" 2>/dev/null
}

carried_wheels() {  # installs .whl/ where it exists and puts it (and the checkout) first on PYTHONPATH
  compgen -G ".whl/*.whl" >/dev/null || return 0
  echo "== installing .whl/ into $SITE"
  python3 -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export FEATCAL_GPU_SITE="$SITE"  # vs_official.py gives the official code's process these wheels alone
}

pick_python() {  # prints the Python to use, creating the venv when none is ready
  local candidate
  for candidate in ${FEATCAL_PYTHON:-} .venv/bin/python python3; do
    if ready "$candidate"; then echo "$candidate"; return; fi
  done
  echo "== no ready Python: setting up $VENV" >&2
  [ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV" >&2
  if ! timeout 60 "$VENV/bin/python" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    timeout 200 "$VENV/bin/pip" install --quiet "torch>=2.6,<=2.14.1" triton >&2
  fi
  timeout 90 "$VENV/bin/pip" install --quiet -e ".[test]" >&2
  ready "$VENV/bin/python" || { echo "== $VENV/bin/python still does not see CUDA or import featcal" >&2; exit 1; }
  echo "$VENV/bin/python"
}

main() {
  echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  step nvidia-smi 20 nvidia-smi -L
  local py
  carried_wheels
  py=$(pick_python)
  echo "== python: $py"
  step versions 60 "$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'devices', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
  if [[ $STEPS == *" tests "* ]]; then
    step tests 240 env FEATCAL_TEST_DEVICE=cuda "$py" -m pytest -q tests/test_devices.py tests/test_kernels*.py \
      tests/test_precision.py
  fi
  if [[ $STEPS == *" official "* ]]; then
    if [ -z "${OFFICIAL_CHECKOUT:-}" ]; then
      FAILED+=("official (skipped: no OFFICIAL_CHECKOUT)")
    else
      step official 200 "$py" benchmarks/vs_official.py --official "$OFFICIAL_CHECKOUT" --device cuda --experts 8 \
        --examples 256 --threads "${GPU_CHECK_THREADS:-16}" --precision fp32 bf16 \
        --out benchmarks/results/vs_official_gpu.md
    fi
  fi
  if [[ $STEPS == *" resume "* ]]; then
    step cross_device 300 "$py" -m benchmarks.cross_device --first cuda --then cpu --gpus 1 \
      --out benchmarks/results/cross_device_gpu.md
  fi
  if [[ $STEPS == *" cost "* ]]; then
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 60 ]; then
      FAILED+=("pipeline_cost (skipped: ${left}s of the ${BUDGET}s left)")
    else
      step pipeline_cost "$left" "$py" -m benchmarks.pipeline_cost --shape vit-b32 --experts 8 --examples 256 \
        --threads "${GPU_CHECK_THREADS:-16}" --device cuda --precision fp32 bf16 --out benchmarks/results/pipeline_cost_gpu.md
    fi
  fi
  if [ ${#FAILED[@]} -gt 0 ]; then
    echo "== FAILED: ${FAILED[*]}"
    return 1
  fi
  echo "== all steps passed in ${SECONDS}s"
}

main 2>&1 | tee -a "$LOG"
