"""LoRA on the Triton twin: the ``tensorrtllm`` backend's PEFT cache over the twin's adapter cache.

What the backend does (``cpp/tensorrt_llm/batch_manager/peftCacheManager.cpp@0cedd9a0``), and the twin with it:
- at start, every digit-named folder of ``lora_prefetch_dir`` is loaded as the task of that id
  (``prefetchLoraWeights``): the twin registers them, read again from their ``.npy`` files when they fell out of
  its host cache;
- a request with ``lora_task_id`` plus ``lora_weights`` and ``lora_config`` puts that adapter into the cache under
  its task id (``addRequestPeft``: ``mHostLoraCache->put``); later requests send the task id alone;
- a task id alone that is not cached fails that request: "LoRA task <id> not found in cache. Please send LoRA
  weights with request" (``PeftTaskNotCachedException``), the message the twin gives too.
The tensors are decoded as ``LoraCache::copyToPages`` reads a row (``cpp/tensorrt_llm/runtime/loraCache.cpp@c85e8726``):
``lora_config`` rows (module id, layer, adapter_size r); a ``lora_weights`` row is ``[r, in]`` then ``[out, r]``,
flattened, the scaling already in the second (``hf_lora_convert.py``). Checks on request tensors are trtpipe's own
(one line naming the input); upstream's ``loraValidateRequestTensors`` messages were not read.

The host cache holds as many adapters as ``lora_cache_host_memory_bytes`` holds of the largest prefetched one
(:func:`trtpipe.engine.lora_cache.host_capacity`); the device bound is the executor's ``max_loras``
(the recipe's ``lora.max_loras``, in ``executor_extras``). Tasks are named ``task-<id>`` in the cache and the
KV pool (reuse keyed by adapter, as ``BlockKey::loraTaskId``).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from trtpipe.engine.lora_build import MODULE_BY_ID, read_tasks
from trtpipe.engine.lora_convert import HF_TO_TRTLLM
from trtpipe.jsonfile import load_json

# TensorRT-LLM LoRA module -> the HF module (the layout's key) of a dense decoder
HF_MODULE = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_dense": "self_attn.o_proj",
    "mlp_h_to_4h": "mlp.gate_proj",
    "mlp_gate": "mlp.up_proj",
    "mlp_4h_to_h": "mlp.down_proj",
}
assert all(HF_TO_TRTLLM[m.rsplit(".", 1)[1]] == t for t, m in HF_MODULE.items())  # the converter's table, inverted


def task_name(task_id: int) -> str:
    return f"task-{task_id}"


def checkpoint_layout(pretrained: dict):
    """The base's LoRA-adaptable linears from a TensorRT-LLM (engine) config: q/k/v rows of ``attention.qkv``,
    o_proj ``attention.dense``, gate_proj ``mlp.fc``, up_proj ``mlp.gate``, down_proj ``mlp.proj``."""
    from trtpipe.models.dims import checkpoint_dims
    from trtpipe.runtime.lora import BaseLayout

    d = checkpoint_dims(pretrained)
    h, q, kv, i = d.hidden_size, d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.intermediate_size
    modules = {
        "self_attn.q_proj": ("attention.qkv", 0, q, h),
        "self_attn.k_proj": ("attention.qkv", q, kv, h),
        "self_attn.v_proj": ("attention.qkv", q + kv, kv, h),
        "self_attn.o_proj": ("attention.dense", 0, h, q),
    }
    if not d.num_experts:
        modules.update(
            {
                "mlp.gate_proj": ("mlp.fc", 0, i, h),
                "mlp.up_proj": ("mlp.gate", 0, i, h),
                "mlp.down_proj": ("mlp.proj", 0, h, i),
            }
        )
    return BaseLayout("model.layers.{}.", d.num_layers, modules, (d.num_heads, d.num_kv_heads, d.head_dim))


@dataclass(frozen=True)
class Rows:
    """How ``lora_weights`` / ``lora_config`` rows become an adapter on this engine (its LoRA modules, its
    ``max_lora_rank``, its linears): rank 0 decodes with it, and so does every worker rank under leader mode (it
    travels to them once, with the LoRA bounds: :meth:`~trtpipe.serving.mpi_engine.MpiStepEngine.configure_lora`)."""

    max_rank: int
    modules: frozenset
    layout: object  # trtpipe.runtime.lora.BaseLayout

    def read_npy(self, task: int, folder: Path):
        """A prefetched task read from its folder (``model.lora_weights.npy`` + ``model.lora_config.npy``)."""
        w = np.load(Path(folder) / "model.lora_weights.npy")
        c = np.load(Path(folder) / "model.lora_config.npy")
        adapter = self.decode(task, w, c, f"{folder}")
        adapter.source = ("npy", int(task), str(folder))
        return adapter

    def decode(self, task: int, weights: np.ndarray, config: np.ndarray, where: str):
        """The adapter of ``lora_weights`` / ``lora_config`` tensors; ValueError (one line naming the input) when
        they do not fit this engine."""
        import torch

        from trtpipe.runtime.lora import AdapterError, adapter_of_modules

        w = np.asarray(weights)
        c = np.asarray(config)
        w = w.reshape(w.shape[-2:]) if w.ndim == 3 and w.shape[0] == 1 else w
        c = c.reshape(c.shape[-2:]) if c.ndim == 3 and c.shape[0] == 1 else c
        if w.ndim != 2 or c.ndim != 2 or c.shape[1] != 3:
            raise ValueError(
                f"{where}: lora_weights must be [rows, width] and lora_config [rows, 3] (a leading batch of 1 "
                f"allowed), got {list(weights.shape)} and {list(config.shape)}"
            )
        if w.shape[0] != c.shape[0]:
            raise ValueError(f"{where}: lora_weights has {w.shape[0]} rows, lora_config {c.shape[0]}")
        modules = {}
        for i, (module_id, layer, r) in enumerate(c.astype(np.int64).tolist()):
            name = MODULE_BY_ID.get(module_id)
            if name not in self.modules or name not in HF_MODULE:
                raise ValueError(
                    f"{where}: lora_config row {i}: module id {module_id} is not one of the engine's LoRA modules "
                    f"({', '.join(sorted(self.modules))})"
                )
            if not 0 < r <= self.max_rank:
                raise ValueError(f"{where}: lora_config row {i}: adapter_size {r} is not in [1, {self.max_rank}]")
            module = HF_MODULE[name]
            _, _, out, fan_in = self.layout.modules[module]
            if r * (fan_in + out) > w.shape[1]:
                raise ValueError(
                    f"{where}: lora_weights row {i} has {w.shape[1]} values; {name} of rank {r} needs "
                    f"{r * (fan_in + out)}"
                )
            row = torch.from_numpy(np.ascontiguousarray(w[i], dtype=np.float32))
            a = row[: r * fan_in].view(r, fan_in)
            b = row[r * fan_in : r * (fan_in + out)].view(out, r)
            if (layer, module) in modules:
                raise ValueError(f"{where}: lora_config names {name} of layer {layer} twice")
            modules[(int(layer), module)] = (a, b)
        try:
            return adapter_of_modules(task_name(task), Path(where), modules, self.layout)
        except AdapterError as exc:
            raise ValueError(f"{where}: {exc}") from None


class TwinAdapters:
    """The Triton twin's LoRA tasks: the adapter cache, the engine's LoRA limits, and the request inputs read."""

    def __init__(self, engine_dir: Path, prefetch: Optional[Path], max_loras: int, host_bytes: Optional[int]):
        from trtpipe.engine.lora_cache import host_capacity
        from trtpipe.serving.adapters import AdapterCache

        cfg = load_json(Path(engine_dir) / "config.json")
        lora = cfg["build_config"]["lora_config"]
        self.max_rank = int(lora["max_lora_rank"])
        self.modules = set(lora["lora_target_modules"])
        self.layout = checkpoint_layout(cfg["pretrained_config"])
        self.rows = Rows(self.max_rank, frozenset(self.modules), self.layout)
        self._sent = itertools.count(1)  # a version per adapter sent with a request (leader mode ships it once)
        tasks = read_tasks(prefetch) if prefetch is not None and prefetch.is_dir() else {}
        capacity = host_capacity(host_bytes, cfg, prefetch) if tasks and host_bytes else max(len(tasks), 1)
        self.cache = AdapterCache(None, max(max_loras, 1), max(capacity, max_loras, 1), self.max_rank, self.layout)
        self.prefetched = {task_name(t) for t in tasks}  # read again from their files once they fell out
        for task in sorted(tasks):  # prefetchLoraWeights: every digit-named folder
            folder = prefetch / str(task)
            self.cache.register(task_name(task), folder, task, loader=self._npy_loader(task, folder))

    def _npy_loader(self, task: int, folder: Path) -> Callable:
        return lambda: self.rows.read_npy(task, folder)

    def wrap(self, engine):
        """The step engine applying each entry's adapter (:class:`~trtpipe.serving.adapters.LoraStepEngine`); over
        the MPI step engine (leader mode, tp x pp > 1) every worker rank gets :class:`Rows` to read the tasks."""
        from trtpipe.serving.adapters import LoraStepEngine

        return LoraStepEngine(engine, self.cache, reader=self.rows)

    def decode(self, task: int, weights: np.ndarray, config: np.ndarray, where: str):
        """:meth:`Rows.decode`."""
        return self.rows.decode(task, weights, config, where)

    def sent(self, task: int, weights: np.ndarray, config: np.ndarray):
        """The adapter of tensors sent with a request for ``task``; it carries them (and a version) so leader mode
        can ship them to the worker ranks, as every rank's PEFT cache receives the request's weights upstream."""
        adapter = self.decode(task, weights, config, f"lora_task_id {task}")
        adapter.source = ("sent", int(task), next(self._sent), np.asarray(weights), np.asarray(config))
        return adapter


def select(adapters: Optional[TwinAdapters], task_id, weights, config) -> Optional[str]:
    """See :meth:`TwinAdapters.select`; ``adapters`` None: an engine built without LoRA."""
    if task_id is None and weights is None and config is None:
        return None
    if adapters is None:
        name = "lora_task_id" if task_id is not None else "lora_weights" if weights is not None else "lora_config"
        raise ValueError(f"{name}: this engine was built without LoRA (its lora_plugin is off)")
    if task_id is None:
        raise ValueError("lora_weights / lora_config need lora_task_id (the task id they are cached under)")
    if (weights is None) != (config is None):
        missing = "lora_config" if config is None else "lora_weights"
        raise ValueError(f"{missing} is missing: lora_weights and lora_config come together")
    task = int(np.asarray(task_id).reshape(-1)[0])
    name = task_name(task)
    if weights is not None:
        adapter = adapters.sent(task, weights, config)

        def gone():  # fell out of the host cache: upstream's message for a task no longer cached
            raise KeyError(not_cached(task))

        adapters.cache.put(name, adapter, gone)
        return name
    if not adapters.cache.is_loaded(name) and name not in adapters.prefetched:
        raise ValueError(not_cached(task))
    return name


def not_cached(task: int) -> str:
    """``PeftTaskNotCachedException``'s message (peftCacheManager.cpp@0cedd9a0 ``addRequestPeft``)."""
    return f"LoRA task {task} not found in cache. Please send LoRA weights with request"


def from_parameters(
    engine_dir: Path, model_repository: str, prefetch: Optional[str], host_bytes: Optional[str], max_loras: int
) -> Optional[TwinAdapters]:
    """The twin's adapters when its engine was built with LoRA (``lora_plugin`` on), else None; ``prefetch`` and
    ``host_bytes`` are the ``lora_prefetch_dir`` / ``lora_cache_host_memory_bytes`` parameters (None: unset)."""
    cfg = load_json(Path(engine_dir) / "config.json")
    if not (cfg.get("build_config", {}).get("plugin_config") or {}).get("lora_plugin"):
        return None
    folder = None
    if prefetch:
        folder = Path(prefetch if os.path.isabs(prefetch) else os.path.join(model_repository, prefetch))
    return TwinAdapters(Path(engine_dir), folder, max_loras, int(host_bytes) if host_bytes else None)
