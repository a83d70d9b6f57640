"""Run under mpiexec: rank 0 verifies a hand-built tree through the MPI step engine (the mask and positions travel
with the step), moves the accepted drafts' KV (broadcast: every rank moves its shard), then decodes one token; rank 0
compares the logits with the one-process engine running the chain of the accepted path, within the float32 error
of that chain (measured against a float64 chain). Prints one JSON line on rank 0; exit 1 on a mismatch."""

import json
import sys

import torch

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]
PATH = [2, 5, 7]
TPB, BLOCKS = 4, 8


def main(ckpt: str) -> int:
    from trtpipe.runtime.distributed import load_all_ranks
    from trtpipe.serving.api import StepBatch, StepEntry
    from trtpipe.serving.mpi_engine import MpiStepEngine, worker_loop
    from trtpipe.serving.reference_engine import ReferenceEngine
    from trtpipe.serving.tree_verify import accepted_slot_moves, mask_from_parents, positions_from_parents

    torch.set_num_threads(1)
    model, _ = load_all_ranks(ckpt)
    if model.layout.rank != 0:
        worker_loop(model)
        return 0
    from trtpipe.runtime import load_checkpoint

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    from numerics import float64_copy

    engine = MpiStepEngine(model)
    ref = load_checkpoint(ckpt)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 500, (11,), generator=g).tolist()
    tokens = torch.randint(3, 500, (len(PARENTS),), generator=g).tolist()
    chain, nxt, L = [tokens[0]] + [tokens[i] for i in PATH], 77, 11
    table = list(range(BLOCKS))

    def run(eng, tree: bool):
        eng.allocate(BLOCKS, TPB)
        if eng.model is not ref and not isinstance(eng, MpiStepEngine):  # the float64 copy
            eng.pools = {k: (a.double(), b.double()) for k, (a, b) in eng.pools.items()}
        eng.logits(StepBatch(0, [StepEntry(0, prompt, 0, table, True, True)]))
        if tree:
            spec = dict(spec_positions=positions_from_parents(PARENTS), spec_mask=mask_from_parents(PARENTS))
            rows = eng.logits(StepBatch(1, [StepEntry(0, tokens, L, table, False, True, **spec)]))[[0, *PATH]]
            eng.move_slots(*accepted_slot_moves(table, L, PATH, TPB))
        else:
            rows = eng.logits(StepBatch(1, [StepEntry(0, chain, L, table, False, True)]))
        after = eng.logits(StepBatch(2, [StepEntry(0, [nxt], L + len(chain), table, False, True)]))
        return rows.double(), after.double()

    try:
        got = run(engine, True)
    finally:
        engine.shutdown()
    c32 = run(ReferenceEngine(ref), False)
    c64 = run(ReferenceEngine(float64_copy(ref)), False)
    out = {}
    for i, what in enumerate(("rows", "after")):
        scale = max(float((c32[i] - c64[i]).abs().max()), 2.0**-24 * float(c64[i].abs().max()))
        out[what + "_err"] = float((got[i] - c64[i]).abs().max())
        out[what + "_bound"] = 4 * scale
    print(json.dumps(out), flush=True)
    return 0 if all(out[w + "_err"] <= out[w + "_bound"] for w in ("rows", "after")) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
