"""Run under mpiexec: the tree forms of speculation and lookahead for a tp 2 target split over two ranks (rank 0's MPI
step engine verifies each step's token set with its mask and positions, the accepted drafts' KV moves on every rank;
heads draft whole on rank 0 from its captured hidden states, built over rank 0's shard and the tp 2 checkpoint as the
Triton twin builds them in leader mode; the workers follow ``worker_loop(target)``). Rank 0 also runs the one-process
(tp 1) executor over the same HF weights with the same heads. Prints one JSON line on rank 0:
tokens and acceptance counters of each run; exit 1 when the greedy tokens of any run differ from tp 1 without
speculation.

    mpiexec -n 2 python tests/serving/mpi/tree_spec_check.py KIND HF_DIR TP2_CKPT HEAD_DIR

KIND: medusa_tree, eagle_chain, eagle_tree (HEAD_DIR: the Medusa heads / the EAGLE-1 head) or lookahead (HEAD_DIR
'-'; (W, N, G) = (4, 3, 4), greedy only).
"""

import json
import sys

import torch

from heads_check import serve

MEDUSA_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]
EAGLE_TREE = "{0}, {1}, {2}, {0, 0}, {1, 0}, {0, 1}, {0, 0, 0}"  # siblings at depths 1 and 2
WNG = (4, 3, 4)


def spec_fields(kind: str, head_dir: str) -> dict:
    if kind == "medusa_tree":
        return dict(
            speculative_decoding_type="Medusa",
            max_draft_len=len(MEDUSA_TREE),
            speculative_model=head_dir,
            medusa_choices=MEDUSA_TREE,
        )
    if kind == "eagle_chain":
        return dict(speculative_decoding_type="Eagle", max_draft_len=3, speculative_model=head_dir)
    if kind == "eagle_tree":
        return dict(
            speculative_decoding_type="Eagle",
            max_draft_len=EAGLE_TREE.count("{"),
            speculative_model=head_dir,
            eagle_choices=EAGLE_TREE,
        )
    w, n, g = WNG
    return dict(
        speculative_decoding_type="Lookahead",
        max_draft_len=(n - 2) + (w - 1 + g) * (n - 1),
        lookahead_window_size=w,
        lookahead_ngram_size=n,
        lookahead_verification_set_size=g,
    )


def prompts_for(kind: str) -> list:
    g = torch.Generator().manual_seed(12)
    out = []
    for m in torch.randint(4, 9, (4,), generator=g):
        phrase = torch.randint(3, 240, (int(m),), generator=g).tolist()
        # lookahead: a phrase said three times (its n-grams are in the pool from the prompt on)
        out.append([1] + (phrase * 3 if kind == "lookahead" else phrase))
    return out


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
        max_batch_size=4, max_num_tokens=128, max_input_len=64, max_seq_len=128, num_blocks=64, tokens_per_block=8
    )
    plain_cfg = ExecutorConfig(**base)
    spec_cfg = ExecutorConfig(**base, **spec_fields(kind, head_dir))
    prompts = prompts_for(kind)
    full = load_hf_checkpoint(hf_dir)  # the whole target in rank 0's process (what a head reads besides)
    sampled = kind != "lookahead"  # lookahead is greedy only (trtpipe.serving.lookahead.GREEDY_ONLY)

    def drafter(over=full, where=hf_dir):
        return draft_engine(spec_cfg, over, where)

    def rank_drafter():  # as the Triton twin in leader mode builds it: over rank 0's shard and its checkpoint
        return drafter(target, ckpt)

    out = {
        "tp1_plain": serve(plain_cfg, ReferenceEngine(full), prompts),
        "tp1_spec": serve(spec_cfg, ReferenceEngine(full), prompts, drafter()),
    }
    if sampled:
        out["tp1_sampled"] = serve(spec_cfg, ReferenceEngine(full), prompts, drafter(), True)
    engine = MpiStepEngine(target)
    try:
        out["tp2_plain"] = serve(plain_cfg, engine, prompts)
        out["tp2_spec"] = serve(spec_cfg, engine, prompts, rank_drafter())
        if sampled:
            out["tp2_sampled"] = serve(spec_cfg, engine, prompts, rank_drafter(), True)
    finally:
        engine.shutdown()
    print(json.dumps(out), flush=True)
    want = out["tp1_plain"]["tokens"]
    ok = all(r["tokens"] == want and not r["errors"] for k, r in out.items() if "sampled" not in k)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
