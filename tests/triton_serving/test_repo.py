"""Repository generation without a server: config messages, the llama70b-fp8 TensorRT config (every contract
§6.3 parameter), the ensemble wiring, default stop ids, the mpirun leader-mode dry run for tp=4, refusal of an
engine built by another TensorRT-LLM, and atomic writing."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from click.testing import CliRunner
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from trtpipe.cli import main
from trtpipe.errors import ServingError
from trtpipe.triton import repo as R
from trtpipe.app.launch_triton import check_engine_versions, repo_info
from trtpipe.app.validation import load_recipe

HERE = Path(__file__).parent
RECIPES = HERE.parents[1] / "recipes"

# Contract §6.3 "Parameters read by the C++ backend" (every row of the table, names verbatim).
SECTION_6_3 = """gpt_model_type gpt_model_path encoder_model_path max_beam_width batch_scheduler_policy
kv_cache_free_gpu_mem_fraction max_tokens_in_paged_kv_cache cross_kv_cache_fraction kv_cache_host_memory_bytes
kv_cache_onboard_blocks max_attention_window_size sink_token_length enable_kv_cache_reuse enable_chunked_context
normalize_log_probs exclude_input_in_output cancellation_check_period_ms stats_check_period_ms
iter_stats_max_iterations request_stats_max_iterations decoding_mode lookahead_window_size lookahead_ngram_size
lookahead_verification_set_size medusa_choices eagle_choices gpu_weights_percent multi_block_mode
enable_context_fmha_fp32_acc cuda_graph_mode cuda_graph_cache_size gpu_device_ids participant_ids num_nodes
lora_cache_optimal_adapter_size lora_cache_max_adapter_size lora_cache_gpu_memory_fraction
lora_cache_host_memory_bytes lora_prefetch_dir speculative_decoding_fast_logits guided_decoding_backend
xgrammar_tokenizer_info_path tokenizer_dir executor_worker_path recv_poll_period_ms""".split()
# enable_trt_overlap (in the table as "deprecated, ignored") is left out, as upstream's template leaves it out


@pytest.fixture(scope="module")
def llama70b():
    return load_recipe(RECIPES / "llama70b-fp8.yaml", check_rules=False)


@pytest.fixture(scope="module")
def llama70b_engine(llama70b, tmp_path_factory):
    """The engine config.json trtllm-build would write for llama70b-fp8 (TP4), from the engine planner."""
    from trtpipe.engine import build_config as bc
    from trtpipe.engine.ckptconfig import predicted_checkpoint_config
    from trtpipe.models.dims import read_hf_config

    cfg = predicted_checkpoint_config(read_hf_config(llama70b.resolve(llama70b.model.source)), llama70b)
    engine = tmp_path_factory.mktemp("llama70b") / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps(bc.engine_config_json(cfg, bc.resolve_build(llama70b, cfg).config)))
    return engine


@pytest.fixture(scope="module")
def llama70b_repo(llama70b, llama70b_engine, tmp_path_factory, tokenizer_with_eos):
    tok = tokenizer_with_eos(tmp_path_factory.mktemp("tok") / "tokenizer", [2, 3])
    out = tmp_path_factory.mktemp("llama70b_repo") / "repo"
    R.write_repo(llama70b, llama70b_engine, tok, out)
    return out


def test_llama70b_tensorrt_llm_config_has_every_contract_parameter(llama70b, llama70b_engine):
    config = R.tensorrt_llm_config(llama70b, R.EngineInfo.read(llama70b_engine))
    text = R.to_pbtxt(config)
    assert "${" not in text
    assert config.backend == "tensorrtllm"
    params = {k: v.string_value for k, v in config.parameters.items()}
    missing = [k for k in SECTION_6_3 if k not in params]
    assert not missing
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["gpt_model_path"] == str(llama70b_engine.resolve())
    assert params["batch_scheduler_policy"] == "max_utilization"
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.9"
    assert params["enable_kv_cache_reuse"] == "true"
    assert params["kv_cache_host_memory_bytes"] == "0"
    assert params["max_attention_window_size"] == "8192"
    assert params["exclude_input_in_output"] == "true"
    assert params["max_beam_width"] == "1" and params["decoding_mode"] == "top_k_top_p"
    assert params["max_tokens_in_paged_kv_cache"] == ""  # the recipe leaves it unset: the pool follows the fraction
    assert config.max_batch_size == 64
    assert config.model_transaction_policy.decoupled  # triton.streaming: true
    assert list(config.dynamic_batching.preferred_batch_size) == [64]
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    inputs = {i.name: i for i in config.input}
    assert inputs["input_ids"].data_type == mc.TYPE_INT32 and list(inputs["input_ids"].dims) == [-1]
    assert not inputs["input_lengths"].optional and not inputs["request_output_len"].optional
    assert inputs["seed"].data_type == mc.TYPE_UINT64 and inputs["seed"].HasField("reshape")
    assert list(inputs["stop_words_list"].dims) == [2, -1]


def test_sliding_window_becomes_the_attention_window(llama70b, llama70b_engine, tmp_path):
    """A Mistral-style engine (pretrained_config.sliding_window) tells the runtime its window; others use max_seq_len."""
    cfg = json.loads((llama70b_engine / "config.json").read_text())
    cfg["pretrained_config"]["sliding_window"] = 4096
    mistral = tmp_path / "engine"
    mistral.mkdir()
    (mistral / "config.json").write_text(json.dumps(cfg))
    params = R.tensorrt_llm_config(llama70b, R.EngineInfo.read(mistral)).parameters
    assert params["max_attention_window_size"].string_value == "4096"
    cfg["pretrained_config"]["sliding_window"] = 100_000  # wider than the engine's max_seq_len: no window at all
    (mistral / "config.json").write_text(json.dumps(cfg))
    params = R.tensorrt_llm_config(llama70b, R.EngineInfo.read(mistral)).parameters
    assert params["max_attention_window_size"].string_value == "8192"


def test_llama70b_recipe_max_tokens_reaches_the_config(llama70b_engine):
    recipe = load_recipe(
        RECIPES / "llama70b-fp8.yaml",
        ["engine.kv_cache.max_tokens=500000", "engine.kv_cache.enable_reuse=false"],
        check_rules=False,
    )
    params = R.tensorrt_llm_config(recipe, R.EngineInfo.read(llama70b_engine)).parameters
    assert params["max_tokens_in_paged_kv_cache"].string_value == "500000"
    assert params["enable_kv_cache_reuse"].string_value == "false"


def test_written_repo_parses_back_and_is_wired(llama70b_repo):
    configs = R.read_configs(llama70b_repo)
    assert set(configs) == {"preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls"}
    for name, config in configs.items():
        assert config.name == name
        assert "${" not in (llama70b_repo / name / "config.pbtxt").read_text()
    assert (llama70b_repo / "tensorrt_llm" / "1").is_dir() and not (
        llama70b_repo / "tensorrt_llm" / "1" / "model.py"
    ).exists()
    assert (llama70b_repo / "preprocessing" / "tokenizer" / "tokenizer.json").exists()
    # every ensemble step reads only tensors that exist and feeds only inputs its model declares
    ens = configs["ensemble"]
    available = {i.name for i in ens.input}
    for step in ens.ensemble_scheduling.step:
        model = configs[step.model_name]
        model_inputs = {i.name: i for i in model.input}
        assert set(step.input_map) <= set(model_inputs), step.model_name
        assert set(step.input_map.values()) <= available, step.model_name
        required = {n for n, i in model_inputs.items() if not i.optional}
        assert required <= set(step.input_map), step.model_name
        assert set(step.output_map) <= {o.name for o in model.output}, step.model_name
        available |= set(step.output_map.values())
    assert "text_output" in available
    # every ensemble output is produced by a step (log probs as upstream's ensemble maps them)
    assert {o.name for o in ens.output} <= available
    assert {"cum_log_probs", "output_log_probs"} <= {o.name for o in ens.output}
    assert {"return_log_probs", "min_tokens"} <= {i.name for i in ens.input}


def test_postprocessing_matches_the_golden_file(stories_recipe):
    golden = (HERE / "golden" / "postprocessing.pbtxt").read_text()
    assert R.to_pbtxt(R.postprocessing_config(stories_recipe())) == golden
    assert text_format.Parse(golden, mc.ModelConfig()).parameters["tokenizer_dir"].string_value == "tokenizer"


def test_twin_declares_what_the_real_model_declares(stories_recipe, stories_engine):
    engine = R.EngineInfo.read(stories_engine(1))
    twin = R.tensorrt_llm_config(stories_recipe(), engine)
    assert twin.backend == "python"
    real = R.tensorrt_llm_config(stories_recipe(), R.EngineInfo(**{**engine.__dict__, "twin": False}))
    assert real.backend == "tensorrtllm"
    assert [i.name for i in twin.input] == [i.name for i in real.input] + [r.name for r in R.TWIN_ONLY_INPUTS]
    assert list(twin.input)[: len(real.input)] == list(real.input) and list(twin.output) == list(real.output)
    assert twin.parameters["gpt_model_path"].string_value == "engine"  # relative: the repo is relocatable
    assert twin.parameters["batch_scheduler_policy"].string_value == "guaranteed_no_evict"


def test_token_ids_from_generation_config_and_tokenizer(tmp_path, tokenizer_with_eos):
    ids = R.token_ids(tokenizer_with_eos(tmp_path / "tok", [128001, 128009]))
    assert (ids.end_id, ids.stop_ids) == (128001, (128009, 2))  # the tokenizer's </s> (2) is an EOS too
    assert ids.pad_id == 128001  # no pad token: pad = end


def test_failed_write_leaves_nothing(tmp_path, stories_recipe, stories_engine):
    out = tmp_path / "repo"
    with pytest.raises(ServingError, match="no tokenizer files"):
        R.write_repo(stories_recipe(), stories_engine(1), tmp_path, out)  # tmp_path holds no tokenizer
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_mpirun_dry_run_for_tp4(llama70b_repo):
    res = CliRunner().invoke(
        main,
        [
            "serve",
            str(llama70b_repo),
            "--dry-run",
            "--http-port",
            "8000",
            "--grpc-port",
            "8001",
            "--metrics-port",
            "8002",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "world_size 4" in res.output
    cmd = shlex.split(res.output.strip().splitlines()[-1])
    assert cmd[:2] == ["mpirun", "--allow-run-as-root"]
    segments, seg = [], []
    for arg in cmd[2:] + [":"]:
        if arg == ":":
            segments.append(seg)
            seg = []
        else:
            seg.append(arg)
    assert len(segments) == 4
    repo = str(llama70b_repo.resolve())
    for rank, s in enumerate(segments):
        assert s[:4] == ["-n", "1", "/opt/tritonserver/bin/tritonserver", f"--model-repository={repo}"]
        assert "--disable-auto-complete-config" in s
        assert f"--backend-config=python,shm-region-prefix-name=prefix{rank}_" in s
        if rank == 0:
            assert {"--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", "--http-address=127.0.0.1"} <= set(s)
            assert not any(a.startswith("--load-model") for a in s)
        else:
            assert {
                "--model-control-mode=explicit",
                "--load-model=tensorrt_llm",
                "--allow-http=false",
                "--allow-grpc=false",
                "--allow-metrics=false",
            } <= set(s)
            assert not any(a.startswith("--http-port") for a in s)


def test_engine_of_another_trtllm_is_refused(llama70b_repo):
    info = repo_info(llama70b_repo)
    assert info["engine_version"] == "1.2.1"
    check_engine_versions(info, "1.2.1")
    with pytest.raises(ServingError, match="built with TensorRT-LLM 1.2.1 but 1.1.0 is installed"):
        check_engine_versions(info, "1.1.0")
    lock = {"tensorrt_llm": "1.2.1", "tensorrt": "10.14.1.48"}
    check_engine_versions(info, "1.2.1", "10.14.1.48", lock)
    with pytest.raises(ServingError, match="built with TensorRT 10.14.1.48 but 10.13.3.9 is installed"):
        check_engine_versions(info, "1.2.1", "10.13.3.9", lock)
    res = CliRunner().invoke(main, ["serve", str(llama70b_repo)])  # TensorRT-LLM is not installed here
    assert res.exit_code == 1
    assert "needs TensorRT-LLM 1.2.1" in res.output and "--dry-run" in res.output


def test_repo_command_from_an_engine_dir(tmp_path, stories_engine):
    out = tmp_path / "repo"
    res = CliRunner().invoke(
        main, ["repo", str(RECIPES / "stories-fp16.yaml"), "--engine", str(stories_engine(1)), "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert res.output.strip() == f"{out} (ensemble, postprocessing, preprocessing, tensorrt_llm)"
    assert (out / "tensorrt_llm" / "engine" / "checkpoint" / "rank0.safetensors").exists()
    again = CliRunner().invoke(
        main, ["repo", str(RECIPES / "stories-fp16.yaml"), "--engine", str(stories_engine(1)), "--out", str(out)]
    )
    assert again.exit_code == 1 and "already exists" in again.output


def test_recipe_dry_run_prints_the_launch_without_building(tmp_path):
    res = CliRunner().invoke(
        main,
        [
            "serve",
            str(RECIPES / "llama70b-fp8.yaml"),
            "--dry-run",
            "--set",
            f"work_dir={tmp_path}",
            "--grpc-port",
            "9001",
        ],
    )
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert f"writes {tmp_path}/artifacts/repo/" in lines[0]
    cmd = shlex.split(lines[-1])
    assert cmd.count(":") == 3 and cmd.count("--load-model=tensorrt_llm") == 3 and "--grpc-port=9001" in cmd
    assert not (tmp_path / "artifacts").exists()  # nothing was built


def test_priority_levels_reach_the_entry_queues(stories_recipe, stories_engine):
    recipe = stories_recipe("triton.priority_levels=3", "triton.max_queue_size=32")
    llm = R.tensorrt_llm_config(recipe, R.EngineInfo.read(stories_engine(1)))
    bls = R.bls_config(recipe)
    for c in (llm, bls):
        assert (c.dynamic_batching.priority_levels, c.dynamic_batching.default_priority_level) == (3, 2)
    assert llm.dynamic_batching.default_queue_policy.max_queue_size == 32
    engine = R.EngineInfo.read(stories_engine(1))
    pre = R.preprocessing_config(recipe, engine, R.token_ids(stories_engine(1) / "checkpoint"))
    assert pre.dynamic_batching.priority_levels == 0  # only the models that queue generation work


def test_the_serving_deadline_reaches_the_twin_executor(stories_recipe, stories_engine, tmp_path):
    from google.protobuf import json_format

    from trtpipe.serving.triton_adapter import settings_from_model_config

    engine = stories_engine(1)
    repo = tmp_path / "repo"
    R.write_repo(
        stories_recipe("serving.request_timeout_s=2.5", "triton.max_queue_size=7"), engine, engine / "checkpoint", repo
    )
    config = text_format.Parse((repo / "tensorrt_llm" / "config.pbtxt").read_text(), mc.ModelConfig())
    settings = settings_from_model_config(
        json_format.MessageToDict(config, preserving_proto_field_name=True), str(repo / "tensorrt_llm")
    )  # Triton's model_repository: the model's dir
    assert settings.executor.request_timeout_s == 2.5 and settings.executor.max_queue_size == 7


# How upstream's python models load their tokenizer (NVIDIA/TensorRT-LLM
# triton_backend/all_models/inflight_batcher_llm/preprocessing/1/model.py@beb339f5; postprocessing and the BLS
# alike): the tokenizer_dir parameter straight into AutoTokenizer.from_pretrained, in tritonserver's working
# directory. Run from a directory that is neither the repository nor a model's (trust_remote_code off: nothing
# shipped is executed, and a local tokenizer loads the same either way).
UPSTREAM_LOAD = """\
import json, sys
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from transformers import AutoTokenizer

out = {}
for name in sys.argv[1:]:
    config = text_format.Parse(open(name).read(), mc.ModelConfig())
    tokenizer_dir = config.parameters["tokenizer_dir"].string_value
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, legacy=False, padding_side="left", trust_remote_code=False)
    out[config.name] = tok("Once upon a time").input_ids
print(json.dumps(out))
"""


@pytest.mark.slow
def test_upstream_models_load_the_tokenizer_from_any_working_directory(tmp_path, stories_recipe, stories_engine):
    import subprocess
    import sys

    engine = stories_engine(1)
    repo = tmp_path / "repo"
    R.write_repo(stories_recipe("triton.bls=true"), engine, engine / "checkpoint", repo)
    pbtxts = [str(repo / m / "config.pbtxt") for m in ("preprocessing", "postprocessing", "tensorrt_llm_bls")]
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "tokenizer").mkdir(parents=True)  # a relative "tokenizer" would find this empty folder and fail
    done = subprocess.run(
        [sys.executable, "-c", UPSTREAM_LOAD, *pbtxts], cwd=elsewhere, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # stories260k's own ids for the prompt (the BOS, then "Once upon a time"), as the fuzz baseline uses them
    assert json.loads(done.stdout) == {
        m: [1, 403, 407, 261, 378] for m in ("preprocessing", "postprocessing", "tensorrt_llm_bls")
    }
    paths = {
        m: c.parameters["tokenizer_dir"].string_value
        for m, c in R.read_configs(repo).items()
        if "tokenizer_dir" in c.parameters
    }
    assert set(paths) >= {"preprocessing", "postprocessing", "tensorrt_llm_bls"}
    for m, path in paths.items():  # the real tensorrt_llm's too (the backend reads it for guided decoding)
        assert Path(path).is_absolute() and (Path(path) / "tokenizer.json").is_file(), (m, path)


def test_the_repo_stage_key_covers_every_recipe_field_its_writer_reads(stories_recipe, stories_engine, tmp_path):
    """Issue 38 item 6: the repo stage wrote serving.request_timeout_s (the twin's executor_extras) without keying
    it, so a changed timeout was served from the cached repository. Every field write_repo reads must enter the
    repo stage's key: its own sections or those of the stages it reads."""
    from recipe_reads import keyed_sections, recipe_reads, unkeyed

    from trtpipe.app.stage_table import STAGES
    from trtpipe.stages.repo import REPO_STAGE

    engine = stories_engine(1)
    for overrides in ((), ("triton.streaming=true",)):  # streaming adds the BLS model
        recipe = stories_recipe(*overrides)
        with recipe_reads(recipe) as reads:
            R.write_repo(recipe, engine, engine / "checkpoint", tmp_path / f"repo{len(overrides)}")
        assert "serving.request_timeout_s" in reads  # the recorder sees the read the bug left unkeyed
        assert unkeyed(reads, keyed_sections(REPO_STAGE, STAGES)) == [], overrides


def test_guided_decoding_backend_and_tokenizer_info_reach_the_tensorrt_llm_model(
    stories_recipe, stories_engine, tmp_path
):
    """serving.guided_decoding_backend: xgrammar writes the backend parameter and xgrammar_tokenizer_info.json as
    examples/generate_xgrammar_tokenizer_info.py@7ed07f06 makes it (vocabulary by id, backend tokenizer JSON, eos),
    named by an absolute xgrammar_tokenizer_info_path; the twin's settings read both, for the real engine's
    config too. Unset: both parameters empty, as upstream's template leaves them."""
    import json

    from google.protobuf import json_format
    from transformers import AutoTokenizer

    from trtpipe.serving.triton_adapter import guided_decoder, settings_from_model_config

    engine = stories_engine(1)
    plain = R.tensorrt_llm_config(stories_recipe(), R.EngineInfo.read(engine))
    assert plain.parameters["guided_decoding_backend"].string_value == ""
    assert plain.parameters["xgrammar_tokenizer_info_path"].string_value == ""
    repo = tmp_path / "repo"
    R.write_repo(stories_recipe("serving.guided_decoding_backend=xgrammar"), engine, engine / "checkpoint", repo)
    config = text_format.Parse((repo / "tensorrt_llm" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert config.parameters["guided_decoding_backend"].string_value == "xgrammar"
    path = Path(config.parameters["xgrammar_tokenizer_info_path"].string_value)
    assert path.is_absolute() and path == (repo / "tensorrt_llm" / "xgrammar_tokenizer_info.json").resolve()
    info = json.loads(path.read_text())
    tok = AutoTokenizer.from_pretrained(engine / "checkpoint")
    assert info["encoded_vocab"] == [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    assert info["tokenizer_str"] == tok.backend_tokenizer.to_str() and info["stop_token_ids"] == [tok.eos_token_id]
    settings = settings_from_model_config(
        json_format.MessageToDict(config, preserving_proto_field_name=True), str(repo / "tensorrt_llm")
    )
    assert settings.executor.guided_decoding_backend == "xgrammar"
    assert guided_decoder(settings).vocab_size == settings.vocab_size
    ensemble = {i.name for i in R.ensemble_config(stories_recipe()).input}
    assert {"guided_decoding_guide_type", "guided_decoding_guide"} <= ensemble
