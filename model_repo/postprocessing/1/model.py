"""Triton python model ``postprocessing``: ``output_ids[:sequence_length]`` → text
(docs/reference/triton-repository.md#postprocessing).

Each request's tokens are decoded on their own, so when the ensemble streams, every chunk is decoded
independently (tokens whose text depends on their neighbours may come out differently); the
``tensorrt_llm_bls`` model with ``accumulate_tokens`` streams exact text deltas instead.
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

_TRUE = {"true", "1", "t", "y", "yes"}


def _param(params, key, default=None):
    value = params.get(key, {}).get("string_value", "")
    return default if value == "" or value.startswith("${") else value


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        try:  # under trtpipe serve: end this stub if tritonserver is killed (a stock Triton image has no trtpipe)
            from trtpipe.triton import stub_watchdog

            stub_watchdog.start()
        except ImportError:
            pass

        params = json.loads(args["model_config"]).get("parameters", {})
        tok_dir = _param(params, "tokenizer_dir")
        if tok_dir is None:
            raise pb_utils.TritonModelException("postprocessing: parameter tokenizer_dir is not set")
        if not os.path.isabs(tok_dir):
            tok_dir = os.path.join(args["model_repository"], tok_dir)
        elif not os.path.isdir(tok_dir):  # moved away from the files it was built from: the copy beside this model
            pb_utils.Logger.log_warn(f"tokenizer_dir {tok_dir} does not exist; using this model's tokenizer/")
            tok_dir = os.path.join(args["model_repository"], "tokenizer")
        self.tokenizer = AutoTokenizer.from_pretrained(
            tok_dir, legacy=False, padding_side="left", trust_remote_code=False
        )
        self.skip_special_tokens = str(_param(params, "skip_special_tokens", "true")).lower() in _TRUE

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            if tokens.ndim == 2:  # [beam, T] without a batch dimension
                tokens, lengths = tokens[None], lengths.reshape(1, -1)
            texts = []
            for b in range(tokens.shape[0]):
                seqs = [tokens[b, k, : int(lengths[b, k])].tolist() for k in range(tokens.shape[1])]
                texts.append(self.tokenizer.batch_decode(seqs, skip_special_tokens=self.skip_special_tokens))
            out = np.array([[t.encode("utf-8") for t in row] for row in texts], dtype=object)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)]))
        return responses
