"""Run under mpiexec: the OpenAI twin on rank 0 serves a tp 2 target split over the ranks (rank 0's MPI step engine;
the workers follow) with Medusa heads (a head kind whose model has real text: stories260k), then without them; an ``openai`` client asks for greedy completions over
HTTP, several at once. Prints one JSON line on rank 0 (each prompt's text and ``usage`` with and without the heads);
exit 1 on a difference.

    mpiexec -n 2 python tests/serving/mpi/heads_openai_check.py HF_DIR TP2_CKPT HEAD_DIR
"""

import dataclasses
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: openai_helpers

PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went", "She saw a big"]


def main(hf_dir: str, ckpt: str, head_dir: str) -> int:
    from trtpipe.runtime.distributed import load_all_ranks
    from trtpipe.serving.mpi_engine import MpiStepEngine, worker_loop

    torch.set_num_threads(1)
    model, _ = load_all_ranks(ckpt)
    if model.layout.rank != 0:
        worker_loop(model)
        return 0
    import openai
    from openai_helpers import serve_in_thread

    from trtpipe.serving.config import twin_default
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    engine = MpiStepEngine(model)
    base = twin_default(128)
    spec = dataclasses.replace(base, speculative_decoding_type="Medusa", max_draft_len=3, speculative_model=head_dir)
    out: dict = {}
    try:
        for name, config in (("plain", base), ("medusa", spec)):
            served = ServedModel(Path(hf_dir), "tiny", config, step_engine=engine)
            try:
                with serve_in_thread(OpenAIServer(served).app) as url:
                    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

                    def ask(prompt):
                        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
                        return r.choices[0].text, r.usage.model_dump()

                    with ThreadPoolExecutor(len(PROMPTS)) as pool:
                        out[name] = list(pool.map(ask, PROMPTS))
            finally:
                served.shutdown()
    finally:
        engine.shutdown()
    print(json.dumps(out), flush=True)
    same = [a[0] for a in out["plain"]] == [b[0] for b in out["medusa"]]
    return 0 if same and all(len(t) > 20 for t, _ in out["plain"]) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
