"""Multi-LoRA serving on the twin: the adapter cache, the step engine that applies each entry's adapter, and the
executor's per-step bound on distinct adapters.

Policy, after TensorRT-LLM's PEFT cache (``PeftCacheManager``: adapters in a bounded device cache, more in a host
cache, a request's adapter loaded before its step):
- ``max_loras`` adapters are *active* at once (the device cache): a step never holds more distinct adapters than
  that (:func:`within_lora_cache` defers the rest to a later step, in scheduling order), and an adapter a step needs
  that is not active replaces the least recently used one.
- ``max_cpu_loras`` adapters stay *loaded* (the host cache); one that fell out of it is read from its directory
  again on demand. On the CPU twin both caches are host memory: the bound and the order are what is modelled.
- An adapter is known by name: the recipe's ``lora.adapters``, or registered by a request (trtllm-serve's
  ``lora_request`` with a ``lora_path``); registering reads and checks it against the base at once, so a bad adapter
  is a 400 for that request, never a failed step.
- A step's entries are grouped by adapter over the packed tokens (:mod:`trtpipe.runtime.lora`): the base GEMMs run
  once, each adapter's deltas once over its own tokens.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from trtpipe.errors import CheckpointError

log = logging.getLogger(__name__)


def within_lora_cache(chosen: list, max_loras: int) -> list:
    """The scheduled requests, without those whose adapter would be one more than ``max_loras`` distinct adapters in
    this step (they wait for a later step, their order kept). Base-model requests never wait. 0: no bound."""
    if max_loras <= 0:
        return chosen
    seen: set = set()
    kept = []
    for r in chosen:
        lora = r.request.lora
        if lora is not None and lora not in seen:
            if len(seen) >= max_loras:
                continue
            seen.add(lora)
        kept.append(r)
    return kept


@dataclass
class CacheStats:
    """Counters since start: reads from disk, activations into the device cache, and what each cache evicted."""

    disk_loads: int = 0
    activations: int = 0
    device_evictions: int = 0
    host_evictions: int = 0


def resolve_source(name: str, source: str, base_dir: Path) -> Path:
    """An adapter's directory: a path (relative to ``base_dir``) or an ``hf://`` repository (the hub cache)."""
    if source.startswith("hf://"):
        from trtpipe.models.hub import resolve_hf

        try:
            return resolve_hf(source)
        except CheckpointError as exc:
            raise CheckpointError(f"lora.adapters.{name}: {str(exc).split(': ', 1)[-1]}") from None
    p = Path(source).expanduser()
    return p if p.is_absolute() else (Path(base_dir) / p)


class AdapterCache:
    """Adapters by name: a bounded device cache (``max_loras``) over a bounded host cache (``max_cpu_loras``),
    each least recently used out. Thread-safe: front ends register, the executor thread activates."""

    def __init__(self, base_dir: Path, max_loras: int, max_cpu_loras: int, max_rank: Optional[int] = None):
        from trtpipe.runtime.lora import BaseLayout

        if max_loras < 1 or max_cpu_loras < 1:
            raise ValueError(
                f"LoRA caches need room for one adapter (max_loras {max_loras}, max_cpu_loras {max_cpu_loras})"
            )
        self.layout = BaseLayout.of(Path(base_dir))
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max(max_cpu_loras, max_loras), max_rank
        self.paths: dict[str, Path] = {}
        self.ids: dict[str, int] = {}  # lora_int_id of each name (trtllm-serve's LoRARequest.adapter_id)
        self._device: OrderedDict = OrderedDict()  # name -> LoraAdapter, front = least recently used
        self._host: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self.paths)

    def register(self, name: str, path: Path, int_id: Optional[int] = None) -> None:
        """Know ``name`` as the adapter in ``path``: read and checked now (:class:`~trtpipe.runtime.lora.AdapterError`
        when it does not fit the base), kept in the host cache. The same name again must name the same directory."""
        path = Path(path)
        with self._lock:
            known = self.paths.get(name)
            if known is not None:
                if known.resolve() != path.resolve():
                    from trtpipe.runtime.lora import AdapterError

                    raise AdapterError(f"adapter '{name}' is already served from {known}, not {path}")
                if int_id is not None:
                    self.ids.setdefault(name, int_id)
                return
        adapter = self._read(name, path)
        with self._lock:
            self.paths.setdefault(name, path)
            self.ids.setdefault(name, len(self.ids) if int_id is None else int_id)
            self._keep(self._host, name, adapter, self.max_cpu_loras, "host_evictions")

    def activate(self, names: Sequence[str]) -> tuple[dict, dict[str, str]]:
        """The adapters of one step made active (at most ``max_loras`` distinct names: the executor bounds a step),
        none of them evicting another; and, per name that could not be activated, why (one line)."""
        names = list(dict.fromkeys(names))
        if len(names) > self.max_loras:
            raise RuntimeError(f"a step holds {len(names)} adapters; max_loras is {self.max_loras}")
        out, problems = {}, {}
        for name in names:
            try:
                out[name] = self._activate(name, names)
            except Exception as exc:  # noqa: BLE001 - that adapter's requests fail, every other one runs
                log.exception("LoRA adapter %r could not be activated", name)
                problems[name] = f"{type(exc).__name__}: {exc}"
        return out, problems

    def _activate(self, name: str, protect: list[str]):
        with self._lock:
            adapter = self._device.get(name)
            if adapter is not None:
                self._device.move_to_end(name)
                return adapter
            adapter, path = self._host.get(name), self.paths.get(name)
        if path is None:
            raise KeyError(f"adapter '{name}' is not served here (known: {', '.join(self.names) or 'none'})")
        if adapter is None:
            adapter = self._read(name, path)  # fell out of the host cache: read again
        with self._lock:
            self._keep(self._host, name, adapter, self.max_cpu_loras, "host_evictions", protect)
            self._keep(self._device, name, adapter, self.max_loras, "device_evictions", protect)
            self.stats.activations += 1
        return adapter

    def active(self) -> list[str]:
        with self._lock:
            return list(self._device)

    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._host)

    def _read(self, name: str, path: Path):
        from trtpipe.runtime.lora import load_adapter

        adapter = load_adapter(name, path, self.layout, self.max_rank)
        with self._lock:
            self.stats.disk_loads += 1
        log.info("LoRA adapter '%s' loaded from %s (r=%d, %d linears)", name, path, adapter.rank, len(adapter.pairs))
        return adapter

    def _keep(self, cache: OrderedDict, name: str, adapter, bound: int, counter: str, protect=()) -> None:
        cache[name] = adapter
        cache.move_to_end(name)
        for old in list(cache):
            if len(cache) <= bound:
                break
            if old != name and old not in protect:
                del cache[old]
                setattr(self.stats, counter, getattr(self.stats, counter) + 1)


class LoraStepEngine:
    """A :class:`~trtpipe.serving.reference_engine.ReferenceEngine` whose entries each run their own adapter.

    An entry whose adapter cannot be activated fails alone (its request gets the error); the others run."""

    def __init__(self, inner, cache: AdapterCache):
        from trtpipe.runtime.lora import attach

        self.inner, self.cache = inner, cache
        self.context = attach(inner.model)

    def allocate(self, num_blocks: int, tokens_per_block: int) -> None:
        self.inner.allocate(num_blocks, tokens_per_block)

    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        self.inner.copy_block(src, dst, num_tokens)

    def step(self, batch):
        import torch

        from trtpipe.serving.api import StepBatch, StepResult

        adapters, problems = self.cache.activate([e.lora for e in batch.entries if e.lora is not None])
        errors = {
            e.request_id: f"LoRA adapter '{e.lora}': {problems[e.lora]}" for e in batch.entries if e.lora in problems
        }
        if errors:
            batch = StepBatch(batch.iteration, [e for e in batch.entries if e.request_id not in errors])
        if not batch.entries:
            return StepResult({}, 0.0, errors)
        rows: dict[str, list[int]] = {}
        t = 0
        for e in batch.entries:  # packed order: entry i's tokens follow entry i-1's (ReferenceEngine.packed)
            if e.lora is not None:
                rows.setdefault(e.lora, []).extend(range(t, t + len(e.tokens)))
            t += len(e.tokens)
        groups = [(adapters[name], torch.tensor(r, dtype=torch.long)) for name, r in rows.items()]
        with self.context.use(groups):
            result = self.inner.step(batch)
        result.errors.update(errors)
        return result
