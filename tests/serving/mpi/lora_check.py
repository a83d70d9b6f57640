"""Run under mpiexec: LoRA over the MPI step engine, one process per rank. Rank 0 serves the adapters of
``ADAPTERS_JSON`` (name -> PEFT directory) on the base ``HF_DIR`` with max_loras 2; the workers attach their
shards of them (trtpipe.serving.adapters.RankLora). Rank 0 saves to OUT (torch.save):

- ``logits``: one packed context step of four prompts under [adapter 0, adapter 1, base, adapter 0], every
  position's logits (each prompt's positions scored, as prompt logprobs do);
- ``tokens``: the greedy tokens of the executor's in-flight run of ``JOBS`` (more adapters than max_loras, so
  steps defer and the caches evict on every rank), with the steps' distinct adapters and the cache counters.

Usage: lora_check.py CKPT HF_DIR ADAPTERS_JSON OUT"""

import json
import sys

import torch

PROMPTS = [
    [1, 403, 407, 261, 378, 261, 300],
    [1, 365, 1, 300, 403, 407, 261, 378, 299],
    [1, 343, 300, 400, 31, 262],
    [1, 403, 300, 262, 319, 378, 261, 300, 407, 31, 400],
]
NEW = 10


def packed_batch(names: list):
    """One context step: prompt i under names[i], every position scored (prompt_targets), blocks of 8."""
    from trtpipe.serving.api import StepBatch, StepEntry

    entries, block = [], 0
    for i, (prompt, lora) in enumerate(zip(PROMPTS, names)):
        need = -(-len(prompt) // 8)
        entries.append(
            StepEntry(
                i,
                prompt,
                0,
                list(range(block, block + need)),
                True,
                True,
                lora=lora,
                prompt_targets=prompt[1:] + [0],
            )
        )
        block += need
    return StepBatch(0, entries)


def jobs(names: list) -> list:
    """(prompt, lora) per request: every adapter twice and the base, interleaved."""
    return [(PROMPTS[k % 4], names[k % len(names)]) for k in range(2 * len(names))] + [(PROMPTS[0], None)]


def main(ckpt: str, hf_dir: str, adapters_json: str, out: str) -> int:
    from trtpipe.runtime.distributed import load_all_ranks
    from trtpipe.serving.mpi_engine import MpiStepEngine, worker_loop

    torch.set_num_threads(1)
    model, _ = load_all_ranks(ckpt)
    if model.layout.rank != 0:
        worker_loop(model)
        return 0
    from trtpipe.serving.adapters import AdapterCache, LoraStepEngine
    from trtpipe.serving.api import ExecutorConfig, Request
    from trtpipe.serving.executor import ExecutorCore

    adapters = json.loads(open(adapters_json).read())
    names = list(adapters)
    cache = AdapterCache(hf_dir, 2, 4, max_rank=64)
    for name, path in adapters.items():
        cache.register(name, path)
    mpi = MpiStepEngine(model)
    engine = LoraStepEngine(mpi, cache)
    result = {}
    try:
        engine.allocate(16, 8)
        result["logits"] = engine.logits(packed_batch([names[0], names[1], None, names[0]]))

        class Recording:
            def __init__(self, inner):
                self.inner, self.steps = inner, []

            def allocate(self, *a):
                self.inner.allocate(*a)

            def copy_block(self, *a):
                self.inner.copy_block(*a)

            def step(self, batch):
                self.steps.append(sorted({e.lora for e in batch.entries if e.lora is not None}))
                return self.inner.step(batch)

        rec = Recording(engine)
        config = ExecutorConfig(
            max_batch_size=16,
            max_num_tokens=128,
            max_input_len=96,
            max_seq_len=128,
            num_blocks=96,
            tokens_per_block=8,
            max_loras=2,
        )
        final = {}
        core = ExecutorCore(config, rec, lambda r: final.__setitem__(r.request_id, r) if r.is_final else None)
        ids = [
            core.submit(Request(p, NEW, end_id=2, exclude_input_from_output=True, lora=lora)) for p, lora in jobs(names)
        ]
        core.run_until_idle()
        result["tokens"] = [final[i].error if final[i].has_error else final[i].tokens for i in ids]
        result["jobs"] = jobs(names)
        result["steps"] = rec.steps
        result["evictions"] = cache.stats.device_evictions
    finally:
        mpi.shutdown()
    torch.save(result, out)
    print(json.dumps({"steps": len(result["steps"]), "evictions": result["evictions"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
