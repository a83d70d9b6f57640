"""Run inside ``unshare -rn`` (Dynamo's workers bind ZMQ publishers to 0.0.0.0): one twin worker behind Dynamo's real
frontend, started with ``--dyn-reasoning-parser deepseek_r1``, on a random Qwen3 chat model (tests/qwen3_chat.py).
Prints JSON: the chat answer's message and the raw text of the same prompt through /v1/completions."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main(port: int) -> None:
    from openai import OpenAI
    from qwen3_chat import make_qwen3_chat
    from transformers import AutoTokenizer

    from trtpipe.app.launch_dynamo import DynamoGraph, Supervisor
    from trtpipe.serving.config import replace_knobs, twin_default

    tmp = Path(tempfile.mkdtemp(prefix="dyn-parsers-"))
    model = make_qwen3_chat(tmp / "m")
    config = replace_knobs(twin_default(1024), enable_kv_cache_reuse=True)
    g = DynamoGraph(
        model, "q", 1, "round-robin", "127.0.0.1", port, config, tmp / "run",
        parser_args=["--dyn-reasoning-parser", "deepseek_r1"],
    )  # fmt: skip
    sup = Supervisor(g, echo=lambda s: print(s, file=sys.stderr, flush=True))
    sup.start()
    try:
        client = OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Tell me a story"}]
        chat = client.chat.completions.create(model="q", messages=messages, max_tokens=24, temperature=0)
        tok = AutoTokenizer.from_pretrained(str(model))
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        raw = client.completions.create(
            model="q", prompt=tok.encode(text, add_special_tokens=False), max_tokens=24, temperature=0
        )
        print(json.dumps({"message": chat.choices[0].message.model_dump(), "raw": raw.choices[0].text}))
    finally:
        sup.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]))
