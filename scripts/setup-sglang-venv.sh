#!/usr/bin/env bash
# Create the virtualenv that runs a real SGLang server on CPU (tests/test_sglang.py, `rollopt serve-sglang`).
#
# SGLang's requirements conflict with rollopt's main .venv, so the server gets its own venv. It holds
# sglang==0.5.23 (installed with --no-deps) and its pure-Python requirements, minus the CUDA-only ones:
# never sgl-kernel / sglang-kernel (CUDA-only wheels: `ImportError: libcuda.so.1`). The one sgl_kernel CPU op
# the server calls comes from rollopt/engines/_sgl_kernel_cpu_standin (put on PYTHONPATH by the launcher).
# See ../shared/notes/sglang-on-cpu.md for how this list was found.
#
# Idempotent: a stamp file records the requirement list; an up-to-date venv returns at once.
# Usage: scripts/setup-sglang-venv.sh [VENV_DIR]   (default: .venv-sglang; PYTHON=python3.11)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${SGLANG_VENV:-.venv-sglang}}"
PYTHON="${PYTHON:-python3.11}"

REQS=(
  "torch==2.14.1" "torchvision==0.29.1"
  aiohttp "anthropic>=0.20.0" "apache-tvm-ffi==0.1.11" "blobfile==3.0.0" build "compressed-tensors==0.18.0"
  datasets distro easydict einops fastapi gguf interegular IPython "llguidance>=1.7.6,<2.0.0"
  "mistral_common>=1.11.5" msgspec ninja numpy "openai==2.8.0" "openai-harmony==0.0.4" orjson
  "outlines==0.1.11" packaging partial_json_parser pillow "prometheus-client>=0.20.0" psutil pybase64
  pydantic "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex requests scipy "sentencepiece==0.2.1"
  setproctitle "smg-grpc-servicer>=0.9.0" tiktoken "tokenizers==0.23.2" tqdm "transformers==5.19.0"
  "uvicorn>=0.51" uvloop watchfiles "xgrammar==0.2.7" xxhash zstandard "soundfile==0.13.1" "timm==1.0.25"
  py-spy torch_memory_saver safetensors
)
SGLANG="sglang==0.5.23"
WANT="$(printf '%s\n' "$SGLANG" "${REQS[@]}")"
STAMP="$VENV/.rollopt-sglang-installed"

if [[ -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "$WANT" ]] && [[ -x "$VENV/bin/python" ]]; then
  touch "$STAMP"  # up to date (make compares the stamp's time with this script's)
  exit 0
fi

started=$SECONDS
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "${REQS[@]}"
"$VENV/bin/python" -m pip install -q --no-deps "$SGLANG"
if "$VENV/bin/python" -m pip show -q sgl-kernel >/dev/null 2>&1 || "$VENV/bin/python" -m pip show -q sglang-kernel >/dev/null 2>&1; then
  echo "setup-sglang-venv: a CUDA-only sgl-kernel/sglang-kernel got installed; removing it" >&2
  "$VENV/bin/python" -m pip uninstall -q -y sgl-kernel sglang-kernel || true
fi
# a smoke test of the import that the server needs (torchvision's ops must load against this torch)
"$VENV/bin/python" -c "import torch, torchvision.ops, sglang; print('sglang', sglang.__version__, 'torch', torch.__version__)"
printf '%s\n' "$WANT" > "$STAMP"
echo "setup-sglang-venv: $VENV ready in $((SECONDS - started)) s"
