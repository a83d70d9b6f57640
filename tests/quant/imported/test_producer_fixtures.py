"""Checkpoints made by the real producers (ModelOpt 0.47 ``export_hf_checkpoint``, llm-compressor ``oneshot``; written
by ``tests/tools/make_prequantized.py`` with each library's own dequantization of every weight, ``oracle.safetensors``,
and transformers' float64 logits where transformers loads the checkpoint on CPU, ``oracle_logits.safetensors``).

The fixtures come from ``tests/prequantized.py`` (built on first use with the producers' own venv,
scripts/install_producers.sh; skipped, saying so, only where that venv is missing). For every fixture trtpipe accepts: the llmapi directory (passed
through or re-laid out) and the engine checkpoint dequantize to the oracle exactly (FP8 members fused into q/k/v or
gate/up: within one FP8 rounding of the shared scale), and the reference runtime's float64 logits equal
transformers' float64 logits (formats with a KV-cache scale excepted: TensorRT-LLM's PyTorch backend, which the
runtime follows, does not apply FP8 KV scales; transformers does).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from imported_helpers import by_hf_name, check_weights, convert_source, linear_weights
from numerics import float64_copy
from prequantized import info, names, prequantized
from trtpipe.errors import CheckpointError
from trtpipe.quant.imported.detect import detect
from trtpipe.export.imported import write_llmapi
from trtpipe.quant.imported.lossy import FP8_REQUANTIZE
from trtpipe.runtime import load_checkpoint
from trtpipe.runtime.hf_loader import load_hf_checkpoint

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", names())
def test_producer_checkpoint(name, tmp_path):
    fixture = prequantized(name)
    fmt = detect(fixture)
    oracle = load_file(str(fixture / "oracle.safetensors"))
    if not fmt.engine.ok and not fmt.llmapi.ok:
        pytest.skip(f"refused for both targets: {fmt.engine.why}")  # the refusal itself: test_table.py
    layers = json.loads((fixture / "config.json").read_text())["num_hidden_layers"]
    if info(name)["producer"] == "gptqmodel" and "actorder" in name:
        # GPTQModel's act-order scatters g_idx (no static groups): refused at conversion, naming the tensor
        with pytest.raises(CheckpointError, match=r"g_idx' is not contiguous \(act-order groups\)"):
            write_llmapi(fmt, fixture, tmp_path / "hf") if fmt.llmapi.ok else convert_source(fixture, tmp_path / "c")
        return
    if fmt.llmapi.ok:
        out = tmp_path / "hf"
        out.mkdir()
        write_llmapi(fmt, fixture, out)
        model = load_hf_checkpoint(out)
        check_weights(by_hf_name(linear_weights(model), fixture, layers), oracle, "llmapi", fmt.quant_algo, False)
        logits = fixture / "oracle_logits.safetensors"
        # GPTQModel's kernels dequantize in the scales' dtype (fp16) inside transformers' forward, so its logits are
        # not a float64 reference (its producer.json says so); its weights are still checked exactly above
        exact = info(name)["producer"] != "gptqmodel"
        if logits.exists() and not fmt.kv_cache and exact:
            ref = load_file(str(logits))
            with torch.no_grad():
                ours = float64_copy(model).forward(ref["input_ids"].reshape(1, -1))
            theirs = ref["logits"].double().reshape(ours.shape)
            err = float((ours - theirs).abs().max())
            # both in float64 on the same dequantized weights: what is left is below float32's unit roundoff of
            # the largest logit (measured ~1e-7 relative); a wrong layout or scale is off by 1e-2 or more
            assert err <= 2.0**-24 * float(theirs.abs().max()) * 64, (fixture.name, err)
    # zero-point INT4: test_zero_point_import.py (its zero is rounded to the model dtype once); FP8 members fused at
    # different scales are requantized (accepted here; check_weights bounds them by one FP8 rounding)
    if fmt.engine.ok and not fmt.params.get("zero_point"):
        conv = load_checkpoint(convert_source(fixture, tmp_path / "ckpt", allow_lossy=(FP8_REQUANTIZE,)))
        check_weights(by_hf_name(linear_weights(conv), fixture, layers), oracle, "engine", fmt.quant_algo, True)
