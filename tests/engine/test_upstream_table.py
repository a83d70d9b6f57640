"""What trtpipe validates, emits and predicts against the upstream table (trtpipe/engine/upstream.py).

The facts live in that table, one row per flag/field with the upstream file@commit it was read from; these tests
derive their expectations from the rows, so a TensorRT-LLM version bump is one table edit.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from engine_helpers import REPO
from test_engine_build_config import ckpt_config, gpu_for, recipe
from trtpipe.cli import main
from trtpipe.engine import build_config as bc
from trtpipe.engine import upstream
from trtpipe.engine.enforce import Target, rejections
from trtpipe.formats.gpus import get_gpu
from trtpipe.engine.presets import BY_NAME, FIELDS, normalize
from trtpipe.errors import EngineError
from trtpipe.models.trtllm_config import deduce_max_seq_len

CLI_PLUGINS = [f for f in upstream.PLUGIN_CONFIG if f.cli]
# every dtype spelling any plugin field takes: each field must refuse the ones outside its own row
ALL_DTYPE_SPELLINGS = sorted({v for f in CLI_PLUGINS for v in f.choices()})


def test_every_row_names_its_upstream_source():
    rows = list(upstream.PLUGIN_CONFIG) + list(upstream.BUILD_FLAGS)
    assert all("@" in r.source or "(" in r.source for r in rows)
    assert all(src for _, _, src in upstream.LORA_CONFIG)
    for fact in (
        upstream.PAGED_STATE_ARCHITECTURES,
        upstream.VALIDATE_REJECTS_BY_SM,
        upstream.BLACKWELL_DC_SM_RANGE,
        upstream.FP8_ROWWISE_ALGOS,
        upstream.FP8_ROWWISE_SETS,
        upstream.NVFP4_GEMM,
        upstream.SWIGLU_PLUGINS_NEED_FUSED_MLP,
    ):
        assert isinstance(fact[1], str) and "tensorrt_llm/" in fact[1]


def test_preset_fields_are_the_cli_rows_of_the_table():
    assert [f.name for f in FIELDS if f.cli] == [f.name for f in CLI_PLUGINS]
    for row in CLI_PLUGINS:
        assert BY_NAME[row.name].default == upstream.cli_default(row)
        if row.kind == "dtype":
            assert BY_NAME[row.name].choices() == row.choices()


@pytest.mark.parametrize("row", [f for f in CLI_PLUGINS if f.kind == "dtype"], ids=lambda f: f.name)
def test_dtype_plugin_values_validate_and_emit_exactly_as_the_table_allows(row):
    for value in ALL_DTYPE_SPELLINGS:
        where = f"engine.plugins.overrides.{row.name}"
        if value not in row.choices():
            with pytest.raises(EngineError) as exc:
                normalize(row.name, value, where)
            assert str(exc.value).startswith(f"{where}: ") and ", ".join(row.choices()) in str(exc.value)
            continue
        assert normalize(row.name, value, where) == value
        argv = ["trtllm-build", f"--{row.name}", value]
        bc.check_argv(argv)  # the emitter's own guard accepts it


def test_emitted_argv_is_checked_against_the_table():
    r = recipe(plugins={"overrides": {"gemm_allreduce_plugin": "bfloat16", "low_latency_gemm_plugin": "fp8"}}, tp=2)
    build = bc.resolve_build(r, ckpt_config(r, "FP8", "FP8"), get_gpu("h100"))
    argv = bc.to_argv(build, "C", "O")
    flags = dict(zip(argv[1::2], argv[2::2]))
    assert flags["--gemm_allreduce_plugin"] == "bfloat16" and flags["--low_latency_gemm_plugin"] == "fp8"
    for bad in (
        ["trtllm-build", "--gemm_allreduce_plugin", "float32"],
        ["trtllm-build", "--gemm_swiglu_plugin", "auto"],
        ["trtllm-build", "--kv_cache_type", "pagedd"],
        ["trtllm-build", "--no_such_flag", "1"],
        ["trtllm-build", "--max_batch_size", "x"],
        ["trtllm-build", "--qserve_gemm_plugin", "auto"],
    ):
        with pytest.raises(EngineError, match=bad[1]):
            bc.check_argv(bad)
    bc.check_argv(["trtllm-build", "--kv_cache_type", "PAGED"])  # KVCacheType.from_string upper-cases


def test_validate_names_the_key_and_the_allowed_values():
    res = CliRunner().invoke(
        main,
        [
            "validate",
            str(REPO / "recipes" / "llama70b-fp8.yaml"),
            "--set",
            "engine.plugins.overrides.gemm_swiglu_plugin=float16",
        ],
    )
    assert res.exit_code == 2, res.output
    (line,) = [x for x in res.output.splitlines() if "gemm_swiglu_plugin" in x]
    assert "engine.plugins.overrides.gemm_swiglu_plugin" in line and "fp8, disable" in line and "'float16'" in line


def test_plugin_config_prediction_is_what_model_dump_writes():
    r = recipe(tp=2)
    cfg = ckpt_config(r, "FP8", "FP8", model="mixtral-8x7b")
    build = bc.resolve_build(r, cfg, get_gpu("h100"))
    pc = bc.to_json(build.config)["plugin_config"]
    assert list(pc) == [f.name for f in upstream.PLUGIN_CONFIG]  # every field, declaration order
    for f in upstream.PLUGIN_CONFIG:
        if f.cli and f.kind == "dtype":
            stored = build.config.plugins[f.name]
            if f.name != "nccl_plugin":
                assert pc[f.name] == (None if stored == "disable" else stored)
    assert pc["gpt_attention_plugin"] == "auto" and pc["moe_plugin"] == "auto"  # kept literally, not resolved
    assert pc["nccl_plugin"] == cfg["dtype"]  # set_nccl_plugin(dtype) at world size 2
    assert pc["paged_kv_cache"] is True and pc["paged_state"] is False  # update_kv_cache_type for a non-Mamba model
    for f in upstream.PLUGIN_CONFIG:  # builder-set fields nobody touched keep the pydantic default
        if not f.cli and f.name not in ("dtype", "paged_kv_cache"):
            assert pc[f.name] == f.default, f.name


def test_lora_config_is_the_default_lora_config():
    r = recipe()
    j = bc.to_json(bc.resolve_build(r, ckpt_config(r), get_gpu("h100")).config)
    assert j["lora_config"] == {name: default for name, default, _ in upstream.LORA_CONFIG}
    assert list(j["lora_config"]) == [name for name, _, _ in upstream.LORA_CONFIG]


def test_fp8_rowwise_sets_the_whole_plugin_group():
    r = recipe(plugins={"preset": "hopper-fp8", "overrides": {"fp8_rowwise_gemm_plugin": "disable"}})
    build = bc.resolve_build(r, ckpt_config(r, "FP8_PER_CHANNEL_PER_TOKEN"), get_gpu("h100"))
    pc = bc.to_json(build.config)["plugin_config"]
    for name, value in upstream.FP8_ROWWISE_SETS[0]:  # even over an explicit disable
        assert pc[name] == (build.config.dtype if value == "dtype" else value), name
    assert pc["smooth_quant_gemm_plugin"] is None


@pytest.mark.parametrize(
    "override,expected", [({}, "nvfp4"), ({"gemm_plugin": "auto"}, "nvfp4"), ({"gemm_plugin": "disable"}, None)]
)
def test_nvfp4_gemm_plugin_unless_disabled_on_the_command_line(override, expected):
    r = recipe(plugins={"preset": "blackwell-fp16", "overrides": override})
    build = bc.resolve_build(r, ckpt_config(r, "NVFP4"), get_gpu("b200"))
    assert bc.to_json(build.config)["plugin_config"]["gemm_plugin"] == expected
    flags = dict(zip(bc.to_argv(build, "C", "O")[1::2], bc.to_argv(build, "C", "O")[2::2]))
    assert flags.get("--gemm_plugin", "disable") == (expected or "disable")  # what the flag says is what is recorded


def test_validate_rejections_are_keyed_on_the_exact_sm():
    by_sm, _ = upstream.VALIDATE_REJECTS_BY_SM
    plugins = {f.name: f.default for f in FIELDS} | {
        "gemm_swiglu_plugin": "fp8",
        "fp8_rowwise_gemm_plugin": "auto",
        "low_latency_gemm_plugin": "fp8",
        "bert_context_fmha_fp32_acc": True,
    }
    for sm in (89, 90, 100, 103, 110, 120):
        found = {k for k, _ in rejections(plugins, Target(sm, "LlamaForCausalLM", "FP8", None))}
        assert found == {k for k in by_sm.get(sm, ()) if k in plugins and plugins[k] not in ("disable", False)}, sm


def test_gemm_swiglu_needs_fused_mlp_only():
    """No Hopper-only rule: the builder checks the fp8 dtype (argparse) and use_fused_mlp."""
    for sm in (89, 90, 120):
        r = recipe(plugins={"overrides": {"gemm_swiglu_plugin": "fp8"}})
        build = bc.resolve_build(r, ckpt_config(r, "FP8", "FP8"), gpu_for(sm))
        assert [k for k, _ in build.rejected] == [], sm
        r = recipe(plugins={"overrides": {"gemm_swiglu_plugin": "fp8", "use_fused_mlp": False}})
        build = bc.resolve_build(r, ckpt_config(r, "FP8", "FP8"), gpu_for(sm))
        assert [k for k, _ in build.rejected] == ["gemm_swiglu_plugin"], sm


def test_opt_num_tokens_is_taken_before_max_num_tokens_is_raised():
    # check_max_num_tokens: opt = min(batch x beam, max_num_tokens as given); max is then raised to tokens_per_block
    r = recipe(max_batch_size=64, max_num_tokens=16, plugins={"overrides": {"multiple_profiles": False}})
    c = bc.resolve_build(r, ckpt_config(r), get_gpu("h100")).config
    assert (c.max_num_tokens, c.opt_num_tokens) == (32, 16)
    # clamped: opt is capped at the clamped max
    r = recipe(
        max_batch_size=4,
        max_seq_len=100,
        max_input_len=50,
        max_num_tokens=8192,
        plugins={"overrides": {"multiple_profiles": False}},
    )
    c = bc.resolve_build(r, ckpt_config(r), get_gpu("h100")).config
    assert (c.max_num_tokens, c.opt_num_tokens) == (400, 4)


def test_deduced_max_seq_len_rounds_up():
    # math.ceil(max_position_embeddings x factor): 4097 x 1.5 = 6145.5 -> 6146
    assert deduce_max_seq_len(4097, {"type": "linear", "factor": 1.5}) == 6146
    assert deduce_max_seq_len(4096, {"rope_type": "dynamic", "factor": 2.0}) == 8192
    assert deduce_max_seq_len(131072, {"rope_type": "llama3", "factor": 8.0}) == 131072
    assert deduce_max_seq_len(None, None) == 2048
