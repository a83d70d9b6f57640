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


def test_block_fp8_recipe_built_and_served_as_stored(tmp_path, stories_dir):
    """A DeepSeek-style block-FP8 source (tests/models/test_deepseek_v3_fp8.py: codes and weight_scale_inv by the
    format's definition) through ``trtpipe build`` of a target: llmapi recipe at tp 2 x ep 2 (the export: the
    source's files byte for byte) and ``trtpipe serve --detach`` (the OpenAI twin, a real process): its greedy
    text is the reference runtime's on the stored checkpoint (FP8 weights and activations as stored), token for
    token."""
    import json
    import socket

    import openai
    from click.testing import CliRunner
    from safetensors.torch import load_file, save_file

    from test_deepseek_v3_fp8 import SHAPE, _quantized, block_quantize
    from trtpipe.cli import main
    from trtpipe.runtime.generate import generate
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    src = make_synthetic(
        "deepseek_v3", tmp_path / "src", seed=12, vocab_size=512, bos_token_id=1, eos_token_id=2, **SHAPE
    )
    tensors = load_file(str(src / "model.safetensors"))
    for k in [k for k in tensors if _quantized(k)]:
        tensors[k], tensors[k[: -len("weight")] + "weight_scale_inv"] = block_quantize(tensors[k])
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (fp8 / "config.json").write_text(json.dumps(cfg))
    for f in TOKENIZER_FILES:
        shutil.copy(stories_dir / f, fp8 / f)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    recipe = tmp_path / "ds.yaml"
    recipe.write_text(
        f"name: ds-fp8-tiny\nwork_dir: '{tmp_path / 'work'}'\ntarget: llmapi\nmodel:\n  source: {fp8}\n"
        "  dtype: float32\nparallel:\n  tp: 2\n  moe_ep: 2\nengine:\n  max_batch_size: 4\n"
        "  max_input_len: 128\n  max_seq_len: 256\n  max_num_tokens: 512\naccuracy:\n  enabled: false\n"
        f"llmapi:\n  port: {port}\n"
    )

    def cli(*args: str) -> str:
        res = CliRunner().invoke(main, list(args))
        assert res.exit_code == 0, res.output
        return res.output

    cli("build", str(recipe))
    exported = [p for p in (tmp_path / "work" / "artifacts" / "export").glob("*/hf")]
    assert len(exported) == 1
    for name in ("model.safetensors", "config.json"):
        assert (exported[0] / name).read_bytes() == (fp8 / name).read_bytes(), name
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fp8)
    runtime = load_hf_checkpoint(fp8)
    cli("serve", str(recipe), "--detach")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt in PROMPTS:
            ids = tok(prompt).input_ids
            want = tok.decode(generate(runtime, [ids], 16, end_ids=2)[0], skip_special_tokens=True)
            r = client.completions.create(model="ds-fp8-tiny", prompt=prompt, max_tokens=16, temperature=0)
            assert len(want) > 8 and r.choices[0].text == want, (prompt, want)
    finally:
        cli("stop", str(recipe))
