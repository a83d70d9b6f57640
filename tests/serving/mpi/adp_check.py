"""Run under mpiexec on an attention-DP checkpoint: rank 0's MPI step engine spreads the requests over the ranks
(each rank: its own requests' attention and KV; the MoE layers exchange tokens), the workers follow.

Rank 0 checks (1) the logits of a context step and a generation step of three requests against transformers'
float64 forward of each sequence, within ORDER_FACTOR x transformers' own float32 error; (2) greedy generation
(``generate_steps``) against transformers' ``generate``. Prints one JSON line on rank 0; exit 1 on a failure.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: numerics


def main(hf_dir: str, ckpt: str) -> int:
    from trtpipe.runtime.distributed import load_all_ranks
    from trtpipe.serving.mpi_engine import MpiStepEngine, generate_steps, worker_loop

    torch.set_num_threads(1)
    model, status = load_all_ranks(ckpt)
    if model.layout.rank != 0:
        worker_loop(model)
        return 0
    from numerics import error_scale, hf_float64

    from trtpipe.models.synthetic import load_hf
    from trtpipe.serving.api import StepBatch, StepEntry

    hf32 = load_hf(hf_dir)
    hf64 = hf_float64(hf32)
    engine = MpiStepEngine(model)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (9, 14, 20)]
    out: dict = {"ranks_loaded": [s["weights_mb"] for s in status]}
    try:
        engine.allocate(16, 8)
        tables = [[4 * i + b for b in range(4)] for i in range(3)]
        ctx = StepBatch(0, [StepEntry(i, p, 0, tables[i], True, True) for i, p in enumerate(prompts)])
        got_ctx = engine.logits(ctx)
        out["context_ranks"] = dict(engine.assigner.request_rank)
        with torch.no_grad():
            ref_ctx = torch.stack([hf64(torch.tensor([p])).logits[0, -1] for p in prompts])
        nxt = [int(t) for t in ref_ctx.argmax(-1)]
        gen = StepBatch(1, [StepEntry(i, [nxt[i]], len(p), tables[i], False, True) for i, p in enumerate(prompts)])
        got_gen = engine.logits(gen)
        seqs = prompts + [p + [t] for p, t in zip(prompts, nxt)]
        with torch.no_grad():
            ref = torch.stack([hf64(torch.tensor([s])).logits[0, -1] for s in seqs])
            own = torch.stack([hf32(torch.tensor([s])).logits[0, -1] for s in seqs])
        got = torch.cat([got_ctx, got_gen]).double()
        out["err"] = float((got - ref).abs().max())
        out["bound"] = 4.0 * error_scale(own, ref)  # numerics.ORDER_FACTOR x transformers' float32 error
        out["logits_ok"] = out["err"] <= out["bound"]

        greedy = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 12, 3)]
        steps = generate_steps(engine, greedy, 16, tokens_per_block=8)
        with torch.no_grad():
            want = [
                hf32.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
                for p in greedy
            ]
        out["greedy_ok"] = [_to_end(s) for s in steps] == [_to_end(w) for w in want]
        out["greedy"] = steps
    finally:
        engine.shutdown()
    print(json.dumps(out), flush=True)
    return 0 if out["logits_ok"] and out["greedy_ok"] else 1


def _to_end(tokens: list, end: int = 2) -> list:
    """Up to and with the first end token (transformers' generate stops there when the config names it)."""
    return tokens[: tokens.index(end) + 1] if end in tokens else tokens


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
