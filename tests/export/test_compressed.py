"""compressed-tensors export: plain transformers with the ``compressed-tensors`` package loads it on CPU, and its
logits equal trtpipe's reference runtime on the same quantized weights (both float32: the tolerance is float32
round-off over 5 layers, 1e-5 relative; a wrong packing, scale layout or activation scheme gives > 1e-2)."""

from __future__ import annotations

import json

import pytest
import torch

from trtpipe.export.compressed import export_compressed
from trtpipe.formats.dequant import pack_int4_to_int32, unpack_int32_to_int4
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from optional import needs

pytestmark = pytest.mark.slow

IDS = torch.tensor([[1, 300, 42, 17, 99, 5, 77, 401, 8, 260, 31, 2, 1, 44]])


@needs("compressed_tensors")
def test_int4_int32_packing_is_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    for in_f in (8, 40, 172):  # whole words, and a padded last word
        q = torch.randint(-8, 8, (6, in_f), dtype=torch.int8, generator=g)
        assert torch.equal(pack_int4_to_int32(q), pack_to_int32(q, 4))
        assert torch.equal(unpack_int32_to_int4(pack_int4_to_int32(q), in_f), q)


@needs("compressed_tensors")
@pytest.mark.parametrize(
    "algo,scheme", [("fp8", "float-quantized"), ("fp8_pc_pt", "float-quantized"), ("int4_wo", "pack-quantized")]
)
def test_loads_in_transformers_and_matches_reference_runtime(stories_export_base, stories_dir, tmp_path, algo, scheme):
    from transformers import AutoModelForCausalLM

    out = tmp_path / algo
    out.mkdir()
    exclude = ["*lm_head", "*mlp.proj"] if algo == "int4_wo" else ["*lm_head"]
    export_compressed(
        stories_export_base["base"],
        stories_dir,
        stories_export_base["stats"],
        out,
        algo=algo,
        kv_cache="none",
        group_size=32,
        alpha=0.5,
        exclude=exclude,
    )
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == scheme
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.hf_quantizer is not None  # compressed-tensors did the loading, not a silent up-cast
    with torch.no_grad():
        theirs = model(IDS).logits
    ours = load_hf_checkpoint(out)(IDS)
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    assert rel < 1e-5, rel
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    # and it is really quantized: far from the unquantized model, by about the format's error
    plain = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32)(IDS).logits
    err = ((theirs - plain).norm() / plain.norm()).item()
    assert 1e-3 < err < 0.2, err
