#!/usr/bin/env bash
# Install NVIDIA AIPerf (trtpipe bench's load generator) into its own venv, ./.venv-aiperf by default.
# Its own venv because AIPerf's dependencies need numpy 2 while nvidia-pytriton pins numpy < 2; trtpipe runs
# it as a subprocess (found at .venv-aiperf/bin/aiperf, or $TRTPIPE_AIPERF). About 1.2 GB, 2-5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
AIPERF_VENV=${AIPERF_VENV:-.venv-aiperf}
AIPERF_VERSION=0.13.0
if [ -x "$AIPERF_VENV/bin/aiperf" ] && [ "$("$AIPERF_VENV/bin/aiperf" --version 2>/dev/null | tail -1)" = "$AIPERF_VERSION" ]; then
  echo "aiperf $AIPERF_VERSION already in $AIPERF_VENV"
  exit 0
fi
"$PY" -m venv "$AIPERF_VENV"
"$AIPERF_VENV/bin/python" -m pip install --disable-pip-version-check -q "aiperf==$AIPERF_VERSION"
echo "installed aiperf $("$AIPERF_VENV/bin/aiperf" --version | tail -1) into $AIPERF_VENV"
