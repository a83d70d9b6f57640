"""Run under mpiexec: a DraftTarget draft sharded over the same ranks as the target (rank 0's executor drives both
MPI step engines; the workers follow ``worker_loop(target, draft)``). Greedy tokens must equal the one-process
executor without speculation; the model as its own draft (sharded too) must accept every draft, per the trace.
Prints one JSON line on rank 0; exit 1 on any difference.

    mpiexec -n 2 python tests/serving/mpi/draft_check.py TARGET_CKPT SELF_DRAFT_CKPT OTHER_DRAFT_CKPT
"""

import json
import sys

import torch


def serve(config, engine, requests, draft=None):
    from trtpipe.serving.executor import ExecutorCore

    final = {}
    core = ExecutorCore(
        config, engine, lambda r: final.__setitem__(r.request_id, r) if r.is_final else None, draft_engine=draft
    )
    ids = [core.submit(r) for r in requests]
    core.run_until_idle()
    return [final[i] for i in ids], core


def main(target_ckpt: str, self_ckpt: str, other_ckpt: str) -> int:
    from trtpipe.runtime.distributed import load_all_ranks
    from trtpipe.serving.mpi_engine import MpiStepEngine, draft_step_engine, worker_loop

    torch.set_num_threads(1)
    target, _ = load_all_ranks(target_ckpt)
    drafts = {"self": load_all_ranks(self_ckpt)[0], "other": load_all_ranks(other_ckpt)[0]}
    if target.layout.rank != 0:
        for name in ("self", "other"):  # one worker loop per scenario: rank 0 stops it after each
            worker_loop(target, drafts[name])
        return 0
    from trtpipe.runtime import load_checkpoint
    from trtpipe.serving.api import ExecutorConfig, Request
    from trtpipe.serving.reference_engine import ReferenceEngine

    config = dict(max_batch_size=8, max_num_tokens=128, max_input_len=96, max_seq_len=160, num_blocks=96)
    plain_cfg = ExecutorConfig(**config, tokens_per_block=8)
    spec_cfg = ExecutorConfig(**config, tokens_per_block=8, speculative_decoding_type="DraftTarget", max_draft_len=3)
    g = torch.Generator().manual_seed(5)
    prompts = [
        [1] + torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (4,), generator=g)
    ]
    reference = ReferenceEngine(load_checkpoint(target_ckpt))
    result = {}
    for name in ("self", "other"):
        # the self-draft trace runs without an end id (20 tokens each); the other draft's with end id 2
        end = None if name == "self" else 2

        def reqs(end=end):
            return [
                Request(p, 20, end_id=end, exclude_input_from_output=True, return_perf_metrics=True) for p in prompts
            ]

        want, _ = serve(plain_cfg, reference, reqs())
        engine = MpiStepEngine(target)
        try:
            got, core = serve(spec_cfg, engine, reqs(), draft_step_engine(engine, drafts[name]))
        finally:
            engine.shutdown()
        result[name] = {
            "equal": [r.tokens for r in got] == [r.tokens for r in want],
            "errors": [r.error for r in got if r.has_error],
            "drafts": [r.perf.total_draft_tokens for r in got],
            "accepted": [r.perf.total_accepted_draft_tokens for r in got],
            "verifications": core.speculator.verifications,
        }
    print(json.dumps(result), flush=True)
    return 0 if all(r["equal"] and not r["errors"] for r in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
