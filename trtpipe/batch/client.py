"""The batch client loop: send the pending requests with bounded concurrency, journal each result as it comes.

One asyncio loop; at most ``Window.allowed`` requests in flight (never more than ``--concurrency``). A result is
written to the journal (output on 2xx, errors otherwise) before the next scheduling decision, so a kill at any
moment loses at most the requests in flight, which the next run sends again. What happens to a request:

  ============================  ==============================================================================
  2xx                           output file
  429 / 503                     window halved, every send paused (``Retry-After`` or backoff), sent again; the
                                try is not counted (the server was busy, the request did nothing wrong)
  400/422 naming ``priority``   the server predates the OpenAI ``priority`` field (trtllm-serve gained it in
                                NVIDIA/TensorRT-LLM PR #15329; its models forbid unknown fields): the job stops
                                sending it, says so once, and sends the request again
  500 / 502 / 504 / 408         sent again after a backoff, up to ``max_retries`` tries; then the errors file
  other 4xx                     errors file (the request itself is wrong; sending it again cannot help)
  connection lost / refused     the server is down: no new sends, ``/health`` probed (a server this job started
                                is started again) until it answers or ``server_wait_s`` passes; the request is
                                sent again, up to ``max_retries`` such losses (a request that kills the server
                                each time ends in the errors file instead of looping)
  ============================  ==============================================================================
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from trtpipe.batch.journal import Journal
from trtpipe.batch.pressure import (
    OVERLOAD_STATUS,
    RETRYABLE_STATUS,
    Window,
    backoff_s,
    parse_retry_after,
    server_load,
    under_pressure,
)
from trtpipe.batch.requests import BatchError, BatchRequest
from trtpipe.extras import require

PRIORITY_REJECTED_STATUS = (400, 422)
HEALTH_PROBE_MAX_S = 5.0


@dataclass
class ClientOptions:
    concurrency: int = 8
    priority: Optional[float] = 0.0  # OpenAI ``priority`` sent with each request (None: not sent)
    max_retries: int = 5
    request_timeout_s: float = 600.0
    server_wait_s: float = 300.0
    metrics_interval_s: float = 2.0  # 0: do not read the server's metrics
    checkpoint_interval_s: float = 10.0


@dataclass
class RunStats:
    """What this run did, for the summary."""

    sent: int = 0
    retried: int = 0
    overloaded: int = 0  # 429/503 answers
    connection_losses: int = 0
    metrics_backoffs: int = 0
    completion_tokens: int = 0
    priority_dropped: bool = False
    elapsed_s: float = 0.0  # from the server answering to the last result


class ServerGone(BatchError):
    """The server stayed unreachable; the job stops, resumable."""

    exit_code = 1


@dataclass
class Item:
    """A request waiting to be sent (again)."""

    req: BatchRequest
    tries: int = 0  # counted tries (retryable 5xx, connection losses)
    delay_s: float = 0.0


@dataclass
class Outcome:
    """What one try got: an HTTP answer (status, body, headers that matter) or the exception that lost it."""

    item: Item
    epoch: int
    status: Optional[int] = None
    body: Any = None
    text: str = ""
    request_id: str = ""
    retry_after: Optional[str] = None
    injected_priority: bool = False
    exc: Optional[BaseException] = None  # a connection loss or timeout


def result_line(
    custom_id: str, status: Optional[int], request_id: str, body: Any, error: Optional[dict] = None
) -> dict:
    """One line of OpenAI's Batch output/errors files (``BatchRequestOutput``): ``response`` for an HTTP answer,
    ``error`` ({code, message}) for a failure without one."""
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


def mentions_priority(status: int, text: str) -> bool:
    """A validation refusal that names the ``priority`` field (an older server's "extra inputs not permitted")."""
    return status in PRIORITY_REJECTED_STATUS and "priority" in text.lower()


class BatchClient:
    def __init__(
        self,
        base_url: str,
        journal: Journal,
        opts: ClientOptions,
        on_result: Callable[[bool], None],
        say: Callable[[str], None],
        revive: Optional[Callable[[], None]] = None,
        on_window: Optional[Callable[[int, int], None]] = None,
    ):
        self.url = base_url.rstrip("/")
        self.journal, self.opts, self.on_result, self.say = journal, opts, on_result, say
        self.revive = revive  # respawns a server this job started, when it died (None: not ours)
        self.on_window = on_window or (lambda in_flight, allowed: None)
        self.window = Window(opts.concurrency)
        self.stats = RunStats()
        self.send_priority = opts.priority is not None
        self.model: Optional[str] = None
        self.up = True
        self.in_flight = 0
        self._probe: Optional[asyncio.Task] = None
        self._overload_streak = 0
        self._aiohttp = require("aiohttp", "trtpipe batch")

    # --- the loop ---------------------------------------------------------------------------------------

    async def run(self, todo: list[BatchRequest]) -> RunStats:
        aiohttp = self._aiohttp
        timeout = aiohttp.ClientTimeout(total=self.opts.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=self.opts.concurrency + 2)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            self.session = session
            await self._await_server()
            t0 = time.monotonic()
            metrics = asyncio.create_task(self._watch_metrics()) if self.opts.metrics_interval_s > 0 else None
            try:
                await self._drain(deque(Item(r) for r in todo))
            finally:
                self.stats.elapsed_s = time.monotonic() - t0
                for t in (metrics, self._probe):
                    if t is not None:
                        t.cancel()
        return self.stats

    async def _drain(self, queue: deque) -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task] = set()
        try:
            while queue or tasks:
                if self._probe is not None and self._probe.done():
                    self._probe.result()  # ServerGone propagates from here
                    self._probe = None
                now = loop.time()
                while queue and self.up and len(tasks) < self.window.allowed and now >= self.window.paused_until:
                    tasks.add(asyncio.create_task(self._send(queue.popleft())))
                self.in_flight = len(tasks)
                self.on_window(self.in_flight, self.window.allowed)
                wake = min(
                    self.opts.checkpoint_interval_s, max(self.window.paused_until - now, 0.05) if self.up else 0.5
                )
                if tasks:
                    done, _ = await asyncio.wait(tasks, timeout=wake, return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(wake)
                    done = set()
                for t in done:
                    tasks.discard(t)
                    retry = self.settle(t.result(), loop.time())
                    if retry is not None:
                        queue.appendleft(retry)
                if self.journal.checkpoint_due(self.opts.checkpoint_interval_s):
                    self.journal.checkpoint("running")
        finally:
            for t in tasks:
                t.cancel()

    # --- one try ----------------------------------------------------------------------------------------

    def body_for(self, req: BatchRequest) -> tuple[dict, bool]:
        body = dict(req.body)
        if "model" not in body and self.model:
            body["model"] = self.model
        injected = self.send_priority and "priority" not in body
        if injected:
            body["priority"] = self.opts.priority
        return body, injected

    async def _send(self, item: Item) -> Outcome:
        if item.delay_s:
            await asyncio.sleep(item.delay_s)
        body, injected = self.body_for(item.req)
        out = Outcome(item, self.window.epoch, injected_priority=injected)
        self.stats.sent += 1
        try:
            async with self.session.post(self.url + item.req.url, json=body) as resp:
                out.status, out.retry_after = resp.status, resp.headers.get("Retry-After")
                out.request_id = resp.headers.get("x-request-id", "")
                out.text = await resp.text(errors="replace")
        except (self._aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            out.exc = exc
            return out
        try:
            out.body = json.loads(out.text)
        except ValueError:
            out.body = {"error": {"message": out.text[:2000], "type": "non_json_response"}}
        if not out.request_id and isinstance(out.body, dict) and isinstance(out.body.get("id"), str):
            out.request_id = out.body["id"]
        return out

    def settle(self, out: Outcome, now: float) -> Optional[Item]:
        """Journal the outcome, or return the item to send again (after adjusting the window)."""
        item, cid = out.item, out.item.req.custom_id
        if out.exc is not None:
            return self._lost(out, now)
        status = out.status
        if 200 <= status < 300:
            self._overload_streak = 0
            self.window.on_success()
            usage = out.body.get("usage") if isinstance(out.body, dict) else None
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                self.stats.completion_tokens += usage["completion_tokens"]
            return self._write(result_line(cid, status, out.request_id, out.body), failed=False)
        if status in OVERLOAD_STATUS:
            self.stats.overloaded += 1
            self._overload_streak += 1
            self.window.on_pressure(out.epoch)
            wait = parse_retry_after(out.retry_after, time.time())
            self.window.pause(now + (wait if wait is not None else backoff_s(self._overload_streak)))
            item.delay_s = 0.0
            return item
        if out.injected_priority and mentions_priority(status, out.text):
            if self.send_priority:
                self.send_priority = False
                self.stats.priority_dropped = True
                self.say(
                    f"warning: {self.url} refuses the 'priority' field ({status}: {out.text[:200]}); "
                    "sending the batch without it, at the server's default priority"
                )
            item.delay_s = 0.0
            return item
        if status in RETRYABLE_STATUS and item.tries < self.opts.max_retries:
            item.tries += 1
            self.stats.retried += 1
            item.delay_s = backoff_s(item.tries)
            return item
        return self._write(result_line(cid, status, out.request_id, out.body), failed=True)

    def _lost(self, out: Outcome, now: float) -> Optional[Item]:
        item = out.item
        self.stats.connection_losses += 1
        timed_out = isinstance(out.exc, asyncio.TimeoutError)
        if item.tries >= self.opts.max_retries:
            code = "timeout" if timed_out else "connection_error"
            msg = f"{type(out.exc).__name__}: {out.exc}" if str(out.exc) else type(out.exc).__name__
            return self._write(
                result_line(
                    item.req.custom_id, None, "", None, {"code": code, "message": f"{msg} ({item.tries + 1} tries)"}
                ),
                failed=True,
            )
        item.tries += 1
        self.stats.retried += 1
        item.delay_s = 0.0
        if not timed_out and self.up:
            self.up = False
            self._probe = asyncio.create_task(self._await_server())
        return item

    def _write(self, record: dict, failed: bool) -> None:
        self.journal.append(record, failed)
        self.on_result(not failed)
        return None

    # --- the server -------------------------------------------------------------------------------------

    async def _await_server(self) -> None:
        """Probe ``/health`` (and learn the model name) until the server answers, or raise ServerGone."""
        loop = asyncio.get_running_loop()
        deadline, attempt = loop.time() + self.opts.server_wait_s, 0
        while True:
            if self.revive is not None:
                self.revive()  # in this thread: the server's death signal is tied to the thread that started it
            if await self._healthy():
                self.up = True
                return
            if loop.time() >= deadline:
                raise ServerGone(
                    f"{self.url}: the server did not answer for {self.opts.server_wait_s:.0f} s; "
                    f"rerun the same command to resume ({self.journal.done} of {self.journal.total} "
                    "done)"
                )
            attempt += 1
            await asyncio.sleep(min(HEALTH_PROBE_MAX_S, 0.25 * 2 ** min(attempt, 5)))

    async def _healthy(self) -> bool:
        try:
            async with self.session.get(self.url + "/health", timeout=self._aiohttp.ClientTimeout(total=5)) as r:
                if r.status != 200:
                    return False
            if self.model is None:
                async with self.session.get(self.url + "/v1/models", timeout=self._aiohttp.ClientTimeout(total=5)) as r:
                    data = (await r.json()).get("data") if r.status == 200 else None
                    if data and isinstance(data[0], dict):
                        self.model = data[0].get("id")
            return True
        except (self._aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return False

    async def _watch_metrics(self) -> None:
        """Every ``metrics_interval_s``: halve the window while the server's gauges show pressure."""
        while True:
            await asyncio.sleep(self.opts.metrics_interval_s)
            if not self.up:
                continue
            try:
                async with self.session.get(
                    self.url + "/prometheus/metrics", timeout=self._aiohttp.ClientTimeout(total=5)
                ) as r:
                    if r.status == 404:
                        return  # this server has no Prometheus endpoint: 429/503 are the only signals
                    text = await r.text() if r.status == 200 else ""
            except (self._aiohttp.ClientError, asyncio.TimeoutError, OSError):
                continue
            if text and under_pressure(server_load(text), self.in_flight):
                if self.window.on_pressure(self.window.epoch):
                    self.stats.metrics_backoffs += 1
