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
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraSettings:
    """What a front end serves: adapters by name (their directories) and the cache bounds (the recipe's ``lora``)."""

    adapters: dict
    max_lora_rank: int = 64
    max_loras: int = 4
    max_cpu_loras: int = 8

    def cache(self, base_dir: Path) -> "AdapterCache":
        """The adapter cache of ``base_dir``'s model with every adapter registered (read and checked now)."""
        cache = AdapterCache(base_dir, self.max_loras, self.max_cpu_loras, self.max_lora_rank)
        for name, path in self.adapters.items():
            cache.register(name, Path(path))
        return cache


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
    """Counters per adapter name since start: reads from disk, steps that found the adapter active (hits) or had to
    activate it into the device cache (misses), and what each cache evicted (the per-adapter series of
    :mod:`trtpipe.serving.lora_metrics`)."""

    loads: Counter = field(default_factory=Counter)
    hits: Counter = field(default_factory=Counter)
    misses: Counter = field(default_factory=Counter)
    evictions: Counter = field(default_factory=Counter)  # (cache "device" | "host", name) -> count

    @property
    def disk_loads(self) -> int:
        return sum(self.loads.values())

    @property
    def activations(self) -> int:
        return sum(self.misses.values())

    @property
    def device_evictions(self) -> int:
        return sum(n for (cache, _), n in self.evictions.items() if cache == "device")

    @property
    def host_evictions(self) -> int:
        return sum(n for (cache, _), n in self.evictions.items() if cache == "host")

    def copy(self) -> "CacheStats":
        return CacheStats(Counter(self.loads), Counter(self.hits), Counter(self.misses), Counter(self.evictions))


class AdapterCache:
    """Adapters by name: a bounded device cache (``max_loras``) over a bounded host cache (``max_cpu_loras``),
    each least recently used out. Thread-safe: front ends register, the executor thread activates."""

    def __init__(
        self, base_dir: Optional[Path], max_loras: int, max_cpu_loras: int, max_rank: Optional[int] = None, layout=None
    ):
        """``layout``: the base's :class:`~trtpipe.runtime.lora.BaseLayout` when given, else read from ``base_dir``."""
        from trtpipe.runtime.lora import BaseLayout

        if max_loras < 1 or max_cpu_loras < 1:
            raise ValueError(
                f"LoRA caches need room for one adapter (max_loras {max_loras}, max_cpu_loras {max_cpu_loras})"
            )
        self.layout = layout if layout is not None else BaseLayout.of(Path(base_dir))
        self.loaders: dict = {}  # name -> how to read it again (else a PEFT directory: load_adapter)
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

    def register(self, name: str, path: Path, int_id: Optional[int] = None, loader=None) -> None:
        """Know ``name`` as the adapter in ``path``: read and checked now (:class:`~trtpipe.runtime.lora.AdapterError`
        when it does not fit the base), kept in the host cache. The same name again must name the same directory.
        ``loader``: how to read it (a callable returning the adapter) when ``path`` is not a PEFT directory."""
        path = Path(path)
        if loader is not None:
            with self._lock:
                self.loaders[name] = loader
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
            self._keep(self._host, name, adapter, self.max_cpu_loras, "host")

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
                self.stats.hits[name] += 1
                return adapter
            adapter, path = self._host.get(name), self.paths.get(name)
        if path is None:
            raise KeyError(f"adapter '{name}' is not served here (known: {', '.join(self.names) or 'none'})")
        if adapter is None:
            adapter = self._read(name, path)  # fell out of the host cache: read again
        with self._lock:
            self._keep(self._host, name, adapter, self.max_cpu_loras, "host", protect)
            self._keep(self._device, name, adapter, self.max_loras, "device", protect)
            self.stats.misses[name] += 1
        return adapter

    def active(self) -> list[str]:
        with self._lock:
            return list(self._device)

    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._host)

    def put(self, name: str, adapter, loader) -> None:
        """Hold ``adapter`` (already read) under ``name`` in the host cache, replacing one of that name; ``loader``
        is how it is read again once it fell out (it may raise: an adapter that only came with a request)."""
        with self._lock:
            self.loaders[name] = loader
            self.paths[name] = adapter.path
            self.ids.setdefault(name, len(self.ids))
            self._device.pop(name, None)
            self._keep(self._host, name, adapter, self.max_cpu_loras, "host_evictions")

    def is_loaded(self, name: str) -> bool:
        """Whether ``name`` is in the host cache now."""
        with self._lock:
            return name in self._host

    def _read(self, name: str, path: Path):
        from trtpipe.runtime.lora import load_adapter

        loader = self.loaders.get(name)
        adapter = loader() if loader is not None else load_adapter(name, path, self.layout, self.max_rank)
        with self._lock:
            self.stats.loads[name] += 1
        log.info("LoRA adapter '%s' loaded from %s (r=%d, %d linears)", name, path, adapter.rank, len(adapter.pairs))
        return adapter

    def _keep(self, cache: OrderedDict, name: str, adapter, bound: int, which: str, protect=()) -> None:
        cache[name] = adapter
        cache.move_to_end(name)
        for old in list(cache):
            if len(cache) <= bound:
                break
            if old != name and old not in protect:
                del cache[old]
                self.stats.evictions[which, old] += 1

    def stats_copy(self) -> CacheStats:
        """The counters now (a copy: the executor thread keeps counting)."""
        with self._lock:
            return self.stats.copy()


def groups_of(batch, adapters: dict) -> list:
    """(adapter, row indices) per adapter over the step's packed tokens: entry i's tokens follow entry i-1's
    (:meth:`~trtpipe.serving.reference_engine.ReferenceEngine.packed`)."""
    import torch

    rows: dict[str, list[int]] = {}
    t = 0
    for e in batch.entries:
        if e.lora is not None:
            rows.setdefault(e.lora, []).extend(range(t, t + len(e.tokens)))
        t += len(e.tokens)
    return [(adapters[name], torch.tensor(r, dtype=torch.long)) for name, r in rows.items()]


class LoraStepEngine:
    """A :class:`~trtpipe.serving.reference_engine.ReferenceEngine` whose entries each run their own adapter.

    An entry whose adapter cannot be activated fails alone (its request gets the error); the others run. Over the
    MPI step engine (tp/pp > 1, one process per rank) the workers attach the same adapters to their shards and follow
    rank 0's cache decisions (:class:`RankLora`): each step's wire names every entry's adapter and its directory."""

    def __init__(self, inner, cache: AdapterCache, reader=None):
        """``reader``: how worker ranks read adapters that are not PEFT directories (the Triton twin's tasks)."""
        from trtpipe.runtime.lora import attach

        self.inner, self.cache = inner, cache
        self.context = attach(inner.model)
        self.last_step: tuple[float, tuple[str, ...]] = (0.0, ())  # (unix time, adapters) of the latest step
        if hasattr(inner, "configure_lora"):  # the MPI step engine: the workers attach theirs
            inner.configure_lora(cache, reader)

    def allocate(self, num_blocks: int, tokens_per_block: int) -> None:
        self.inner.allocate(num_blocks, tokens_per_block)

    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        self.inner.copy_block(src, dst, num_tokens)

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        self.inner.move_slots(src, dst)

    def _prepare(self, batch):
        """(the batch without entries whose adapter failed to activate, their errors, the step's groups)."""
        from trtpipe.serving.api import StepBatch

        adapters, problems = self.cache.activate([e.lora for e in batch.entries if e.lora is not None])
        errors = {
            e.request_id: f"LoRA adapter '{e.lora}': {problems[e.lora]}" for e in batch.entries if e.lora in problems
        }
        if errors:
            batch = StepBatch(batch.iteration, [e for e in batch.entries if e.request_id not in errors])
        groups = groups_of(batch, adapters)
        if hasattr(self.inner, "step_adapters"):  # the MPI step engine names them (and their sources) on the wire
            self.inner.step_adapters = adapters
        self.last_step = (time.time(), tuple(a.name for a, _ in groups))
        return batch, errors, groups

    def step(self, batch):
        from trtpipe.serving.api import StepResult

        batch, errors, groups = self._prepare(batch)
        if not batch.entries:
            return StepResult({}, 0.0, errors)
        with self.context.use(groups):
            result = self.inner.step(batch)
        result.errors.update(errors)
        return result

    def logits(self, batch):
        """The inner engine's logits of a packed step, each entry under its adapter (an adapter that cannot be
        activated raises)."""
        batch, errors, groups = self._prepare(batch)
        if errors:
            raise RuntimeError("; ".join(errors.values()))
        with self.context.use(groups):
            return self.inner.logits(batch)


class RankLora:
    """A worker rank's LoRA (ranks > 0 of the MPI step engine): its shards wrapped like rank 0's, an adapter cache
    with rank 0's bounds, fed the same activations in the same order (so the same evictions); an adapter is read
    from the directory rank 0 names the first time a step needs it."""

    def __init__(self, model, layout, max_loras: int, max_cpu_loras: int, max_rank: Optional[int], reader=None):
        """``reader``: rank 0's :class:`~trtpipe.serving.triton_lora.Rows` (the Triton twin's tasks), else None."""
        from trtpipe.runtime.lora import attach

        self.cache = AdapterCache(None, max_loras, max_cpu_loras, max_rank, layout=layout)
        self.context = attach(model)
        self.reader = reader
        self.sent: dict = {}  # name -> (version, weights, config) of tensors rank 0 shipped (the "disk" of those)
        self.versions: dict = {}  # name -> version of the sent adapter in the cache now

    def _know(self, name: str, src) -> None:
        if isinstance(src, str):  # a PEFT directory
            self.cache.register(name, Path(src))
        elif src[0] == "npy":  # a prefetched task's folder
            reader, task, folder = self.reader, int(src[1]), Path(src[2])
            self.cache.register(name, folder, task, loader=lambda: reader.read_npy(task, folder))
        elif src[0] == "sent":  # tensors sent with a request: shipped once per version, replacing the task
            task, version = int(src[1]), src[2]
            if len(src) == 5:
                self.sent[name] = (version, src[3], src[4])
            if self.versions.get(name) != version:
                held = self.sent.get(name)
                if held is None or held[0] != version:
                    raise RuntimeError(f"LoRA on a worker rank: {name} version {version} was never shipped")
                reader, w, c = self.reader, held[1], held[2]

                def load():
                    return reader.decode(task, w, c, f"lora_task_id {task}")

                self.cache.put(name, load(), load)
                self.versions[name] = version
        else:
            raise RuntimeError(f"LoRA on a worker rank: unknown adapter source {src[0]!r} for {name}")

    def run(self, batch, paths: dict, forward):
        """``forward(batch)`` with each entry's adapter applied (``paths``: name -> source, from rank 0's
        :meth:`~trtpipe.serving.mpi_engine.MpiStepEngine.lora_sources`)."""
        for name, src in paths.items():
            self._know(name, src)
        adapters, problems = self.cache.activate([e.lora for e in batch.entries if e.lora is not None])
        if problems:  # rank 0 activated them: a worker that cannot ends the job (rank 0 sees the dead collective)
            raise RuntimeError(f"LoRA on a worker rank: {problems}")
        with self.context.use(groups_of(batch, adapters)):
            return forward(batch)


# --- choosing a request's adapter (the OpenAI front end) ------------------------------------------------------

LORA_REQUEST_KEYS = ("lora_name", "lora_int_id", "lora_path", "lora_ckpt_source")


class AdapterRequestError(ValueError):
    """A request that names an adapter wrongly: its message and the request field it concerns (an HTTP 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def select_adapter(cache: Optional[AdapterCache], base_name: str, model, lora_request) -> Optional[str]:
    """The adapter a request asks for, by OpenAI ``model`` (an adapter name listed by /v1/models) or by
    trtllm-serve's ``lora_request`` ``{lora_name, lora_int_id, lora_path}`` (``LoRARequest``,
    ``tensorrt_llm/executor/request.py@08c33130``; the field of CompletionRequest / ChatCompletionRequest,
    ``tensorrt_llm/serve/openai_protocol.py@0076e939``). A ``lora_path`` not served yet is read and checked now
    (upstream: ``ValueError`` when the path does not exist). None: the base model.

    Raises:
        AdapterRequestError: an unknown name, a path that is not an adapter of this base, two fields that disagree.
    """
    by_model = None
    if model is not None and model != base_name:
        if cache is None or model not in cache.names:
            raise AdapterRequestError(f"The model `{str(model)[:200]}` does not exist.", "model")
        by_model = model
    if lora_request is None:
        return by_model
    if cache is None:
        raise AdapterRequestError(
            "'lora_request': this server serves no LoRA adapters (no lora_config)", "lora_request"
        )
    if not isinstance(lora_request, dict) or set(lora_request) - set(LORA_REQUEST_KEYS):
        raise AdapterRequestError(
            f"'lora_request' must be an object with {', '.join(LORA_REQUEST_KEYS[:3])}", "lora_request"
        )
    name, int_id, path = lora_request.get("lora_name"), lora_request.get("lora_int_id"), lora_request.get("lora_path")
    if not isinstance(name, str) or not name:
        raise AdapterRequestError("'lora_request.lora_name' must be a non-empty string", "lora_request")
    if isinstance(int_id, bool) or not isinstance(int_id, int) or int_id < 0:
        raise AdapterRequestError("'lora_request.lora_int_id' must be an integer >= 0", "lora_request")
    if lora_request.get("lora_ckpt_source", "hf") != "hf":
        raise AdapterRequestError(
            "'lora_request.lora_ckpt_source': only 'hf' (PEFT) adapters are served", "lora_request"
        )
    if by_model is not None and by_model != name:
        raise AdapterRequestError(
            f"'model' names adapter '{by_model}' but 'lora_request' names '{name}'", "lora_request"
        )
    owner = next((n for n, i in dict(cache.ids).items() if i == int_id), None)
    if owner is not None and owner != name:
        raise AdapterRequestError(
            f"'lora_request.lora_int_id' {int_id} is adapter '{owner}', not '{name}'", "lora_request"
        )
    if name not in cache.names:
        if not path:
            raise AdapterRequestError(
                f"'lora_request': adapter '{name}' is not served and no lora_path is given", "lora_request"
            )
        if not isinstance(path, str) or not Path(path).is_dir():
            raise AdapterRequestError(f"lora_path ({str(path)[:200]}) does not exist.", "lora_request")
    elif cache.ids.get(name) not in (None, int_id):
        raise AdapterRequestError(f"adapter '{name}' is lora_int_id {cache.ids[name]}, not {int_id}", "lora_request")
    try:
        cache.register(name, Path(path) if path else cache.paths[name], int_id)
    except Exception as exc:  # noqa: BLE001 - an adapter that does not fit this base: the request's own error
        raise AdapterRequestError(f"'lora_request': {exc}", "lora_request") from None
    return name
