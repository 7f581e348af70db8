#!/bin/bash
# One-rank Megatron check on a CUDA machine without the project installed (no Ray, no vLLM): bash scripts/gpu_check.sh
# Installs the wheels in $WHEELS (default .gpu/wheels: megatron-core 0.16.1, tensordict 0.15.3, pyvers 0.2.3, which a
# bare PyTorch image lacks), then runs scripts/gpu_check.py. $OUT gets check.log, full.log, env.log, install.log.
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/gpucheck_out}; mkdir -p "$OUT"; export OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  ${WHEELS:-.gpu/wheels}/*.whl > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|tokenizers|huggingface.hub|safetensors|numpy|cloudpickle) "
} > "$OUT/env.log" 2>&1; cat "$OUT/env.log"
timeout -k 10 300 python3 scripts/gpu_check.py --device cuda "$@" > >(tee "$OUT/full.log") 2>&1
rc=$?; sleep 1; echo "check.py exit code: $rc (124: timed out)"; exit $rc
