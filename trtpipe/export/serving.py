"""Serving artifacts of the llmapi target: the ``extra_llm_api_options`` YAML, the ``trtllm-serve`` command, the
multi-GPU / multi-node launch lines, and a Triton repository holding TensorRT-LLM's ``llmapi`` Python model.

The YAML is a dict of ``TorchLlmArgs`` fields, whose pydantic models forbid unknown keys: one misspelled or
too-new key and the server does not start. So every key written comes from :data:`LLM_API_KEYS`, a table of
dotted keys and the TensorRT-LLM releases known to accept them; :func:`llm_api_options` refuses anything else
(a bug here, never a file the server rejects).

Sources (TensorRT-LLM ``tensorrt_llm/llmapi/llm_args.py``, ``commands/serve.py``; ``triton_backend/all_models/
llmapi``): the key set was read from a 1.1-era revision; keys also present in the 1.4 reference are taken to be
in 1.2; for 1.0 only the long-standing core keys are written (``kv_cache_config.tokens_per_block``,
``return_perf_metrics`` and ``enable_iter_perf_stats`` are left out there, unverified for 1.0).

1.3 (what NVIDIA Dynamo's TensorRT-LLM runtime images carry: :mod:`trtpipe.deploy.trtllm_release`) takes every 1.2
key plus the keys NVIDIA's per-model serving configs use (:data:`KEYS_13`, ``examples/configs/database/**``; the
five imported in ``tests/export/data/database/`` name their file@commit). Confirmed in
``tensorrt_llm/llmapi/llm_args.py@0004396720054fd8e205cbf616f21f0b57c6b412``, a 2026 revision later than 1.3 (it
has DeepSeek-V4 configs), as fields: ``BaseLlmArgs.trust_remote_code``, ``dtype``, ``enable_attention_dp``,
``enable_chunked_prefill``, ``num_postprocess_workers``, ``backend``, ``env_overrides`` (``Optional[Dict[str,
str]]``, values coerced to strings); ``TorchLlmArgs.cuda_graph_config``, ``attention_dp_config``, ``moe_config``,
``print_iter_log``, ``stream_interval``; ``KvCacheConfig.dtype`` (``auto``/``fp8``/``fp8_ds_mla``/``nvfp4``/a
torch dtype); ``BaseCudaGraphConfig.batch_sizes``. The fields of ``AttentionDpConfig`` and ``MoeConfig.backend``
were not read at that commit (other stored revisions: :mod:`trtpipe.export.options_rules`). NOT confirmed: a
llm_args.py at a 1.3.0rc tag (the code index holds none that names its release; PyPI's 1.3.0rc sdists are stubs),
so the 1.3 table is "1.2 plus what NVIDIA's own database configs pass to trtllm-serve"; and that 1.2 refuses the
1.3-only keys: trtpipe writes those for 1.3 only because that is the release they were read for.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Optional

import yaml

from trtpipe.errors import TrtpipeError
from trtpipe.models.parsers import TABLES, TRTLLM_RELEASE, Parser
from trtpipe.models.parsers import resolve as resolve_parser
from trtpipe.recipe.schema import Recipe
from trtpipe.recipe.speculative import speculative_config

VERSIONS = ("1.0", "1.1", "1.2", "1.3")
_ALL = frozenset(VERSIONS)
_SINCE_11 = frozenset(("1.1", "1.2", "1.3"))
_SINCE_12 = frozenset(("1.2", "1.3"))
_V13 = frozenset(("1.3",))

# keys whose value is a free-form mapping written as one leaf (env_overrides: environment variable -> value)
LEAF_MAPPINGS = frozenset(("env_overrides",))

# TorchLlmArgs keys of NVIDIA's database configs (examples/configs/database/**) that the 1.2 table does not hold
# (enable_attention_dp is not among them: it predates 1.0, see LLM_API_KEYS)
KEYS_13: dict[str, frozenset] = {
    "attention_dp_config.enable_balance": _V13,
    "attention_dp_config.timeout_iters": _V13,
    "attention_dp_config.batching_wait_iters": _V13,
    "moe_config.backend": _V13,
    "stream_interval": _V13,
    "print_iter_log": _V13,
    "cuda_graph_config.batch_sizes": _V13,
    "trust_remote_code": _V13,
    "dtype": _V13,
    "backend": _V13,  # deprecated there, Literal["pytorch"]
    "num_postprocess_workers": _V13,
    "env_overrides": _V13,
}

# dotted TorchLlmArgs key -> releases that accept it (only keys trtpipe writes are listed)
LLM_API_KEYS: dict[str, frozenset] = {
    "max_batch_size": _ALL,
    "max_num_tokens": _ALL,
    "max_seq_len": _ALL,
    "max_beam_width": _ALL,
    "tensor_parallel_size": _ALL,
    "pipeline_parallel_size": _ALL,
    "moe_expert_parallel_size": _ALL,
    # attention data parallel (a TorchLlmArgs / _ParallelConfig field; Mapping(enable_attention_dp) in
    # NVIDIA/TensorRT-LLM@05ebebb2 tensorrt_llm/mapping.py; the 0.19-1.0 performance pages' MoE YAML sets it)
    "enable_attention_dp": _ALL,
    "enable_chunked_prefill": _ALL,
    "guided_decoding_backend": _ALL,  # Optional[Literal["xgrammar", "llguidance"]], default None (off)
    "kv_cache_config.free_gpu_memory_fraction": _ALL,
    "kv_cache_config.enable_block_reuse": _ALL,
    "kv_cache_config.max_tokens": _ALL,
    "kv_cache_config.host_cache_size": _ALL,
    "kv_cache_config.dtype": _ALL,
    "kv_cache_config.tokens_per_block": _SINCE_11,
    "scheduler_config.capacity_scheduler_policy": _ALL,
    "cuda_graph_config.max_batch_size": _ALL,
    "cuda_graph_config.enable_padding": _ALL,
    "enable_iter_perf_stats": _SINCE_11,
    "return_perf_metrics": _SINCE_11,
    # disaggregated serving (Dynamo prefill/decode workers): KV handed over by the cache transceiver; prefill
    # workers run without the overlap scheduler (ai-dynamo/dynamo@2d8655dd engine_configs/qwen3/prefill.yaml)
    "cache_transceiver_config.backend": _SINCE_11,
    "disable_overlap_scheduler": _SINCE_11,
    # LoRA (trtpipe.export.lora: LoraConfig fields of tensorrt_llm/lora_helper.py@585c7565; written for 1.2 only)
    "lora_config.lora_dir": frozenset(("1.2",)),
    "lora_config.lora_ckpt_source": frozenset(("1.2",)),
    "lora_config.max_lora_rank": frozenset(("1.2",)),
    "lora_config.max_loras": frozenset(("1.2",)),
    "lora_config.max_cpu_loras": frozenset(("1.2",)),
    "lora_config.lora_target_modules": frozenset(("1.2",)),
    # speculative decoding (trtpipe/recipe/speculative.py says where each name was read)
    "speculative_config.decoding_type": _ALL,
    "speculative_config.max_draft_len": _ALL,
    "speculative_config.speculative_model": _SINCE_12,
    "speculative_config.speculative_model_dir": frozenset(("1.0", "1.1")),
    "speculative_config.max_matching_ngram_size": _ALL,
    "speculative_config.eagle3_one_model": _ALL,
    "speculative_config.eagle_choices": _SINCE_12,  # Eagle3's static tree (trtpipe/recipe/eagle.py refuses 1.0/1.1)
    # Eagle3's dynamic tree (EagleDecodingConfig / DecodingBaseConfig; trtpipe/recipe/eagle.py writes it for 1.3)
    "speculative_config.use_dynamic_tree": frozenset(("1.3",)),
    "speculative_config.dynamic_tree_max_topK": frozenset(("1.3",)),
    "speculative_config.max_total_draft_tokens": frozenset(("1.3",)),
    "speculative_config.num_nextn_predict_layers": _ALL,
    **KEYS_13,
}

# trtllm-serve flags per release (1.2 adds long aliases and --config for the YAML; the short ones still work)
SERVE_FLAGS: dict[str, dict[str, str]] = {
    "1.0": {
        "tp": "--tp_size",
        "pp": "--pp_size",
        "ep": "--ep_size",
        "kv_fraction": "--kv_cache_free_gpu_memory_fraction",
        "yaml": "--extra_llm_api_options",
    },
    "1.1": {
        "tp": "--tp_size",
        "pp": "--pp_size",
        "ep": "--ep_size",
        "kv_fraction": "--kv_cache_free_gpu_memory_fraction",
        "yaml": "--extra_llm_api_options",
    },
    "1.2": {
        "tp": "--tensor_parallel_size",
        "pp": "--pipeline_parallel_size",
        "ep": "--moe_expert_parallel_size",
        "kv_fraction": "--free_gpu_memory_fraction",
        "yaml": "--config",
    },
}
SERVE_FLAGS["1.3"] = SERVE_FLAGS["1.2"]  # trtllm-serve <model> --config (deployment-guide-for-deepseek-r1@7c22bbf9)

YAML_NAME = "extra_llm_api_options.yaml"
_PLACEHOLDER = "@EXTRA_LLM_API_OPTIONS@"
_HERE = 'HERE="$(cd "$(dirname "$0")" && pwd)"\n'


class UnknownLLMAPIKey(TrtpipeError):
    """A key that the target TensorRT-LLM release does not accept was about to be written."""


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and f"{prefix}{k}" not in LEAF_MAPPINGS:  # {} is checked as a key
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def checked(options: dict, version: str) -> dict:
    """``options`` unchanged if every (dotted) key is accepted by ``version``; else :class:`UnknownLLMAPIKey`."""
    if version not in VERSIONS:
        raise UnknownLLMAPIKey(
            f"llmapi.version: no key table for TensorRT-LLM {version} (known: {', '.join(VERSIONS)})"
        )
    for key in _flatten(options):
        releases = LLM_API_KEYS.get(key, frozenset())
        if releases and version not in releases:
            raise UnknownLLMAPIKey(
                f"extra_llm_api_options: '{key}' is a TorchLlmArgs key of TensorRT-LLM "
                f"{', '.join(v for v in VERSIONS if v in releases)}, not of {version} (set llmapi.version)"
            )
        if version not in releases:
            raise UnknownLLMAPIKey(
                f"extra_llm_api_options: '{key}' is not a TorchLlmArgs key of TensorRT-LLM "
                f"{version} (the server would refuse the file)"
            )
    return options


def _set(d: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[last] = value


# keys trtpipe owns in an imported llmapi.options (set from the recipe where the imported file has them)
OWNED_KEYS: dict[str, Any] = {
    "tensor_parallel_size": lambda r: r.parallel.tp,
    "moe_expert_parallel_size": lambda r: r.parallel.moe_ep,
    "max_batch_size": lambda r: r.engine.max_batch_size,
    "max_num_tokens": lambda r: r.engine.max_num_tokens,
    "max_seq_len": lambda r: r.engine.max_seq_len,
    "kv_cache_config.free_gpu_memory_fraction": lambda r: r.engine.kv_cache.free_gpu_memory_fraction,
}


def imported_options(recipe: Recipe, version: str) -> dict:
    """``llmapi.options`` as written: the same keys in the same order, the :data:`OWNED_KEYS` among them set from
    the recipe (equal to what was imported unless the recipe changed them)."""
    import copy

    out = copy.deepcopy(recipe.llmapi.options)
    for dotted, get in OWNED_KEYS.items():
        *parents, last = dotted.split(".")
        d = out
        for p in parents:
            d = d.get(p) if isinstance(d, dict) else None
        value = get(recipe)
        if isinstance(d, dict) and last in d and value is not None and value != -1:
            d[last] = value
    return checked(out, version)


def llm_api_options(
    recipe: Recipe,
    version: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    lora_dir: Optional[str | Path] = None,
) -> dict:
    """The ``extra_llm_api_options`` dict for ``version`` (default: the recipe's ``llmapi.version``); with
    ``lora_dir`` (where the serving host finds the adapters :func:`trtpipe.export.lora.copy_adapters` copied) its
    ``lora_config`` (target modules read from the recipe's adapters)."""
    version = version or recipe.llmapi.version
    if recipe.llmapi.options:
        return imported_options(recipe, version)
    e, kv, p, q = recipe.engine, recipe.engine.kv_cache, recipe.parallel, recipe.quantization
    want: dict[str, Any] = {
        "max_batch_size": e.max_batch_size,
        "max_num_tokens": e.max_num_tokens,
        "max_seq_len": max_seq_len or e.max_seq_len,
        "max_beam_width": e.max_beam_width,
        "tensor_parallel_size": p.tp,
        "pipeline_parallel_size": p.pp,
        "kv_cache_config.free_gpu_memory_fraction": kv.free_gpu_memory_fraction,
        "kv_cache_config.enable_block_reuse": kv.enable_reuse,
        "kv_cache_config.max_tokens": kv.max_tokens,
        "kv_cache_config.host_cache_size": kv.host_memory_bytes or None,
        "kv_cache_config.dtype": "fp8" if q.kv_cache == "fp8" else None,  # the checkpoint says so too
        "kv_cache_config.tokens_per_block": kv.tokens_per_block,
        "scheduler_config.capacity_scheduler_policy": recipe.triton.scheduler_policy.upper(),
        "cuda_graph_config.max_batch_size": e.max_batch_size,
        "cuda_graph_config.enable_padding": True,
        "enable_iter_perf_stats": True,  # /metrics returns per-iteration stats only with it
        "return_perf_metrics": True,  # mounts /prometheus/metrics
        "guided_decoding_backend": recipe.serving.guided_decoding_backend,  # response_format needs a backend
    }
    if p.moe_ep > 0:
        want["moe_expert_parallel_size"] = p.moe_ep
    if p.attention_dp:
        want["enable_attention_dp"] = True
    if lora_dir is not None and recipe.lora.adapters:
        from trtpipe.export.lora import lora_options, target_modules

        served = [f"{lora_dir}/{name}" for name in recipe.lora.adapters]  # as the serving host sees them
        want.update(lora_options(recipe, served, target_modules(recipe)))
    want.update(speculative_config(recipe, version))
    out: dict = {}
    for key, value in want.items():
        if value is None:
            continue
        if version not in LLM_API_KEYS[key]:  # written only where the release is known to take it
            continue
        _set(out, key, value)
    return checked(out, version)


def options_yaml(options: dict, version: str) -> str:
    head = (
        f"# extra_llm_api_options for TensorRT-LLM {version} (trtllm-serve {SERVE_FLAGS[version]['yaml']}, "
        f"Triton llmapi model.yaml, Dynamo --extra-engine-args).\n# Generated by trtpipe from a per-release key "
        f"table: every key here is a TorchLlmArgs field of {version}.\n"
    )
    return head + yaml.safe_dump(checked(options, version), sort_keys=False)


def served_parsers(recipe: Recipe) -> dict[str, Optional[Parser]]:
    """The tool and reasoning parsers a deployment of ``recipe`` runs (``serving.*_parser``, else the model
    family's default: :mod:`trtpipe.models.parsers`), by recipe key."""
    from trtpipe.recipe.rules import load_model_info

    info, _ = load_model_info(recipe)
    model_type, vocab = (info.model_type, info.vocab_size) if info is not None else ("", 0)
    name = recipe.model.source.rstrip("/").rsplit("/", 1)[-1]
    return {k: resolve_parser(k, getattr(recipe.serving, k), model_type, name, vocab) for k in TABLES}


def parser_flags(recipe: Recipe) -> list[str]:
    """``--tool_parser`` / ``--reasoning_parser`` of trtllm-serve, for the parsers its release has."""
    flags = []
    for kind, parser in served_parsers(recipe).items():
        if parser is not None and parser.trtllm is not None:
            flags += [f"--{kind}", parser.trtllm]
    return flags


def serve_command(
    recipe: Recipe, model_dir: str, yaml_path: str, version: Optional[str] = None, host: Optional[str] = None
) -> list[str]:
    """``trtllm-serve <model_dir> ...`` (the LLM API starts its own workers for tp*pp GPUs on one node)."""
    version = version or recipe.llmapi.version
    f, e, p = SERVE_FLAGS[version], recipe.engine, recipe.parallel
    cmd = [
        "trtllm-serve",
        model_dir,
        "--backend",
        "pytorch",
        "--host",
        host or recipe.llmapi.host,
        "--port",
        str(recipe.llmapi.port),
        f["tp"],
        str(p.tp),
        f["pp"],
        str(p.pp),
    ]
    if p.moe_ep > 0:
        cmd += [f["ep"], str(p.moe_ep)]
    cmd += ["--max_batch_size", str(e.max_batch_size), "--max_num_tokens", str(e.max_num_tokens)]
    if e.max_seq_len:
        cmd += ["--max_seq_len", str(e.max_seq_len)]
    cmd += [f["kv_fraction"], str(e.kv_cache.free_gpu_memory_fraction), f["yaml"], yaml_path]
    if version == TRTLLM_RELEASE:  # the release whose parser names trtpipe read
        cmd += parser_flags(recipe)
    return cmd


def launch_lines(recipe: Recipe, model_dir: str, yaml_path: str) -> dict[str, str]:
    """Shell lines: one node (``trtllm-serve`` alone), Slurm (``srun`` + ``trtllm-llmapi-launch``, one rank per
    GPU, MPI world = tp*pp), and ``mpirun`` over a host list (same wrapper)."""
    world, nodes = recipe.parallel.world_size, recipe.llmapi.nodes
    per_node = -(-world // nodes)
    inner = shlex.join(serve_command(recipe, model_dir, yaml_path, host="0.0.0.0"))
    single = shlex.join(serve_command(recipe, model_dir, yaml_path))
    return {
        "single_node": single,
        "slurm": f"srun --mpi=pmix -N {nodes} --ntasks-per-node={per_node} trtllm-llmapi-launch {inner}",
        "mpirun": (
            f'mpirun -np {world} --hostfile "${{HOSTFILE:?one line per node: host slots={per_node}}}" '
            f"--bind-to none trtllm-llmapi-launch {inner}"
        ),
    }


def model_yaml(
    recipe: Recipe, model_dir: str, version: Optional[str] = None, lora_dir: Optional[str | Path] = None
) -> dict:
    """``1/model.yaml``: ``LLM()`` kwargs (the same TorchLlmArgs keys) plus ``triton_config``."""
    version = version or recipe.llmapi.version
    opts = llm_api_options(recipe, version, lora_dir=lora_dir)
    out = {"model": model_dir, "backend": "pytorch"}
    out.update(opts)
    out["triton_config"] = {
        "max_batch_size": 0,  # the llmapi model does not batch in Triton; TRT-LLM does
        "decoupled": recipe.triton.streaming,
    }
    return out


def write_serving(recipe: Recipe, hf_dir: Path, out: Path, model_ref: Optional[str] = None) -> dict:
    """Write the trtllm-serve artifacts into ``out`` (the Triton ``llmapi`` repository beside them is
    :func:`trtpipe.triton.llmapi_repo.write_llmapi_repo`); ``model_ref`` is the model path as the serving host sees
    it (default: ``hf_dir``, absolute)."""
    version = recipe.llmapi.version
    model_ref = model_ref or str(Path(hf_dir).resolve())
    lora_dir = None
    if recipe.lora.adapters:  # the adapters beside the export, named by lora_config.lora_dir
        from trtpipe.export.lora import ADAPTERS_DIR, copy_adapters

        copy_adapters(recipe, out)
        lora_dir = (out / ADAPTERS_DIR).resolve()
    opts = llm_api_options(recipe, version, lora_dir=lora_dir)
    (out / YAML_NAME).write_text(options_yaml(opts, version))
    here = '"$HERE/' + YAML_NAME + '"'  # the scripts find the YAML beside themselves
    lines = {k: v.replace(_PLACEHOLDER, here) for k, v in launch_lines(recipe, model_ref, _PLACEHOLDER).items()}
    (out / "serve.sh").write_text(
        "#!/usr/bin/env bash\n# One node, tp*pp GPUs: trtllm-serve starts its own workers.\nset -euo pipefail\n"
        f"{_HERE}exec {lines['single_node']}\n"
    )
    (out / "launch-slurm.sh").write_text(
        "#!/usr/bin/env bash\n# Multi-node under Slurm: one MPI rank per GPU; trtllm-llmapi-launch makes rank 0 the "
        "server and\n# the others workers (needs openssl and python3 on every node; a local model path on each).\n"
        f"set -euo pipefail\n{_HERE}{lines['slurm']}\n"
    )
    (out / "launch-mpirun.sh").write_text(
        "#!/usr/bin/env bash\n# Multi-node with mpirun: HOSTFILE lists the nodes; one rank per GPU.\n"
        f"set -euo pipefail\n{_HERE}{lines['mpirun']}\n"
    )
    for name in ("serve.sh", "launch-slurm.sh", "launch-mpirun.sh"):
        (out / name).chmod(0o755)
    return {"version": version, "serve": lines["single_node"], "yaml": opts, "lora_dir": lora_dir and str(lora_dir)}
