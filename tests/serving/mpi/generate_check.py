"""Run under mpiexec: rank 0 drives the MPI step engine (paged KV per rank), the workers follow; rank 0
compares the tokens with the one-process runtime's generate (greedy and seeded sampling).
Prints one JSON line on rank 0; exit 1 on a mismatch."""

import json
import sys

import torch


def main(ckpt: str) -> int:
    from trtpipe.runtime.distributed import load_all_ranks
    from trtpipe.serving.mpi_engine import MpiStepEngine, generate_steps, worker_loop

    torch.set_num_threads(1)
    model, _ = load_all_ranks(ckpt)
    if model.layout.rank != 0:
        worker_loop(model)
        return 0
    from trtpipe.runtime import generate, load_checkpoint

    engine = MpiStepEngine(model)
    ref = load_checkpoint(ckpt)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 1, 9)]
    cases = {"greedy": dict(), "sampled": dict(temperature=0.9, top_k=20, top_p=0.9, seed=5)}
    result = {}
    try:
        for name, kw in cases.items():
            got = generate_steps(engine, prompts, 24, end_ids=2, tokens_per_block=8, **kw)
            want = generate(ref, prompts, 24, end_ids=2, **kw)
            result[name] = got == want
            result[name + "_tokens"] = got
    finally:
        engine.shutdown()
    print(json.dumps(result), flush=True)
    return 0 if all(v for k, v in result.items() if not k.endswith("_tokens")) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
