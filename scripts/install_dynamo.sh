#!/usr/bin/env bash
# Install NVIDIA Dynamo's frontend and router (ai-dynamo 1.6.1) into their own venv, ./.venv-dynamo by default, for
# `trtpipe serve --dynamo` and its tests. Its own venv: Dynamo wants numpy 2 while nvidia-pytriton pins numpy < 2.
# ai-dynamo 1.6.1 declares `aisimulate==0.13.0` (only its planner/profiler estimates use it) and PyPI's aisimulate
# 0.13.0 does not install, so ai-dynamo goes in with --no-deps after its other requirements (its METADATA's
# Requires-Dist, minus aisimulate). `dynamo.trtllm` itself needs tensorrt_llm and is not installed: the twin is the
# worker (trtpipe.serving.dynamo_worker), so this venv also gets torch (pinned, CPU) and this checkout, editable,
# with its `agents` extra (xgrammar, llguidance: the worker runs guided decoding for the frontend's response_format).
# About 1.6 GB, 1-2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DYNAMO_VENV=${DYNAMO_VENV:-.venv-dynamo}
DYNAMO_VERSION=1.6.1
MARK="$DYNAMO_VENV/.dynamo-$DYNAMO_VERSION-agents"
if [ -f "$MARK" ]; then
  echo "ai-dynamo $DYNAMO_VERSION already in $DYNAMO_VENV"
  exit 0
fi
"$PY" -m venv "$DYNAMO_VENV"
PIP=("$DYNAMO_VENV/bin/python" -m pip install --disable-pip-version-check -q)
"${PIP[@]}" "ai-dynamo-runtime==$DYNAMO_VERSION"
"${PIP[@]}" 'aiohttp>=3.14.3,<4' 'certifi>=2026.10.19' 'kubernetes>=32.0.1,<33' 'msgspec>=0.19' \
  'prometheus-client>=0.23.1,<1' 'pyzmq>=26' 'redis>=6.2,<9' 'tqdm>=4' 'transformers>=4.56' \
  'typing-extensions>=4.10' 'zstandard>=0.23,<1'
"${PIP[@]}" --no-deps "ai-dynamo==$DYNAMO_VERSION"
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[agents]'
"$DYNAMO_VENV/bin/python" -c 'import dynamo.frontend, dynamo.llm, dynamo.common.backend.engine, trtpipe.serving.dynamo_worker, xgrammar, llguidance'
touch "$MARK"
echo "installed ai-dynamo $DYNAMO_VERSION into $DYNAMO_VENV"
