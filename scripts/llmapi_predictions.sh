#!/usr/bin/env bash
# What trtpipe predicts for the shipped llmapi (PyTorch-backend) MoE recipes, each beside NVIDIA's nearest
# published rows, and the capacity answer (plan --slo) for gpt-oss-120b and Qwen3-235B-A22B.
#   scripts/llmapi_predictions.sh [OUT_FILE]     (default: stdout; docs/results/llmapi_predictions.txt is its output)
# Workload: ISL/OSL 1000/1000 (a shape the published tables have for all three models), closed loop at concurrency 64
# (each recipe's max_batch_size) for predict; plan --slo at 8 req/s with TTFT p99 2 s and ITL p99 50 ms on H100
# and B200 (where the published PyTorch-backend rows are). Deterministic (seeded simulator,
# fitted constants in trtpipe/perf/constants.json); the six commands run side by side, ~10-20 min on 2 shared cores.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
PUB=trtpipe/perf/data/published_trtllm.csv
SLO=ttft_p99=2000ms,itl_p99=50ms
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
n=0
pids=()
job() {  # each command in the background into its own file (the simulations are single-threaded), printed in order
  n=$((n + 1))
  { echo "\$ trtpipe $*"; "$BIN/trtpipe" "$@" 2>/dev/null; echo; } > "$TMP/$(printf %02d $n)" &
  pids+=($!)
}
main() {
  echo "# trtpipe $(git rev-parse --short HEAD 2>/dev/null || echo '?'), constants: trtpipe/perf/constants.json"
  echo
  for r in gpt-oss-120b-mxfp4 qwen3-235b-a22b-fp8 qwen3-30b-a3b-fp8; do
    job predict "recipes/$r.yaml" --isl 1000 --osl 1000 --concurrency 64 --published "$PUB"
  done
  # Qwen3-30B-A3B is published only in FP4 on Blackwell: the same recipe in NVFP4 on one B200
  job predict recipes/qwen3-30b-a3b-fp8.yaml --set quantization.algo=nvfp4 --gpu b200-180gb \
    --isl 1000 --osl 1000 --concurrency 64 --published "$PUB"
  for r in gpt-oss-120b-mxfp4 qwen3-235b-a22b-fp8; do
    job plan "recipes/$r.yaml" --slo "$SLO" --rate 8 --isl 1000 --osl 1000 --gpus h100-sxm-80gb,b200-180gb
  done
  for p in "${pids[@]}"; do wait "$p"; done  # a failed command fails the script (set -e)
  cat "$TMP"/*
}
if [ $# -ge 1 ]; then main > "$1"; else main; fi
