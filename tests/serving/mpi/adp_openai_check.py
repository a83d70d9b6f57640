"""Run under mpiexec: the OpenAI twin on rank 0 serves a model whose steps run on attention-DP ranks (rank 0's MPI
step engine; the workers follow). An ``openai`` client asks for greedy completions over HTTP, several at once so that
the ranks share the batch; rank 0 compares each text with transformers' greedy ``generate`` on the same weights.
Prints one JSON line on rank 0; exit 1 on a difference."""

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: openai_helpers

PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went", "She saw a big"]


def main(hf_dir: str, ckpt: str) -> int:
    from trtpipe.runtime.distributed import load_all_ranks
    from trtpipe.serving.mpi_engine import MpiStepEngine, worker_loop

    torch.set_num_threads(1)
    model, _ = load_all_ranks(ckpt)
    if model.layout.rank != 0:
        worker_loop(model)
        return 0
    import openai
    from openai_helpers import serve_in_thread
    from transformers import AutoTokenizer

    from trtpipe.models.synthetic import load_hf
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    engine = MpiStepEngine(model)
    served = ServedModel(Path(hf_dir), "adp-tiny", step_engine=engine)
    tok, hf = AutoTokenizer.from_pretrained(hf_dir), load_hf(hf_dir)
    out: dict = {}
    try:
        with serve_in_thread(OpenAIServer(served).app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

            def ask(prompt):
                r = client.completions.create(model="adp-tiny", prompt=prompt, max_tokens=24, temperature=0)
                return r.choices[0].text

            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                got = list(pool.map(ask, PROMPTS))
        for prompt, text in zip(PROMPTS, got):
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                want = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2)
            out[prompt] = {"got": text, "want": tok.decode(want[0, ids.shape[1] :], skip_special_tokens=True)}
        out["ranks_used"] = sorted(set(engine.assigner.block_rank.values()))
    finally:
        served.shutdown()
        engine.shutdown()
    print(json.dumps(out), flush=True)
    ok = all(v["got"] == v["want"] and len(v["want"]) > 20 for k, v in out.items() if k in PROMPTS)
    return 0 if ok and out["ranks_used"] == [0, 1] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
