"""Qwen3, Qwen3-MoE and Gemma 3 served as users serve them, against transformers' greedy text on the same weights:
``trtpipe build`` + ``trtpipe serve --detach`` + ``trtpipe infer`` (the engine target's CPU twin behind a real
tritonserver), and the OpenAI twin (``openai`` client over HTTP) on the llmapi export of Qwen3.

The synthetic models use the stories260k tokenizer (vocab 512) so prompts are text; Qwen3 dense and Gemma 3 are
untied here (Qwen3-8B and larger are; Gemma 3 is tied, which its rules also map): a tied random model only repeats
its last token, which would test nothing. Gemma 3's sliding window is 5 tokens, so every answer goes past it."""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from openai_helpers import serve_in_thread
from trtpipe.cli import main
from trtpipe.models.synthetic import load_hf, make_synthetic
from optional import needs

pytestmark = [pytest.mark.triton, pytest.mark.slow, needs("tritonclient", "aiohttp")]

PROMPTS = ["Once upon a time", "The little dog"]
KINDS = {"qwen3": dict(tie_word_embeddings=False), "qwen3_moe": dict(), "gemma3": dict(tie_word_embeddings=False)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json")


def _model(kind: str, root: Path, stories_dir: Path) -> Path:
    d = make_synthetic(kind, root / kind, seed=12, vocab_size=512, bos_token_id=1, eos_token_id=2, **KINDS[kind])
    for f in TOKENIZER_FILES:
        shutil.copy(stories_dir / f, d / f)
    return d


def _hf_greedy(model_dir: Path, prompt: str, n: int, model=None) -> str:
    """transformers' greedy text (``model``: an already loaded one, else the directory's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=2)[0, ids.shape[1] :]
    return tok.decode(out, skip_special_tokens=True)


def _cli(*args: str) -> str:
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("kind", list(KINDS))
def test_engine_target_serves_transformers_greedy_text(kind, tmp_path, stories_dir):
    model = _model(kind, tmp_path, stories_dir)
    recipe = tmp_path / f"{kind}.yaml"
    recipe.write_text(
        f"name: {kind}-tiny\nwork_dir: '{tmp_path / 'work'}'\nmodel:\n  source: {model}\n  dtype: float32\n"
        "engine:\n  max_batch_size: 4\n  max_input_len: 128\n  max_seq_len: 256\n  max_num_tokens: 512\n"
        "accuracy:\n  enabled: false\ntriton:\n  max_batch_size: 4\n"
    )
    _cli("build", str(recipe))
    out = _cli("serve", str(recipe), "--detach")
    assert re.search(r"pid\s+\d+", out), out
    hf = load_hf(model)
    try:
        for prompt in PROMPTS:
            got = _cli("infer", prompt, "--server", str(recipe), "--max-tokens", "24").rstrip("\n")
            assert got == _hf_greedy(model, prompt, 24, model=hf), prompt
    finally:
        _cli("stop", str(recipe))


@pytest.mark.parametrize("kind", list(KINDS))
def test_openai_twin_serves_the_llmapi_export(kind, tmp_path, stories_dir):
    import openai
    from trtpipe.checkpoint.convert import convert
    from trtpipe.export.unified import export_unified
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    model = _model(kind, tmp_path, stories_dir)
    base = convert(model, tmp_path / "base", tp=2, dtype="float32")
    export = tmp_path / "unified"
    export.mkdir()
    export_unified(base, model, None, export, algo="none", kv_cache="none", group_size=128, alpha=0.5, exclude=[])
    app = OpenAIServer(ServedModel(export, f"{kind}-tiny")).app
    hf = load_hf(model)
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        for prompt in PROMPTS:
            r = client.completions.create(model=f"{kind}-tiny", prompt=prompt, max_tokens=24, temperature=0)
            assert r.choices[0].text == _hf_greedy(model, prompt, 24, model=hf), prompt


def test_gpt_oss_llmapi_recipe_built_and_served_speaks_transformers_greedy_text(tmp_path, stories_dir):
    """gpt-oss has no engine target (``trtpipe infer`` is Triton's client, so the ``openai`` one asks here):
    ``trtpipe build`` of a target: llmapi recipe on the shipped layout (MXFP4
    experts) at tp2 x ep2, ``trtpipe serve --detach`` (the OpenAI twin, a real process), the ``openai`` client, then
    ``trtpipe stop``. The oracle is transformers on its own dequantization of the same blocks (a float model of the
    same draw whose experts are replaced by ``convert_moe_packed_tensors`` of them); its prompts run past the
    window of 4 tokens."""
    import openai
    from safetensors import safe_open
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    kw = dict(seed=12, vocab_size=512, bos_token_id=1, eos_token_id=2)
    mx = make_synthetic("gpt_oss_mxfp4", tmp_path / "mx", **kw)
    for f in TOKENIZER_FILES:
        shutil.copy(stories_dir / f, mx / f)
    hf = load_hf(make_synthetic("gpt_oss", tmp_path / "bf", **kw))
    with safe_open(str(mx / "model.safetensors"), "pt") as f, torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(
                    convert_moe_packed_tensors(
                        f.get_tensor(name + "_blocks"), f.get_tensor(name + "_scales"), dtype=torch.float32
                    )
                )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    recipe = tmp_path / "gpt-oss.yaml"
    recipe.write_text(
        f"name: gpt-oss-tiny\nwork_dir: '{tmp_path / 'work'}'\ntarget: llmapi\nmodel:\n  source: {mx}\n"
        "  dtype: float32\nparallel:\n  tp: 2\n  moe_ep: 2\nengine:\n  max_batch_size: 4\n"
        "  max_input_len: 128\n  max_seq_len: 256\n  max_num_tokens: 512\naccuracy:\n  enabled: false\n"
        f"llmapi:\n  port: {port}\n"
    )
    _cli("build", str(recipe))
    _cli("serve", str(recipe), "--detach")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt in PROMPTS:
            r = client.completions.create(model="gpt-oss-tiny", prompt=prompt, max_tokens=24, temperature=0)
            assert r.choices[0].text == _hf_greedy(mx, prompt, 24, model=hf), prompt
    finally:
        _cli("stop", str(recipe))
