#!/usr/bin/env bash
# The paired regression gate (issue 38; benchmarks/gate.py) on the GPU machine: this tree against a base
# checkout, the PPO demo at a GPU geometry run by both in the same run, interleaved step by step. Each phase is
# timed with CUDA events at device-synchronised edges (benchmarks/phase_clock.py picks them when CUDA is in use),
# so a stall or an extra synchronisation shows as the wall time a user waits for; the verdict is the same paired
# bootstrap as on CPU (benchmarks/gate_stats.py). Not yet run on a GPU.
#
# The device machine gets a copy of the working tree, maybe without .git, so the base travels as a checkout made
# here beforehand, under shared/ (or any carried path), e.g. the merge base with main:
#   mkdir -p shared/bench-base && git archive "$(git merge-base HEAD main)" | tar -x -C shared/bench-base
# then the device tool: run(command="bash benchmarks/gpu/bench_check.sh shared/bench-base", carry=[".whl"], timeout_s=540)
# (.whl: the megatron-core wheel, as benchmarks/gpu/run_checks.sh's header says). With .git present, a revision
# works too: bash benchmarks/gpu/bench_check.sh --rev main.
# Exit status: the gate's (0 passed, 1 a phase regressed, 2 could not measure). Results: $OUT/check.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-${OUT:-benchmarks/results/gpu}}
WHEELS=${MEGARL_WHEELS:-.whl}
mkdir -p "$RESULTS"
if [ "${1:-}" = "--rev" ]; then base=(--base "${2:?--rev needs a revision}"); else base=(--base-dir "${1:?usage: $0 BASE_DIR | --rev REV}"); fi

if ! "$PY" -c "import megatron.core" 2>/dev/null; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "error: megatron-core is not installed and $WHEELS/ holds no wheel: download it as benchmarks/gpu/run_checks.sh's header says" >&2
    exit 2
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/megarl_site "$WHEELS"/*.whl || exit 2
  export PYTHONPATH="/tmp/megarl_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# A ~0.2B random Llama (made on first use, its own path: the CPU demo's model stays as it is), the demo's task
# and batch: long enough phases for the device to be busy, short enough for 30 rounds of two sides in minutes.
exec "$PY" benchmarks/suite.py check "${base[@]}" --rounds "${BENCH_ROUNDS:-30}" --out "$RESULTS/check.json" \
  --set "model.path=$PWD/runs/bench/gpu-llama-digits" --set model.make_tiny.hidden=1024 \
  --set model.make_tiny.intermediate=2816 --set model.make_tiny.layers=16 --set model.make_tiny.heads=16 \
  --set model.make_tiny.kv_heads=8 --set model.make_tiny.max_positions=64
