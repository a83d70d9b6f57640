"""The engine target's LoRA: ``trtllm-build``'s LoRA flags, the adapters converted into Triton's ``lora_prefetch_dir``,
and the ``tensorrtllm`` backend's PEFT cache parameters sized from them.

Upstream (confirmed at the commits named):
- ``trtllm-build`` (``tensorrt_llm/commands/build.py@65f1d153``): ``--lora_dir`` (``nargs="+"``; "the first one is
  used for configuration"), ``--lora_ckpt_source hf|nemo``, ``--lora_target_modules`` (``nargs="+"``, choices
  ``LoraManager.LORA_MODULE_IDS``), ``--max_lora_rank`` (64); ``build_model`` builds a ``LoraConfig``
  (``tensorrt_llm.lora_helper``) from them only when the ``lora_plugin`` is on, the command line's target modules
  preferred over the adapter directory's. ``--lora_plugin`` is a dtype plugin flag (``auto`` = the model dtype).
- The prefetch directory (``cpp/tensorrt_llm/batch_manager/peftCacheManager.cpp@0cedd9a0``
  ``PeftCacheManager::prefetchLoraWeights``; tensorrtllm_backend ``docs/lora.md@05ceae03``): one folder per task,
  **named by the task id's digits only** (``<dir>/<task_id>/model.lora_weights.npy`` + ``model.lora_config.npy``);
  any other folder name is skipped with a warning. So a folder cannot carry the adapter's name: trtpipe writes
  ``tasks.json`` (task id -> adapter name) beside the folders, which the C++ loader ignores (it reads directories).
  Task ids are the adapters' places in ``lora.adapters`` (0, 1, ...), the ``lora_int_id`` the OpenAI twin gives them.
- The PEFT cache parameters sized from the converted adapters: :mod:`trtpipe.engine.lora_cache`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from trtpipe.engine.lora_convert import MODULE_IDS
from trtpipe.errors import EngineError
from trtpipe.jsonfile import load_json
from trtpipe.models.dims import ModelDims

if TYPE_CHECKING:  # the Triton twin imports this module: no pydantic there
    from trtpipe.recipe.schema import Recipe

PREFETCH_DIR = "lora_prefetch"  # in the engine artifact: <engine>/lora_prefetch/<task_id>/model.lora_*.npy
TASKS_FILE = "tasks.json"  # {task id: adapter name}, beside the task folders
STORAGE = {"float16": 2, "float32": 4}  # the converter's storage dtypes (bfloat16 is not ported)
MODULE_BY_ID = {v: k for k, v in MODULE_IDS.items()}


@dataclass(frozen=True)
class LoraBuild:
    """What ``trtllm-build`` is told about LoRA (``--lora_plugin`` travels with the other plugin flags)."""

    dirs: tuple[str, ...]  # the PEFT adapter directories (--lora_dir)
    max_lora_rank: int
    target_modules: tuple[str, ...]  # TensorRT-LLM names (attn_q, ...), LORA_MODULE_IDS order

    def argv(self) -> list[str]:
        return [
            "--lora_dir",
            *self.dirs,
            "--lora_ckpt_source",
            "hf",
            "--max_lora_rank",
            str(self.max_lora_rank),
            "--lora_target_modules",
            *self.target_modules,
        ]

    def config_json(self) -> dict:
        """The fields of ``build_config.lora_config`` ``build_model`` sets (the rest keep LoraConfig's defaults)."""
        return {
            "lora_dir": list(self.dirs),
            "lora_ckpt_source": "hf",
            "max_lora_rank": self.max_lora_rank,
            "lora_target_modules": list(self.target_modules),
        }


def lora_build(recipe: Recipe) -> Optional[LoraBuild]:
    """The recipe's adapters as trtllm-build's LoRA arguments (None without adapters or for the llmapi target)."""
    if recipe.target != "engine" or not recipe.lora.adapters:
        return None
    from trtpipe.export.lora import adapter_dirs, target_modules

    dirs = adapter_dirs(recipe)
    used = set(target_modules(recipe, dirs))
    return LoraBuild(
        dirs=tuple(str(Path(d).resolve()) for d in dirs.values()),
        max_lora_rank=recipe.lora.max_lora_rank,
        target_modules=tuple(m for m in MODULE_IDS if m in used),
    )


def task_ids(recipe: Recipe) -> dict[str, int]:
    """Each adapter's LoRA task id: its place in ``lora.adapters``."""
    return {name: i for i, name in enumerate(recipe.lora.adapters)}


def write_prefetch(recipe: Recipe, out: Path, dtype: str) -> dict[str, int]:
    """Convert every adapter (:mod:`trtpipe.engine.lora_convert`, ``hf_lora_convert.py``'s math) into
    ``out/<task_id>/model.lora_weights.npy`` + ``model.lora_config.npy`` at the engine's ``dtype``, and
    ``out/tasks.json``. Returns {name: task id}.

    Raises:
        EngineError: a dtype the converter does not store (bfloat16), naming ``lora.adapters``.
    """
    from trtpipe.engine.lora_convert import write
    from trtpipe.export.lora import adapter_dirs

    if dtype not in STORAGE:
        raise EngineError(
            f"lora.adapters: the engine dtype is {dtype}; the LoRA converter stores float16 or float32 only "
            "(the tensorrtllm backend's loadNpy reads no bfloat16 .npy: numpyUtils.cpp@1069bc9d)"
        )
    ids = task_ids(recipe)
    dirs = adapter_dirs(recipe)
    out = Path(out)
    for name, task in ids.items():
        write(dirs[name], out / str(task), dtype)
    (out / TASKS_FILE).write_text(json.dumps({str(t): n for n, t in ids.items()}, indent=2) + "\n")
    return ids


def read_tasks(prefetch: Path) -> dict[int, str]:
    """``tasks.json`` of a prefetch directory: {task id: adapter name} ({} when the file is absent)."""
    path = Path(prefetch) / TASKS_FILE
    if not path.is_file():
        return {}
    return {int(k): str(v) for k, v in load_json(path, EngineError).items()}


# ---- what the engine target refuses (one line naming the key) --------------------------------------------------


def _engine_lora_rules(recipe: Recipe, m: Optional[ModelDims]):
    """The engine target with adapters: pp dividing the layers evenly (a PEFT cache holds the rows of layers
    ``ppRank * localNumLayers`` up to the next stage's, ``LoraCache::determineNumPages`` at
    ``cpp/tensorrt_llm/runtime/loraCache.cpp@c85e8726``: upstream's ranges for an uneven split were not read, so
    the cache sizing would be a guess), a float16 or float32 engine (upstream's limit: ``prefetchLoraWeights`` reads
    the task files with ``utils::loadNpy``, whose ``typeFromNumpyDesc`` takes ``f2`` / ``f4`` and no bfloat16,
    ``cpp/tensorrt_llm/runtime/utils/numpyUtils.cpp@1069bc9d``; ``hf_lora_convert.py --storage-type bfloat16``
    writes an ``|V2`` array it refuses), and adapters whose rank is below every targeted module's sizes
    (``hf_lora_convert.py`` takes the smaller dimension of each tensor for the rank:
    :func:`trtpipe.engine.lora_convert.rank_problems`). tp and pp themselves are served (the Triton twin's leader
    mode shards the adapters as TensorRT-LLM does)."""
    if recipe.target != "engine" or not recipe.lora.adapters:
        return
    if recipe.engine.plugins.overrides.get("lora_plugin") in ("disable", None) and (
        "lora_plugin" in recipe.engine.plugins.overrides
    ):
        yield (
            "engine.plugins.overrides.lora_plugin",
            "disable with lora.adapters on target: engine: the adapters need the LoRA plugin (drop the override)",
        )
    p = recipe.parallel
    if m is not None and p.pp > 1 and m.num_layers % p.pp:
        yield (
            "parallel.pp",
            f"{p.pp} does not divide the {m.num_layers} layers with lora.adapters on target: engine: the PEFT cache's "
            "layer ranges per stage are upstream's for an even split only (loraCache.cpp determineNumPages)",
        )
    if m is not None:
        dtype = recipe.model.dtype
        if dtype == "auto":
            dtype = "float16" if m.torch_dtype == "float32" else m.torch_dtype
        if dtype not in STORAGE:
            yield (
                "model.dtype",
                f"{dtype} with lora.adapters on target: engine: the tensorrtllm backend reads prefetched LoRA tasks "
                "as float16 or float32 .npy only (numpyUtils.cpp loadNpy has no bfloat16); set model.dtype: float16",
            )
    from trtpipe.engine.lora_convert import rank_problems
    from trtpipe.export.lora import adapter_dirs

    try:
        dirs = adapter_dirs(recipe)
    except Exception:  # noqa: BLE001 - an unreadable source is reported by the export rules, naming it
        return
    for name, d in dirs.items():
        try:
            problems = rank_problems(d)
        except Exception:  # noqa: BLE001 - a broken adapter is reported by the export rules (load_adapter)
            continue
        if problems:
            yield (
                f"lora.adapters.{name}",
                f"{problems[0]}: TensorRT-LLM's converter (hf_lora_convert.py@05316d33) would write the wrong "
                f"adapter_size for it ({len(problems)} modules); use a smaller r for target: engine",
            )


ENGINE_LORA_RULES = (_engine_lora_rules,)
