"""The ``tensorrtllm`` backend's PEFT cache for an engine's LoRA adapters: ``lora_cache_*`` sized from the adapters
the engine stage converted (:mod:`trtpipe.engine.lora_build`), and the host-cache bound the Triton twin reads back.

The cache pages (``PeftCacheManager::getPageManagerConfig`` / ``getMaxNumSlots``,
``cpp/tensorrt_llm/batch_manager/peftCacheManager.cpp@0cedd9a0``; the per-task page count of ``LoraCache::determineNumPages``, ``cpp/tensorrt_llm/runtime/loraCache.cpp@c85e8726``): a page is
  ``slots_per_page`` slots of ``page_width`` values, ``page_width`` the smallest ``in + out`` of the engine's LoRA
  modules; a row (module, layer, rank r) takes ``ceil(r * (in + out) / page_width)`` consecutive slots, a row that
  does not fit the page's rest starts a new page. :func:`cache_parameters` sizes ``lora_cache_host_memory_bytes``
  and ``lora_cache_gpu_memory_fraction`` so the host cache holds ``max_cpu_loras`` and the device cache
  ``max_loras`` of the largest adapter, in whole pages. Each module's ``in``/``out`` and tp split as
  ``LoraModule::createLoraModules`` makes them (:func:`module_sizes`). At tp x pp > 1 every size is one GPU's
  (:func:`cache_shape`), and the ``lora_cache_*`` parameters, which every rank's executor applies to its own
  cache, are per GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trtpipe.engine.lora_build import MODULE_BY_ID, PREFETCH_DIR, STORAGE, TASKS_FILE, read_tasks
from trtpipe.errors import EngineError
from trtpipe.jsonfile import load_json
from trtpipe.models.dims import ModelDims

if TYPE_CHECKING:  # the Triton twin imports this module: no pydantic there
    from trtpipe.recipe.schema import Recipe


def module_sizes(d: ModelDims, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(in, out) of each LoRA module on one tp rank: ``LoraModule::localInDim`` / ``localOutDim``
    (``cpp/include/tensorrt_llm/runtime/loraModule.h@16d2467e``) with the split dims of ``createLoraModules``
    (``cpp/tensorrt_llm/runtime/loraModule.cpp@2a9abd95``): q, k, v, qkv, h_to_4h and gate split their out by tp
    (``outTpSplitDim`` 0), dense and 4h_to_h their in (``inTpSplitDim`` 1), the rank never split. The whole sizes
    are the linears' (dense's in is heads x head_dim here where upstream writes hidden: equal on these models); a
    rank's KV heads are ceil(kv / tp) (replicated when fewer than tp)."""
    h, q, i = d.hidden_size, d.num_heads * d.head_dim, d.intermediate_size
    kv = -(-d.num_kv_heads // tp) * d.head_dim
    return {
        "attn_qkv": (h, q // tp + 2 * kv),
        "attn_q": (h, q // tp),
        "attn_k": (h, kv),
        "attn_v": (h, kv),
        "attn_dense": (q // tp, h),
        "mlp_h_to_4h": (h, i // tp),
        "mlp_4h_to_h": (i // tp, h),
        "mlp_gate": (h, i // tp),
    }


@dataclass(frozen=True)
class Pages:
    page_width: int  # values per slot
    slots_per_page: int
    min_total_slots: int  # what one max-sized adapter needs (the cache must hold at least this)

    def page_bytes(self, dtype_bytes: int) -> int:
        return self.slots_per_page * self.page_width * dtype_bytes


def pages(sizes: dict[str, tuple[int, int]], modules, layers: int, optimal: int, max_adapter: int) -> Pages:
    """``getPageManagerConfig``'s page shape for the engine's LoRA ``modules`` over one GPU's ``layers`` (its pp
    stage's), ``sizes`` that rank's (:func:`module_sizes`)."""
    one_d = [sum(sizes[m]) for m in modules]
    width = min(one_d)
    total_slots = sum(optimal * math.ceil(x / width) for x in one_d) * layers
    min_num_slots = math.ceil(max_adapter * max(one_d) / width)
    min_total = math.ceil(max_adapter * sum(one_d) * layers / width)
    return Pages(width, max(total_slots, min_num_slots), min_total)


def task_pages(config: np.ndarray, sizes: dict[str, tuple[int, int]], p: Pages, layers=None) -> int:
    """``LoraCache::determineNumPages``: the pages one adapter's ``lora_config`` rows take on one GPU (only the rows
    of its pp stage's ``layers``, a range; None: every row)."""
    page = slot = 0
    for module_id, layer, r in np.asarray(config).reshape(-1, 3):
        if layers is not None and int(layer) not in layers:
            continue
        n = math.ceil(int(r) * sum(sizes[MODULE_BY_ID[int(module_id)]]) / p.page_width)
        if n + slot > p.slots_per_page:
            slot, page = 0, page + 1
        slot += n
    return page + 1


@dataclass(frozen=True)
class CacheShape:
    """The pages of an engine's PEFT cache and what its largest prefetched adapter takes."""

    rank: int  # the prefetched adapters' largest rank (lora_cache_optimal_adapter_size)
    tp: int
    pp: int
    max_rank: int  # the engine's max_lora_rank (lora_cache_max_adapter_size: an adapter sent later may use it)
    pages: Pages
    largest_pages: int
    page_bytes: int


def cache_shape(engine_cfg: dict, prefetch: Path) -> CacheShape:
    """:class:`CacheShape` of an engine ``config.json`` and its prefetch directory (which must hold tasks), per GPU:
    at tp x pp > 1 each rank's cache holds its tp shard of its pp stage's rows (``getPageManagerConfig``:
    ``localInDim(tpSize) + localOutDim(tpSize)``, ``getNbAttentionLayers(ppSize, ppRank)`` layers; a row of layer
    ``l`` is cached on the stage with ``ppRank * localNumLayers <= l < (ppRank + 1) * localNumLayers``:
    ``determineNumPages``). The largest stage (ceil(layers / pp): upstream's count for an uneven split was not
    read) sizes every GPU's cache."""
    from trtpipe.models.dims import checkpoint_dims

    dims = checkpoint_dims(engine_cfg["pretrained_config"])
    mapping = engine_cfg["pretrained_config"].get("mapping") or {}
    tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
    lora_cfg = engine_cfg["build_config"]["lora_config"]
    sizes = module_sizes(dims, tp)
    configs = [np.load(Path(prefetch) / str(t) / "model.lora_config.npy") for t in read_tasks(prefetch)]
    if not configs:
        raise EngineError(f"{prefetch}: no LoRA task is listed in {TASKS_FILE}")
    rank = max(int(c.reshape(-1, 3)[:, 2].max()) for c in configs)
    max_rank = int(lora_cfg["max_lora_rank"])
    rank = min(rank, max_rank)  # the manager takes min(size, max_lora_rank) too
    local = -(-dims.num_layers // pp)
    p = pages(sizes, lora_cfg["lora_target_modules"], local, rank, max_rank)
    stages = [range(s * local, (s + 1) * local) for s in range(pp)]
    largest = max(task_pages(c, sizes, p, stage) for c in configs for stage in stages)
    return CacheShape(
        rank, tp, pp, max_rank, p, largest, p.page_bytes(STORAGE.get(engine_cfg["pretrained_config"]["dtype"], 2))
    )


def cache_parameters(recipe: Recipe, engine_dir: Path) -> dict:
    """The ``lora_cache_*`` and ``lora_prefetch_dir`` parameters of the ``tensorrt_llm`` model for an engine built
    with this recipe's adapters ({} without them): the optimal adapter size the largest rank of the adapters, the
    largest the engine's ``max_lora_rank`` (so an adapter sent with a request later fits a page too), the host cache (at least every prefetched adapter) ``max_cpu_loras`` and the device cache ``max_loras`` of the
    largest adapter's pages, the device share as a fraction of the memory the engine's plan leaves after the KV pool.

    Raises:
        EngineError: the device cache does not fit what the KV pool leaves (naming the knobs).
    """
    engine_dir = Path(engine_dir)
    prefetch = engine_dir / PREFETCH_DIR
    if not recipe.lora.adapters or not prefetch.is_dir():
        return {}
    s = cache_shape(load_json(engine_dir / "config.json", EngineError), prefetch)
    floor = math.ceil(s.pages.min_total_slots / s.pages.slots_per_page)
    # every prefetched adapter is put into the host cache at start (prefetchLoraWeights): room for all of them
    held = max(recipe.lora.max_cpu_loras, len(read_tasks(prefetch)))
    host = max(held * s.largest_pages, floor) * s.page_bytes
    device = max(recipe.lora.max_loras * s.largest_pages, floor) * s.page_bytes
    fraction = 0.05  # the backend's default, kept when the engine has no plan
    from trtpipe.engine.planner import PLAN_FILE, kv_pool

    plan_path = engine_dir / PLAN_FILE
    if plan_path.is_file():
        plan = load_json(plan_path, EngineError)
        pool, _ = kv_pool(plan, recipe.engine.kv_cache)
        left = min(f - k for f, k in zip(plan["free_bytes_per_gpu"], pool["kv_pool_bytes"]))
        if left <= device:
            raise EngineError(
                f"lora.max_loras: the device LoRA cache ({recipe.lora.max_loras} x {s.largest_pages} pages = "
                f"{device} bytes) does not fit the {max(left, 0)} bytes the KV pool leaves per GPU; lower "
                "lora.max_loras or engine.kv_cache.free_gpu_memory_fraction"
            )
        fraction = math.ceil(device / left * 1e6) / 1e6
    return {
        "lora_cache_optimal_adapter_size": s.rank,
        "lora_cache_max_adapter_size": s.max_rank,
        "lora_cache_gpu_memory_fraction": fraction,
        "lora_cache_host_memory_bytes": host,
        "lora_prefetch_dir": str(prefetch),
    }


def host_capacity(host_bytes: int, engine_cfg: dict, prefetch: Path) -> int:
    """How many of the largest prefetched adapter ``lora_cache_host_memory_bytes`` holds, in the pages of
    :func:`cache_parameters` (the Triton twin's host-cache bound; at least 1)."""
    if not read_tasks(prefetch):
        return 1
    s = cache_shape(engine_cfg, prefetch)
    return max(1, int(host_bytes) // (s.largest_pages * s.page_bytes))
