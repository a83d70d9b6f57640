"""Producer-made pre-quantized checkpoints as ``model.source``, served as users serve them: the engine target's CPU
twin behind a real tritonserver (``trtpipe build`` + ``serve --detach`` + ``infer``) and the OpenAI twin over the
llmapi export (``trtpipe build`` of a ``target: llmapi`` recipe, served over HTTP, asked with the ``openai``
client). The greedy text equals the reference runtime's greedy on the source as stored (its dequantized weights,
``load_hf_checkpoint``) and, where transformers loads the checkpoint on CPU, transformers' greedy.

Sources: ModelOpt 0.47 FP8 (engine: converted; llmapi: passed through), llm-compressor W4A16 (engine:
converted via W4A16_AWQ; llmapi: re-laid out) and llm-compressor INT8 W8A8 (engine only: converted to the plugin
SmoothQuant layout; its twin quantizes activations with TensorRT-LLM's amax / 127, the source as stored with
compressed-tensors' amax / 127.5, and the greedy text is the same) and ModelOpt 0.47 NVFP4 (engine: converted to
TensorRT-LLM's NVFP4 layout, recipe on a B200; its down_proj is unquantized), all of stories260k (tests/prequantized.py). ``trtpipe eval`` of
the engine target compares the producer's checkpoint with its unquantized original and gates on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from openai_helpers import serve_in_thread
from prequantized import prequantized
from trtpipe.cli import main
from trtpipe.runtime import generate
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from optional import needs

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The little dog"]
NEW_TOKENS = 16
SOURCES = ["modelopt-fp8-stories", "llmc-w4a16-stories"]
# engine target only (its llmapi target is refused): INT8 W8A8, converted to the plugin SmoothQuant layout; and
# ModelOpt NVFP4 (its llmapi target passes it through, as for FP8), converted to TensorRT-LLM's NVFP4 layout
ENGINE_SOURCES = [*SOURCES, "llmc-w8a8_int8-stories", "modelopt-nvfp4-stories"]
# source -> engine.gpu of its engine recipe (NVFP4's FP4 GEMM needs SM >= 10.0: validate refuses the default H100)
GPU = {"modelopt-nvfp4-stories": "b200-180gb"}
# source -> model.dtype (default bfloat16). ModelOpt's NVFP4 stories260k keeps its unquantized down_proj, embeddings
# and norms in float32; a bfloat16 checkpoint rounds them, and "The little dog" then leaves the source's greedy text
# (at float32 the conversion is exact: tests/quant/imported/test_nvfp4_import.py checks it on the Qwen3 fixture)
DTYPE = {"modelopt-nvfp4-stories": "float32"}
# source -> model.allow_lossy_import of its engine recipe (ModelOpt FP8: q/k/v and gate/up scales differ)
LOSSY = {"modelopt-fp8-stories": "[fp8_requantize]"}


def _recipe(tmp_path: Path, source: Path, target: str, accuracy: str = "  enabled: false\n") -> Path:
    p = tmp_path / f"{target}.yaml"
    lossy = f"  allow_lossy_import: {LOSSY[source.name]}\n" if target == "engine" and source.name in LOSSY else ""
    gpu = f"  gpu: {GPU[source.name]}\n" if source.name in GPU else ""
    p.write_text(
        f"name: pq-{target}\nwork_dir: '{tmp_path / ('work-' + target)}'\ntarget: {target}\nmodel:\n"
        f"  source: {source}\n  dtype: {DTYPE.get(source.name, 'bfloat16')}\n{lossy}engine:\n  max_batch_size: 4\n  max_input_len: 64\n"
        f"  max_seq_len: 128\n  max_num_tokens: 256\n{gpu}accuracy:\n{accuracy}triton:\n"
        "  max_batch_size: 4\n"
    )
    return p


def _cli(*args: str) -> str:
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def _reference_greedy(source: Path) -> dict[str, str]:
    """The reference runtime's greedy text on the source as stored (and, where transformers loads it on CPU,
    the same text from transformers: checked here, so every test compares against both)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    model = load_hf_checkpoint(source)
    out = {}
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        new = generate(model, [ids], NEW_TOKENS, end_ids=tok.eos_token_id)[0]
        out[prompt] = tok.decode(new, skip_special_tokens=True)
    producer = json.loads((source / "producer.json").read_text())
    if producer.get("oracle_logits"):  # transformers loads it on CPU (the fixture says so)
        kw = {}
        if producer["producer"] == "llmcompressor":
            from transformers import CompressedTensorsConfig

            kw["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
        hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kw).eval()
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                new = hf.generate(
                    ids,
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.eos_token_id,
                )[0, ids.shape[1] :]
            assert tok.decode(new, skip_special_tokens=True) == out[prompt], (source.name, prompt)
    return out


def _built(name: str, tmp_path: Path, target: str) -> tuple[dict[str, str], Path]:
    """The reference greedy text of fixture ``name`` and its recipe for ``target``, built with ``trtpipe build``."""
    source = prequantized(name)
    want = _reference_greedy(source)
    recipe = _recipe(tmp_path, source, target)
    _cli("build", str(recipe))
    return want, recipe


@pytest.mark.triton
@pytest.mark.parametrize("name", ENGINE_SOURCES)
def test_engine_twin_serves_the_sources_greedy_text(name, tmp_path):
    want, recipe = _built(name, tmp_path, "engine")
    if name == "llmc-w8a8_int8-stories":  # the build config enables the SmoothQuant plugins for it
        engine_cfg = json.loads(next((tmp_path / "work-engine").rglob("engine/**/config.json")).read_text())
        plugins = engine_cfg["build_config"]["plugin_config"]
        assert engine_cfg["pretrained_config"]["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
        assert (
            plugins["smooth_quant_gemm_plugin"],
            plugins["rmsnorm_quantization_plugin"],
            plugins["quantize_per_token_plugin"],
        ) == ("bfloat16", "bfloat16", True), plugins
    if name == "modelopt-nvfp4-stories":  # converted to NVFP4; the builder gives it the NVFP4 GEMM plugin
        engine_cfg = json.loads(next((tmp_path / "work-engine").rglob("engine/**/config.json")).read_text())
        assert engine_cfg["pretrained_config"]["quantization"]["quant_algo"] == "NVFP4"
        assert engine_cfg["build_config"]["plugin_config"]["gemm_plugin"] == "nvfp4"
    _cli("serve", str(recipe), "--detach")
    try:
        for prompt in PROMPTS:
            got = _cli("infer", prompt, "--server", str(recipe), "--max-tokens", str(NEW_TOKENS)).rstrip("\n")
            assert got == want[prompt], (name, prompt)
    finally:
        _cli("stop", str(recipe))


@needs("aiohttp")
@pytest.mark.parametrize("name", SOURCES)
def test_openai_twin_serves_the_sources_greedy_text(name, tmp_path):
    import openai
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    want, _ = _built(name, tmp_path, "llmapi")
    export = next((tmp_path / "work-llmapi" / "artifacts" / "export").iterdir()) / "hf"
    app = OpenAIServer(ServedModel(export, "pq")).app
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt in PROMPTS:
            r = client.completions.create(model="pq", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
            assert r.choices[0].text == want[prompt], (name, prompt)


def test_eval_gates_a_producer_checkpoint_against_its_original(tmp_path, stories_dir):
    """llm-compressor's W4A16 of stories260k, engine target, ``accuracy.reference`` the original: ``trtpipe eval``
    compares the converted checkpoint with the original and fails the gate a W4A16 checkpoint cannot meet
    (KL <= 1e-6; the message carries the measured KL)."""
    acc = f"  num_samples: 2\n  seq_len: 16\n  reference: {stories_dir}\n  max_kl_divergence: 0.000001\n"
    res = CliRunner().invoke(main, ["eval", str(_recipe(tmp_path, prequantized("llmc-w4a16-stories"), "engine", acc))])
    assert res.exit_code != 0, res.output
    assert "accuracy gate failed for quantized: KL" in res.output and "> max_kl_divergence 1e-06" in res.output, (
        res.output
    )


@pytest.mark.parametrize("name", SOURCES)
def test_eval_of_the_llmapi_target_measures_its_export(name, tmp_path, stories_dir, caplog):
    """llmapi target of a producer checkpoint (ModelOpt FP8: passed through; llm-compressor W4A16: re-laid out):
    without ``accuracy.reference`` ``trtpipe eval`` reports the export's perplexity alone, the reference runtime's
    perplexity on the source as stored (the export is that model); with the original named it reports the
    unquantized and quantized rows and fails a gate (KL <= 1e-6) that the quantized checkpoint cannot meet."""
    from trtpipe.quant import accuracy
    from trtpipe.quant.data import load_tokenizer, token_batches

    source, data = prequantized(name), Path(__file__).resolve().parents[3] / "recipes" / "data" / "eval-sample.jsonl"
    acc = f"  eval_data: {data}\n  num_samples: 2\n  seq_len: 16\n"
    res = CliRunner().invoke(main, ["eval", str(_recipe(tmp_path, source, "llmapi", acc))])
    assert res.exit_code == 0, res.output
    report = json.loads(next((tmp_path / "work-llmapi" / "artifacts" / "verify").glob("*/accuracy.json")).read_text())
    assert report["reference"] is None and report["num_samples"] == 2 and report["seq_len"] == 16, report
    tokens = token_batches(str(data), Path, "text", load_tokenizer(source), 2, 16)
    assert report["perplexity"] == accuracy.perplexity(source, tokens), name

    gated = tmp_path / "gated"
    gated.mkdir()
    acc += f"  reference: {stories_dir}\n  max_kl_divergence: 0.000001\n"
    res = CliRunner().invoke(main, ["eval", str(_recipe(gated, source, "llmapi", acc))])
    assert res.exit_code != 0, res.output
    assert "accuracy gate failed for quantized: KL" in res.output and "> max_kl_divergence 1e-06" in res.output, (
        res.output
    )
    rows = [line.split() for line in caplog.text.splitlines() if line.startswith(("unquantized ", "quantized "))]
    assert [r[0] for r in rows] == ["unquantized", "quantized"], caplog.text  # the report the gate read
    assert float(rows[1][1]) == pytest.approx(report["perplexity"], abs=5e-5)  # the table prints 4 decimals
