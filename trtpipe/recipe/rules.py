"""Cross-field rules, checked at validation time so a bad layout fails in a second, not after a long build.

A rule is a function ``(recipe, model) -> iterable of (dotted.key, message)``; ``model`` is the model's
:class:`ModelDims` (or None when the model directory cannot be read, which is itself reported).
Each package keeps the rules about its own facts (:data:`RECIPE_RULES` here, ``QUANT_RULES`` in
``trtpipe/quant/rules.py``, ``ENGINE_RULES`` in ``trtpipe/engine/rules.py``, ``EXPORT_RULES`` in
``trtpipe/export/rules.py``); :data:`trtpipe.app.validation.RULES` is the one list of all of them, and
:func:`check_recipe` runs the list it is given. Nothing here imports those packages (they import the schema).
The rules here are the layout facts of the TRT-LLM checkpoint (docs/reference/trtllm-checkpoint.md#mapping and
#weight-names-and-per-rank-shapes-llama-unquantized: what shards) and the recipe's own consistency (lengths,
ports, data files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Optional

from trtpipe.errors import CheckpointError, Problem, TrtpipeError
from trtpipe.formats.schemes import needs_calibration_data
from trtpipe.models import get_family
from trtpipe.models.dims import ModelDims, read_hf_config
from trtpipe.models.parsers import problem as parser_problem
from trtpipe.models.trtllm_config import deduce_max_seq_len, resolve_moe_sizes
from trtpipe.recipe.schema import Recipe

Finding = tuple[str, str]
Rule = Callable[[Recipe, Optional[ModelDims]], Iterable[Finding]]

DATA_SUFFIXES = (".txt", ".jsonl", ".json")


def model_dir(recipe: Recipe) -> Path:
    """The local model directory a recipe names (``hf://`` sources resolve through the hub cache)."""
    src = recipe.model.source
    if src.startswith("hf://"):
        from trtpipe.models.hub import resolve_hf

        return resolve_hf(src)
    return recipe.resolve(src)


def _hf_config_dir(uri: str) -> Path:
    """Fetch only ``config.json`` of a hub model (validation must not download weights).

    The local cache comes first, so validating an already downloaded model works offline and fast.
    """
    import logging

    from trtpipe.models.hub import parse_hf_uri

    repo, revision = parse_hf_uri(uri)
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:  # pragma: no cover - huggingface_hub ships with transformers
        raise CheckpointError("hf:// sources need huggingface_hub (pip install huggingface_hub)") from None
    try:
        return Path(hf_hub_download(repo, "config.json", revision=revision, local_files_only=True)).parent
    except Exception:  # not cached (the hub raises several types for that): ask the hub
        pass
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # its retry chatter would break the one-line-per-problem output
    try:
        return Path(hf_hub_download(repo, "config.json", revision=revision)).parent
    except Exception as exc:  # offline, 401, 404, ... all mean "cannot read the model config"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot fetch config.json of {uri}: {first}") from None
    finally:
        hub_log.setLevel(level)


def _strip_key(message: str) -> str:
    return message[len("model.source: ") :] if message.startswith("model.source: ") else message


def load_model_info(recipe: Recipe) -> tuple[Optional[ModelDims], list[Finding]]:
    """The model's config facts, or None and the finding that says why they cannot be read."""
    src = recipe.model.source
    try:
        path = _hf_config_dir(src) if src.startswith("hf://") else recipe.resolve(src)
        if not path.is_dir():
            what = "is a file, not a model directory" if path.exists() else "model directory not found"
            return None, [("model.source", f"{what}: {path}")]
        info = read_hf_config(path)
    except CheckpointError as exc:
        return None, [("model.source", _strip_key(str(exc)))]
    except (OSError, ValueError, TypeError, AttributeError, ZeroDivisionError) as exc:
        # A config.json that is JSON but not a model config (a list, strings for sizes, zero heads, ...).
        return None, [("model.source", f"config.json is not a usable Hugging Face config: {exc}")]
    sizes = {
        "num_attention_heads": info.num_heads,
        "num_key_value_heads": info.num_kv_heads,
        "num_hidden_layers": info.num_layers,
        "intermediate_size": info.intermediate_size,
        "hidden_size": info.hidden_size,
    }
    bad = [f"{k}={v}" for k, v in sizes.items() if v < 1]
    if bad:
        return None, [("model.source", f"config.json has non-positive sizes: {', '.join(bad)}")]
    return info, []


def deduced_max_seq_len(m: ModelDims) -> int:
    """trtllm-build's default max_seq_len for this model (the engine stage's own deduction, one function)."""
    return deduce_max_seq_len(m.max_position_embeddings, m.rope_scaling)


def _written(recipe: Recipe, *keys: str) -> str:
    """The first of ``keys`` the recipe sets (errors point at what the user wrote, not at a default)."""
    return next((k for k in keys if recipe.written(k)), keys[0])


def _model_family(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    """The architecture has a family, and its config asks for nothing that family cannot honour (before weights)."""
    if m is None:
        return
    try:
        family = get_family(m.architecture)
    except CheckpointError as exc:
        yield "model.source", str(exc)
        return
    for key, why in family.unsupported(m):
        yield "model.source", f"config.json: {key} {why}"
    if family.no_engine and recipe.target == "engine":
        yield "target", f"engine: {family.no_engine}; use target: llmapi"
    q = recipe.quantization
    if family.no_recipe_quantization and (q.algo != "none" or q.kv_cache != "none"):
        key = "quantization.algo" if q.algo != "none" else "quantization.kv_cache"
        value = q.algo if q.algo != "none" else q.kv_cache
        yield key, f"{value} is not supported for {m.architecture}: {family.no_recipe_quantization}; allowed: none"


def _parallel_layout(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    p = recipe.parallel
    if p.world_size > 64:
        yield "parallel", f"tp*pp = {p.world_size} ranks; at most 64 are supported"
    if p.attention_dp:
        yield from _attention_dp(recipe, m)
    if m is None:
        return
    if not p.attention_dp:  # attention DP splits no heads: only the experts
        yield from _heads_split(m, p.tp)
    if m.num_layers < p.pp:
        yield "parallel.pp", f"pp={p.pp} exceeds the model's {m.num_layers} layers"
    if not m.is_moe:
        if m.intermediate_size % p.tp:
            yield "parallel.tp", f"the model's intermediate_size {m.intermediate_size} does not divide by tp={p.tp}"
        if p.moe_ep != -1 or p.moe_tp != -1:
            key = "parallel.moe_ep" if p.moe_ep != -1 else "parallel.moe_tp"
            yield key, f"moe_ep/moe_tp apply only to mixture-of-experts models ({m.architecture} has no experts)"
        return
    ep, mtp = resolve_moe_sizes(p.tp, p.moe_ep, p.moe_tp)
    key = "parallel.moe_ep" if p.moe_ep != -1 else ("parallel.moe_tp" if p.moe_tp != -1 else "parallel.tp")
    if ep * mtp != p.tp:
        yield key, f"moe_ep ({ep}) x moe_tp ({mtp}) must equal tp ({p.tp})"
    elif m.num_experts % ep:
        yield key, f"the model's {m.num_experts} experts do not divide by moe_ep={ep}"
    elif m.expert_intermediate_size % mtp:
        yield key, f"the experts' intermediate size {m.expert_intermediate_size} does not divide by moe_tp={mtp}"


def _heads_split(m: ModelDims, tp: int) -> Iterable[Finding]:
    if m.num_heads % tp:
        yield "parallel.tp", f"the model's {m.num_heads} attention heads do not divide by tp={tp}"
    if m.num_kv_heads >= tp and m.num_kv_heads % tp:
        yield "parallel.tp", f"the model's {m.num_kv_heads} KV heads do not divide by tp={tp}"
    if m.num_kv_heads < tp and tp % m.num_kv_heads:
        yield (
            "parallel.tp",
            f"tp={tp} is not a multiple of the model's {m.num_kv_heads} KV heads (KV heads are replicated tp/kv times)",
        )


def _attention_dp(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    """``parallel.attention_dp``: TensorRT-LLM's ``enable_attention_dp``, a PyTorch-backend mapping
    (NVIDIA/TensorRT-LLM@05ebebb2 ``tensorrt_llm/mapping.py``: the MoE sizes must still multiply to tp_size) whose
    ranks meet only in the MoE layers (@000561df ``_torch/models/modeling_deepseekv3.py``)."""
    p = recipe.parallel
    if recipe.target == "engine":
        yield (
            "parallel.attention_dp",
            "is written only into the PyTorch backend's extra_llm_api_options (enable_attention_dp); "
            "use target: llmapi",
        )
    if p.tp < 2:
        yield "parallel.attention_dp", f"needs tp > 1 (the attention-DP ranks are the tp GPUs); tp is {p.tp}"
    if m is not None and not m.is_moe:
        yield (
            "parallel.attention_dp",
            f"{m.architecture} has no experts: its attention-DP ranks would share nothing (tp whole copies of the "
            "model); serve replicas instead",
        )


def _engine_limits(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    e = recipe.engine
    if e.max_seq_len is not None and e.max_input_len > e.max_seq_len:
        key = _written(recipe, "engine.max_input_len", "engine.max_seq_len")
        yield key, f"engine.max_input_len {e.max_input_len} exceeds engine.max_seq_len {e.max_seq_len}"
    if e.max_seq_len is not None and m is not None and e.max_seq_len > deduced_max_seq_len(m):
        yield (
            "engine.max_seq_len",
            f"{e.max_seq_len} exceeds the model's context of {deduced_max_seq_len(m)} tokens (config.json "
            "max_position_embeddings, times a rope_scaling factor if any): positions past it were never trained; "
            "lower engine.max_seq_len, or use a checkpoint whose rope_scaling extends its context",
        )
    elif e.max_seq_len is None and m is not None and recipe.written("engine.max_input_len"):
        limit = deduced_max_seq_len(m)
        if e.max_input_len > limit:
            yield (
                "engine.max_input_len",
                (
                    f"{e.max_input_len} exceeds the max_seq_len {limit} deduced from the model (trtllm-build would clip it); "
                    "set engine.max_seq_len or lower max_input_len"
                ),
            )
    if e.workers > recipe.parallel.world_size:
        yield (
            "engine.workers",
            (
                f"{e.workers} workers for {recipe.parallel.world_size} engine(s) (tp*pp); trtllm-build caps workers at that"
            ),
        )
    if recipe.triton.max_batch_size > e.max_batch_size and recipe.target == "engine":  # llmapi: Triton does not batch
        key = _written(recipe, "triton.max_batch_size", "engine.max_batch_size")
        yield (
            key,
            f"triton.max_batch_size {recipe.triton.max_batch_size} exceeds engine.max_batch_size {e.max_batch_size}",
        )
    if e.kv_cache.enable_reuse and recipe.quantization.kv_cache == "int8":
        # INT8 KV turns paged context FMHA off, and the runtime then drops reuse silently
        # (docs/reference/trtllm-build.md#builder-enforced-combinations, #kv-cache-memory).
        if recipe.written("engine.kv_cache.enable_reuse"):
            yield (
                "engine.kv_cache.enable_reuse",
                (
                    "KV reuse needs paged context FMHA, which INT8 KV cache disables; use kv_cache: fp8 or enable_reuse: false"
                ),
            )
        else:
            yield (
                "quantization.kv_cache",
                (
                    "int8 KV cache disables paged context FMHA and with it KV reuse (engine.kv_cache.enable_reuse "
                    "defaults to true); use kv_cache: fp8 or set engine.kv_cache.enable_reuse: false"
                ),
            )


def _triton_ports(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    t = recipe.triton
    seen: dict[int, str] = {}
    for name in ("http_port", "grpc_port", "metrics_port"):
        port = getattr(t, name)
        if port is None:
            continue
        if port in seen:
            yield f"triton.{name}", f"port {port} is already triton.{seen[port]}"
        seen.setdefault(port, name)


def _exists(path: Path) -> Optional[bool]:
    """Path.exists that says None (cannot tell) instead of raising on odd names."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return None


def _data_findings(recipe: Recipe, key: str, value: str) -> Iterable[Finding]:
    if value == "self":
        return
    path = recipe.resolve(value)
    exists = _exists(path)
    if exists is None:
        yield key, f"cannot check path {value!r}"
    elif not exists:
        yield key, f"not found: {path} (or use 'self')"
    elif path.is_file() and path.suffix.lower() not in DATA_SUFFIXES:
        yield key, f"{path.name}: must be a .txt, .jsonl or .json file, a directory, or 'self'"


def _data_files(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    q = recipe.quantization
    if needs_calibration_data(q.algo, q.kv_cache):  # the scheme table's column, as the quantize stage reads it
        yield from _data_findings(recipe, "quantization.calibration.dataset", q.calibration.dataset)
    if recipe.accuracy.enabled:
        yield from _data_findings(recipe, "accuracy.eval_data", recipe.accuracy.eval_data)


def _parser_names(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    """serving.tool_parser / reasoning_parser name parsers the llmapi target's release has
    (trtpipe/models/parsers.py)."""
    for kind in ("tool_parser", "reasoning_parser"):
        why = parser_problem(kind, getattr(recipe.serving, kind), recipe.llmapi.version)
        if why:
            yield f"serving.{kind}", why


RECIPE_RULES: tuple[Rule, ...] = (
    _model_family,
    _parallel_layout,
    _engine_limits,
    _triton_ports,
    _data_files,
    _parser_names,
)


def check_recipe(recipe: Recipe, rules: Iterable[Rule]) -> list[Problem]:
    """Run ``rules`` (all of them: :data:`trtpipe.app.validation.RULES`); return every problem with the file position of
    the key it names, in file order."""
    model, findings = load_model_info(recipe)
    findings = list(findings)
    for fn in rules:
        try:
            findings.extend(fn(recipe, model))
        except TrtpipeError as exc:  # a rule that needs more than it has says so in its own error
            findings.append(("", str(exc)))
    keyed = {message for key, message in findings if key}
    problems = []
    for key, message in dict.fromkeys(findings):  # a rule's own error repeating a keyed finding says nothing new
        if not key and message in keyed:
            continue
        name, line, col = recipe.locate(key)
        problems.append(Problem(name, line, col, key, message))
    problems.sort(key=lambda p: (p.line, p.col))
    return problems
