"""Build config per preset x quantization: emitted flags exist in the 1.2.x CLI, defaults and §4.2/§4.3 rules hold."""

from __future__ import annotations

import itertools

import pytest

from engine_helpers import hf_config
from trtpipe.engine import build_config as bc
from trtpipe.engine.ckptconfig import deduced_max_seq_len, predicted_checkpoint_config
from trtpipe.engine.enforce import Target, enforce, rejections
from trtpipe.formats.gpus import CATALOG, GPU, get_gpu
from trtpipe.engine.presets import BY_NAME, FIELDS, all_presets, auto_preset
from trtpipe.errors import EngineError
from trtpipe.models.dims import parse_hf_config
from trtpipe.recipe.schema import Recipe

BUILD_CONFIG_KEYS = {  # contract §4.4: every BuildConfig field minus dry_run / visualize_network
    "max_input_len",
    "max_seq_len",
    "opt_batch_size",
    "max_batch_size",
    "max_beam_width",
    "max_num_tokens",
    "opt_num_tokens",
    "max_prompt_embedding_table_size",
    "kv_cache_type",
    "gather_context_logits",
    "gather_generation_logits",
    "strongly_typed",
    "force_num_profiles",
    "profiling_verbosity",
    "enable_debug_output",
    "max_draft_len",
    "speculative_decoding_mode",
    "use_refit",
    "input_timing_cache",
    "output_timing_cache",
    "lora_config",
    "weight_sparsity",
    "weight_streaming",
    "plugin_config",
    "use_strip_plan",
    "max_encoder_input_len",
    "monitor_memory",
    "use_mrope",
}


def recipe(**engine) -> Recipe:
    tp = engine.pop("tp", 1)
    return Recipe.model_validate(
        {"name": "t", "model": {"source": "/nonexistent"}, "parallel": {"tp": tp}, "engine": engine}
    )


def ckpt_config(r: Recipe, quant_algo=None, kv=None, model="llama-3-8b") -> dict:
    cfg = predicted_checkpoint_config(parse_hf_config(hf_config(model)), r)
    cfg["quantization"].update(quant_algo=quant_algo, kv_cache_quant_algo=kv)
    return cfg


def gpu_for(sm: int) -> GPU:
    for g in CATALOG:
        if g.sm == sm:
            return g
    return GPU(f"sm{sm}", f"SM {sm} card", 80 * 1024, sm, 1000)


def combos():
    for p in all_presets().values():
        for sm, qa, kv in itertools.product(p.match["sm"], p.match["quant_algo"], p.match["kv_cache_quant_algo"]):
            yield p.name, sm, qa, kv


COMBOS = list(combos())


def test_every_combination_has_exactly_one_auto_preset():
    seen = {}
    for name, sm, qa, kv in COMBOS:
        assert (sm, qa, kv) not in seen, f"{name} and {seen[(sm, qa, kv)]} both match {(sm, qa, kv)}"
        seen[(sm, qa, kv)] = name
    for name, sm, qa, kv in COMBOS:
        assert auto_preset(sm, qa, kv).name == name
    # every catalog GPU has a preset for unquantized, FP8-KV and weight-only models where the builder allows them
    for g in CATALOG:
        assert auto_preset(g.sm, None, None)
        assert auto_preset(g.sm, "W4A16_AWQ", None) if not 100 <= g.sm < 120 else True


@pytest.mark.parametrize("named", [False, True], ids=["auto", "named"])
def test_emitted_flags_exist_in_the_cli_and_no_invalid_combination(named, contract_flags):
    checked = 0
    for name, sm, qa, kv in COMBOS:
        r = recipe(plugins=name if named else "auto", tp=2)
        cfg = ckpt_config(r, qa, kv)
        build = bc.resolve_build(r, cfg, gpu_for(sm))
        assert build.preset == name
        argv = bc.to_argv(build, "CK", "OUT")
        flags = argv[1::2]
        values = argv[2::2]
        assert argv[0] == "trtllm-build" and all(f.startswith("--") for f in flags)
        assert set(flags) <= contract_flags, set(flags) - contract_flags
        assert len(flags) == len(set(flags))
        for f, v in zip(flags, values):
            field = BY_NAME.get(f[2:])
            if field is not None:
                assert v in (("enable", "disable") if field.kind == "bool" else field.choices()) or field.kind == "int"
        # what is emitted is a fixed point of the builder's rewrites: it changes nothing we emit
        final, again = enforce(dict(build.config.plugins), build.target)
        assert again == [] and final == dict(build.config.plugins)
        rejected = rejections(build.config.plugins, build.target)
        builder_rejects = 100 <= sm < 120 and (kv == "INT8" or qa == "FP8_PER_CHANNEL_PER_TOKEN")
        assert bool(rejected) == builder_rejects, (name, sm, qa, kv, rejected)
        checked += 1
    assert checked == len(COMBOS) > 100


def test_argv_and_json_agree_for_every_preset():
    for name, sm, qa, kv in COMBOS:
        r = recipe(plugins=name, max_batch_size=16, max_input_len=2048, max_seq_len=4096, max_num_tokens=4096)
        build = bc.resolve_build(r, ckpt_config(r, qa, kv), gpu_for(sm))
        j = bc.to_json(build.config)
        assert set(j) == BUILD_CONFIG_KEYS
        argv = bc.to_argv(build, "CK", "OUT")
        flags = dict(zip(argv[1::2], argv[2::2]))
        for key in ("max_batch_size", "max_input_len", "max_seq_len", "max_beam_width", "max_num_tokens"):
            assert int(flags[f"--{key}"]) == j[key]
        assert flags["--kv_cache_type"].upper() == j["kv_cache_type"] == "PAGED"
        pc = j["plugin_config"]
        for f in FIELDS:
            if f"--{f.name}" not in flags:
                continue
            v = flags[f"--{f.name}"]
            if f.kind == "bool":
                assert pc[f.name] is (v == "enable")
            elif f.kind == "int":
                assert pc[f.name] == int(v)
            elif f.name != "nccl_plugin" and not (
                f.name == "fp8_rowwise_gemm_plugin" and qa == "FP8_PER_CHANNEL_PER_TOKEN"
            ):
                assert pc[f.name] == (None if v == "disable" else v)  # "auto" is kept literally (model_dump)
        # the --build_config spelling drops the shape flags and keeps the plugin flags
        jargv = bc.to_argv(build, "CK", "OUT", build_config_json="bc.json")
        jflags = dict(zip(jargv[1::2], jargv[2::2]))
        assert jflags["--build_config"] == "bc.json" and "--max_seq_len" not in jflags
        assert {k: v for k, v in flags.items() if k[2:] in BY_NAME} == {
            k: v for k, v in jflags.items() if k[2:] in BY_NAME
        }


def test_json_plugin_config_builder_set_fields():
    r = recipe(tp=2)
    awq = bc.to_json(bc.resolve_build(r, ckpt_config(r, "W4A16_AWQ"), get_gpu("h100-sxm-80gb")).config)["plugin_config"]
    assert awq["weight_only_groupwise_quant_matmul_plugin"] == "bfloat16"
    assert awq["weight_only_quant_matmul_plugin"] is None
    assert awq["nccl_plugin"] == "bfloat16"  # world_size 2
    assert awq["gemm_plugin"] == "auto" and awq["dtype"] == "bfloat16"  # PluginConfig stores "auto" as given
    r1 = recipe()
    w8 = bc.to_json(bc.resolve_build(r1, ckpt_config(r1, "W8A16"), get_gpu("a100-sxm-80gb")).config)["plugin_config"]
    assert w8["weight_only_quant_matmul_plugin"] == "bfloat16" and w8["nccl_plugin"] is None
    sq = bc.to_json(
        bc.resolve_build(r1, ckpt_config(r1, "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"), get_gpu("a100-sxm-80gb")).config
    )["plugin_config"]
    assert sq["smooth_quant_gemm_plugin"] == "bfloat16" and sq["quantize_per_token_plugin"] is True
    fp16 = bc.to_json(bc.resolve_build(r1, ckpt_config(r1), get_gpu("a100-sxm-80gb")).config)
    assert fp16["plugin_config"]["paged_kv_cache"] is True and fp16["plugin_config"]["use_fp8_context_fmha"] is False
    assert fp16["speculative_decoding_mode"] == 1 and fp16["strongly_typed"] is True and fp16["opt_batch_size"] == 8


def test_fp8_context_fmha_without_fp8_kv_is_reported_for_a_named_preset():
    r = recipe(plugins="hopper-fp8")
    build = bc.resolve_build(r, ckpt_config(r, "FP8", None), get_gpu("h100-sxm-80gb"))
    assert build.config.plugins["use_fp8_context_fmha"] is False  # what the builder would end with
    msgs = bc.findings(build)
    assert [k for k, _ in msgs] == ["engine.plugins.preset"]
    assert "FP8 paged context FMHA needs an FP8 KV cache" in msgs[0][1]
    # with preset auto the same rewrite is applied and emitted explicitly, not reported
    ra = recipe()
    auto = bc.resolve_build(ra, ckpt_config(ra, "FP8", None), get_gpu("h100-sxm-80gb"))
    assert auto.preset == "hopper-fp8" and bc.findings(auto) == []
    assert "--use_fp8_context_fmha" in bc.to_argv(auto, "C", "O")
    assert bc.to_argv(auto, "C", "O")[bc.to_argv(auto, "C", "O").index("--use_fp8_context_fmha") + 1] == "disable"
    # with an FP8 KV cache it stays on
    rk = recipe(plugins="hopper-fp8")
    ok = bc.resolve_build(rk, ckpt_config(rk, "FP8", "FP8"), get_gpu("h100-sxm-80gb"))
    assert ok.config.plugins["use_fp8_context_fmha"] is True and bc.findings(ok) == []


def test_int8_kv_disables_paged_context_fmha():
    r = recipe(plugins={"preset": "ampere-int8", "overrides": {"use_paged_context_fmha": True}})
    build = bc.resolve_build(r, ckpt_config(r, "W8A8_SQ_PER_CHANNEL", "INT8"), get_gpu("a100-sxm-80gb"))
    assert build.config.plugins["use_paged_context_fmha"] is False
    ((key, msg),) = bc.findings(build)
    assert (
        key == "engine.plugins.overrides.use_paged_context_fmha" and "INT8 KV cache disables paged context FMHA" in msg
    )


@pytest.mark.parametrize(
    "qa,kv,key",
    [
        ("W4A16_AWQ", None, "quantization.algo"),
        ("W8A16", None, "quantization.algo"),
        ("W8A8_SQ_PER_CHANNEL", None, "quantization.algo"),
        (None, "INT8", "quantization.kv_cache"),
    ],
)
def test_blackwell_rejects_weight_only_smoothquant_and_int8_kv(qa, kv, key):
    t = Target(sm=100, architecture="LlamaForCausalLM", quant_algo=qa, kv_cache_quant_algo=kv)
    found = rejections({f.name: f.default for f in FIELDS}, t)
    assert [k for k, _ in found] == [key] and "SM 10.0" in found[0][1]
    assert (
        rejections({f.name: f.default for f in FIELDS}, Target(120, "LlamaForCausalLM", qa, kv)) == []
    )  # SM 12.0 is outside


def test_reduce_fusion_and_user_buffer_need_tp_gt_1():
    r = recipe(plugins={"preset": "hopper-fp8", "overrides": {"reduce_fusion": True, "user_buffer": True}})
    build = bc.resolve_build(r, ckpt_config(r, "FP8", "FP8"), get_gpu("h100-sxm-80gb"))
    keys = dict(bc.findings(build))
    assert set(keys) == {"engine.plugins.overrides.reduce_fusion", "engine.plugins.overrides.user_buffer"}
    assert "needs tp > 1" in keys["engine.plugins.overrides.reduce_fusion"]
    r2 = recipe(tp=4, plugins={"preset": "hopper-fp8", "overrides": {"reduce_fusion": True, "user_buffer": True}})
    b2 = bc.resolve_build(r2, ckpt_config(r2, "FP8", "FP8"), get_gpu("h100-sxm-80gb"))
    assert bc.findings(b2) == [] and b2.config.plugins["reduce_fusion"] and b2.config.plugins["user_buffer"]
    r3 = recipe(tp=2, plugins={"preset": "hopper-fp16", "overrides": {"reduce_fusion": True}})
    b3 = bc.resolve_build(r3, ckpt_config(r3, model="mixtral-8x7b"), get_gpu("h100-sxm-80gb"))
    assert "not supported for MixtralForCausalLM" in dict(bc.findings(b3))["engine.plugins.overrides.reduce_fusion"]


def test_unknown_preset_and_override_field():
    r = recipe(plugins="hopper-fp9")
    with pytest.raises(EngineError, match="unknown preset 'hopper-fp9'; did you mean 'hopper-fp8'"):
        bc.resolve_build(r, ckpt_config(r), get_gpu("h100"))
    r = recipe(plugins={"overrides": {"use_fp8_contxt_fmha": True}})
    with pytest.raises(EngineError, match="did you mean 'use_fp8_context_fmha'"):
        bc.resolve_build(r, ckpt_config(r), get_gpu("h100"))
    r = recipe(plugins={"overrides": {"gemm_plugin": "int4"}})
    with pytest.raises(EngineError, match="gemm_plugin must be one of"):
        bc.resolve_build(r, ckpt_config(r), get_gpu("h100"))


def test_max_num_tokens_resolution_section_4_3():
    g = get_gpu("h100")
    # clamped to max_batch x max_seq_len
    r = recipe(max_batch_size=2, max_seq_len=1024, max_input_len=512, max_num_tokens=8192)
    b = bc.resolve_build(r, ckpt_config(r), g)
    assert b.config.max_num_tokens == 2048 and b.config.opt_num_tokens is None  # hopper presets: multiple_profiles
    assert "engine.max_num_tokens" in dict(bc.findings(b))  # the recipe wrote 8192
    # raised to tokens_per_block with context FMHA on; opt = min(batch*beam, max) without multiple_profiles
    r = recipe(
        max_num_tokens=16,
        plugins={"overrides": {"multiple_profiles": False}},
        kv_cache={"tokens_per_block": 64},
        max_batch_size=4,
        max_beam_width=2,
    )
    b = bc.resolve_build(r, ckpt_config(r), g)
    assert b.config.max_num_tokens == 64 and b.config.opt_num_tokens == 8
    # without remove_input_padding: max_batch x max_seq_len
    r = recipe(
        max_batch_size=3, max_seq_len=100, max_input_len=50, plugins={"overrides": {"remove_input_padding": False}}
    )
    assert bc.resolve_build(r, ckpt_config(r), g).config.max_num_tokens == 300
    # raised to max_input_len when context_fmha is off
    r = recipe(max_num_tokens=100, max_input_len=500, max_seq_len=1000, plugins={"overrides": {"context_fmha": False}})
    b = bc.resolve_build(r, ckpt_config(r), g)
    assert b.config.max_num_tokens == 500
    assert b.config.plugins["use_paged_context_fmha"] is False  # forced off with context_fmha


def test_max_seq_len_deduction_and_input_clipping():
    assert (
        deduced_max_seq_len(
            {"max_position_embeddings": 131072, "rotary_scaling": {"rope_type": "llama3", "factor": 8.0}}
        )
        == 131072
    )
    assert (
        deduced_max_seq_len({"max_position_embeddings": 4096, "rotary_scaling": {"type": "linear", "factor": 2.0}})
        == 8192
    )
    assert deduced_max_seq_len({"max_position_embeddings": None}) == 2048
    r = recipe()  # llama-3-8b: 8192 positions, default max_input_len 1024
    b = bc.resolve_build(r, ckpt_config(r), get_gpu("h100"))
    assert (b.config.max_seq_len, b.config.max_input_len) == (8192, 1024)
    r = recipe(max_input_len=9000)
    b = bc.resolve_build(r, ckpt_config(r), get_gpu("h100"))
    assert b.config.max_input_len == 8192 and "engine.max_input_len" in dict(bc.findings(b))


def test_tokens_per_block_precedence():
    g = get_gpu("h100")
    r = recipe(plugins={"overrides": {"tokens_per_block": 64}})
    assert bc.resolve_build(r, ckpt_config(r), g).config.plugins["tokens_per_block"] == 64
    r = recipe(kv_cache={"tokens_per_block": 128}, plugins={"overrides": {"tokens_per_block": 64}})
    assert bc.resolve_build(r, ckpt_config(r), g).config.plugins["tokens_per_block"] == 128


def test_engine_config_json_shape():
    r = recipe(tp=2)
    cfg = ckpt_config(r)
    cfg["mapping"]["rank"] = 1
    out = bc.engine_config_json(cfg, bc.resolve_build(r, cfg, get_gpu("h100")).config)
    assert set(out) == {"version", "pretrained_config", "build_config"} and out["version"] == "1.2.1"
    assert "rank" not in out["pretrained_config"]["mapping"] and out["pretrained_config"]["mapping"]["tp_size"] == 2
    assert out["build_config"]["max_num_tokens"] == 8192


def test_field_defaults_match_the_reference_table():
    """Every CLI plugin field's default equals the 1.x default in docs/reference/trtllm-build.md's flag tables."""
    import re

    from engine_helpers import BUILD_REFERENCE

    text = BUILD_REFERENCE.read_text()
    section = text[text.index("## General flags") : text.index("## Builder-enforced combinations")]
    table = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.split("|")]
        if len(cells) > 3 and cells[1].startswith("`--"):
            for flag in re.findall(r"`--([a-z0-9_]+)`", cells[1]):
                table[flag] = cells[2]
    spell = {"auto": "auto", "None (off)": "disable", "disable": "disable", "enable": "enable"}
    for f in FIELDS:
        if not f.cli:
            continue
        want = spell.get(table[f.name], table[f.name])
        got = (
            f.default
            if f.kind == "dtype"
            else ("enable" if f.default else "disable")
            if f.kind == "bool"
            else str(f.default)
        )
        assert got == want, (f.name, got, table[f.name])
    assert {f.name for f in FIELDS if f.cli} <= set(table)
