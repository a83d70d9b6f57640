"""Triton python model ``tensorrt_llm``, CPU twin: the ``tensorrtllm`` backend's inputs, outputs, scheduling and
metrics, served by trtpipe's in-flight batching executor over the reference runtime (real tokens, not TensorRT).

A thin adapter: requests become executor requests (``trtpipe.serving.triton_adapter``), which join the running
batch at the next step; responses are sent from the executor thread as tokens come. Client cancellation (checked
every ``cancellation_check_period_ms``) and ``stop=true`` requests cancel at the next step. The backend's
Prometheus families are updated every ``stats_check_period_ms`` from the executor's last iteration record.
"""

import os
import queue
import threading

import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _error(message):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


class TritonPythonModel:
    def initialize(self, args):
        import json
        import os

        import torch

        from trtpipe.runtime import load_checkpoint
        from trtpipe.serving import triton_adapter
        from trtpipe.serving.executor import Executor
        from trtpipe.serving.reference_engine import ReferenceEngine
        from trtpipe.triton import executor_guard, stub_watchdog

        # A send to a dead tritonserver blocks holding the GIL: only another process can end this stub then.
        if stub_watchdog.start() is None:
            pb_utils.Logger.log_warn(
                "tensorrt_llm twin: no python3 for the stub watchdog; a kill -9 of "
                "tritonserver can leave this stub running"
            )
        self.twin = triton_adapter
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.settings = triton_adapter.settings_from_model_config(config, args["model_repository"])
        torch.set_num_threads(self.settings.cpu_threads)
        run_dir = os.environ.get("TRTPIPE_MPI_RUN_DIR")
        if run_dir and args["model_name"] == "tensorrt_llm_draft":  # the two-model form's draft in leader mode:
            from trtpipe.serving.draft_proxy import DraftClient  # its shards run on the ranks, through the target

            self.engine = DraftClient(run_dir)
        elif run_dir:  # rank 0 of a leader-mode mpiexec job: its shard here, the other ranks follow each step
            from trtpipe.processes import DRAFT_DIR_ENV
            from trtpipe.serving.draft_proxy import DraftServer
            from trtpipe.serving.mpi_engine import start_leader

            self.engine = start_leader(str(self.settings.engine_dir), run_dir, os.environ.get(DRAFT_DIR_ENV))
            if getattr(self.engine, "draft", None) is not None:  # the two-model form: serve the draft's stub
                self.draft_server = DraftServer(self.engine.draft, run_dir)
        else:
            from trtpipe.serving import orchestrator_world

            if orchestrator_world.enabled() and orchestrator_world.world_of(self.settings.engine_dir) > 1:
                # orchestrator mode: this instance's own MPI world of rank workers, driven from here
                self.world = orchestrator_world.World(self.settings.engine_dir, args["model_name"])
                self.engine = self.world.client
            else:
                self.engine = ReferenceEngine(load_checkpoint(self.settings.engine_dir / "checkpoint", device="cpu"))
        from trtpipe.serving.reference_engine import draft_engine  # the recipe's draft or Medusa heads, else None

        # an engine built with LoRA: the prefetched tasks loaded now, each entry its own adapter in a step
        self.adapters = triton_adapter.twin_adapters(config, args["model_repository"], self.settings)
        if self.adapters is not None:  # in leader mode the worker ranks attach their shards (RankLora)
            self.engine = self.adapters.wrap(self.engine)

        self.guided = triton_adapter.guided_decoder(self.settings)
        self.executor = Executor(
            self.settings.executor,
            executor_guard.with_fault(self.engine),
            threads=self.settings.cpu_threads,
            guided=self.guided,
            draft_engine=draft_engine(
                self.settings.executor, getattr(self.engine, "model", None), self.settings.engine_dir / "checkpoint"
            ),
        )
        # tritonserver cannot see this thread: a loop that dies stops the server, so readiness fails at once
        executor_guard.guard(self.executor, pb_utils.Logger.log_error)
        params = config.get("parameters", {})
        self.cancel_period = int(triton_adapter.param(params, "cancellation_check_period_ms", "100")) / 1000
        self.stats_period = int(triton_adapter.param(params, "stats_check_period_ms", "100")) / 1000
        self.live = {}  # executor id -> (response sender, Triton request id)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._metrics(args)
        self.outbox = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=f, daemon=True)
            for f in (self._watch_cancellation, self._report_stats, self._send_responses)
        ]
        for t in self.threads:
            t.start()

    # ---- metrics ---------------------------------------------------------------------------------
    def _metrics(self, args):
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.gauges, self.families = {}, []
        for family, (category, doc) in self.twin.GAUGES.items():
            fam = pb_utils.MetricFamily(name=family, description=doc, kind=pb_utils.MetricFamily.GAUGE)
            self.families.append(fam)
            for (name, value), _ in self.twin.gauge_values(self._zero_stats()).items():
                if name == family:
                    self.gauges[(name, value)] = fam.Metric(labels={**labels, category: value})
        self.histograms = {}
        for family, (category, value, doc) in self.twin.HISTOGRAMS.items():
            fam = pb_utils.MetricFamily(name=family, description=doc, kind=pb_utils.MetricFamily.HISTOGRAM)
            self.families.append(fam)
            self.histograms[family] = fam.Metric(labels={**labels, category: value}, buckets=self.twin.TOKEN_BUCKETS)
        # guided decoding: the OpenAI twin's counters (trtpipe.serving.guided.COUNTERS), raised by what changed
        self.counters = {}
        self.counted_lock = threading.Lock()
        if self.guided is not None:
            from trtpipe.serving.guided import COUNTERS

            for family, attr, doc in COUNTERS:
                fam = pb_utils.MetricFamily(name=family, description=doc, kind=pb_utils.MetricFamily.COUNTER)
                self.families.append(fam)
                self.counters[attr] = fam.Metric(labels=labels)
            self.counted = self.guided.snapshot()

    def _zero_stats(self):
        from trtpipe.serving.executor import IterationStats

        return IterationStats(
            0, 0, 0, self.settings.executor.max_batch_size, 0, 0, 0, 0, 0, 0, 0.0, self.executor.core.pool.stats()
        )

    def _report_stats(self):
        path = os.environ.get(self.twin.ITER_STATS_ENV)
        log = self.twin.IterationLog(path) if path else None
        while not self.stopping.wait(self.stats_period):
            if log is not None:
                log.write_new(self.executor.core.iterations)
            stats = self.executor.stats()
            if stats is not None:
                for key, value in self.twin.gauge_values(stats).items():
                    self.gauges[key].set(float(value))
            finished = self.executor.core.finished_lengths
            while finished:
                n_in, n_out = finished.popleft()
                self.histograms["nv_llm_input_token_len"].observe(n_in)
                self.histograms["nv_llm_output_token_len"].observe(n_out)
            self._count_guided()
        if log is not None:  # the last steps before the stop, then the file is closed
            log.write_new(self.executor.core.iterations)
            log.close()

    def _count_guided(self):
        """Raise the guided-decoding counters by what changed since the last call. Called by the stats loop and
        before each final response, so a client that has its answer reads metrics that include its request."""
        if not self.counters:
            return
        with self.counted_lock:
            now = self.guided.snapshot()
            for attr, metric in self.counters.items():
                if getattr(now, attr) > getattr(self.counted, attr):
                    metric.increment(getattr(now, attr) - getattr(self.counted, attr))
            self.counted = now

    # ---- requests --------------------------------------------------------------------------------
    def _watch_cancellation(self):
        while not self.stopping.wait(self.cancel_period):
            # Under the lock: a request leaves ``live`` (under the lock) before its final response is sent, and
            # asking a finished request's sender would touch a response factory the server already freed.
            with self.lock:
                for rid, (sender, _) in self.live.items():
                    if sender.is_cancelled():
                        self.executor.cancel(rid)

    def _stop(self, request):
        """``stop=true``: cancel every executor request of this Triton request id; answer with an empty final."""
        tid = request.request_id()
        if not tid:
            raise ValueError("a stop request needs the request id of the request to stop")
        with self.lock:
            for rid, (_, owner) in list(self.live.items()):
                if owner == tid:
                    self.executor.cancel(rid)

    def _send_responses(self):
        """Responses leave on their own thread (as in the backend), so the step loop never waits on IPC."""
        while True:
            item = self.outbox.get()
            if item is None:
                return
            respond, resp = item
            try:
                respond(resp)
            except Exception as exc:  # one undeliverable response must not stop everyone's
                pb_utils.Logger.log_error(f"tensorrt_llm twin: response {resp.request_id} not delivered: {exc}")

    def _submit(self, request, parsed, deliver):
        def respond(resp):
            if resp.is_final:  # also a request its client cancelled: the server keeps its state until the final
                with self.lock:
                    self.live.pop(resp.request_id, None)
                self._count_guided()
            if resp.has_error:
                deliver(
                    _error(
                        f"Executor failed process requestId {resp.request_id} due to the following error: {resp.error}"
                    ),
                    True,
                )
                return
            if resp.is_final and parsed.request.streaming and not resp.tokens and not parsed.wants_outputs_at_end:
                deliver(None, True)  # a flag-only final response, as the backend sends after the last token
                return
            tensors = [pb_utils.Tensor(n, a) for n, a in self.twin.response_outputs(resp, parsed)]
            deliver(pb_utils.InferenceResponse(output_tensors=tensors), resp.is_final)

        def on_response(resp):  # on the executor thread: hand over and go back to stepping
            self.outbox.put((respond, resp))

        with self.lock:  # registered before the first response can arrive
            rid = self.executor.submit(parsed.request, on_response)
            if self.decoupled:
                self.live[rid] = (request.get_response_sender(), request.request_id())

    def execute(self, requests):
        results = [None] * len(requests)
        done = [threading.Event() for _ in requests]
        for i, request in enumerate(requests):
            sender = request.get_response_sender() if self.decoupled else None

            def deliver(response, final, i=i, sender=sender):
                if sender is not None and response is None:
                    sender.send(flags=FINAL)
                elif sender is not None:
                    sender.send(response, flags=FINAL if final else 0)
                elif final:
                    results[i] = response
                    done[i].set()

            def get(name, request=request):
                t = pb_utils.get_input_tensor_by_name(request, name)
                return None if t is None else t.as_numpy()

            try:
                parsed = self.twin.parse_request(get, self.settings, self.decoupled, self.adapters)
                if parsed.stop:
                    self._stop(request)
                    deliver(pb_utils.InferenceResponse(output_tensors=[]), True)
                else:
                    self._submit(request, parsed, deliver)
            except Exception as exc:  # bad input, or the executor queue is full: this request only
                self._count_guided()  # e.g. a guide that did not compile
                deliver(_error(str(exc)), True)
        if self.decoupled:
            return None
        for event in done:
            event.wait()
        return results

    def finalize(self):
        self.stopping.set()
        self.executor.shutdown()
        self.outbox.put(None)
        if hasattr(self.engine, "shutdown"):  # leader mode: release the worker ranks
            self.engine.shutdown()
        if getattr(self, "world", None) is not None:  # orchestrator mode: stop this instance's MPI world
            self.world.close()
