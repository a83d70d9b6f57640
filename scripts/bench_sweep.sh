#!/usr/bin/env bash
# Re-runnable concurrency sweep of a recipe's served model with trtpipe bench (AIPerf + tritonserver metrics).
#   scripts/bench_sweep.sh [RECIPE] [OUT_DIR] [extra trtpipe bench options...]
# Defaults: recipes/stories-fp16.yaml, bench-results/sweep-<recipe>-<time>. The recipe is served with
# triton.streaming=true (TTFT/ITL need streamed responses) on a server started for the sweep and stopped
# after it (bench starts one when none runs). Writes per point result.json + AIPerf's export, and
# sweep.csv, sweep.json, throughput_latency.png, latency_cdf.png, pareto.png.
set -euo pipefail
cd "$(dirname "$0")/.."
RECIPE=${1:-recipes/stories-fp16.yaml}
NAME=$(basename "$RECIPE" .yaml)
OUT=${2:-bench-results/sweep-$NAME-$(date +%Y%m%d-%H%M%S)}
shift $(( $# < 2 ? $# : 2 ))
BIN=${VENV:-.venv}/bin
"$BIN/trtpipe" bench "$RECIPE" --set triton.streaming=true -c 1,2,4,8,16 -n 64 --isl 64 --osl 64 --warmup 4 \
  --slo ttft:500ms,itl:20ms --out "$OUT" "$@"
echo "sweep written to $OUT"
