"""The Triton repository of the llmapi target: TensorRT-LLM's ``llmapi`` Python model
(``triton_backend/all_models/llmapi``), whose ``model.yaml`` holds the same ``LLM()`` arguments as the
trtllm-serve YAML (:func:`trtpipe.export.serving.model_yaml`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

import yaml

from trtpipe.export.serving import model_yaml
from trtpipe.recipe.schema import Recipe
from trtpipe.triton.repo import MODEL_CODE, mc, to_pbtxt

# --- Triton llmapi model -------------------------------------------------------------------------------------

# config.pbtxt of triton_backend/all_models/llmapi/tensorrt_llm (max_batch_size and the transaction policy are
# set by its model.py from model.yaml's triton_config, so they are not written here)
_INPUTS = [
    ("text_input", "TYPE_STRING", [-1], False),
    ("image_url", "TYPE_STRING", [-1], True),
    ("streaming", "TYPE_BOOL", [1], True),
    ("sampling_param_best_of", "TYPE_INT32", [1], True),
    ("sampling_param_temperature", "TYPE_FP32", [1], True),
    ("sampling_param_top_k", "TYPE_INT32", [1], True),
    ("sampling_param_top_p", "TYPE_FP32", [1], True),
    ("sampling_param_frequency_penalty", "TYPE_FP32", [1], True),
    ("sampling_param_presence_penalty", "TYPE_FP32", [1], True),
    ("sampling_param_max_tokens", "TYPE_INT32", [1], True),
    ("sampling_param_stop", "TYPE_STRING", [-1], True),
    ("sampling_param_seed", "TYPE_UINT64", [1], True),
    ("sampling_param_exclude_input_from_output", "TYPE_BOOL", [1], True),
    ("sampling_param_return_perf_metrics", "TYPE_BOOL", [1], True),
    ("return_finish_reason", "TYPE_BOOL", [1], True),
    ("return_stop_reason", "TYPE_BOOL", [1], True),
    ("return_cumulative_logprob", "TYPE_BOOL", [1], True),
    ("stop", "TYPE_BOOL", [1], True),
    ("lora_id", "TYPE_UINT64", [1], True),
    ("lora_name", "TYPE_STRING", [1], True),
    ("lora_path", "TYPE_STRING", [1], True),
    ("lora_ckpt_source", "TYPE_STRING", [1], True),
]
_OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]),
    ("finish_reason", "TYPE_STRING", [1]),
    ("stop_reason", "TYPE_STRING", [1]),
    ("cumulative_logprob", "TYPE_FP32", [1]),
    ("kv_cache_reused_block", "TYPE_INT32", [1]),
    ("kv_cache_missed_block", "TYPE_INT32", [1]),
    ("kv_cache_alloc_new_blocks", "TYPE_INT32", [1]),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32", [1]),
    ("kv_cache_hit_rate", "TYPE_FP32", [1]),
    ("arrival_time_ns", "TYPE_INT64", [1]),
    ("first_scheduled_time_ns", "TYPE_INT64", [1]),
    ("first_token_time_ns", "TYPE_INT64", [1]),
    ("last_token_time_ns", "TYPE_INT64", [1]),
    ("acceptance_rate", "TYPE_FP32", [1]),
    ("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    ("total_draft_tokens", "TYPE_INT32", [1]),
]


# The CPU twin's model.py (model_repo/llmapi/1/model.py, trtpipe.serving.llmapi_adapter) reads its executor
# configuration, serialized by trtpipe.serving.config.to_json, from this parameter.
TWIN_CONFIG_PARAMETER = "twin_executor_config"


def llmapi_pbtxt(twin_executor_config: Optional[str] = None, decoupled: bool = False) -> str:
    """Upstream's config.pbtxt; with ``twin_executor_config`` the twin's, which also states the transaction policy
    (upstream's model.py sets it from model.yaml's ``triton_config`` in ``auto_complete_config``)."""
    c = mc.ModelConfig(name="tensorrt_llm", backend="python")
    c.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    if twin_executor_config is not None:
        c.parameters[TWIN_CONFIG_PARAMETER].string_value = twin_executor_config
        c.model_transaction_policy.decoupled = decoupled
    for name, dtype, dims, optional in _INPUTS:
        i = c.input.add(name=name, data_type=mc.DataType.Value(dtype), dims=dims)
        i.optional = optional
    for name, dtype, dims in _OUTPUTS:
        c.output.add(name=name, data_type=mc.DataType.Value(dtype), dims=dims)
    return to_pbtxt(c)


def write_llmapi_repo(
    recipe: Recipe,
    repo: Path,
    model_ref: str,
    lora_dir: Optional[Path] = None,
    twin_executor_config: Optional[str] = None,
) -> None:
    """``repo/tensorrt_llm/{config.pbtxt,1/model.yaml}`` and a README saying where the model code comes from.
    With ``twin_executor_config`` (an ExecutorConfig as ``trtpipe.serving.config.to_json`` writes it) the CPU twin's
    ``model.py`` too, which serves ``model_ref`` on trtpipe's executor in place of TensorRT-LLM."""
    model = repo / "tensorrt_llm"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(llmapi_pbtxt(twin_executor_config, recipe.triton.streaming))
    if twin_executor_config is not None:
        shutil.copy(MODEL_CODE / "llmapi" / "1" / "model.py", model / "1" / "model.py")
    (model / "1" / "model.yaml").write_text(
        yaml.safe_dump(model_yaml(recipe, model_ref, lora_dir=lora_dir), sort_keys=False)
    )
    (repo / "README.md").write_text(
        "Triton repository for TensorRT-LLM's `llmapi` Python model. Copy `model.py` and `helpers.py` from\n"
        "`triton_backend/all_models/llmapi/tensorrt_llm/1/` of the TensorRT-LLM release you serve with into\n"
        "`tensorrt_llm/1/` (they ship in the `tritonserver:<yy.mm>-trtllm-python-py3` containers), then:\n\n"
        "    python3 <TensorRT-LLM>/triton_backend/scripts/launch_triton_server.py --model_repo=triton_repo\n\n"
        "Multi-node: `srun -N <nodes> --ntasks-per-node=<gpus> --mpi=pmix trtllm-llmapi-launch "
        "/opt/tritonserver/bin/tritonserver --model-repository triton_repo`.\n"
        'Request: `POST /v2/models/tensorrt_llm/generate {"text_input": "...", "sampling_param_max_tokens": 50}`.\n'
    )
