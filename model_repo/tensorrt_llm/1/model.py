"""Triton python model ``tensorrt_llm``, CPU twin: the ``tensorrtllm`` backend's inputs, outputs and semantics
(contract §6.3) served by trtpipe's reference runtime on the engine's ``checkpoint/`` (any tp/pp layout).

Written only where no TensorRT engine exists (no GPU / no TensorRT-LLM): it computes real tokens with the
reference model, it is not the TensorRT engine. Requests Triton hands over together are batched into one
``generate`` call per group of identical sampling settings; in decoupled mode each new token is sent as it
is produced when the request sets ``streaming``. A request the engine could not take (empty input,
``request_output_len`` < 1, more tokens than ``max_seq_len``, a prompt above ``max_input_len``, bad word lists)
gets an error response naming the input; the model keeps serving.
"""

import json
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from trtpipe.triton import request_checks  # per-request validation (keep: a bad request must not fail a batch)

_TRUE = {"true", "1", "t", "y", "yes"}
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _param(params, key, default=None):
    value = params.get(key, {}).get("string_value", "")
    return default if value == "" or value.startswith("${") else value


def _scalar(request, name, default, kind):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    a = t.as_numpy()
    if a.size == 0:
        return default
    return kind(a.reshape(-1)[0])


def word_lists(array):
    """``[1, 2, L]`` (ids row, cumulative end offsets padded with -1) → list of token-id lists."""
    if array is None or array.size == 0:
        return []
    a = array.reshape(-1, 2, array.shape[-1])[0]
    words, start = [], 0
    for end in a[1]:
        if end < 0:
            break
        words.append([int(x) for x in a[0, start:end]])
        start = int(end)
    return words


def _default_end_id(path):
    """The first EOS id of the checkpoint's generation_config.json (the ensemble always sends end_id)."""
    try:
        with open(path) as fh:
            eos = json.load(fh).get("eos_token_id")
    except (OSError, ValueError):
        return None
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return int(eos) if isinstance(eos, int) else None


class _Job:
    """One request: its prompt, limits, sampling settings and where its tokens go."""

    def __init__(self, request, sender, prompt, out_len, settings, streaming, exclude_input):
        self.request, self.sender, self.prompt = request, sender, prompt
        self.out_len, self.settings = out_len, settings
        self.streaming, self.exclude_input = streaming, exclude_input
        self.tokens, self.done = [], False


class TritonPythonModel:
    def initialize(self, args):
        import torch

        from trtpipe.runtime import generate, load_checkpoint

        self.config = json.loads(args["model_config"])
        params = self.config.get("parameters", {})
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.config)
        engine = _param(params, "gpt_model_path")
        if engine is None:
            raise pb_utils.TritonModelException("tensorrt_llm twin: parameter gpt_model_path is not set")
        if not os.path.isabs(engine):
            engine = os.path.join(args["model_repository"], engine)
        with open(os.path.join(engine, "config.json")) as fh:
            build = json.load(fh).get("build_config", {})
        self.max_input_len = int(build.get("max_input_len", 1 << 30))
        self.max_seq_len = int(build.get("max_seq_len", 1 << 30))
        self.exclude_input_default = str(_param(params, "exclude_input_in_output", "false")).lower() in _TRUE
        self.default_end_id = _default_end_id(os.path.join(engine, "checkpoint", "generation_config.json"))
        torch.set_num_threads(int(_param(params, "cpu_threads", "1")))
        self.model = load_checkpoint(os.path.join(engine, "checkpoint"), device="cpu")
        self.generate = generate
        self.lock = threading.Lock()

    # ---- request parsing -------------------------------------------------------------------------
    def _job(self, request):
        """Parse and validate one request (ValueError names the problem)."""
        ids_t = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if ids_t is None:
            raise ValueError("input_ids is missing")
        ids = ids_t.as_numpy()
        if ids.dtype != np.int32:
            raise ValueError(f"input_ids must be INT32, got {ids.dtype}")
        if ids.ndim == 2 and ids.shape[0] != 1:
            raise ValueError(f"the CPU twin takes one sequence per request, got a batch of {ids.shape[0]}")
        ids = ids.reshape(-1)
        vocab = self.model.args.vocab_size
        in_len = _scalar(request, "input_lengths", ids.size, int)
        if in_len < 1 or ids.size == 0:
            raise ValueError("input_ids is empty: the prompt has no tokens")
        if in_len > ids.size:
            raise ValueError(f"input_lengths {in_len} is larger than input_ids ({ids.size} tokens)")
        if in_len > self.max_input_len:
            raise ValueError(f"prompt of {in_len} tokens exceeds the engine's max_input_len {self.max_input_len}")
        out_len = _scalar(request, "request_output_len", None, int)
        if out_len is None:
            raise ValueError("request_output_len (max_tokens) is missing")
        limit = self.max_seq_len - in_len
        if out_len < 1:
            raise ValueError(f"request_output_len (max_tokens) must be at least 1, got {out_len}")
        if out_len > limit:
            raise ValueError(
                f"request_output_len (max_tokens) {out_len} exceeds the limit {limit} "
                f"(max_seq_len {self.max_seq_len} - {in_len} prompt tokens)"
            )
        request_checks.check_token_ids(ids[:in_len], vocab)  # trtpipe/triton/request_checks.py (keep these calls)
        bad = pb_utils.get_input_tensor_by_name(request, "bad_words_list")
        if bad is not None and request_checks.word_lists(bad.as_numpy(), "bad_words_list", vocab):
            raise ValueError("bad_words_list is not supported by the CPU twin (the TensorRT engine supports it)")
        end_id = _scalar(request, "end_id", self.default_end_id, int)  # None: no end id, run to the limit
        stop = pb_utils.get_input_tensor_by_name(request, "stop_words_list")
        stops = request_checks.word_lists(stop.as_numpy(), "stop_words_list", vocab) if stop is not None else []
        temperature = _scalar(request, "temperature", 1.0, float)
        top_k = _scalar(request, "runtime_top_k", 0, int)
        top_p = _scalar(request, "runtime_top_p", 0.0, float)
        if top_k < 0 or not 0.0 <= top_p <= 1.0 or temperature < 0:
            raise ValueError(f"bad sampling settings: temperature {temperature}, runtime_top_k {top_k}, runtime_top_p {top_p}")
        # TensorRT-LLM semantics: top_k 1 (or top_k 0 with top_p 0) is greedy. Stop words may be single ids
        # (the model's other EOS ids): they end the sequence and stay in it, as in TensorRT-LLM.
        greedy = top_k == 1 or (top_k == 0 and top_p == 0.0) or temperature == 0.0
        seed = _scalar(request, "seed", None, int)
        request_checks.check_sampling(temperature, top_k, top_p, seed)
        settings = (0.0 if greedy else temperature, 0 if greedy else top_k, 1.0 if greedy or top_p == 0.0 else top_p,
                    None if greedy else seed)
        streaming = _scalar(request, "streaming", False, bool)
        if streaming and not self.decoupled:
            raise ValueError("streaming needs the decoupled tensorrt_llm model (recipe triton.streaming: true)")
        exclude = _scalar(request, "exclude_input_in_output", self.exclude_input_default, bool)
        sender = request.get_response_sender() if self.decoupled else None
        job = _Job(request, sender, ids[:in_len].tolist(), out_len, settings, streaming, exclude)
        job.end_id, job.stop_words = end_id, [tuple(w) for w in stops if w]
        return job

    # ---- responses -------------------------------------------------------------------------------
    def _response(self, job, tokens):
        out = tokens if (job.exclude_input or job.streaming) else job.prompt + tokens
        ids = np.array(out, np.int32).reshape(1, 1, len(out))
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("output_ids", ids),
                pb_utils.Tensor("sequence_length", np.array([[len(out)]], np.int32)),
            ]
        )

    def _finish(self, job):
        if job.done:
            return
        job.done = True
        if job.sender is None:
            return
        if job.streaming:
            job.sender.send(flags=FINAL)
        else:
            job.sender.send(self._response(job, job.tokens), flags=FINAL)

    def _on_step(self, group):
        def on_step(new):
            for job, toks in zip(group, new):
                if job.done:
                    continue
                if toks is None:  # finished (end id, stop word) in an earlier step
                    self._finish(job)
                    continue
                toks = [int(t) for t in toks][: job.out_len - len(job.tokens)]
                job.tokens += toks
                if job.streaming and toks:
                    job.sender.send(self._response(job, toks))
                if len(job.tokens) >= job.out_len:
                    self._finish(job)

        return on_step

    def _run(self, group):
        temperature, top_k, top_p, seed = group[0].settings
        new = self.generate(
            self.model,
            [job.prompt for job in group],
            max_new_tokens=max(job.out_len for job in group),
            end_ids=[job.end_id for job in group],
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop_words=[[list(w) for w in job.stop_words] for job in group],
            on_step=self._on_step(group),
        )
        for job, toks in zip(group, new):
            if not job.done:  # the last step's tokens arrive through on_step; this only closes the request
                job.tokens = [int(t) for t in toks][: job.out_len]
            self._finish(job)

    def execute(self, requests):
        jobs, errors = [], {}
        for i, request in enumerate(requests):
            try:
                jobs.append((i, self._job(request)))
            except ValueError as exc:
                errors[i] = pb_utils.TritonError(str(exc))
                if self.decoupled:
                    request.get_response_sender().send(pb_utils.InferenceResponse(error=errors[i]), flags=FINAL)
        groups = {}
        for i, job in jobs:  # a seeded request runs alone: sequence k of a batch would get seed + k
            key = job.settings if job.settings[3] is None else (i,)
            groups.setdefault(key, []).append((i, job))
        done = {}
        with self.lock:
            for members in groups.values():
                group = [job for _, job in members]
                try:
                    self._run(group)
                except Exception as exc:  # a failed batch answers each of its requests with the cause
                    for i, job in members:
                        errors[i] = pb_utils.TritonError(f"generation failed: {type(exc).__name__}: {exc}")
                        if self.decoupled and not job.done:
                            job.done = True
                            job.sender.send(pb_utils.InferenceResponse(error=errors[i]), flags=FINAL)
                    continue
                for i, job in members:
                    done[i] = job
        if self.decoupled:
            return None
        return [
            pb_utils.InferenceResponse(error=errors[i]) if i in errors else self._response(done[i], done[i].tokens)
            for i in range(len(requests))
        ]

    def finalize(self):
        self.model = None
