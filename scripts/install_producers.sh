#!/usr/bin/env bash
# Install the real quantization producers that make the pre-quantized test fixtures (tests/tools/make_prequantized.py)
# into their own venv, ./.venv-producers by default: llm-compressor, NVIDIA ModelOpt, GPTQModel (+ optimum, which
# transformers needs to load GPTQ checkpoints). Their own venv because llm-compressor pins an older transformers
# (<=5.17) and compressed-tensors (0.19.0) than trtpipe's venv has. torch is pinned to the same CPU build (2.13.0)
# through a constraints file, so no producer can pull a multi-GB CUDA build. GPTQModel and some of its
# dependencies are source distributions: they build without CUDA (no kernels are compiled) in a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PRODUCERS_VENV=${PRODUCERS_VENV:-.venv-producers}
STAMP="$PRODUCERS_VENV/.producers-installed"
REQ=scripts/producers-requirements.txt
if [ -f "$STAMP" ] && cmp -s "$STAMP" "$REQ"; then
  echo "producers already in $PRODUCERS_VENV"
  exit 0
fi
start=$(date +%s)
"$PY" -m venv "$PRODUCERS_VENV"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" >"$constraints"
"$PRODUCERS_VENV/bin/python" -m pip install --disable-pip-version-check -q torch==2.13.0
"$PRODUCERS_VENV/bin/python" -m pip install --disable-pip-version-check -q -c "$constraints" -r "$REQ"
"$PRODUCERS_VENV/bin/python" -m pip check >/dev/null || "$PRODUCERS_VENV/bin/python" -m pip check
cp "$REQ" "$STAMP"
echo "installed producers into $PRODUCERS_VENV in $(( $(date +%s) - start )) s:" \
  "$("$PRODUCERS_VENV/bin/python" -m pip list --disable-pip-version-check 2>/dev/null \
     | grep -i -E '^(torch|transformers|llmcompressor|compressed-tensors|nvidia-modelopt|gptqmodel|autoawq) ' | tr -s ' ' | tr '\n' ';')"
