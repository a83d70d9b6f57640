"""Triton python model ``tensorrt_llm_bls`` (docs/reference/triton-repository.md#tensorrt_llm_bls):
preprocessing → tensorrt_llm in python.

With ``accumulate_tokens`` (trtpipe writes true) a streamed answer is re-decoded from all tokens so far and
only the new text is sent: the pieces join to exactly the non-streamed text, with no broken words or
half UTF-8 characters (a trailing U+FFFD is held back until the next token completes it).

``min_tokens`` and ``return_log_probs`` go to tensorrt_llm, and ``cum_log_probs`` / ``output_log_probs`` come back,
as upstream's BLS passes them (NVIDIA/TensorRT-LLM triton_backend/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/
lib/triton_decoder.py@07f3e442: ``_get_llm_tensors_from_request``, ``_get_response``). Upstream sends one response
per tensorrt_llm response, each with that response's tensors; here a streamed piece carries the log probs of every
token since the previous piece (a piece held back for its U+FFFD passes its tokens' log probs on to the next), so
the pieces' ``output_log_probs`` join to the non-streamed ones, and ``cum_log_probs`` is the latest response's.

Draft-target speculative decoding in upstream's two-model form (``tensorrt_llm_draft_model_name`` names the draft
``tensorrt_llm`` model; a request asks with ``num_draft_tokens``): the loop of upstream's
``tensorrt_llm_bls/1/lib/decode.py@4db68284`` ``Decoder._spec_generate`` -- the draft model generates
k = min(num_draft_tokens, tokens left - 1) tokens after the sequence so far, the target gets the sequence with those
as ``draft_input_ids`` and ``request_output_len`` k + 1 (``triton_decoder.py@07f3e442``
``_get_llm_tensors_from_request``), verifies them in one forward and returns the accepted drafts and its own next
token, which are appended; until max_tokens, an end (the target returned fewer than k + 1 tokens) or a stop word.
As upstream: not streamed, no context logits; ``use_draft_logits`` sends the draft's ``generation_logits`` to the
target as ``draft_logits`` (verification by rejection sampling: trtpipe/serving/draft_logits.py). Here also refused in
one line: ``return_log_probs`` and ``min_tokens`` (they would count per round, not per request).
``acceptance_rate`` / ``total_accepted_draft_tokens`` / ``total_draft_tokens`` come back with ``return_perf_metrics``
summed over the rounds (upstream returns the last round's target response).
"""

import collections
import json
import os
import queue
import re
import signal
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

_TRUE = {"true", "1", "t", "y", "yes"}
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# How much longer than the CPU twin's request_timeout_s a stream may go without its final response before the BLS
# counts that response as lost (the twin fails a late request at its next step; a step takes far less than this).
GRACE_S = 5.0
# front input → (model, its input name)
_PRE = {
    "text_input": "QUERY",
    "max_tokens": "REQUEST_OUTPUT_LEN",
    "bad_words": "BAD_WORDS_DICT",
    "stop_words": "STOP_WORDS_DICT",
    "end_id": "END_ID",
    "pad_id": "PAD_ID",
}
_LLM = {
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "temperature": "temperature",
    "seed": "seed",
    "exclude_input_in_output": "exclude_input_in_output",
    "stream": "streaming",
    "return_perf_metrics": "return_perf_metrics",
    "return_num_input_tokens": "return_num_input_tokens",
    "return_num_output_tokens": "return_num_output_tokens",
    "guided_decoding_guide_type": "guided_decoding_guide_type",
    "guided_decoding_guide": "guided_decoding_guide",
    "min_tokens": "min_tokens",
    "return_log_probs": "return_log_probs",
    "lora_task_id": "lora_task_id",
    "lora_weights": "lora_weights",
    "lora_config": "lora_config",
}
_SHAPED = ("lora_weights", "lora_config")  # passed on with their shape ([1, rows, width], [1, rows, 3])
# tensorrt_llm outputs passed through with the last text response when the request asked for them
_MEASURED = (
    "kv_cache_alloc_new_blocks",
    "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks",
    "arrival_time_ns",
    "first_scheduled_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
    "num_input_tokens",
    "num_output_tokens",
)
# the request inputs that ask for _MEASURED
_ASK_MEASURED = ("return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens")
_PRE_OUT = {
    "INPUT_ID": "input_ids",
    "REQUEST_INPUT_LEN": "input_lengths",
    "REQUEST_OUTPUT_LEN": "request_output_len",
    "STOP_WORDS_IDS": "stop_words_list",
    "BAD_WORDS_IDS": "bad_words_list",
    "OUT_END_ID": "end_id",
    "OUT_PAD_ID": "pad_id",
}


def _param(params, key, default=None):
    value = params.get(key, {}).get("string_value", "")
    return default if value == "" or value.startswith("${") else value


def _start_watchdog():
    """End this stub if tritonserver dies (kill -9): its request threads could wait on tensorrt_llm forever.

    Under ``trtpipe serve`` a watchdog process does it (a blocked send can hold the GIL, so a thread cannot
    be relied on); where trtpipe is not installed (a stock Triton image), a thread that checks the parent."""
    try:
        from trtpipe.triton import stub_watchdog
    except ImportError:
        stub_watchdog = None
    if stub_watchdog is not None and stub_watchdog.start() is not None:
        return
    parent = os.getppid()

    def exit_with_parent():
        while True:
            time.sleep(0.2)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=exit_with_parent, daemon=True).start()


def _log_prob_tensors(asked, values, cum):
    """``output_log_probs`` [1, 1, L] of ``values`` and ``cum_log_probs`` [1, 1], as tensorrt_llm shapes them; none
    unless the request asked (``return_log_probs``) or before tensorrt_llm sent any."""
    if not asked or cum is None:
        return []
    return [
        pb_utils.Tensor("cum_log_probs", np.array([[cum]], np.float32)),
        pb_utils.Tensor("output_log_probs", np.array(values, np.float32).reshape(1, 1, len(values))),
    ]


# the acceptance outputs of a speculative request (tensorrt_llm_bls/config.pbtxt@0193dbd4 declares them)
_ACCEPTANCE = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
# inputs a speculative round sets itself (the rest of the request's tensorrt_llm inputs go to both models)
_ROUND_SET = (
    "input_ids",
    "input_lengths",
    "request_output_len",
    "exclude_input_in_output",
    "streaming",
    "return_perf_metrics",
    "return_num_input_tokens",
    "return_num_output_tokens",
)


def _words(stop_words_list):
    """The token sequences of a ``stop_words_list`` tensor [1, 2, L] (ids, then end offsets padded with -1)."""
    if stop_words_list is None or stop_words_list.size == 0:
        return []
    ids, offsets = stop_words_list.reshape(2, -1)
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        words.append(ids[start:end].tolist())
        start = int(end)
    return [w for w in words if w]


class _Failed(Exception):
    """A failure to pass on as it is: its message, and the error code of the model that failed (None: INTERNAL)."""

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = code

    @classmethod
    def of(cls, error):
        """From a ``TritonError`` of a response: a request's own fault (INVALID_ARG, 400) stays one."""
        return cls(error.message(), error.code())


def _pbtxt_params(text):
    """A config.pbtxt's string parameters, shaped as in the model config JSON (for ``_param``)."""
    pairs = re.findall(r'key:\s*"([^"]+)"\s*value\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"', text)
    return {key: {"string_value": re.sub(r"\\(.)", r"\1", value)} for key, value in pairs}


def _request_timeout_s(llm_config_text):
    """The longest a request can live in the CPU twin's ``tensorrt_llm`` (its executor fails a request that has not
    finished ``serving.request_timeout_s`` after it arrived; trtpipe writes it into ``executor_extras``). None for
    a model without it (the TensorRT-LLM backend): then nothing bounds the wait for a final response."""
    extras = _param(_pbtxt_params(llm_config_text), "executor_extras")
    try:
        timeout = float(json.loads(extras)["request_timeout_s"]) if extras else 0.0
    except (ValueError, KeyError, TypeError):
        return None
    return timeout if timeout > 0 else None


class _InnerStreaming:
    """Whether a request the client did not stream may still go to a decoupled tensorrt_llm as a stream.

    It should: a thread waiting in a response iterator keeps new calls out (``_IteratorGate``), so one long
    unstreamed request would hold up every request that arrives after it (measured: 8 tokens took 0.87 s instead
    of 0.07 s behind a 400-token request), and a client's cancel would only be seen at its end. Streamed, the wait
    ends every step. Not where the executor refuses streaming: a pausing capacity policy without chunked context
    for a request that may outgrow max_input_len, and static batching (the executor's admission rule, as in
    trtpipe.serving.executor: this model also runs on stock Triton images, without trtpipe).
    """

    def __init__(self, llm_config_text, llm_dir):
        params = _pbtxt_params(llm_config_text)
        p = lambda key, default=None: _param(params, key, default)  # noqa: E731
        self.static = str(p("gpt_model_type", "inflight_fused_batching")).lower() == "v1"
        self.pausing = str(p("batch_scheduler_policy", "guaranteed_no_evict")).lower() != "guaranteed_no_evict"
        self.chunked = str(p("enable_chunked_context", "false")).lower() in _TRUE
        self.exclude_default = str(p("exclude_input_in_output", "false")).lower() in _TRUE
        self.max_input_len = None
        engine = p("gpt_model_path")
        if engine is not None:
            try:
                with open(os.path.join(llm_dir, engine, "config.json")) as fh:
                    self.max_input_len = int(json.load(fh)["build_config"]["max_input_len"])
            except (OSError, ValueError, KeyError, TypeError):
                pass

    def allows(self, input_len, max_tokens):
        if self.static:
            return False
        if self.pausing and not self.chunked:
            return self.max_input_len is not None and input_len + max_tokens - 1 <= self.max_input_len
        return True


class _Lost(Exception):
    """No final response by the stream's deadline."""


class _IteratorGate:
    """Keeps ``exec(decoupled=True)`` and waits in a response iterator's ``next()`` apart, and bounds every wait.

    The python backend's decoupled BLS (2.51, and the same locks upstream since) takes three locks in a cycle:
    a thread woken inside ``next()`` holds its iterator's mutex while it waits for the GIL; the stub's response
    thread holds the iterator map's mutex while it waits for that iterator's mutex; and ``exec(decoupled=True)``
    holds the GIL while it waits for the map's mutex. With several streams in flight a new request can hang the
    whole stub (seen after a few thousand requests at concurrency 4). So a new call waits until the streams in
    flight have each taken their next response (about one engine step), and they wait until it has returned.

    A wait inside ``next()`` may never end: tritonserver 2.51's python backend loses the error response of a
    decoupled BLS call (python_backend r24.10 ``src/infer_response.cc`` ``InferResponse::SaveToSharedMemory``
    writes the response's id only when it has no error, so the stub files it under a stale id; fixed upstream in
    python_backend 7f21b67, r25.04). So a new call does not wait for a thread that has been inside ``next()``
    longer than ``PATIENCE_S`` (one lost final would otherwise keep every later request out), and each stream is
    read by a thread of its own, so its consumer can give up at a deadline while that thread reads on to the end.
    """

    # A finished response iterator is let go only this long after its last response (see ``_retire``).
    HOLD_S = 2.0
    # A new call waits at most this long for the threads inside next(): much longer than an engine step.
    PATIENCE_S = 5.0

    def __init__(self, stuck_s=None, on_stuck=None):
        self.cv = threading.Condition()
        self.inside = {}  # reader thread id -> when it entered next()
        self.calling = {}  # caller thread id -> when it began to wait for, or entered, exec(decoupled=True)
        self.retired = collections.deque()  # (time finished, iterator)
        if stuck_s is not None and on_stuck is not None:
            threading.Thread(target=self._watch, args=(stuck_s, on_stuck), daemon=True).start()

    def call(self, request):
        me = threading.get_ident()
        with self.cv:
            self.calling[me] = time.monotonic()
            while True:
                now = time.monotonic()
                fresh = [t for t in self.inside.values() if now - t < self.PATIENCE_S]
                if not fresh:
                    break
                self.cv.wait(self.PATIENCE_S - (now - min(fresh)))
        try:
            return request.exec(decoupled=True)
        finally:
            with self.cv:
                del self.calling[me]
                self.cv.notify_all()

    def responses(self, responses, deadline=None):
        """A decoupled call's responses, read to their end by a thread of its own (only an iterator read to its end
        is let go by the stub), each wait for the next one inside the gate. Raises ``_Lost`` when the stream has
        not ended by ``deadline`` (``time.monotonic()``; None: no limit). The consumer may stop at any point."""
        box = queue.SimpleQueue()
        it = iter(responses)

        def read():
            while True:
                resp = self._next(it)
                box.put(resp)
                if resp is None:
                    self._retire(it)
                    return

        threading.Thread(target=read, daemon=True).start()
        while True:
            try:
                resp = box.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise _Lost() from None
            if resp is None:
                return
            yield resp

    def _next(self, it):
        me = threading.get_ident()
        with self.cv:
            self.cv.wait_for(lambda: not self.calling)
            self.inside[me] = time.monotonic()
        try:
            return next(it, None)
        finally:
            with self.cv:
                del self.inside[me]
                self.cv.notify_all()

    def _watch(self, stuck_s, on_stuck):
        """Call ``on_stuck(seconds)`` once a call has waited for, or been inside, exec() longer than ``stuck_s``."""
        while True:
            time.sleep(1.0)
            with self.cv:
                oldest = min(self.calling.values(), default=None)
            if oldest is not None and time.monotonic() - oldest > stuck_s:
                on_stuck(time.monotonic() - oldest)
                return

    def _retire(self, it):
        """Keep a finished iterator a while, so that this thread, holding the GIL, drops the last reference.

        On its last response the iterator queues its removal from the stub's iterator map, which another stub
        thread carries out without the GIL. If that map entry were the last reference, the iterator's kept
        responses would free their numpy arrays there, without the GIL, and corrupt the interpreter's heap (the
        BLS stub then dies in pymalloc; seen in soaks with client cancellations, gdb stack in docs/reference/serving.md).
        The removal takes well under a millisecond; ``HOLD_S`` leaves it thousands of times that.
        """
        now = time.monotonic()
        done = []
        with self.cv:
            self.retired.append((now, it))
            while self.retired and now - self.retired[0][0] > self.HOLD_S:
                done.append(self.retired.popleft())
        del done  # dropped here, with the GIL held


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        self.config = json.loads(args["model_config"])
        params = self.config.get("parameters", {})
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.config)
        self.accumulate = str(_param(params, "accumulate_tokens", "false")).lower() in _TRUE
        self.llm_name = _param(params, "tensorrt_llm_model_name", "tensorrt_llm")
        self.draft_name = _param(params, "tensorrt_llm_draft_model_name", "")
        tok_dir = _param(params, "tokenizer_dir", "tokenizer")
        if not os.path.isabs(tok_dir):
            tok_dir = os.path.join(args["model_repository"], tok_dir)
        elif not os.path.isdir(tok_dir):  # moved away from the files it was built from: the copy beside this model
            pb_utils.Logger.log_warn(f"tokenizer_dir {tok_dir} does not exist; using this model's tokenizer/")
            tok_dir = os.path.join(args["model_repository"], "tokenizer")
        self.tokenizer = AutoTokenizer.from_pretrained(tok_dir, legacy=False, trust_remote_code=False)
        _start_watchdog()
        llm_dir = os.path.join(os.path.dirname(args["model_repository"]), self.llm_name)
        with open(os.path.join(llm_dir, "config.pbtxt")) as fh:
            llm_config = fh.read()
        self.llm_decoupled = "decoupled: true" in llm_config  # then tensorrt_llm must be called as decoupled
        self.inner_streaming = _InnerStreaming(llm_config, llm_dir)
        # Every request ends within request_timeout_s in the twin: a call to it waiting longer is stuck for good.
        self.request_timeout_s = _request_timeout_s(llm_config)
        stuck_s = None if self.request_timeout_s is None else self.request_timeout_s + GRACE_S
        self.gate = _IteratorGate(stuck_s, self._stuck)

    @staticmethod
    def _stuck(seconds):
        """A call into tensorrt_llm has not returned long after every request there must have ended. tritonserver
        2.51 gives a python model no way to turn unready, so stop the server (as the twin does when its executor
        loop dies, ``trtpipe.triton.executor_guard``): readiness fails at once and its supervisor takes over."""
        server = os.getppid()
        pb_utils.Logger.log_error(
            f"tensorrt_llm_bls: a call into tensorrt_llm has been stuck for {seconds:.0f} s; stopping tritonserver "
            f"(pid {server}) so the deployment turns unready and is restarted"
        )
        try:
            os.kill(server, signal.SIGTERM)
        except ProcessLookupError:
            pass

    @staticmethod
    def _text(text, measured=()):
        """A response and its tensors: the caller keeps the tensors until the response is sent. The sender drops
        outputs the client did not ask for without the GIL, which must not free the last reference to them."""
        tensors = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object)), *measured]
        return pb_utils.InferenceResponse(output_tensors=tensors), tensors

    def _call(self, model, inputs, outputs, decoupled=False, request_id=""):
        req = pb_utils.InferenceRequest(
            model_name=model, requested_output_names=outputs, inputs=inputs, request_id=request_id
        )
        if decoupled:
            return self.gate.call(req)
        resp = req.exec()
        if resp.has_error():
            raise _Failed.of(resp.error())
        return resp

    def _stop(self, llm_inputs, inner_id):
        """Cancel the inner tensorrt_llm request by its id (``stop``); its stream still ends with a final."""
        stop = llm_inputs + [pb_utils.Tensor("stop", np.array([[True]], dtype=bool))]
        try:
            for _ in self.gate.responses(
                self._call(self.llm_name, stop, [], True, inner_id), time.monotonic() + GRACE_S
            ):
                pass
        except _Lost:
            pass

    def _generate(self, request, cancelled=lambda: False):
        """Yield (new text, final, its output tensors) for one request; nothing more once ``cancelled()``.

        After a client cancel the inner tensorrt_llm request is cancelled too; its remaining responses are read to
        the end by the gate's reader thread (a response nobody takes would hold up the model sending it). An error
        response ends the stream at once; a stream with no final response by the twin's request_timeout_s (+
        ``GRACE_S``) lost it (see ``_IteratorGate``) and ends with an error saying so.
        """
        pre_inputs = []
        for name, target in _PRE.items():
            t = pb_utils.get_input_tensor_by_name(request, name)
            if t is not None:
                pre_inputs.append(pb_utils.Tensor(target, t.as_numpy().reshape(1, -1)))
        pre = self._call("preprocessing", pre_inputs, list(_PRE_OUT))
        llm_inputs = [
            pb_utils.Tensor(dst, pb_utils.get_output_tensor_by_name(pre, src).as_numpy())
            for src, dst in _PRE_OUT.items()
        ]
        given = {}
        for name, target in _LLM.items():
            t = pb_utils.get_input_tensor_by_name(request, name)
            if t is not None:
                given[name] = t.as_numpy() if name in _SHAPED else t.as_numpy().reshape(1, -1)
                if name != "stream":
                    llm_inputs.append(pb_utils.Tensor(target, given[name]))
        stream = bool(given["stream"].reshape(-1)[0]) if "stream" in given else False
        k_t = pb_utils.get_input_tensor_by_name(request, "num_draft_tokens")
        k = int(k_t.as_numpy().reshape(-1)[0]) if k_t is not None else 0
        if k > 0:
            self._check_speculative(request, given, stream)
            logits_t = pb_utils.get_input_tensor_by_name(request, "use_draft_logits")
            use_logits = logits_t is not None and bool(logits_t.as_numpy().reshape(-1)[0])
            yield from self._speculate(pre, given, llm_inputs, k, cancelled, use_logits)
            return
        prefix = []  # the prompt, for an unstreamed answer that includes it but is read as a stream
        inner_stream = stream
        if self.llm_decoupled and not stream:
            in_len = int(pb_utils.get_output_tensor_by_name(pre, "REQUEST_INPUT_LEN").as_numpy().reshape(-1)[0])
            out_len = int(pb_utils.get_output_tensor_by_name(pre, "REQUEST_OUTPUT_LEN").as_numpy().reshape(-1)[0])
            if self.inner_streaming.allows(in_len, out_len):
                inner_stream = True
                exclude = (
                    bool(given["exclude_input_in_output"].reshape(-1)[0])
                    if "exclude_input_in_output" in given
                    else self.inner_streaming.exclude_default
                )
                if not exclude:
                    prefix = (
                        pb_utils.get_output_tensor_by_name(pre, "INPUT_ID").as_numpy().reshape(-1)[:in_len].tolist()
                    )
        if "stream" in given or inner_stream:
            llm_inputs.append(pb_utils.Tensor("streaming", np.array([[inner_stream]], dtype=bool)))
        outputs = ["output_ids", "sequence_length"]
        asked = [n for n in _ASK_MEASURED if pb_utils.get_input_tensor_by_name(request, n) is not None]
        if asked:
            outputs += list(_MEASURED)
        log_probs = "return_log_probs" in given and bool(given["return_log_probs"].reshape(-1)[0])
        if log_probs:
            outputs += ["cum_log_probs", "output_log_probs"]
        inner_id = f"bls-{uuid.uuid4().hex}"
        if self.llm_decoupled:
            timeout = self.request_timeout_s
            deadline = None if timeout is None else time.monotonic() + timeout + GRACE_S
            upcoming = self.gate.responses(self._call(self.llm_name, llm_inputs, outputs, True, inner_id), deadline)
        else:
            upcoming = iter([self._call(self.llm_name, llm_inputs, outputs, request_id=inner_id)])
        tokens, sent, measured = list(prefix), "", []
        pending, cum = [], None  # log probs of the tokens not yet sent; the latest cumulative log prob
        try:
            for resp in upcoming:
                if cancelled():
                    if self.llm_decoupled:
                        self._stop(llm_inputs, inner_id)
                    return
                if resp.has_error():  # an error response is the stream's last
                    raise _Failed.of(resp.error())
                got = [pb_utils.get_output_tensor_by_name(resp, n) for n in _MEASURED] if asked else []
                measured = [pb_utils.Tensor(t.name(), t.as_numpy()) for t in got if t is not None] or measured
                if log_probs:
                    lp_t = pb_utils.get_output_tensor_by_name(resp, "output_log_probs")
                    cum_t = pb_utils.get_output_tensor_by_name(resp, "cum_log_probs")
                    pending += [] if lp_t is None else lp_t.as_numpy().reshape(-1).tolist()
                    cum = cum if cum_t is None else float(cum_t.as_numpy().reshape(-1)[0])
                ids_t = pb_utils.get_output_tensor_by_name(resp, "output_ids")
                if ids_t is None:  # the final flag-only response
                    continue
                ids = ids_t.as_numpy().reshape(-1)  # [1, 1, L]: one sequence, beam 1
                n = int(pb_utils.get_output_tensor_by_name(resp, "sequence_length").as_numpy().reshape(-1)[0])
                tokens += ids[:n].tolist()
                if stream and self.decoupled:  # a model that is not decoupled sends one response
                    text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                    if text.endswith("\ufffd") or not text.startswith(sent):
                        continue
                    if len(text) > len(sent):
                        yield text[len(sent) :], False, _log_prob_tensors(log_probs, pending, cum)
                        sent, pending = text, []
        except _Lost:
            self._stop(llm_inputs, inner_id)  # should it still run there, end it
            raise _Failed(
                f"tensorrt_llm_bls: {self.llm_name} sent no final response within its request_timeout_s "
                f"({self.request_timeout_s:g} s) + {GRACE_S:g} s: the request timed out or failed there, and "
                f"tritonserver 2.51's python backend lost its error response (a decoupled BLS call's error "
                f"responses carry no request id before python_backend r25.04)"
            ) from None
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        extra = [*_log_prob_tensors(log_probs, pending, cum), *measured]
        yield (text[len(sent) :] if text.startswith(sent) else text), True, extra

    def _check_speculative(self, request, given, stream):
        """One line for what a speculative request cannot have (upstream's ``Request.validate`` and model.py)."""
        invalid = getattr(pb_utils.TritonError, "INVALID_ARG", None)
        if not self.draft_name:
            raise _Failed("cannot perform speculative decoding without draft model", invalid)
        if stream:
            raise _Failed("streaming is not supported with speculative decoding", invalid)
        refused = [
            ("return_log_probs", "return_log_probs" in given and bool(given["return_log_probs"].reshape(-1)[0])),
            ("min_tokens", "min_tokens" in given and int(given["min_tokens"].reshape(-1)[0]) > 0),
        ]
        for name, on in refused:
            if on:
                raise _Failed(
                    f"{name} is not supported with speculative decoding (num_draft_tokens) by this BLS", invalid
                )

    def _once(self, model, inputs, outputs, inner_id):
        """One request to a tensorrt_llm model, not streamed: its response with ``output_ids``."""
        if not self.llm_decoupled:
            return self._call(model, inputs, outputs, request_id=inner_id)
        timeout = self.request_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout + GRACE_S
        got = None
        try:
            for resp in self.gate.responses(self._call(model, inputs, outputs, True, inner_id), deadline):
                if resp.has_error():
                    raise _Failed.of(resp.error())
                if pb_utils.get_output_tensor_by_name(resp, "output_ids") is not None:
                    got = resp
        except _Lost:
            raise _Failed(f"tensorrt_llm_bls: {model} sent no final response within its request_timeout_s") from None
        if got is None:
            raise _Failed(f"tensorrt_llm_bls: {model} returned no output_ids")
        return got

    def _speculate(self, pre, given, llm_inputs, k, cancelled, use_logits=False):
        """Yield the one (text, final, tensors) of a speculative request: upstream's ``_spec_generate`` rounds.
        ``use_logits`` (``use_draft_logits``): the draft's ``generation_logits`` go to the target as ``draft_logits``
        (decode.py@4db68284: ``draft_response.generation_logits[0][0]``, the last len(drafts) rows)."""
        in_len = int(pb_utils.get_output_tensor_by_name(pre, "REQUEST_INPUT_LEN").as_numpy().reshape(-1)[0])
        out_len = int(pb_utils.get_output_tensor_by_name(pre, "REQUEST_OUTPUT_LEN").as_numpy().reshape(-1)[0])
        prompt = pb_utils.get_output_tensor_by_name(pre, "INPUT_ID").as_numpy().reshape(-1)[:in_len].tolist()
        stops = _words(pb_utils.get_output_tensor_by_name(pre, "STOP_WORDS_IDS").as_numpy())
        shared = [t for t in llm_inputs if t.name() not in _ROUND_SET]
        asked = any(n in given and bool(given[n].reshape(-1)[0]) for n in _ASK_MEASURED)
        perf = [n for n in _MEASURED if asked]

        def ids(seq, n, exclude=True):
            return [
                pb_utils.Tensor("input_ids", np.array([seq], np.int32)),
                pb_utils.Tensor("input_lengths", np.array([[len(seq)]], np.int32)),
                pb_utils.Tensor("request_output_len", np.array([[n]], np.int32)),
                pb_utils.Tensor("exclude_input_in_output", np.array([[exclude]], bool)),
            ]

        def tokens_of(resp):
            out = pb_utils.get_output_tensor_by_name(resp, "output_ids").as_numpy().reshape(-1)
            n = int(pb_utils.get_output_tensor_by_name(resp, "sequence_length").as_numpy().reshape(-1)[0])
            return out[:n].tolist()

        generated, drafted, accepted, measured = [], 0, 0, []
        while True:
            if cancelled():
                return
            nd = min(k, out_len - len(generated) - 1)
            drafts = []
            if nd > 0:  # upstream sets min_tokens = k for the draft call: it drafts k tokens, end id or not
                min_tokens = pb_utils.Tensor("min_tokens", np.array([[nd]], np.int32))
                draft_in = [t for t in shared if t.name() != "min_tokens"] + ids(prompt + generated, nd) + [min_tokens]
                wanted = ["output_ids", "sequence_length"] + (["generation_logits"] if use_logits else [])
                if use_logits:
                    draft_in.append(pb_utils.Tensor("return_generation_logits", np.array([[True]], bool)))
                draft_resp = self._once(self.draft_name, draft_in, wanted, "")
                drafts = tokens_of(draft_resp)[:nd]
                if use_logits:  # [1, beam, tokens, vocab] -> the drafts' rows
                    rows = pb_utils.get_output_tensor_by_name(draft_resp, "generation_logits").as_numpy()[0][0]
                    draft_logits = rows[len(rows) - len(drafts) :].astype(np.float32)
            target_in = shared + ids(prompt + generated, len(drafts) + 1)
            target_in += [pb_utils.Tensor(n, np.array([[True]], bool)) for n in _ASK_MEASURED]
            if drafts:
                target_in.append(pb_utils.Tensor("draft_input_ids", np.array([drafts], np.int32)))
                if use_logits:
                    target_in.append(pb_utils.Tensor("draft_logits", draft_logits[None]))
            resp = self._once(self.llm_name, target_in, ["output_ids", "sequence_length", *_ACCEPTANCE, *perf], "")
            new = tokens_of(resp)
            counts = [pb_utils.get_output_tensor_by_name(resp, n) for n in _ACCEPTANCE[1:]]
            accepted += int(counts[0].as_numpy().reshape(-1)[0]) if counts[0] is not None else 0
            drafted += int(counts[1].as_numpy().reshape(-1)[0]) if counts[1] is not None else 0
            got = [pb_utils.get_output_tensor_by_name(resp, n) for n in perf]
            measured = [pb_utils.Tensor(t.name(), t.as_numpy()) for t in got if t is not None] or measured
            generated += new
            seq = prompt + generated
            if (
                len(generated) >= out_len
                or len(new) < len(drafts) + 1  # ended by the end id or a stop word inside the target
                or any(seq[len(seq) - len(w) :] == w for w in stops)
            ):
                break
        exclude = (
            bool(given["exclude_input_in_output"].reshape(-1)[0])
            if "exclude_input_in_output" in given
            else self.inner_streaming.exclude_default
        )
        text = self.tokenizer.decode(generated if exclude else prompt + generated, skip_special_tokens=True)
        counted = {"num_input_tokens": len(prompt), "num_output_tokens": len(generated)}  # the request's, not a round's
        extra = [
            pb_utils.Tensor(t.name(), np.array([[counted[t.name()]]], np.int32)) if t.name() in counted else t
            for t in measured
        ]
        if asked:
            extra += [
                pb_utils.Tensor("acceptance_rate", np.array([[accepted / drafted if drafted else 0.0]], np.float32)),
                pb_utils.Tensor("total_accepted_draft_tokens", np.array([[accepted]], np.int32)),
                pb_utils.Tensor("total_draft_tokens", np.array([[drafted]], np.int32)),
            ]
        yield text, True, extra

    def _serve(self, request, sender):
        """Answer one request through ``sender`` (decoupled), or return its response."""
        try:
            if sender is None:
                parts = list(self._generate(request))
                return self._text("".join(piece for piece, _, _ in parts), parts[-1][2])[0]
            for piece, final, extra in self._generate(request, sender.is_cancelled):
                if final and extra:
                    response, tensors = self._text(piece, extra)
                    sender.send(response, flags=FINAL)
                    return None
                if piece:
                    response, tensors = self._text(piece, extra)
                    sender.send(response)
            # Also a stream the client cancelled ends with its final flag: the server keeps the state of a stream
            # until then (about 40 KB in tritonserver per cancelled request, measured).
            sender.send(flags=FINAL)
        except Exception as exc:  # noqa: BLE001 - every request ends with a final response, whatever failed
            message = str(exc) if isinstance(exc, _Failed) else f"tensorrt_llm_bls: {type(exc).__name__}: {exc}"
            code = exc.code if isinstance(exc, _Failed) else None
            error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
            err = pb_utils.InferenceResponse(error=error)
            if sender is None:
                return err
            sender.send(err, flags=FINAL)
        return None

    def execute(self, requests):
        """Each request on its own thread, so concurrent requests reach tensorrt_llm together and share its
        in-flight batch (one request at a time here would serialize every client behind the slowest)."""
        if self.decoupled:
            for request in requests:
                threading.Thread(target=self._serve, args=(request, request.get_response_sender()), daemon=True).start()
            return None
        responses = [None] * len(requests)

        def run(i, request):
            responses[i] = self._serve(request, None)

        threads = [threading.Thread(target=run, args=(i, r), daemon=True) for i, r in enumerate(requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return responses
