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

VERSIONS = ("1.0", "1.1", "1.2")
_ALL = frozenset(VERSIONS)
_SINCE_11 = frozenset(("1.1", "1.2"))

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
    "speculative_config.speculative_model": frozenset(("1.2",)),
    "speculative_config.speculative_model_dir": frozenset(("1.0", "1.1")),
    "speculative_config.max_matching_ngram_size": _ALL,
    "speculative_config.eagle3_one_model": _ALL,
    "speculative_config.num_nextn_predict_layers": _ALL,
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

YAML_NAME = "extra_llm_api_options.yaml"
_PLACEHOLDER = "@EXTRA_LLM_API_OPTIONS@"
_HERE = 'HERE="$(cd "$(dirname "$0")" && pwd)"\n'


class UnknownLLMAPIKey(TrtpipeError):
    """A key that the target TensorRT-LLM release does not accept was about to be written."""


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
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
        if version not in LLM_API_KEYS.get(key, frozenset()):
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
