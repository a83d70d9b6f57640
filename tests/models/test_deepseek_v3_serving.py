"""DeepSeek-V3 served as users serve it: the llmapi export (of a tp 2 x ep 2 checkpoint: the tensors of the source,
byte for byte) behind the OpenAI twin (``openai`` client over HTTP, the paged executor caching MLA latents), against
transformers' greedy text on the same weights. The synthetic model uses the stories260k tokenizer (vocab 512)."""

from __future__ import annotations

import shutil

import pytest
import torch

from openai_helpers import serve_in_thread
from trtpipe.models.synthetic import load_hf, make_synthetic

pytestmark = [pytest.mark.slow]

PROMPTS = ["Once upon a time", "The little dog"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json")


def _hf_greedy(model_dir, prompt: str, n: int, model) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=2)[0, ids.shape[1] :]
    return tok.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_k2"])
def test_openai_twin_serves_transformers_greedy_text(kind, tmp_path, stories_dir):
    import openai
    from safetensors import safe_open

    from trtpipe.checkpoint.convert import convert
    from trtpipe.export.unified import export_unified
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    model = make_synthetic(kind, tmp_path / kind, seed=12, vocab_size=512, bos_token_id=1, eos_token_id=2)
    for f in TOKENIZER_FILES:
        shutil.copy(stories_dir / f, model / f)
    base = convert(model, tmp_path / "base", tp=2, moe_ep=2, dtype="float32")
    export = tmp_path / "unified"
    export.mkdir()
    export_unified(base, model, None, export, algo="none", kv_cache="none", group_size=128, alpha=0.5, exclude=[])
    with (
        safe_open(str(export / "model.safetensors"), "pt") as f,
        safe_open(str(model / "model.safetensors"), "pt") as g,
    ):
        assert set(f.keys()) == set(g.keys())
        for k in g.keys():
            assert torch.equal(f.get_tensor(k), g.get_tensor(k)), k
    app = OpenAIServer(ServedModel(export, f"{kind}-tiny")).app
    hf = load_hf(model)
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        for prompt in PROMPTS:
            r = client.completions.create(model=f"{kind}-tiny", prompt=prompt, max_tokens=24, temperature=0)
            want = _hf_greedy(model, prompt, 24, hf)
            assert len(want) > 20 and r.choices[0].text == want, (prompt, want)
