#!/usr/bin/env bash
# The one prepared script for a session lent a GPU (device tool): CUDA/NCCL parity and the
# throughput numbers the issues ask for, written under $OUT (copy them into benchmarks/results/).
# The device image has torch but not megatron-core: carry wheels in .whl/ (see the device README),
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl megatron-core==0.16.1
set -uo pipefail
OUT=${OUT:-/tmp/megarl_gpu}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"

# 1. bf16 log-prob parity on CUDA/NCCL for every family (tp 1), against transformers in fp32.
for arch in llama qwen2 qwen3 mixtral qwen3_moe; do
  python3 -m megarl.tools.make_tiny_model --arch "$arch" --out "/tmp/tiny_$arch" --vocab-size 301 >/dev/null
done
python3 - <<'PY' > /tmp/in.jsonl
import json, random
random.seed(0)
for n in (7, 12, 3, 9, 16):
    print(json.dumps({"input_ids": [random.randrange(301) for _ in range(n)]}))
PY
for arch in llama qwen2 qwen3 mixtral qwen3_moe; do
  torchrun --standalone --nproc_per_node 1 -m megarl.tools.logprobs --model "/tmp/tiny_$arch" --input /tmp/in.jsonl \
    --output "$OUT/logprobs_$arch.jsonl" --dtype bfloat16 2>&1 | tail -2
done

# 2. MFU of an actor update, ~1B dense model, bf16.
timeout 300 torchrun --standalone --nproc_per_node 1 benchmarks/actor_mfu.py --preset 1b --seq-len 2048 --sequences 8 \
  --out "$OUT/actor_mfu_1b.json" 2>&1 | tail -20

# 2b. Sequence packing (TE thd attention) vs padded micro-batches, same ~1B model, ragged lengths.
timeout 240 torchrun --standalone --nproc_per_node 1 benchmarks/packing.py --preset 1b --sequences 32 \
  --prompt 256 --response 1024 --tokens-per-microbatch 16384 --out "$OUT/packing_1b.json" 2>&1 | tail -8

# 3. Reshard time on NCCL for a ~1B synthetic model (single GPU: 1 rank, so only the local path).
timeout 120 torchrun --standalone --nproc_per_node 1 benchmarks/reshard.py --train-tp 1 --rollout-tp 1 \
  --num-layers 16 --hidden 2048 --ffn-hidden 5632 --vocab 32000 --dtype bfloat16 --out "$OUT/reshard_1b.json" 2>&1 | tail -5
ls -l "$OUT"
