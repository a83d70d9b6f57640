"""Triton python model ``preprocessing``: text → token ids
(docs/reference/triton-repository.md#preprocessing), with trtpipe's default stop ids.

I/O and parameter keys are upstream's template's (text-only rows); the template's embedding-bias and prompt-table
inputs are declared but refused with a one-line error.

Parameters: ``tokenizer_dir`` (relative paths are relative to this model's directory; trtpipe writes an absolute
one, which upstream's model.py also resolves, and an absolute one that no longer exists falls back to this model's
own ``tokenizer/``), ``add_special_tokens``,
``end_id`` / ``pad_id`` (from generation_config.json and the tokenizer, written by trtpipe) and
``stop_token_ids`` (comma list: the model's other EOS ids, e.g. Llama-3's ``<|eot_id|>``), which are appended
to every request's stop words so generation stops on all of them by default, and ``max_input_len`` (the engine's):
a prompt whose characters alone prove it has more tokens is refused before it is tokenized (the rule of
``trtpipe.serving.request_checks.refuse_untokenized``, which the OpenAI twin applies too; tokenizing 4 MB costs
gigabytes and seconds of this model's only thread, which every request waits behind).
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

_TRUE = {"true", "1", "t", "y", "yes"}
# Inputs of upstream's template this model declares (so upstream's model.py can be swapped in) but does not use.
NOT_IMPLEMENTED = ("EMBEDDING_BIAS_WORDS", "EMBEDDING_BIAS_WEIGHTS", "PROMPT_TABLE_EXTRA_ID")


def _param(params, key, default=None):
    value = params.get(key, {}).get("string_value", "")
    return default if value == "" or value.startswith("${") else value


def _tensor(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _texts(array, name):
    """STRING tensor [b, k] → list of lists of str (bytes decoded as UTF-8; ValueError names the input otherwise)."""
    out = []
    for row in array.reshape(array.shape[0], -1):
        try:
            out.append([v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in row])
        except UnicodeDecodeError as exc:  # e.g. a lone surrogate written by a lenient encoder
            raise ValueError(f"{name} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    return out


def word_list(words, tokenizer, extra_ids=()):
    """One request's words → ``[2, L]`` int32: token ids, then cumulative end offsets padded with -1."""
    ids, offsets = [], []
    for word in words:
        if not word:
            continue
        enc = tokenizer.encode(word, add_special_tokens=False)
        if enc:
            ids += enc
            offsets.append(len(ids))
    for tid in extra_ids:
        ids.append(int(tid))
        offsets.append(len(ids))
    if not ids:
        return np.zeros((2, 0), np.int32)
    out = np.full((2, len(ids)), -1, np.int32)
    out[0] = ids
    out[1, : len(offsets)] = offsets
    return out


def _stack_word_lists(lists):
    width = max(w.shape[1] for w in lists)
    out = np.zeros((len(lists), 2, width), np.int32)
    out[:, 1, :] = -1
    for i, w in enumerate(lists):
        out[i, :, : w.shape[1]] = w
    return out


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        try:  # under trtpipe serve: end this stub if tritonserver is killed (a stock Triton image has no trtpipe)
            from trtpipe.serving import request_checks
            from trtpipe.triton import stub_watchdog

            stub_watchdog.start()
        except ImportError:
            request_checks = None

        config = json.loads(args["model_config"])
        params = config.get("parameters", {})
        tok_dir = _param(params, "tokenizer_dir")
        if tok_dir is None:
            raise pb_utils.TritonModelException("preprocessing: parameter tokenizer_dir is not set")
        if not os.path.isabs(tok_dir):
            tok_dir = os.path.join(args["model_repository"], tok_dir)
        elif not os.path.isdir(tok_dir):  # moved away from the files it was built from: the copy beside this model
            pb_utils.Logger.log_warn(f"tokenizer_dir {tok_dir} does not exist; using this model's tokenizer/")
            tok_dir = os.path.join(args["model_repository"], "tokenizer")
        self.tokenizer = AutoTokenizer.from_pretrained(
            tok_dir, legacy=False, padding_side="left", trust_remote_code=False
        )
        self.add_special_tokens = str(_param(params, "add_special_tokens", "true")).lower() in _TRUE
        eos = (
            self.tokenizer.encode(self.tokenizer.eos_token, add_special_tokens=False)
            if self.tokenizer.eos_token
            else []
        )
        end = _param(params, "end_id")
        self.end_id = int(end) if end is not None else (eos[0] if eos else 0)
        pad = _param(params, "pad_id")
        self.pad_id = int(pad) if pad is not None else self.end_id
        stop = _param(params, "stop_token_ids", "")
        self.stop_token_ids = [int(s) for s in stop.split(",") if s.strip()]
        limit = _param(params, "max_input_len")
        self.max_input_len = int(limit) if limit is not None else None
        self.checks = request_checks
        if request_checks is not None and self.max_input_len is not None:
            self.longest_token = request_checks.longest_token_chars(self.tokenizer.get_vocab())
        elif self.max_input_len is not None:
            pb_utils.Logger.log_warn("preprocessing: no trtpipe here; long prompts are tokenized before refused")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._one(request)))
            except ValueError as exc:  # the request's own fault: 400 over HTTP, INVALID_ARGUMENT over gRPC
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
        return responses

    def _one(self, request):
        for name in NOT_IMPLEMENTED:
            value = _tensor(request, name)
            if value is not None and value.size:
                raise ValueError(
                    f"{name}: declared as in upstream's template, not implemented by trtpipe's preprocessing"
                )
        queries = _texts(_tensor(request, "QUERY"), "text_input (QUERY)")
        batch = len(queries)
        ids = []
        for q in queries:
            text = q[0] if q else ""
            if not text.strip():
                raise ValueError("text_input (QUERY) is empty: send a non-empty prompt")
            if self.checks is not None and self.max_input_len is not None:
                self.checks.refuse_untokenized(
                    len(text), self.longest_token, self.max_input_len, f"exceeds max_input_len {self.max_input_len}"
                )
            ids.append(self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens))
        lengths = np.array([[len(x)] for x in ids], np.int32)
        input_ids = np.full((batch, int(lengths.max())), self.pad_id, np.int32)  # right-padded, as upstream's
        for i, x in enumerate(ids):
            input_ids[i, : len(x)] = x

        out_len = _tensor(request, "REQUEST_OUTPUT_LEN")
        if out_len.dtype != np.int32:
            raise ValueError(f"max_tokens (REQUEST_OUTPUT_LEN) must be INT32, got {out_len.dtype}")
        stop = _tensor(request, "STOP_WORDS_DICT")
        bad = _tensor(request, "BAD_WORDS_DICT")
        stop_rows = _texts(stop, "stop_words") if stop is not None else [[] for _ in range(batch)]
        bad_rows = _texts(bad, "bad_words") if bad is not None else [[] for _ in range(batch)]
        stop_ids = _stack_word_lists([word_list(w, self.tokenizer, self.stop_token_ids) for w in stop_rows])
        bad_ids = _stack_word_lists([word_list(w, self.tokenizer) for w in bad_rows])

        end = _tensor(request, "END_ID")
        pad = _tensor(request, "PAD_ID")
        end = np.full((batch, 1), self.end_id, np.int32) if end is None else end.astype(np.int32).reshape(batch, 1)
        pad = np.full((batch, 1), self.pad_id, np.int32) if pad is None else pad.astype(np.int32).reshape(batch, 1)
        return [
            pb_utils.Tensor("INPUT_ID", input_ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", lengths),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", out_len.astype(np.int32).reshape(batch, -1)),
            pb_utils.Tensor("STOP_WORDS_IDS", stop_ids),
            pb_utils.Tensor("BAD_WORDS_IDS", bad_ids),
            pb_utils.Tensor("OUT_END_ID", end),
            pb_utils.Tensor("OUT_PAD_ID", pad),
        ]
