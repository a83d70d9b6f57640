#!/usr/bin/env bash
# Regenerate the deployment report (docs/results/report/: report.md, report.json, report.png) and the
# accuracy table of docs/results/accuracy.md from the same `trtpipe report` run, so the two cannot disagree.
#
#   scripts/make_accuracy_report.sh [--bench] [--out DIR] [--set KEY=VALUE ...]
#
# 1. builds the stories recipes the table compares (fp16 = the unquantized float16 baseline, fp8, int8_sq,
#    int4_awq) up to their verify stage (cached stages are reused; with --bench, the whole build);
#    a recipe whose accuracy gate fails (int4_awq's +7 % perplexity is above its 5 % limit) still has its
#    verify numbers reported: the report reads the measured accuracy.json, not the build's exit status;
# 2. with --bench, builds each recipe's repository streaming and runs `trtpipe bench RECIPE --set
#    triton.streaming=true -c 4 -n 64` (AIPerf + tritonserver, through the BLS, so TTFT and ITL are measured;
#    about a minute each); without it the report's latency columns come from earlier bench results in each
#    work_dir, or say there are none;
# 3. runs `trtpipe report RECIPES --out DIR` (default docs/results/report);
# 4. replaces docs/results/accuracy.md's table between `<!-- accuracy:begin -->` and `<!-- accuracy:end -->` with the
#    report's `accuracy_table` (report.json), and names this command and the commit above it.
# --set is passed to every build, bench and report call (e.g. --set model.source=/path/to/stories260k).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
ARGS="$*"  # as given, for the line docs/results/accuracy.md carries above the table
OUT=docs/results/report
BENCH=0
SETS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) BENCH=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    --set) SETS+=(--set "$2"); shift 2 ;;
    *) echo "make_accuracy_report.sh: unknown argument '$1' (expected --bench, --out DIR, --set KEY=VALUE)" >&2; exit 2 ;;
  esac
done
RECIPES=(recipes/stories-fp16.yaml recipes/stories-fp8.yaml recipes/stories-int8-sq.yaml recipes/stories-int4-awq.yaml)

for r in "${RECIPES[@]}"; do
  # A failing accuracy gate ends the build with exit 1 after verify wrote its numbers; anything else is fatal.
  status=0
  if [ "$BENCH" = 1 ]; then
    "$PY" -m trtpipe.cli build "$r" --set triton.streaming=true "${SETS[@]}" || status=$?
  else
    "$PY" -m trtpipe.cli build "$r" --until verify "${SETS[@]}" || status=$?
  fi
  if [ "$status" != 0 ] && [ "$status" != 1 ]; then exit "$status"; fi
  if [ "$BENCH" = 1 ] && [ "$status" = 0 ]; then
    "$PY" -m trtpipe.cli bench "$r" --set triton.streaming=true -c 4 -n 64 "${SETS[@]}"
  fi
done

"$PY" -m trtpipe.cli report "${RECIPES[@]}" "${SETS[@]}" --out "$OUT"

"$PY" - "$OUT/report.json" docs/results/accuracy.md "$ARGS" <<'EOF'
import json, os, subprocess, sys
from pathlib import Path

report, readme, args = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
table = json.loads(report.read_text())["accuracy_table"]
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
begin, end = "<!-- accuracy:begin -->", "<!-- accuracy:end -->"
text = readme.read_text()
if text.count(begin) != 1 or text.count(end) != 1:
    sys.exit(f"{readme}: needs exactly one '{begin}' and one '{end}' line")
head, rest = text.split(begin)
_, tail = rest.split(end)
made = (f"Made by `scripts/make_accuracy_report.sh{(' ' + args) if args else ''}` at commit {commit}, in the same "
        f"run as [{report.parent}/report.md]({os.path.relpath(report.parent, readme.parent)}/report.md):")
readme.write_text(f"{head}{begin}\n{made}\n\n{table}\n{end}{tail}")
print(f"{readme}: accuracy table rewritten from {report}")
EOF
