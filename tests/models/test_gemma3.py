"""Gemma 3 text through both targets' readers, against transformers in float64 on a synthetic model with
gemma-3-27b's ratios (heads*head_dim narrower than hidden, query_pre_attn_scalar != head_dim, 5 sliding layers then a
global one, window 5 shorter than the prompts): the engine-path checkpoint (TRT-LLM names, +1 folded into every norm,
the config fields upstream's converter would drop) and the llmapi path (the HF layout itself and trtpipe's unified
export of it), plus a Gemma3ForConditionalGeneration checkpoint converted from its language model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from numerics import assert_as_accurate, assert_greedy_equal, error_scale, hf_float64
from trtpipe.checkpoint.convert import convert
from trtpipe.export.unified import export_unified
from trtpipe.models.synthetic import load_hf, make_synthetic
from trtpipe.runtime import generate, load_checkpoint
from trtpipe.runtime.hf_loader import load_hf_checkpoint

NORMS = {  # TRT-LLM name (per layer) -> HF name
    "input_layernorm.weight": "input_layernorm.weight",
    "post_layernorm.weight": "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight": "post_feedforward_layernorm.weight",
    "attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    d = make_synthetic("gemma3", tmp_path_factory.mktemp("gemma3") / "hf", seed=3)
    hf = load_hf(d)
    ids = torch.randint(3, 250, (3, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits32 = hf(ids).logits
        logits64 = hf_float64(hf)(ids).logits
    return {
        "dir": d,
        "hf": hf,
        "hf64": hf_float64(hf),
        "ids": ids,
        "ref64": logits64,
        "scale": error_scale(logits32, logits64),
    }


def _greedy(rt, g, what, n=40):
    prompt = g["ids"][0].tolist()
    want = g["hf"].generate(g["ids"][:1], max_new_tokens=n, do_sample=False, pad_token_id=0)[0, 20:].tolist()
    assert_greedy_equal(generate(rt, [prompt], n, end_ids=None)[0], want, g["hf"], g["hf64"], prompt, what)


def test_checkpoint_config_and_plus_one_norms_by_name(gemma3, tmp_path):
    ckpt = convert(gemma3["dir"], tmp_path / "ckpt", tp=2, dtype="bfloat16")
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architecture"] == "Gemma3ForCausalLM" and cfg["hidden_act"] == "gelu_pytorch_tanh"
    assert (cfg["head_size"], cfg["query_pre_attn_scalar"], cfg["sliding_window"]) == (12, 16, 5)
    assert cfg["rotary_base"] == 1e6 and cfg["rope_local_base_freq"] == 1e4 and cfg["norm_epsilon"] == 1e-6
    assert cfg["rotary_scaling"] == {"type": "linear", "rope_type": "linear", "factor": 8.0}
    assert (cfg["attn_bias"], cfg["mlp_bias"], cfg["inter_layernorms"], cfg["_sliding_window_pattern"]) == (
        False,
        False,
        True,
        6,
    )
    assert cfg["final_logit_softcapping"] is None and cfg["position_embedding_type"] == "rope_gpt_neox"
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (cfg["use_parallel_embedding"], cfg["embedding_sharding_dim"]) == (True, 0)
    sd = {k: v.detach() for k, v in gemma3["hf"].state_dict().items()}
    with safe_open(str(ckpt / "rank1.safetensors"), "pt") as f:
        names = set(f.keys())
        for trt, hf in NORMS.items():
            got = f.get_tensor(f"transformer.layers.3.{trt}")
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, (sd[f"model.layers.3.{hf}"].float() + 1.0).to(torch.bfloat16)), trt  # +1 in float32
        assert torch.equal(f.get_tensor("transformer.ln_f.weight"), (sd["model.norm.weight"] + 1.0).to(torch.bfloat16))
        # unscaled, and vocab-sharded at tp > 1: upstream's GemmaConfig sets use_parallel_embedding = tp_size > 1
        assert torch.equal(
            f.get_tensor("transformer.vocab_embedding.weight"), sd["model.embed_tokens.weight"][125:].to(torch.bfloat16)
        )
        head = f.get_tensor("lm_head.weight")
    assert torch.equal(head, sd["model.embed_tokens.weight"][125:].to(torch.bfloat16))  # the tied copy, rank 1's half
    assert "transformer.layers.0.mlp.fc.weight" in names and "transformer.layers.0.attention.dense.weight" in names


def test_bf16_embedding_scale_is_rounded_to_the_weight_dtype():
    from trtpipe.runtime.model import embedding_scale

    assert embedding_scale("Gemma3ForCausalLM", 5376, "bfloat16") == 73.5  # sqrt(5376) = 73.32
    assert embedding_scale("Gemma3ForCausalLM", 5376, "float32") == pytest.approx(73.3212, abs=1e-4)
    assert embedding_scale("LlamaForCausalLM", 5376, "bfloat16") == 1.0


def test_engine_checkpoint_runs_as_transformers_past_the_window(gemma3, tmp_path):
    rt = load_checkpoint(convert(gemma3["dir"], tmp_path / "ckpt", tp=2, pp=2, dtype="float32"))
    assert [rt.layers[i].attention[0].window for i in range(6)] == [5] * 5 + [None]
    assert [rt.layers[i].rope.base for i in range(6)] == [1e4] * 5 + [1e6]
    assert_as_accurate(rt(gemma3["ids"]), gemma3["ref64"], gemma3["scale"], "gemma3 engine checkpoint tp2 pp2")


def test_hf_layout_runs_as_transformers(gemma3):
    rt = load_hf_checkpoint(gemma3["dir"])
    assert_as_accurate(rt(gemma3["ids"]), gemma3["ref64"], gemma3["scale"], "gemma3 HF layout")
    _greedy(rt, gemma3, "gemma3 HF layout greedy")


def test_unified_export_round_trips_zero_centred_norms(gemma3, tmp_path):
    ckpt = convert(gemma3["dir"], tmp_path / "ckpt", tp=2, dtype="float32")
    out = tmp_path / "unified"
    export_unified(ckpt, gemma3["dir"], None, out, algo="none", kv_cache="none", group_size=128, alpha=0.5, exclude=[])
    sd = gemma3["hf"].state_dict()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for hf in NORMS.values():  # back to HF's zero-centred values (the +1 subtracted)
            assert torch.allclose(f.get_tensor(f"model.layers.2.{hf}"), sd[f"model.layers.2.{hf}"], atol=1e-7), hf
        assert torch.allclose(f.get_tensor("model.norm.weight"), sd["model.norm.weight"], atol=1e-7)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_parameters"] == json.loads((gemma3["dir"] / "config.json").read_text())["rope_parameters"]
    # the transformers-4 spelling too (TensorRT-LLM 1.2 pins 4.57, whose Gemma3TextConfig reads only these)
    assert (cfg["rope_theta"], cfg["rope_local_base_freq"]) == (1e6, 1e4)
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    rt = load_hf_checkpoint(out)
    assert_as_accurate(rt(gemma3["ids"]), gemma3["ref64"], gemma3["scale"], "gemma3 unified export")
    _greedy(rt, gemma3, "gemma3 unified export greedy")


def test_bf16_unified_export_keeps_the_sources_norms_bit_for_bit(gemma3, tmp_path):
    """In bfloat16, ``1 + w`` loses ``w``'s low bits (ModelOpt 0.47 exports the source's ``w``): the export takes the
    source's own norm tensors where the checkpoint still holds exactly what the conversion made of them."""
    ckpt = convert(gemma3["dir"], tmp_path / "ckpt", tp=1, dtype="bfloat16")
    out = tmp_path / "unified"
    export_unified(ckpt, gemma3["dir"], None, out, algo="none", kv_cache="none", group_size=128, alpha=0.5, exclude=[])
    sd = gemma3["hf"].state_dict()
    lost = 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for i in range(gemma3["hf"].config.num_hidden_layers):
            for hf in NORMS.values():
                src = sd[f"model.layers.{i}.{hf}"].to(torch.bfloat16)
                assert torch.equal(f.get_tensor(f"model.layers.{i}.{hf}"), src), (i, hf)
                lost += int(not torch.equal(((src.float() + 1).to(torch.bfloat16).float() - 1).to(torch.bfloat16), src))
        assert torch.equal(f.get_tensor("model.norm.weight"), sd["model.norm.weight"].to(torch.bfloat16))
    assert lost > 0  # the round trip through 1 + w would have changed some of them: the test can fail


def test_conditional_generation_converts_its_language_model(tmp_path):
    import transformers

    d = make_synthetic("gemma3_multimodal", tmp_path / "mm", seed=4)
    mm = transformers.Gemma3ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("language_model.model.layers.0.") for k in keys)  # what save_pretrained writes
    assert any(k.startswith("vision_tower.") for k in keys) and any(
        k.startswith("multi_modal_projector.") for k in keys
    )
    ckpt = convert(d, tmp_path / "ckpt", tp=2, dtype="float32")
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architecture"] == "Gemma3ForCausalLM" and cfg["num_hidden_layers"] == 6
    with safe_open(str(ckpt / "rank0.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "vision" in k or "multi_modal" in k]
    ids = torch.randint(3, 250, (2, 14), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():  # text only: the language model of the multimodal model is the oracle
        l32 = mm(input_ids=ids).logits
        mm64 = hf_float64(mm)
        l64 = mm64(input_ids=ids).logits
    assert_as_accurate(load_checkpoint(ckpt)(ids), l64, error_scale(l32, l64), "gemma3 ConditionalGeneration -> text")
    assert_as_accurate(load_hf_checkpoint(d)(ids), l64, error_scale(l32, l64), "gemma3 ConditionalGeneration HF layout")


def test_validate_names_what_gemma3_cannot_honour(gemma3, tmp_path):
    from trtpipe.models import get_family
    from trtpipe.models.dims import read_hf_config

    cfg = json.loads((gemma3["dir"] / "config.json").read_text())
    fam = get_family("Gemma3ForCausalLM")
    assert list(fam.unsupported(read_hf_config(gemma3["dir"]))) == []
    for key, value in (("use_bidirectional_attention", True), ("attn_logit_softcapping", 50.0)):
        bad = tmp_path / key
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        assert [k for k, _ in fam.unsupported(read_hf_config(bad))] == [key]


@pytest.mark.slow
def test_awq_export_folds_the_mlp_scale_into_the_norm_before_the_mlp(gemma3, tmp_path):
    """Gemma's MLP input is pre_feedforward_layernorm (post_attention_layernorm normalizes the attention output):
    the unified export folds the MLP group's AWQ pre-quant scale there, and leaves post_attention_layernorm as the
    unquantized export writes it."""
    from quant_helpers import our_stats

    base = convert(gemma3["dir"], tmp_path / "base", tp=1, dtype="bfloat16")
    calib = torch.randint(3, 250, (8, 32), generator=torch.Generator().manual_seed(1))
    stats = our_stats(base, calib, tmp_path / "stats", awq_group_size=16)
    outs = {}
    for algo in ("none", "int4_awq"):
        out = tmp_path / algo
        out.mkdir()
        export_unified(
            base,
            gemma3["dir"],
            stats if algo != "none" else None,
            out,
            algo=algo,
            kv_cache="none",
            group_size=16,
            alpha=0.5,
            exclude=["*lm_head"],
        )
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            outs[algo] = {k: f.get_tensor(k) for k in f.keys() if k.endswith("layernorm.weight")}
    plain, awq = outs["none"], outs["int4_awq"]
    for i in range(6):
        assert torch.equal(
            awq[f"model.layers.{i}.post_attention_layernorm.weight"],
            plain[f"model.layers.{i}.post_attention_layernorm.weight"],
        )
        assert not torch.equal(
            awq[f"model.layers.{i}.pre_feedforward_layernorm.weight"],
            plain[f"model.layers.{i}.pre_feedforward_layernorm.weight"],
        )


def test_a_checkpoint_missing_a_feed_forward_norm_is_refused_naming_it(gemma3, tmp_path):
    from safetensors.torch import load_file, save_file

    from trtpipe.errors import CheckpointError

    ckpt = convert(gemma3["dir"], tmp_path / "ckpt", tp=1, dtype="float32")
    t = load_file(str(ckpt / "rank0.safetensors"))
    del t["transformer.layers.2.pre_feedforward_layernorm.weight"]
    save_file(t, str(ckpt / "rank0.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"tensor 'transformer\.layers\.2\.pre_feedforward_layernorm\.weight' is missing"
    ):
        load_checkpoint(ckpt)


def test_a_final_logit_softcap_is_applied_as_transformers_does(tmp_path):
    d = make_synthetic("gemma3", tmp_path / "hf", seed=5, final_logit_softcapping=30.0)
    hf = load_hf(d)
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        l32, l64 = hf(ids).logits, hf_float64(hf)(ids).logits
        hf.config.final_logit_softcapping = None
        raw = hf(ids).logits
    assert float(raw.abs().max()) > 30.0 > float(l64.abs().max())  # the cap bites, unsaturated
    ckpt = convert(d, tmp_path / "ckpt", tp=2, dtype="float32")
    assert json.loads((ckpt / "config.json").read_text())["final_logit_softcapping"] == 30.0
    assert_as_accurate(load_checkpoint(ckpt)(ids), l64, error_scale(l32, l64), "gemma3 final softcap")
