"""Run under mpiexec: the Triton twin's LoRA (trtpipe.serving.triton_lora) over the MPI step engine, as leader
mode runs it (rank 0 the executor, the other ranks ``worker_loop``). Rank 0 serves the engine's prefetched tasks and
one adapter sent with its tensors (``SENT_WEIGHTS`` / ``SENT_CONFIG``, .npy, as task 7), max_loras 4; each worker
reads the prefetched tasks from their folders and gets the sent tensors once, over the step's wire
(trtpipe.serving.adapters.RankLora). Rank 0 saves to OUT (torch.save):

- ``mixed``: the greedy tokens of JOBS submitted together (three tasks, the sent one and the base in one in-flight
  batch), with the largest number of entries and of distinct adapters a step held;
- ``solo``: the greedy tokens of each job run alone;
- ``sent_wires``: the length of each ``("sent", ...)`` source on the steps' wire (5: with the tensors, 3: the
  task and version only);
- ``replaced`` / ``task0``: task 7 sent again with task 0's prefetched tensors, then a prompt under task 7 and under
  task 0 (the workers must have replaced task 7).

Usage: lora_twin_check.py ENGINE_DIR SENT_WEIGHTS SENT_CONFIG OUT"""

import json
import sys

import numpy as np
import torch

PROMPTS = [
    [1, 403, 407, 261, 378, 261, 300],
    [1, 365, 1, 300, 403, 407, 261, 378, 299],
    [1, 343, 300, 400, 31, 262],
    [1, 403, 300, 262, 319, 378, 261, 300, 407, 31, 400],
    [1, 403, 407, 31, 262],
]
SENT_TASK = 7
LORAS = ["task-0", "task-1", "task-2", f"task-{SENT_TASK}", None]
JOBS = [(p, 12, lora) for p, lora in zip(PROMPTS, LORAS)]
EOS = 2


def main(engine_dir: str, sent_weights: str, sent_config: str, out: str) -> int:
    from pathlib import Path

    from trtpipe.runtime.distributed import load_all_ranks
    from trtpipe.serving.mpi_engine import MpiStepEngine, worker_loop

    torch.set_num_threads(1)
    engine_dir = Path(engine_dir)
    model, _ = load_all_ranks(str(engine_dir / "checkpoint"))
    if model.layout.rank != 0:
        worker_loop(model)
        return 0
    from trtpipe.engine.lora_build import PREFETCH_DIR
    from trtpipe.serving.api import ExecutorConfig, Request
    from trtpipe.serving.executor import ExecutorCore
    from trtpipe.serving.triton_lora import TwinAdapters, select

    mpi = MpiStepEngine(model)
    twin = TwinAdapters(engine_dir, engine_dir / PREFETCH_DIR, 4, None)
    engine = twin.wrap(mpi)
    wires, sources = [], mpi.lora_sources

    def recording(batch):
        out = sources(batch)
        wires.extend(len(v) for v in (out or {}).values() if isinstance(v, tuple) and v[0] == "sent")
        return out

    mpi.lora_sources = recording
    sent = select(twin, np.array([[SENT_TASK]], np.uint64), np.load(sent_weights), np.load(sent_config))
    assert sent == LORAS[3], sent
    config = ExecutorConfig(
        max_batch_size=8,
        max_num_tokens=128,
        max_input_len=96,
        max_seq_len=128,
        num_blocks=96,
        tokens_per_block=8,
        max_loras=4,
    )

    def run(jobs):
        final = {}
        core = ExecutorCore(config, engine, lambda r: final.__setitem__(r.request_id, r) if r.is_final else None)
        ids = [core.submit(Request(p, n, end_id=EOS, exclude_input_from_output=True, lora=lora)) for p, n, lora in jobs]
        core.run_until_idle()
        return [final[i].error if final[i].has_error else final[i].tokens for i in ids], core

    result = {}
    try:
        result["mixed"], core = run(JOBS)
        result["widest"] = max(len(s.entries) for s in core.iterations)
        result["solo"] = [run([job])[0][0] for job in JOBS]
        task0 = engine_dir / PREFETCH_DIR / "0"
        w0, c0 = np.load(task0 / "model.lora_weights.npy"), np.load(task0 / "model.lora_config.npy")
        select(twin, np.array([[SENT_TASK]], np.uint64), w0, c0)
        result["replaced"] = run([(PROMPTS[3], 12, LORAS[3])])[0][0]
        result["task0"] = run([(PROMPTS[3], 12, LORAS[0])])[0][0]
        result["sent_wires"] = wires
    finally:
        mpi.shutdown()
    torch.save(result, out)
    print(json.dumps({"widest": result["widest"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
