"""Triton python model ``tensorrt_llm`` of the llmapi repository, CPU twin: the inputs and outputs of TensorRT-LLM's
``llmapi`` model (``triton_backend/all_models/llmapi/tensorrt_llm/1/model.py``) served by trtpipe's in-flight
batching executor over the reference runtime of the model directory ``model.yaml`` names.

A thin adapter (``trtpipe.serving.llmapi_adapter``): the executor configuration is the recipe's, serialized once
into the ``twin_executor_config`` parameter; the tokenizer, end id and draft model are the OpenAI twin's
(``ServedModel``). Not decoupled: ``execute`` returns each request's final response. Decoupled: each response
carries the text so far (upstream sends ``RequestOutput.outputs[0].text``, the cumulative text), the last is final.
"""

import json
import os
import threading

import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _error(message):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


class TritonPythonModel:
    def initialize(self, args):
        import yaml

        from trtpipe.serving import llmapi_adapter
        from trtpipe.serving.config import from_json
        from trtpipe.serving.openai_server import ServedModel
        from trtpipe.triton import stub_watchdog
        from trtpipe.triton.llmapi_repo import TWIN_CONFIG_PARAMETER

        stub_watchdog.start()
        self.twin = llmapi_adapter
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        here = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(here, "model.yaml")) as f:
            llm_args = yaml.safe_load(f)
        text = config["parameters"][TWIN_CONFIG_PARAMETER]["string_value"]
        self.served = ServedModel(llm_args["model"], args["model_name"], from_json(text))

    def _respond(self, request, deliver):
        def get(name):
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        tok = self.served.tokenizer
        prompt = self.twin.prompt_of(get)
        streaming = bool(self.twin.scalar(get, "streaming")) and self.decoupled
        end_id, stop_ids = self.served.end_tokens.for_request()  # every eos id of generation_config.json
        req = self.twin.request_of(get, tok(prompt).input_ids, end_id, streaming, stop_ids)
        tokens = []

        def on_response(resp):  # on the executor thread
            if resp.has_error:
                deliver(_error(f"Error generating request: {resp.error}"), True)
                return
            tokens.extend(resp.tokens)
            self.twin.drop_stop_token(tokens, resp, stop_ids)
            if resp.is_final or streaming:
                text = tok.decode(tokens, skip_special_tokens=True)
                final = resp.is_final
                outputs = self.twin.response_outputs(resp, text, get) if final else [self.twin.text_output(text)]
                tensors = [pb_utils.Tensor(n, a) for n, a in outputs]
                deliver(pb_utils.InferenceResponse(output_tensors=tensors), resp.is_final)

        self.served.executor.submit(req, on_response)

    def execute(self, requests):
        results = [None] * len(requests)
        done = [threading.Event() for _ in requests]
        for i, request in enumerate(requests):
            sender = request.get_response_sender() if self.decoupled else None

            def deliver(response, final, i=i, sender=sender):
                if sender is not None:
                    sender.send(response, flags=FINAL if final else 0)
                elif final:
                    results[i] = response
                    done[i].set()

            try:
                self._respond(request, deliver)
            except Exception as exc:  # bad input: this request only
                deliver(_error(f"Error generating request: {exc}"), True)
        if self.decoupled:
            return None
        for event in done:
            event.wait()
        return results

    def finalize(self):
        self.served.shutdown()
