"""The CPU twin as an NVIDIA Dynamo worker: the in-flight executor behind Dynamo's frontend and KV-aware router.

Where TensorRT-LLM's PyTorch backend runs as ``python -m dynamo.trtllm`` on a GPU host, this module runs the same
export on the reference runtime as a token-level engine of Dynamo's backend SDK (ai-dynamo 1.6.1
``dynamo/common/backend/engine.py``: ``LLMEngine``, started by ``dynamo.common.backend.run.run``). Dynamo's
frontend tokenizes, routes and detokenizes; this worker gets token ids and yields token chunks, and its executor is
the one every other trtpipe front end uses (:class:`~trtpipe.serving.executor.Executor`: no second scheduler).

What the router needs from a worker, and where it comes from here:
- KV events: the executor's block pool reports each block entering or leaving its reuse tree
  (:class:`~trtpipe.serving.kv_events.EventRecorder`); a thread publishes them through the ``KvEventPublisher``
  the SDK hands over (``PushSource``), full blocks only, with ``kv_cache_block_size`` = the pool's block size;
- load: a ``ComponentSnapshot`` (blocks used / total, hit rate) after each batch of events and on every idle tick.

Run in Dynamo's own virtual environment (``scripts/install_dynamo.sh``), normally by ``trtpipe serve --dynamo``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any, Optional

from trtpipe.extras import require

require("dynamo.common.backend", "the Dynamo worker (trtpipe serve --dynamo)")

from dynamo.common.backend.engine import EngineConfig, LLMEngine, LlmRegistration  # noqa: E402
from dynamo.common.backend.health_check import build_health_check_payload  # noqa: E402
from dynamo.common.backend.publisher import ComponentSnapshot, PushSource  # noqa: E402
from dynamo.common.backend.run import run  # noqa: E402
from dynamo.common.backend.worker import WorkerConfig  # noqa: E402
from dynamo.common.utils.token_ids import normalize_request_token_ids  # noqa: E402
from dynamo.llm.exceptions import InvalidArgument  # noqa: E402

from trtpipe.processes import write_state  # noqa: E402
from trtpipe.serving.api import ExecutorConfig, Response  # noqa: E402
from trtpipe.serving.dynamo_requests import FINISH, RequestRefused, translate  # noqa: E402
from trtpipe.serving.config import from_json  # noqa: E402
from trtpipe.serving.end_tokens import EndTokens, read_end_tokens  # noqa: E402
from trtpipe.serving.kv_events import EventRecorder, Removed, Stored  # noqa: E402

log = logging.getLogger("trtpipe.dynamo")
POLL_S = 0.1  # how often a waiting request looks at its context (client gone) and the publisher at the pool


class TwinEngine(LLMEngine):
    """The reference runtime + executor over one exported checkpoint, as a Dynamo token engine."""

    def __init__(self, model_dir: Path, name: str, config: ExecutorConfig, threads: Optional[int]):
        self.model_dir, self.name, self.config, self.threads = model_dir, name, config, threads
        self.executor = None
        self.eos_id: Optional[EndTokens] = None
        self.recorder = EventRecorder()
        self._snapshots = None
        self._publisher_thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.status_file: Optional[Path] = None
        self.published = 0  # KV events handed to Dynamo's publisher (stored and removed calls)

    @classmethod
    async def from_args(cls, argv: Optional[list[str]] = None) -> tuple["TwinEngine", WorkerConfig]:
        p = argparse.ArgumentParser(description="trtpipe's CPU twin as a Dynamo worker")
        p.add_argument("--model", required=True, type=Path, help="the exported HF checkpoint directory")
        p.add_argument("--served-model-name", required=True)
        p.add_argument("--executor-config", required=True, help="ExecutorConfig as JSON")
        p.add_argument("--threads", type=int, default=None)
        p.add_argument("--namespace", default="dynamo")
        p.add_argument("--component", default="backend")
        p.add_argument("--endpoint-types", default="chat,completions")
        p.add_argument("--discovery-backend", default="file")
        p.add_argument("--status-file", type=Path, help="where to write this worker's pid and Dynamo instance id")
        # as dynamo.trtllm's flags: Dynamo's frontend parses tool calls and reasoning with these (its own names)
        p.add_argument("--dyn-tool-call-parser", default=None)
        p.add_argument("--dyn-reasoning-parser", default=None)
        args = p.parse_args(argv)
        engine = cls(args.model, args.served_model_name, from_json(args.executor_config), args.threads)
        engine.status_file = args.status_file
        worker = WorkerConfig(
            namespace=args.namespace,
            component=args.component,
            endpoint="generate",
            model_name=str(args.model),
            served_model_name=args.served_model_name,
            endpoint_types=args.endpoint_types,
            discovery_backend=args.discovery_backend,
            enable_kv_routing=True,
            tool_call_parser=args.dyn_tool_call_parser,
            reasoning_parser=args.dyn_reasoning_parser,
        )
        return engine, worker

    async def start(self, worker_id: int) -> EngineConfig:
        from trtpipe.runtime.hf_loader import load_hf_checkpoint
        from trtpipe.serving.executor import Executor
        from trtpipe.serving.reference_engine import ReferenceEngine

        model = await asyncio.to_thread(load_hf_checkpoint, self.model_dir)
        self.eos_id = read_end_tokens(self.model_dir)  # EndTokens: every eos id of generation_config.json
        from trtpipe.serving.reference_engine import draft_engine

        drafts = await asyncio.to_thread(draft_engine, self.config, model, self.model_dir)
        self.executor = Executor(
            self.config, ReferenceEngine(model), threads=self.threads, guided=self._guided(model), draft_engine=drafts
        )
        self.executor.core.pool.listener = self.recorder
        if self.status_file is not None:  # the supervisor's evidence of which instance this process is
            write_state(self.status_file, {"pid": os.getpid(), "instance_id": int(worker_id)})
        log.info(
            "worker %s: %s loaded (%d KV blocks of %d tokens)",
            worker_id,
            self.model_dir,
            self.config.num_blocks,
            self.config.tokens_per_block,
        )
        return EngineConfig(
            model=str(self.model_dir),
            served_model_name=self.name,
            llm=LlmRegistration(
                context_length=self.config.max_seq_len,
                kv_cache_block_size=self.config.tokens_per_block,
                total_kv_blocks=self.config.num_blocks,
                max_num_seqs=self.config.max_batch_size,
                max_num_batched_tokens=self.config.max_num_tokens,
            ),
        )

    def _guided(self, model):
        """The executor's guided decoding (``serving.guided_decoding_backend``), on this model's tokenizer."""
        if not self.config.guided_decoding_backend:
            return None
        from transformers import AutoTokenizer

        from trtpipe.serving.guided import GuidedDecoder

        tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), trust_remote_code=False)
        vocab = int(model.config.get("vocab_size") or len(tokenizer))
        return GuidedDecoder.from_tokenizer(self.config.guided_decoding_backend, tokenizer, vocab)

    async def generate(self, request: dict, context: Any):
        normalize_request_token_ids(request)
        try:
            req = translate(request, self.eos_id, self.config.max_seq_len)
        except RequestRefused as exc:  # Dynamo answers InvalidArgument with a 4xx, anything else with a 500
            raise InvalidArgument(str(exc)) from None
        loop = asyncio.get_running_loop()
        responses: asyncio.Queue = asyncio.Queue()
        rid = self.executor.submit(req, lambda r: loop.call_soon_threadsafe(responses.put_nowait, r))
        produced, cancelled = 0, False
        while True:
            try:
                resp: Response = await asyncio.wait_for(responses.get(), POLL_S)
            except asyncio.TimeoutError:
                if not cancelled and context.is_stopped():  # the client went away: free its slot and blocks
                    self.executor.cancel(rid)
                    cancelled = True
                continue
            if resp.has_error:
                raise InvalidArgument(resp.error)
            produced += len(resp.tokens)
            chunk: dict = {"token_ids": list(resp.tokens), "index": 0}
            if resp.is_final:
                chunk["finish_reason"] = FINISH.get(resp.finish_reason, "stop")
                chunk["completion_usage"] = {
                    "prompt_tokens": len(req.prompt),
                    "completion_tokens": produced,
                    "total_tokens": len(req.prompt) + produced,
                }
                yield chunk
                return
            yield chunk

    async def abort(self, context: Any) -> None:
        """Cancellation is seen in :meth:`generate` (the context is stopped); nothing else holds resources."""

    async def register_prometheus(self, metrics: Any) -> None:
        """The pool's own reuse counters on the worker's ``/metrics`` (``trtpipe_kv_cache_{reused,missed}_blocks``):
        the hit rate a router achieved, summed over workers, is read from these, not inferred from routing."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.core import CounterMetricFamily

        from dynamo.common.backend.metrics import register_engine_registry

        engine = self

        class PoolCounters:
            def collect(self):
                if engine.executor is None:
                    return
                stats = engine.executor.core.pool.stats()
                for name, value, doc in (
                    ("kv_cache_reused_blocks", stats.reused_blocks, "prompt blocks taken from the reuse cache"),
                    ("kv_cache_missed_blocks", stats.missed_blocks, "prompt blocks computed (not cached)"),
                    (
                        "kv_events_published",
                        engine.published,
                        "KV events (stored, removed) handed to Dynamo's publisher",
                    ),
                ):
                    yield CounterMetricFamily(f"trtpipe_{name}", doc, value=value)

        registry = CollectorRegistry()
        registry.register(PoolCounters())
        register_engine_registry(metrics, registry, prefix_filters=["trtpipe_"])

    async def kv_event_sources(self) -> list:
        return [PushSource(on_ready=self._start_publisher, dp_rank=0)]

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        self._snapshots = publisher

    async def health_check_payload(self) -> Optional[dict]:
        return build_health_check_payload(bos_token_id=1)

    async def cleanup(self) -> None:
        self._stop.set()
        if self._publisher_thread is not None:
            self._publisher_thread.join(timeout=2.0)
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None

    # ---- publishing --------------------------------------------------------------------------------
    def _start_publisher(self, publisher: Any) -> None:
        self._publisher_thread = threading.Thread(
            target=self._publish, args=(publisher,), daemon=True, name="trtpipe-kv-events"
        )
        self._publisher_thread.start()

    def _publish(self, publisher: Any) -> None:
        """Events in the order the pool made them; a load snapshot after each burst and on every idle tick."""
        block = self.config.tokens_per_block
        while not self._stop.is_set():
            try:
                event = self.recorder.events.get(timeout=POLL_S)
            except queue.Empty:
                self._snapshot()
                continue
            try:
                if isinstance(event, Stored):
                    publisher.publish_stored(
                        token_ids=list(event.tokens),
                        num_block_tokens=[block],
                        block_hashes=[event.block_hash],
                        parent_hash=event.parent_hash,
                    )
                elif isinstance(event, Removed):
                    publisher.publish_removed(block_hashes=list(event.block_hashes))
                self.published += 1
            except Exception:  # a lost event makes routing worse, never wrong: keep serving, say so
                log.exception("KV event %s not published", event)
            if self.recorder.events.empty():
                self._snapshot()

    def _snapshot(self) -> None:
        if self._snapshots is None or self.executor is None:
            return
        stats = self.executor.core.pool.stats()
        self._snapshots.publish(
            0,
            ComponentSnapshot(
                kv_used_blocks=stats.used_blocks,
                kv_total_blocks=stats.max_blocks,
                gpu_cache_usage=stats.fraction_used,
                dp_rank=0,
                kv_cache_hit_rate=stats.cache_hit_rate if stats.reused_blocks + stats.missed_blocks else None,
            ),
        )


def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    run(TwinEngine, argv)


if __name__ == "__main__":
    main()
