"""Run under mpiexec: rank 0's in-flight executor drives the MPI step engine (workers follow the broadcasts);
the tokens must equal the same executor over the one-process reference engine, scenario by scenario (in-flight,
chunked context, prefix reuse with partial-block copies, a tiny pool that forces pauses, n-gram speculation).
Prints one JSON line on rank 0; exit 1 on any difference."""

import json
import sys

import torch

SCENARIOS = {
    "inflight": dict(),
    "chunked": dict(enable_chunked_context=True, max_num_tokens=16),
    "reuse": dict(enable_kv_cache_reuse=True),
    "max-util-tiny-pool": dict(capacity_policy="max_utilization", num_blocks=17),
    # verification entries (a token + 3 drafts) through the ranks' packed step (trtpipe/serving/speculative.py)
    "ngram-speculation": dict(speculative_decoding_type="NGram", max_draft_len=3),
}


def serve(core_cls, config, engine, prompts, lengths):
    final = {}
    core = core_cls(config, engine, lambda r: final.__setitem__(r.request_id, r) if r.is_final else None)
    from trtpipe.serving.api import Request

    ids = []
    for p, n in zip(prompts, lengths):
        ids.append(core.submit(Request(p, n, end_id=2, exclude_input_from_output=True)))
        core.iterate()
    core.run_until_idle()
    return [final[i].tokens if not final[i].has_error else final[i].error for i in ids], core


def main(ckpt: str) -> int:
    from trtpipe.runtime.distributed import load_all_ranks
    from trtpipe.serving.mpi_engine import MpiStepEngine, worker_loop

    torch.set_num_threads(1)
    model, _ = load_all_ranks(ckpt)
    if model.layout.rank != 0:
        worker_loop(model)
        return 0
    from trtpipe.runtime import load_checkpoint
    from trtpipe.serving.api import CapacityPolicy, ExecutorConfig
    from trtpipe.serving.executor import ExecutorCore
    from trtpipe.serving.reference_engine import ReferenceEngine

    engine, ref = MpiStepEngine(model), load_checkpoint(ckpt)
    prefix = [1, 403, 407, 261, 378, 261, 300, 1, 365, 1, 300, 403, 407, 261, 378, 261, 300]
    g = torch.Generator().manual_seed(3)
    result = {}
    try:
        for name, kw in SCENARIOS.items():
            kw = dict(kw)
            if "capacity_policy" in kw:
                kw["capacity_policy"] = CapacityPolicy(kw["capacity_policy"])
            config = ExecutorConfig(
                **{
                    **dict(
                        max_batch_size=8,
                        max_num_tokens=64,
                        max_input_len=96,
                        max_seq_len=128,
                        num_blocks=64,
                        tokens_per_block=8,
                    ),
                    **kw,
                }
            )
            prompts = [
                (prefix if name == "reuse" else []) + torch.randint(3, 500, (int(k),), generator=g).tolist()
                for k in torch.randint(2, 40, (10,), generator=g)
            ]
            lengths = [int(k) for k in torch.randint(4, 30, (10,), generator=g)]
            if name.startswith("ngram"):  # a phrase said three times: the lookups find continuations
                prompts = [p[:6] * 3 for p in prompts]
            got, core = serve(ExecutorCore, config, engine, prompts, lengths)
            want, _ = serve(ExecutorCore, config, ReferenceEngine(ref), prompts, lengths)
            stats = core.pool.stats()
            result[name] = {
                "equal": got == want,
                "tokens": sum(len(t) for t in got if isinstance(t, list)),
                "reused_blocks": stats.reused_blocks,
                "paused": max(s.num_paused for s in core.iterations),
                "accepted_drafts": core.speculator.total_accepted_draft_tokens if core.speculator else 0,
            }
    finally:
        engine.shutdown()
    print(json.dumps(result), flush=True)
    return 0 if all(r["equal"] for r in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
