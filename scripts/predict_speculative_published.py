"""The speculative step model (trtpipe/perf/speculative.py) against NVIDIA's published speculative-decoding figures.

Rows quoted from NVIDIA/TensorRT-LLM (text, not figures):
- ``docs/source/blogs/tech_blog/blog7_NGram_performance_Analysis_And_Auto_Enablement.md@7274a594``: Llama-4-Scout-
  17B-16E, FP8 weights, 8 x B200, TP 8, N-Gram, second conversation turn (accepted length 1.66 for k=3, v=5 and for
  k=5, v=3): E2E speed-up 96.13 % at batch 1 (v=5), 63.99 % at batch 4 (v=5), 33.06 % at batch 32 (v=3).
- ``docs/source/blogs/tech_blog/blog2_DeepSeek_R1_MTP_Implementation_and_Optimization.md@000a01de``:
  DeepSeek-R1-FP4, 8 x B200, attention TP 8, MoE EP 2, batch 1, ISL/OSL 1K/2K, MTP next-n 3: 2.16x over next-n 0.
  Its acceptance rates are in a figure only, so the acceptance length the model needs for 2.16x is printed instead.

Not stated by the blogs and assumed here: the KV length of a decode step (``--kv-len``, default 1024) and the KV
dtype (Scout BF16, R1 FP8). The model predicts the decode step; the blogs measure end-to-end runtime, which also
holds the (unchanged) prefill, so a decode prediction above the published figure is expected by that share.

    PYTHONPATH=. python scripts/predict_speculative_published.py
"""

from __future__ import annotations

import argparse

from trtpipe.formats.gpus import get_gpu
from trtpipe.perf.cost import Deployment
from trtpipe.perf.fit import load_constants
from trtpipe.perf.models import published_spec
from trtpipe.perf.speculative import draft_deployment, speculative_step

SCOUT_ROWS = ((1, 5, 1.66, 1.9613), (4, 5, 1.66, 1.6399), (32, 3, 1.66, 1.3306))  # batch, v, AL, published x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-len", type=int, default=1024)
    args = ap.parse_args()
    c = load_constants()["pytorch"]
    b200 = get_gpu("b200-180gb")
    scout = Deployment(published_spec("Llama 4 Scout"), b200, "fp8", "fp16", 8, pytorch_backend=True)
    print(f"Llama-4-Scout FP8, 8x B200 TP8, N-Gram, KV length {args.kv_len} (blog7@7274a594)")
    print("| batch | max_draft_len | AL | plain step ms | verify ms | predicted x | published x | error |")
    print("|---|---|---|---|---|---|---|---|")
    errs = []
    for batch, k, al, pub in SCOUT_ROWS:
        s = speculative_step(scout, c, batch, args.kv_len, k, al)
        err = s.speedup / pub - 1
        errs.append(abs(err))
        print(
            f"| {batch} | {k} | {al} | {s.plain_s * 1e3:.2f} | {s.verify_s * 1e3:.2f} | {s.speedup:.3f} | "
            f"{pub:.3f} | {100 * err:+.1f} % |"
        )
    print(f"mean |error| {100 * sum(errs) / len(errs):.1f} %")
    r1 = Deployment(published_spec("DeepSeek R1 0528"), b200, "fp4", "fp8", 8, 1, 2, pytorch_backend=True)
    mtp = draft_deployment(r1, "MTP")
    one = speculative_step(r1, c, 1, 1024 + 1024, 3, 1.0, mtp)  # KV length: mid-way through a 1K/2K request
    need = 2.16 / one.speedup  # the speed-up is linear in AL
    print(
        f"\nDeepSeek-R1 FP4, 8x B200 TP8 EP2, MTP k=3, batch 1, KV length 2048 (blog2@000a01de): plain step "
        f"{one.plain_s * 1e3:.2f} ms, verify {one.verify_s * 1e3:.2f} ms, 3 MTP drafts {one.draft_s * 1e3:.2f} ms; "
        f"the published 2.16x needs an acceptance length of {need:.2f} (of at most 4)"
    )


if __name__ == "__main__":
    main()
