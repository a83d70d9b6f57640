"""Oracle: the unified HF export of a Gemma 3 text model (synthetic, gemma-3-27b's ratios: heads*head_dim narrower
than hidden, four (1+w) norms per layer, a tied and scaled embedding) against NVIDIA ModelOpt 0.47.0's
``export_hf_checkpoint`` of the same bf16 model, quantized with ``mtq.quantize`` on the same calibration batches.

Identical: the file list, tensor names, dtypes and shapes, hf_quant_config.json's ``quantization`` (``exclude_modules``
is ``lm_head`` alone: ModelOpt attaches no quantizer to ``Gemma3TextScaledWordEmbedding``, see
``trtpipe.models.family.Family.embedding_in_exclude_modules``) and config.json's inline ``quantization_config``;
FP8 and NVFP4 weight codes and weight scales byte-identical, and the norms and the embedding byte-identical (the
source's own ``w``, not ``(1 + w) - 1`` after a bf16 round trip); INT4 packing byte-identical for the same weights
and scales (the AWQ searches themselves differ). Activation / KV scales: within the error of ModelOpt's bf16
forward pass against our float32 one, as in the dense oracle (tests/export/test_unified_oracle.py)."""

from __future__ import annotations

import json

import pytest
import torch

from quant_helpers import (
    assert_same_layout,
    modelopt_config,
    modelopt_unified_export,
    our_stats,
    raw_bytes,
    safetensors_of,
)
from trtpipe.checkpoint.convert import TOKENIZER_FILES, convert
from trtpipe.formats.primitives import pack_int4_rows, quantize, unpack_int4_rows
from trtpipe.export.unified import export_unified
from trtpipe.models.synthetic import make_synthetic

pytestmark = [pytest.mark.oracle, pytest.mark.slow]

# mode -> (recipe algo, kv cache, ModelOpt configs concatenated)
MODES = {
    "fp8_kv": ("fp8", "fp8", ("FP8_DEFAULT_CFG", "FP8_KV_CFG")),
    "nvfp4": ("nvfp4", "none", ("NVFP4_DEFAULT_CFG",)),
    "int4_awq": ("int4_awq", "none", ("INT4_AWQ_CFG",)),
}
# o_proj's input is heads*head_dim = 48 wide: 16 is the largest INT4 group that divides every linear's input
GROUP = 16
LAYERS = 6
TOL = 2**-5  # bf16 forward (ModelOpt) against float32 (ours), as in the dense oracle


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    mtq = pytest.importorskip(
        "modelopt.torch.quantization", reason="ModelOpt 0.47.0 not installed (pip install -e '.[oracle]')"
    )
    from modelopt.torch.export import export_hf_checkpoint

    root = tmp_path_factory.mktemp("gemma3_oracle")
    hf = make_synthetic("gemma3", root / "hf", seed=3, vocab_size=512)
    base = convert(hf, root / "base", tp=1, dtype="bfloat16")
    tokens = torch.randint(3, 512, (16, 32), generator=torch.Generator().manual_seed(11))
    stats = {
        None: our_stats(base, tokens, root / "stats"),
        GROUP: our_stats(base, tokens, root / "stats_awq", awq_group_size=GROUP),
    }
    ours, theirs = {}, {}
    for mode, (algo, kv, cfg_names) in MODES.items():
        int4 = algo == "int4_awq"
        out = root / f"ours_{mode}"
        out.mkdir()
        export_unified(
            base,
            hf,
            stats[GROUP if int4 else None],
            out,
            algo=algo,
            kv_cache=kv,
            group_size=GROUP,
            alpha=0.5,
            exclude=["*lm_head"],
        )
        ours[mode] = out
        cfg = modelopt_config(mtq, cfg_names, int4_group=GROUP if int4 else None)
        theirs[mode] = modelopt_unified_export(mtq, export_hf_checkpoint, hf, cfg, tokens, root / f"modelopt_{mode}")
    return dict(hf=hf, base=base, ours=ours, theirs=theirs)


@pytest.mark.parametrize("mode", list(MODES))
def test_same_files_names_dtypes_shapes_and_configs(case, mode):
    a_dir, b_dir = case["ours"][mode], case["theirs"][mode]
    a, b = assert_same_layout(a_dir, b_dir, ignore=TOKENIZER_FILES)
    qa, qb = (json.loads((d / "hf_quant_config.json").read_text())["quantization"] for d in (a_dir, b_dir))
    assert qa == qb and qa["exclude_modules"] == ["lm_head"]
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (a_dir, b_dir))
    qa, qb = dict(ca["quantization_config"]), dict(cb["quantization_config"])
    assert qa.pop("producer") != qb.pop("producer")
    assert qa == qb
    for key in (
        "architectures",
        "tie_word_embeddings",
        "num_hidden_layers",
        "head_dim",
        "query_pre_attn_scalar",
        "sliding_window",
        "layer_types",
        "rope_parameters",
    ):
        assert ca[key] == cb[key], key


@pytest.mark.parametrize("mode", ["fp8_kv", "nvfp4"])
def test_codes_scales_norms_and_embedding_byte_identical(case, mode):
    a, b = safetensors_of(case["ours"][mode]), safetensors_of(case["theirs"][mode])
    codes = norms = 0
    for k in a:
        if k.endswith((".input_scale", ".k_scale", ".v_scale")):
            torch.testing.assert_close(a[k], b[k], rtol=TOL, atol=0)
            continue
        assert torch.equal(raw_bytes(a[k]), raw_bytes(b[k])), k
        codes += k.endswith(".weight") and a[k].dtype in (torch.float8_e4m3fn, torch.uint8)
        norms += k.endswith("norm.weight")
    assert codes == LAYERS * 7  # q, k, v, o, gate, up, down
    assert norms == LAYERS * 6 + 1  # four layer norms, q_norm, k_norm per layer; the final norm
    if mode == "fp8_kv":
        assert sum(k.endswith((".k_scale", ".v_scale")) for k in a) == 2 * LAYERS


def test_int4_packing_identical_for_identical_scales(case):
    """For every INT4 projection of ModelOpt's export: on the same weight and ModelOpt's scales, our quantize+pack
    gives the bytes of ModelOpt's own packer; and ModelOpt's stored bytes of o_proj / down_proj (their pre-quant scale
    stored, not folded into a norm), read with our unpacker, times its scales give back the original weight within
    INT4 error (a swapped nibble or row pairing gives > 100 %). ModelOpt quantizes the weight its AWQ rescaled in
    bf16, so its stored codes are not exactly those of ``w / pre_quant_scale`` in float32."""
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8
    from transformers import AutoModelForCausalLM

    orig = AutoModelForCausalLM.from_pretrained(case["hf"], dtype=torch.bfloat16).state_dict()
    b = safetensors_of(case["theirs"]["int4_awq"])
    checked = stored = 0
    for k, t in b.items():
        if t.dtype != torch.uint8:
            continue
        module = k[: -len(".weight")]
        pqs = b.get(f"{module}.pre_quant_scale")
        w = orig[k].float()
        w_q = w / pqs.float() if pqs is not None else w
        ws = b[f"{module}.weight_scale"]
        ours = pack_int4_rows(quantize(w_q, ws, "int4", GROUP)).view(torch.uint8)
        assert torch.equal(ours, pack_int4_in_uint8(w_q, ws, GROUP).view(torch.uint8)), k
        if pqs is not None:
            deq = unpack_int4_rows(t.view(torch.int8)).float() * ws.repeat_interleave(GROUP, -1) * pqs.float()
            assert ((deq - w).norm() / w.norm()) < 0.2, k
            stored += 1
        checked += 1
    assert (checked, stored) == (LAYERS * 7, LAYERS * 2)


@pytest.mark.parametrize("mode", list(MODES))
def test_reference_loader_reads_both_exports(case, mode):
    """The reference runtime's unified-HF loader on ModelOpt's export and on ours: relative logit error against the
    unquantized model within the format's error and far below what a misread layout gives (> 40 %, as the dense
    oracle states)."""
    from trtpipe.runtime import load_checkpoint
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(5))
    ref = load_checkpoint(case["base"])(ids)
    errs = {
        who: ((load_hf_checkpoint(case[who][mode])(ids) - ref).norm() / ref.norm()).item() for who in ("ours", "theirs")
    }
    print(mode, errs)
    assert max(errs.values()) < (0.1 if mode.startswith("fp8") else 0.3), errs
