#!/usr/bin/env bash
# Create ./.venv with trtpipe and everything its tests and the CPU demo need (about 2 minutes, 2 GB).
# torch is pinned exactly: an open range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --disable-pip-version-check -q torch==2.13.0
"$VENV/bin/python" -m pip install --disable-pip-version-check -q -e '.[serve,mpi,oracle,test,bench,deploy,agents,lora,eval]'
"$VENV/bin/python" -m pip check >/dev/null || "$VENV/bin/python" -m pip check
touch "$VENV/.trtpipe-installed"
echo "installed into $VENV ($("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
