"""``trtpipe recipe import``: a recipe from one of NVIDIA's per-model serving configs.

NVIDIA/TensorRT-LLM keeps one ``extra_llm_api_options`` YAML per model, GPU and load under
``examples/configs/database/<org>/<model>/<gpu>/<isl><osl>_tp<N>_conc<C>.yaml`` (e.g.
``deepseek-ai/DeepSeek-R1-0528/H200/1k1k_tp8_conc1.yaml``; the path is the only place the model, GPU and
sequence lengths are named). The import keeps the YAML's keys as they are in ``llmapi.options`` (written back out
by the llmapi stage: the same keys in the same order, :func:`trtpipe.export.serving.imported_options`), and copies
the values trtpipe plans with into ``parallel`` and ``engine`` (tp, expert parallel, batch, tokens, sequence length,
KV memory fraction, the GPU from the path). The key table of ``llmapi.version`` 1.3 decides what is accepted: a key
it does not hold is refused naming the file and the key, and nothing is written.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import yaml

from trtpipe.errors import TrtpipeError
from trtpipe.export.serving import UnknownLLMAPIKey, checked
from trtpipe.perf.published import GPU_LABELS

VERSION = "1.3"  # the release whose key table NVIDIA's database configs were read for (trtpipe/export/serving.py)
_NAME = re.compile(r"^(\d+)k(\d+)k_tp(\d+)_conc(\d+)\.yaml$")


class DatabaseImportError(TrtpipeError):
    """A database YAML that cannot become a recipe."""


def parse_path(path: Path) -> dict[str, Any]:
    """``<org>/<model>/<gpu>/<isl>k<osl>k_tp<N>_conc<C>.yaml`` -> its parts (isl/osl in tokens: 1k = 1024)."""
    parts = Path(path).parts
    m = _NAME.match(parts[-1]) if parts else None
    if m is None or len(parts) < 4:
        raise DatabaseImportError(
            f"{path}: not a database config path (<org>/<model>/<gpu>/<isl>k<osl>k_tp<N>_conc<C>.yaml, as under "
            "examples/configs/database/ of NVIDIA/TensorRT-LLM)"
        )
    isl, osl, tp, conc = (int(g) for g in m.groups())
    return {
        "org": None if parts[-4] == "database" else parts[-4],  # database/glm-4.7-fp8/H100/...: no organisation
        "model": parts[-3],
        "gpu": parts[-2],
        "isl": isl * 1024,
        "osl": osl * 1024,
        "tp": tp,
        "concurrency": conc,
        "stem": Path(parts[-1]).stem,
    }


def gpu_key(label: str) -> str:
    """The catalog key of a database GPU folder (H200, H200_SXM, B200, B200_NVL, GB200, ...)."""
    for prefix, key in GPU_LABELS:
        if label.upper().replace("_", " ").startswith(prefix):
            return key
    raise DatabaseImportError(
        f"GPU folder '{label}': no catalog GPU for it (known: {', '.join(p for p, _ in GPU_LABELS)})"
    )


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def recipe_data(path: Path, text: str, model: Optional[str] = None) -> dict[str, Any]:
    """The recipe (as a mapping, in file order) for the database YAML ``text`` found at ``path``; ``model`` is
    ``model.source`` (default: ``hf://<org>/<model>`` from the path)."""
    where = parse_path(path)
    if model is None and where["org"] is None:
        raise DatabaseImportError(
            f"{path}: the path names no organisation (database/<model>/<gpu>/...), so the model is unknown: "
            "give --model (hf://org/name or a local directory)"
        )
    try:
        options = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DatabaseImportError(f"{path}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(options, dict) or not options:
        raise DatabaseImportError(f"{path}: not a mapping of TorchLlmArgs keys")
    try:
        checked(options, VERSION)
    except UnknownLLMAPIKey as exc:
        raise DatabaseImportError(f"{path}: {exc}") from None
    kv = options.get("kv_cache_config") or {}
    name = _slug(f"{where['model']}-{where['gpu']}-{where['stem']}")
    engine: dict[str, Any] = {"gpu": gpu_key(where["gpu"]), "max_input_len": where["isl"]}
    for key in ("max_batch_size", "max_num_tokens", "max_seq_len"):
        if key in options:
            engine[key] = options[key]
    if "free_gpu_memory_fraction" in kv:
        engine["kv_cache"] = {"free_gpu_memory_fraction": kv["free_gpu_memory_fraction"]}
    parallel: dict[str, Any] = {"tp": options.get("tensor_parallel_size", where["tp"])}
    if "moe_expert_parallel_size" in options:
        parallel["moe_ep"] = options["moe_expert_parallel_size"]
    return {
        "name": name,
        "work_dir": f"work/{name}",
        "target": "llmapi",
        "model": {"source": model or f"hf://{where['org']}/{where['model']}"},
        "parallel": parallel,
        "engine": engine,
        "llmapi": {"version": VERSION, "options": options},
    }


def import_recipe(path: Path, source: Optional[str] = None, model: Optional[str] = None) -> str:
    """The recipe text for the database YAML at ``path`` (``source``: where it came from, e.g. its file@commit,
    written into the header; ``model``: ``model.source`` instead of the path's). Checked by loading it as a recipe;
    raises :class:`DatabaseImportError` in one line."""
    from trtpipe.recipe.schema import Recipe

    data = recipe_data(path, Path(path).read_text(), model)
    try:
        Recipe.model_validate(data)
    except Exception as exc:  # pydantic's error: its first line names the key
        raise DatabaseImportError(
            f"{path}: the imported recipe is invalid: {' '.join(str(exc).split())[:300]}"
        ) from None
    head = (
        f"# Imported by `trtpipe recipe import` from NVIDIA's serving config {source or path}.\n"
        "# llmapi.options holds its keys as written; trtpipe writes them back out in extra_llm_api_options.yaml.\n"
    )
    return head + yaml.safe_dump(data, sort_keys=False)
