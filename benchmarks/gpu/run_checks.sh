#!/usr/bin/env bash
# The GPU checks of issues 13, 12 and 42 in one go, for one H200 (torch 2.11, Python 3.12, no
# megatron-core and no Transformer-Engine in the image), in under 9 minutes:
#   (0) the device's measured dense peak: an 8192^3 bf16 matmul (TFLOP/s);
#   (a) issue 13: the actor update of a ~1B dense Llama in bf16 with megarl's SDPA attention, its MFU
#       against both the datasheet peak (989) and the measured matmul peak;
#   (b) issue 12: bf16 log-prob parity vs transformers for every family in FAMILIES (max/mean |d logprob|),
#       the MoE families through the MoE forward without Transformer-Engine.
# Each check writes its JSON as soon as it has numbers (parity after every model family), straight
# into $OUT when the device tool sets it (so a time-out, of one check or of the whole script, loses
# nothing already measured), otherwise into benchmarks/results/gpu/.
#
#   bash benchmarks/gpu/run_checks.sh             # on the GPU machine
#   bash benchmarks/gpu/run_checks.sh --dry-run   # here, on CPU: the same code at toy sizes, float32
#
# megatron-core travels as a wheel (the image has none). Once, here, in the repo root (/.whl/ is in
# .gitignore):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl megatron-core==0.19.2
# (0.19.2 is the release CI's Python 3.12 tier tests; its needs, torch/numpy/packaging, are in the image.)
# Then the device tool: run(command="bash benchmarks/gpu/run_checks.sh", carry=[".whl"], timeout_s=560).
# MEGARL_WHEELS=DIR takes the wheels from DIR instead; MEGARL_PIP_CACHE=DIR installs from a pip
# cache/wheelhouse directory (pip --find-links DIR). Exit status: 0 all checks passed, 1 one failed, 2 setup.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-${OUT:-benchmarks/results/gpu}}  # $OUT: what the device tool brings back
WHEELS=${MEGARL_WHEELS:-.whl}
mkdir -p "$RESULTS"
start=$(date +%s)

if ! "$PY" -c "import megatron.core" 2>/dev/null; then
  site=/tmp/megarl_site
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEELS"/*.whl || exit 2
  elif [ -n "${MEGARL_PIP_CACHE:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --find-links "$MEGARL_PIP_CACHE" --target "$site" megatron-core || exit 2
  else
    echo "error: megatron-core is not installed and $WHEELS/ holds no wheel: download it as the header of $0 says" >&2
    exit 2
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore
if [ "$DRY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  mode=(--tiny)
  families=(${MEGARL_GPU_CHECK_FAMILIES:-})
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  mode=()
  families=()
fi

status=0
run() {  # run NAME SECONDS ARGS...: one check under its own time limit, its log beside the JSON
  local name=$1 limit=$2
  shift 2
  # The dry run checks the code, not the budget: a loaded CPU machine imports torch and Megatron slowly.
  [ "$DRY" = 1 ] && limit=$((limit * 4))
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$PY" benchmarks/gpu/checks.py "$@" --out "$RESULTS" ${mode[@]+"${mode[@]}"} 2>&1 | tee "$RESULTS/$name.log" | tail -40
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  [ "$rc" = 0 ] || status=1
}
# Budgets (sum 525 s, inside the device tool's 560 with setup): matmul seconds after imports; 1B model creation +
# load ~1-2 min, updates seconds; parity: imports + 7 tiny families, each written as it finishes; delta (issue 42):
# 4 one-layer models built on the host, 10 PPO updates each, every weight encoded and applied (written per lr).
run matmul 60 matmul
run actor 240 actor
run parity 150 parity ${families[@]:+--families "${families[@]}"}
run delta 75 delta
# Planned, not written yet: the long-context check (actor update at 32k+ tokens per sequence, context
# parallelism) and the LoRA check (adapter update + merged-weight sync), once megarl has long-context
# training and LoRA. Each becomes one more family of checks.py (OUTPUTS) and one line here, e.g.
#   run long_context 120 long_context
#   run lora 120 lora
# with the budgets above shrunk to keep the sum inside the device tool's limit.

echo "all checks: exit $status in $(( $(date +%s) - start ))s; results in $RESULTS"
exit $status
