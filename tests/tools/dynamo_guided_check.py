"""Run inside ``unshare -rn`` (Dynamo's workers bind ZMQ publishers to 0.0.0.0): one twin worker with
``guided_decoding_backend`` set, behind Dynamo's real frontend, on the random Llama with stories260k's tokenizer that
tests/export/test_openai_guided.py serves (its near-uniform logits finish documents; a random Qwen3 spins on
whitespace), with that test's chat template.
Sends OpenAI ``response_format: json_schema`` chat requests through the frontend (the schemas of
tests/guided_oracle.py, sampled, a few seeds each) and prints JSON: per request the schema's name, the finish
reason and the answer's text."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main(port: int, backend: str) -> None:
    import shutil

    from guided_oracle import SCHEMAS
    from openai import OpenAI
    from transformers import AutoTokenizer

    from trtpipe.app.launch_dynamo import DynamoGraph, Supervisor
    from trtpipe.models.synthetic import make_synthetic
    from trtpipe.serving.config import replace_knobs, twin_default

    tmp = Path(tempfile.mkdtemp(prefix="dyn-guided-"))
    model = make_synthetic("llama", tmp / "m", seed=1, vocab_size=512, eos_token_id=2)
    stories = ROOT / "models" / "stories260k"
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(stories / f, model / f)
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.chat_template = (ROOT / "tests" / "export" / "data" / "chat_template.jinja").read_text()
    tok.save_pretrained(str(model))
    config = replace_knobs(twin_default(1024), guided_decoding_backend=backend)
    g = DynamoGraph(model, "q", 1, "round-robin", "127.0.0.1", port, config, tmp / "run")
    sup = Supervisor(g, echo=lambda s: print(s, file=sys.stderr, flush=True))
    sup.start()
    out = []
    try:
        client = OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for name, schema in SCHEMAS.items():
            fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
            for seed in range(3):
                r = client.chat.completions.create(
                    model="q",
                    messages=[{"role": "user", "content": "Tell me about Lily."}],
                    max_tokens=200,
                    temperature=1.0,
                    seed=seed,
                    response_format=fmt,
                )
                c = r.choices[0]
                out.append({"schema": name, "finish": c.finish_reason, "text": c.message.content})
    finally:
        sup.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
