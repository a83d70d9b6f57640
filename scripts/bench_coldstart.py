"""Cold vs warm first-request latency with and without Triton model_warmup, on a fresh server each time.

    .venv/bin/python scripts/bench_coldstart.py recipes/stories-fp16.yaml --set triton.streaming=true --rounds 3

Alternates warm-up on/off for ``--rounds`` rounds (this machine is noisy: compare medians of the same run),
prints one table and writes the raw numbers as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from trtpipe.app.bench_cold import measure_cold


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm-requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("bench-results/coldstart.json"))
    a = ap.parse_args()
    runs = {"on": [], "off": []}
    for i in range(a.rounds):
        for mode in ("off", "on"):
            r = measure_cold(
                a.recipe,
                [*a.overrides, f"triton.warmup={'true' if mode == 'on' else 'false'}"],
                a.warm_requests,
                a.max_tokens,
            )
            runs[mode].append(r)
            print(
                f"round {i + 1} warmup {mode}: ready {r['ready_s']:.2f} s, cold ttft {r['cold']['ttft_ms']:.1f} ms "
                f"e2e {r['cold']['e2e_ms']:.1f} ms, warm ttft {r['warm_median']['ttft_ms']:.1f} ms "
                f"e2e {r['warm_median']['e2e_ms']:.1f} ms",
                file=sys.stderr,
            )

    def med(rs, f):
        return statistics.median(f(r) for r in rs)

    print(
        f"{'model_warmup':<13}{'ready s':>9}{'cold ttft ms':>14}{'warm ttft ms':>14}{'cold/warm ttft':>16}"
        f"{'cold e2e ms':>13}{'warm e2e ms':>13}{'cold/warm e2e':>15}   (medians of {a.rounds} fresh servers)"
    )
    for mode in ("off", "on"):
        rs = runs[mode]
        ct, wt = med(rs, lambda r: r["cold"]["ttft_ms"]), med(rs, lambda r: r["warm_median"]["ttft_ms"])
        ce, we = med(rs, lambda r: r["cold"]["e2e_ms"]), med(rs, lambda r: r["warm_median"]["e2e_ms"])
        print(
            f"{mode:<13}{med(rs, lambda r: r['ready_s']):>9.2f}{ct:>14.1f}{wt:>14.1f}{ct / wt:>15.2f}x"
            f"{ce:>13.1f}{we:>13.1f}{ce / we:>14.2f}x"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(runs, indent=1) + "\n")
    print(f"raw: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
