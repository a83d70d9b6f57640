"""Run under mpiexec: MTP, EAGLE-3 or Medusa heads drafting for a tp 2 target split over the ranks (rank 0's MPI step
engine keeps the target's hidden states, the head runs in rank 0's process; the workers follow
``worker_loop(target)``). Rank 0 also runs the one-process (tp 1) executor over the same HF weights, with and without
the head. Each runs greedy and sampled (temperature 1, a seed per request). Prints one JSON line on rank 0: tokens and
acceptance counters of each run; exit 1 when the greedy tokens of any run differ from tp 1 without speculation.

    mpiexec -n 2 python tests/serving/mpi/heads_check.py KIND HF_DIR TP2_CKPT HEAD_DIR
"""

import json
import sys

import torch

K = 3
KINDS = {"mtp": "MTP", "eagle3": "Eagle3", "medusa": "Medusa"}


def serve(config, engine, prompts, draft=None, sampled=False):
    """``sampled``: temperature 1 with a seed per request (rejection sampling against the heads' distributions)."""
    from trtpipe.serving.api import Request, SamplingParams
    from trtpipe.serving.executor import ExecutorCore

    final = {}
    core = ExecutorCore(
        config, engine, lambda r: final.__setitem__(r.request_id, r) if r.is_final else None, draft_engine=draft
    )
    ids = [
        core.submit(
            Request(
                p,
                20,
                exclude_input_from_output=True,
                return_perf_metrics=True,
                sampling=SamplingParams(1.0, seed=100 + i) if sampled else SamplingParams(),
            )
        )
        for i, p in enumerate(prompts)
    ]
    core.run_until_idle()
    got = [final[i] for i in ids]
    return {
        "tokens": [r.tokens for r in got],
        "errors": [r.error for r in got if r.has_error],
        "drafts": [r.perf.total_draft_tokens for r in got],
        "accepted": [r.perf.total_accepted_draft_tokens for r in got],
        "verifications": core.speculator.verifications if core.speculator is not None else 0,
    }


def main(kind: str, hf_dir: str, ckpt: str, head_dir: str) -> int:
    from trtpipe.runtime.distributed import load_all_ranks
    from trtpipe.serving.mpi_engine import MpiStepEngine, worker_loop

    torch.set_num_threads(1)
    target, _ = load_all_ranks(ckpt)
    if target.layout.rank != 0:
        worker_loop(target)
        return 0
    from trtpipe.runtime.hf_loader import load_hf_checkpoint
    from trtpipe.serving.api import ExecutorConfig
    from trtpipe.serving.reference_engine import ReferenceEngine, draft_engine

    base = dict(
        max_batch_size=4, max_num_tokens=64, max_input_len=64, max_seq_len=128, num_blocks=64, tokens_per_block=8
    )
    plain_cfg = ExecutorConfig(**base)
    spec_cfg = ExecutorConfig(
        **base,
        speculative_decoding_type=KINDS[kind],
        max_draft_len=K,
        speculative_model=None if kind == "mtp" else head_dir,
    )
    g = torch.Generator().manual_seed(12)
    prompts = [
        [1] + torch.randint(3, 240, (int(m),), generator=g).tolist() for m in torch.randint(2, 14, (4,), generator=g)
    ]
    full = load_hf_checkpoint(hf_dir)  # the whole target in rank 0's process (the OpenAI twin loads it too)
    out = {
        "tp1_plain": serve(plain_cfg, ReferenceEngine(full), prompts),
        "tp1_spec": serve(spec_cfg, ReferenceEngine(full), prompts, draft_engine(spec_cfg, full, hf_dir)),
        "tp1_sampled": serve(spec_cfg, ReferenceEngine(full), prompts, draft_engine(spec_cfg, full, hf_dir), True),
    }
    engine = MpiStepEngine(target)
    try:
        out["tp2_plain"] = serve(plain_cfg, engine, prompts)
        out["tp2_spec"] = serve(spec_cfg, engine, prompts, draft_engine(spec_cfg, full, hf_dir))
        out["tp2_sampled"] = serve(spec_cfg, engine, prompts, draft_engine(spec_cfg, full, hf_dir), True)
    finally:
        engine.shutdown()
    print(json.dumps(out), flush=True)
    want = out["tp1_plain"]["tokens"]
    ok = all(r["tokens"] == want and not r["errors"] for k, r in out.items() if "sampled" not in k)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
