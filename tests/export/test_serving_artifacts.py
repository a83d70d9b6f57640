"""Serving artifacts of the llmapi target against the contract's tables: the extra_llm_api_options YAML for
TensorRT-LLM 1.0, 1.1 and 1.2 holds only TorchLlmArgs keys of that release (an unknown key is never written),
the trtllm-serve flags are each release's spelling, and the Triton llmapi model is the documented one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from trtpipe.export.serving import (
    LLM_API_KEYS,
    UnknownLLMAPIKey,
    checked,
    launch_lines,
    llm_api_options,
    serve_command,
    write_serving,
)
from trtpipe.triton.llmapi_repo import llmapi_pbtxt, write_llmapi_repo
from trtpipe.app.validation import load_recipe
from optional import needs

REPO = Path(__file__).resolve().parents[2]

# The TorchLlmArgs fields listed by the contract (1.1-era llm_args.py; same core fields in the 1.4 reference):
# top level, and the fields of each sub-model. A key outside these can never be valid.
CONTRACT_TOP = set(
    """model tokenizer tokenizer_mode skip_tokenizer_init trust_remote_code tensor_parallel_size dtype
revision tokenizer_revision pipeline_parallel_size context_parallel_size gpus_per_node moe_cluster_parallel_size
moe_tensor_parallel_size moe_expert_parallel_size enable_attention_dp enable_lm_head_tp_in_adp cp_config load_format
fail_fast_on_attention_window_too_large enable_lora lora_config kv_cache_config enable_chunked_prefill
guided_decoding_backend iter_stats_max_iterations request_stats_max_iterations peft_cache_config scheduler_config
cache_transceiver_config sparse_attention_config speculative_config max_batch_size max_input_len max_seq_len
max_beam_width max_num_tokens gather_generation_logits num_postprocess_workers postprocess_tokenizer_dir
reasoning_parser backend return_perf_metrics orchestrator_type build_config garbage_collection_gen0_threshold
cuda_graph_config attention_dp_config disable_overlap_scheduler moe_config attn_backend sampler_type
enable_iter_perf_stats enable_iter_req_stats print_iter_log perf_metrics_max_requests batch_wait_timeout_ms
batch_wait_timeout_iters batch_wait_max_tokens_ratio torch_compile_config enable_autotuner
enable_layerwise_nvtx_marker enable_min_latency stream_interval force_dynamic_quantization allreduce_strategy
checkpoint_loader checkpoint_format kv_connector_config mm_encoder_only ray_worker_extension_cls""".split()
)
# not in the 1.1-era field list: env_overrides (environment variables set for the workers), which NVIDIA's gpt-oss
# database config uses (examples/configs/database/openai/gpt-oss-120b/B200/1k1k_tp8_conc64.yaml@029c15cb)
CONTRACT_TOP_13 = {"env_overrides"}
CONTRACT_SUB = {
    "kv_cache_config": set(
        """enable_block_reuse max_tokens max_attention_window sink_token_length
        free_gpu_memory_fraction host_cache_size onboard_blocks cross_kv_cache_fraction secondary_offload_min_priority
        event_buffer_max_size attention_dp_events_gather_period_ms enable_partial_reuse copy_on_partial_reuse
        use_uvm max_gpu_total_bytes dtype mamba_ssm_cache_dtype tokens_per_block""".split()
    ),
    "cuda_graph_config": {"batch_sizes", "max_batch_size", "enable_padding"},
    "attention_dp_config": {"enable_balance", "timeout_iters", "batching_wait_iters"},
    "moe_config": {"backend", "max_num_tokens", "load_balancer"},
    "scheduler_config": {"capacity_scheduler_policy", "context_chunking_policy", "dynamic_batch_config"},
    # CacheTransceiverConfig of the 1.1/1.2-era llm_args.py revisions read (backend DEFAULT/UCX/NIXL/MPI)
    "cache_transceiver_config": {"backend", "max_tokens_in_buffer", "kv_transfer_timeout_ms"},
    # LoraConfig (tensorrt_llm/lora_helper.py@585c7565)
    "lora_config": set(
        """lora_dir lora_ckpt_source max_lora_rank lora_target_modules trtllm_modules_to_hf_modules max_loras
        max_cpu_loras swap_gate_up_proj_lora_b_weight""".split()
    ),
    # DecodingBaseConfig and its NGram / Eagle / MTP subclasses (llm_args.py@fcd3f316; speculative_model_dir in a
    # 1.0/1.1-era revision)
    "speculative_config": {
        "decoding_type",
        "max_draft_len",
        "speculative_model",
        "speculative_model_dir",
        "max_matching_ngram_size",
        "eagle3_one_model",
        "eagle_choices",  # EagleDecodingConfig.eagle_choices (EAGLE-3's static tree, trtpipe/recipe/eagle.py)
        "use_dynamic_tree",  # EagleDecodingConfig.use_dynamic_tree / dynamic_tree_max_topK (EAGLE-3's dynamic tree)
        "dynamic_tree_max_topK",
        "max_total_draft_tokens",  # DecodingBaseConfig.max_total_draft_tokens
        "num_nextn_predict_layers",
    },
}


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(REPO / "recipes" / "stories-llmapi-fp8.yaml", check_rules=False)


def _keys(d: dict, prefix: str = "") -> list[str]:
    return [k2 for k, v in d.items() for k2 in (_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"])]


def test_key_table_is_within_the_contract():
    for key in LLM_API_KEYS:
        top, _, sub = key.partition(".")
        if top in CONTRACT_TOP_13:
            assert LLM_API_KEYS[key] == {"1.3"}, key
            continue
        assert top in CONTRACT_TOP, key
        if sub:
            assert sub in CONTRACT_SUB[top], key


@needs("tritonclient")
@pytest.mark.parametrize("version", ["1.0", "1.1", "1.2", "1.3"])
def test_generated_yaml_per_version(recipe, version, tmp_path):
    opts = llm_api_options(recipe, version)
    for key in _keys(opts):
        top, _, sub = key.partition(".")
        assert top in CONTRACT_TOP and (not sub or sub in CONTRACT_SUB[top]), key
        assert version in LLM_API_KEYS[key], key
    assert opts["kv_cache_config"]["dtype"] == "fp8"  # recipe: kv_cache fp8
    assert opts["kv_cache_config"]["free_gpu_memory_fraction"] == 0.9
    assert opts["scheduler_config"]["capacity_scheduler_policy"] == "GUARANTEED_NO_EVICT"
    assert ("tokens_per_block" in opts["kv_cache_config"]) == (version != "1.0")  # not verified for 1.0
    assert ("return_perf_metrics" in opts) == (version != "1.0")
    r = recipe.model_copy(deep=True)
    object.__setattr__(r, "llmapi", r.llmapi.model_copy(update={"version": version}))
    write_serving(r, tmp_path / "hf", tmp_path)
    write_llmapi_repo(r, tmp_path / "triton_repo", str(tmp_path / "hf"))
    written = yaml.safe_load((tmp_path / "extra_llm_api_options.yaml").read_text())
    assert written == opts
    model_yaml = yaml.safe_load((tmp_path / "triton_repo/tensorrt_llm/1/model.yaml").read_text())
    assert model_yaml.pop("triton_config") == {"max_batch_size": 0, "decoupled": False}
    assert model_yaml.pop("model").endswith("hf") and model_yaml.pop("backend") == "pytorch"
    assert model_yaml == opts


def test_unknown_or_too_new_keys_are_refused():
    with pytest.raises(
        UnknownLLMAPIKey,
        match="'kv_cache_config.tokens_per_block' is a TorchLlmArgs key of TensorRT-LLM 1.1, 1.2, 1.3, not of 1.0",
    ):
        checked({"kv_cache_config": {"tokens_per_block": 32}}, "1.0")
    with pytest.raises(UnknownLLMAPIKey, match="'max_batch' is not a TorchLlmArgs key of TensorRT-LLM 1.2"):
        checked({"max_batch": 8}, "1.2")
    with pytest.raises(UnknownLLMAPIKey, match="'moe_confg' is not a TorchLlmArgs key"):
        checked({"moe_confg": {}}, "1.3")  # an empty section is a key too
    with pytest.raises(UnknownLLMAPIKey, match="no key table"):
        checked({}, "1.4")


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.from_regex(r"[a-z_]{1,20}", fullmatch=True), st.integers(), min_size=1, max_size=4),
    st.sampled_from(["1.0", "1.1", "1.2", "1.3"]),
)
def test_no_key_outside_the_table_ever_passes(d, version):
    if all(version in LLM_API_KEYS.get(k, ()) for k in d):
        assert checked(d, version) == d
    else:
        with pytest.raises(UnknownLLMAPIKey):
            checked(d, version)


def test_serve_flags_per_version(recipe):
    old = serve_command(recipe, "/m", "/c.yaml", "1.1")
    new = serve_command(recipe, "/m", "/c.yaml", "1.2")
    assert old[:2] == new[:2] == ["trtllm-serve", "/m"]
    assert {"--tp_size", "--pp_size", "--kv_cache_free_gpu_memory_fraction", "--extra_llm_api_options"} <= set(old)
    assert {"--tensor_parallel_size", "--pipeline_parallel_size", "--free_gpu_memory_fraction", "--config"} <= set(new)
    assert new[new.index("--backend") + 1] == "pytorch" and new[new.index("--port") + 1] == "8000"


def test_multi_node_lines(recipe):
    r = load_recipe(
        REPO / "recipes" / "stories-llmapi-fp8.yaml",
        ["parallel.tp=8", "parallel.pp=2", "llmapi.nodes=2"],
        check_rules=False,
    )
    lines = launch_lines(r, "/m", "/c.yaml")
    assert lines["slurm"].startswith("srun --mpi=pmix -N 2 --ntasks-per-node=8 trtllm-llmapi-launch trtllm-serve /m ")
    assert lines["mpirun"].startswith("mpirun -np 16 ") and "trtllm-llmapi-launch trtllm-serve /m" in lines["mpirun"]
    assert (
        "--host 0.0.0.0" in lines["slurm"] and "--tensor_parallel_size 8 --pipeline_parallel_size 2" in lines["slurm"]
    )


@needs("tritonclient")
def test_triton_llmapi_config():
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    text = llmapi_pbtxt()
    c = text_format.Parse(text, mc.ModelConfig())
    assert c.name == "tensorrt_llm" and c.backend == "python" and c.max_batch_size == 0
    assert not c.HasField("model_transaction_policy")  # model.py sets it from model.yaml
    ins = {i.name: i for i in c.input}
    assert not ins["text_input"].optional and ins["sampling_param_max_tokens"].optional
    assert {o.name for o in c.output} >= {"text_output", "finish_reason", "kv_cache_hit_rate", "arrival_time_ns"}


@needs("tritonclient")
def test_guided_decoding_backend_reaches_the_yaml_and_the_llmapi_model(recipe, tmp_path):
    """serving.guided_decoding_backend is LlmArgs.guided_decoding_backend in both files; unset, the key is absent
    (None: upstream's default, guided decoding off)."""
    assert "guided_decoding_backend" not in llm_api_options(recipe)
    r = recipe.model_copy(deep=True)
    object.__setattr__(r, "serving", r.serving.model_copy(update={"guided_decoding_backend": "xgrammar"}))
    write_serving(r, tmp_path / "hf", tmp_path)
    write_llmapi_repo(r, tmp_path / "triton_repo", str(tmp_path / "hf"))
    assert (
        yaml.safe_load((tmp_path / "extra_llm_api_options.yaml").read_text())["guided_decoding_backend"] == "xgrammar"
    )
    model_yaml = yaml.safe_load((tmp_path / "triton_repo/tensorrt_llm/1/model.yaml").read_text())
    assert model_yaml["guided_decoding_backend"] == "xgrammar"
