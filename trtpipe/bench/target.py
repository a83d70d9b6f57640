"""What a benchmark talks to and what it is allowed to ask, derived from the recipe (or a served repository).

A :class:`Target` holds the HTTP endpoint AIPerf posts to, the tokenizer it counts tokens with, the
engine's length limits, and which optional inputs the front model declares (``end_id``, ``min_tokens``,
``return_perf_metrics``, ``return_num_output_tokens``). The request body is a Jinja template AIPerf fills:
``text_input`` + ``max_tokens`` (+ ``stream``), plus ``end_id: -1`` so every request produces exactly the
requested number of tokens (TensorRT-LLM stops only at max_tokens when no end id can match; ``min_tokens``
is used instead where the model declares it).

Provenance (:func:`provenance`) is what makes two result files comparable: the recipe's quantization, KV
dtype, tp/pp, batch/token limits, hashes of the engine config and every config.pbtxt, and tool versions.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from trtpipe.bench.metrics import BenchError
from trtpipe.formats.schemes import BY_RECIPE
from trtpipe.jsonfile import load_json

BLS = "tensorrt_llm_bls"


@dataclass
class Target:
    http_url: str  # http://host:port
    model: str  # the front model requests go to
    streaming: bool  # the front model is decoupled: /generate_stream, TTFT and ITL are measurable
    tokenizer: str  # directory AIPerf loads the tokenizer from
    metrics_url: Optional[str] = None  # http://host:port/metrics (tritonserver's metrics port)
    max_input_len: Optional[int] = None
    max_seq_len: Optional[int] = None
    inputs: list[str] = field(default_factory=list)  # the front model's declared inputs
    repo: Optional[str] = None
    recipe: Optional[str] = None

    @property
    def endpoint(self) -> str:
        return f"/v2/models/{self.model}/generate_stream" if self.streaming else f"/v2/models/{self.model}/generate"

    def body_template(self, fixed_output: bool = True) -> dict:
        """The request body's fields beyond text_input/max_tokens (JSON values; AIPerf fills the rest)."""
        extra: dict = {}
        if self.streaming:
            extra["stream"] = True
        if fixed_output:
            if "min_tokens" in self.inputs:
                extra["min_tokens"] = "__MAX_TOKENS__"
            elif "end_id" in self.inputs:
                extra["end_id"] = -1
        for flag in ("return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens"):
            if flag in self.inputs:
                extra[flag] = True
        return extra

    def template_text(self, osl: int, fixed_output: bool = True) -> str:
        """The Jinja payload template AIPerf's ``template`` endpoint renders per request."""
        parts = ['"text_input": {{ text|tojson }}', f'"max_tokens": {{{{ max_tokens or {int(osl)} }}}}']
        for k, v in self.body_template(fixed_output).items():
            value = f"{{{{ max_tokens or {int(osl)} }}}}" if v == "__MAX_TOKENS__" else json.dumps(v)
            parts.append(f'"{k}": {value}')
        return "{" + ", ".join(parts) + "}\n"

    def check_lengths(self, isl: int, osl: int, isl_stddev: int = 0, osl_stddev: int = 0) -> None:
        """Refuse a workload the engine would reject or silently shorten (mean + 3 stddev must fit)."""
        top_in, top_out = isl + 3 * isl_stddev, osl + 3 * osl_stddev
        if isl < 1 or osl < 1:
            raise BenchError(f"--isl and --osl must be at least 1 (got {isl}, {osl})")
        if self.max_input_len is not None and top_in > self.max_input_len:
            raise BenchError(
                f"--isl {isl} (+3 stddev = {top_in}) exceeds the engine's max_input_len {self.max_input_len}"
            )
        if self.max_seq_len is not None and top_in + top_out > self.max_seq_len:
            raise BenchError(
                f"--isl + --osl = {top_in + top_out} (with 3 stddev) exceeds the engine's max_seq_len "
                f"{self.max_seq_len}"
            )

    def to_json(self) -> dict:
        return asdict(self)


def _get_json(url: str, timeout: float = 10.0) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise BenchError(f"{url}: cannot read ({exc})") from None


def model_inputs(http_url: str, model: str) -> tuple[list[str], bool]:
    """The model's declared input names and whether it is decoupled (HTTP model config)."""
    cfg = _get_json(f"{http_url}/v2/models/{model}/config")
    decoupled = bool(cfg.get("model_transaction_policy", {}).get("decoupled", False))
    if cfg.get("platform") == "ensemble":
        steps = cfg.get("ensemble_scheduling", {}).get("step", [])
        for s in steps:
            if s.get("model_name") == "tensorrt_llm":
                decoupled = model_inputs(http_url, "tensorrt_llm")[1]
    return [i["name"] for i in cfg.get("input", [])], decoupled


def ready_models(http_url: str) -> list[str]:
    req = urllib.request.Request(f"{http_url}/v2/repository/index", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            index = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise BenchError(f"{http_url}: cannot reach the server ({exc})") from None
    return [m["name"] for m in index if m.get("state") == "READY"]


def resolve_target(
    http_url: str,
    tokenizer: Optional[str],
    model: Optional[str] = None,
    metrics_url: Optional[str] = None,
    repo: Optional[Path] = None,
    recipe: Optional[str] = None,
) -> Target:
    """Probe the server: the front model (BLS for streams when served, else the ensemble), decoupled or not,
    which optional inputs it declares; limits and tokenizer from the repository when there is one."""
    http_url = http_url.rstrip("/")
    if not http_url.startswith("http"):
        http_url = "http://" + http_url
    names = ready_models(http_url)
    if model is None:
        if BLS in names and model_inputs(http_url, BLS)[1]:
            model = BLS
        else:
            front = [n for n in names if n not in ("preprocessing", "postprocessing", "tensorrt_llm", BLS)]
            if not front:
                raise BenchError(
                    f"{http_url}: no front model (ensemble or {BLS}) is ready (models: {', '.join(names)})"
                )
            model = front[0]
    elif model not in names:
        raise BenchError(f"{http_url}: model {model} is not ready (models: {', '.join(names) or 'none'})")
    inputs, decoupled = model_inputs(http_url, model)
    if "text_input" not in inputs:
        raise BenchError(f"{model}: has no text_input (bench drives the ensemble or {BLS}, not token-id models)")
    max_in = max_seq = None
    if repo is not None:
        info = load_json(Path(repo) / "trtpipe_repo.json", BenchError)
        max_in, max_seq = info.get("max_input_len"), info.get("max_seq_len")
        tokenizer = tokenizer or str(Path(repo) / "preprocessing" / "tokenizer")
    if tokenizer is None:
        raise BenchError("--tokenizer DIR is needed with --url (the model's tokenizer, to count tokens)")
    return Target(
        http_url,
        model,
        decoupled,
        str(tokenizer),
        metrics_url,
        max_in,
        max_seq,
        inputs,
        str(repo) if repo else None,
        recipe,
    )


# --- provenance ------------------------------------------------------------------------------------


def _sha(path: Path) -> Optional[str]:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def recipe_facts(recipe) -> dict:
    """The recipe settings that change performance numbers."""
    q, e, t = recipe.quantization, recipe.engine, recipe.triton
    return {
        "name": recipe.name,
        "path": str(recipe.path) if recipe.path else None,
        "model_source": recipe.model.source,
        "dtype": recipe.model.dtype,
        "quantization": q.algo,
        "kv_cache_dtype": q.kv_cache,
        "group_size": q.group_size if q.algo in BY_RECIPE and BY_RECIPE[q.algo].groupwise else None,
        "tp": recipe.parallel.tp,
        "pp": recipe.parallel.pp,
        "max_batch_size": e.max_batch_size,
        "max_input_len": e.max_input_len,
        "max_seq_len": e.max_seq_len,
        "max_num_tokens": e.max_num_tokens,
        "max_beam_width": e.max_beam_width,
        "gpu": e.gpu,
        "kv_free_gpu_memory_fraction": e.kv_cache.free_gpu_memory_fraction,
        "kv_tokens_per_block": e.kv_cache.tokens_per_block,
        "kv_enable_reuse": e.kv_cache.enable_reuse,
        "plugins_preset": e.plugins.preset,
        "plugins_overrides": dict(e.plugins.overrides),
        "triton": {
            "streaming": t.streaming,
            "batching_strategy": t.batching_strategy,
            "scheduler_policy": t.scheduler_policy,
            "max_batch_size": t.max_batch_size,
            "instances": t.instances.model_dump(),
            "max_queue_delay_microseconds": t.max_queue_delay_microseconds,
        },
    }


def repo_facts(repo: Path) -> dict:
    """The repository's engine (twin or TensorRT), its config hash, and every config.pbtxt hash."""
    repo = Path(repo)
    info = load_json(repo / "trtpipe_repo.json", BenchError)
    engine_cfg = repo / "tensorrt_llm" / "engine" / "config.json"
    if not engine_cfg.exists():
        engine_cfg = Path(info.get("engine", "")) / "config.json"
    return {
        "path": str(repo),
        "engine": "cpu-twin" if info.get("twin") else "tensorrt",
        "engine_version": info.get("engine_version"),
        "world_size": info.get("world_size"),
        "engine_config_sha256": _sha(engine_cfg),
        "config_pbtxt_sha256": {p.parent.name: _sha(p) for p in sorted(repo.glob("*/config.pbtxt"))},
    }


def server_facts(http_url: str) -> dict:
    try:
        meta = _get_json(f"{http_url}/v2", timeout=5)
    except BenchError:
        return {}
    return {"name": meta.get("name"), "version": meta.get("version")}


def provenance(target: Target, recipe=None, aiperf_version: Optional[str] = None) -> dict:
    from trtpipe.pipeline.versions import PACKAGES, package_version
    import platform

    from trtpipe import __version__

    versions = {"trtpipe": __version__, "python": platform.python_version(), "aiperf": aiperf_version}
    versions.update(
        {
            k: package_version(*PACKAGES[k])
            for k in ("torch", "transformers", "tritonclient", "nvidia_pytriton", "tensorrt_llm")
        }
    )
    return {
        "recipe": recipe_facts(recipe) if recipe is not None else None,
        "repo": repo_facts(Path(target.repo)) if target.repo else None,
        "server": server_facts(target.http_url),
        "versions": versions,
        "host": platform.node(),
    }
