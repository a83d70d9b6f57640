"""Ask a served model for text over gRPC (streaming, decoupled models) or HTTP.

The front model is the ensemble (``text_input`` → ``text_output``). A streamed answer goes to
``tensorrt_llm_bls`` when the server has it (it re-decodes accumulated tokens, so the pieces join to the
exact text); otherwise to the ensemble. A decoupled model can only be called over a gRPC stream, so the
client looks at the model config and uses the stream even for a one-piece answer.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from trtpipe.errors import ServingError
from trtpipe.extras import require

STREAM_TIMEOUT_S = 120.0
BLS_MODEL = "tensorrt_llm_bls"


@dataclass
class GenerateOptions:
    """Sampling settings of one request (None: the model's default)."""

    max_tokens: int = 64
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    end_id: Optional[int] = None
    stop_words: list[str] = field(default_factory=list)
    exclude_input_in_output: Optional[bool] = None
    guided_decoding_guide_type: Optional[str] = None  # json, json_schema, regex, ebnf_grammar, structural_tag
    guided_decoding_guide: Optional[str] = None
    lora_task_id: Optional[int] = None  # an engine's LoRA task; with lora_weights + lora_config the first time
    lora_weights: Optional[np.ndarray] = None  # [rows, width] (hf_lora_convert.py's model.lora_weights, float16)
    lora_config: Optional[np.ndarray] = None  # [rows, 3] int32 (module id, layer, adapter_size)


def infer_inputs(mod, rows) -> list:
    """(name, array, Triton datatype) rows as tritonclient InferInput objects (``mod``: tritonclient.grpc or .http)."""
    out = []
    for name, array, dtype in rows:
        i = mod.InferInput(name, list(array.shape), dtype)
        i.set_data_from_numpy(array)
        out.append(i)
    return out


def text_inputs(mod, prompt: str, opts: GenerateOptions, stream: bool) -> list:
    """The inputs of the text front models (ensemble, BLS) as tritonclient InferInput objects."""
    rows: list[tuple[str, np.ndarray, str]] = [
        ("text_input", np.array([[prompt.encode("utf-8")]], dtype=object), "BYTES"),
        ("max_tokens", np.array([[opts.max_tokens]], dtype=np.int32), "INT32"),
        ("stream", np.array([[stream]], dtype=bool), "BOOL"),
    ]
    temperature, top_k, top_p = opts.temperature, opts.top_k, opts.top_p
    if temperature and top_k is None and top_p is None:
        top_p = 1.0  # TensorRT-LLM samples only when top_k or top_p asks for it; temperature alone would be greedy
    optional = [
        ("temperature", temperature, np.float32, "FP32"),
        ("top_k", top_k, np.int32, "INT32"),
        ("top_p", top_p, np.float32, "FP32"),
        ("seed", opts.seed, np.uint64, "UINT64"),
        ("end_id", opts.end_id, np.int32, "INT32"),
        ("exclude_input_in_output", opts.exclude_input_in_output, bool, "BOOL"),
    ]
    rows += [(n, np.array([[v]], dtype=dt), tt) for n, v, dt, tt in optional if v is not None]
    for name in ("guided_decoding_guide_type", "guided_decoding_guide"):
        if getattr(opts, name) is not None:
            rows.append((name, np.array([[getattr(opts, name).encode("utf-8")]], dtype=object), "BYTES"))
    if opts.lora_task_id is not None:
        rows.append(("lora_task_id", np.array([[opts.lora_task_id]], dtype=np.uint64), "UINT64"))
    if opts.lora_weights is not None:
        w = np.asarray(opts.lora_weights, dtype=np.float16)
        rows.append(("lora_weights", w.reshape(1, *w.shape[-2:]), "FP16"))
    if opts.lora_config is not None:
        c = np.asarray(opts.lora_config, dtype=np.int32)
        rows.append(("lora_config", c.reshape(1, *c.shape[-2:]), "INT32"))
    if opts.stop_words:
        rows.append(("stop_words", np.array([[w.encode() for w in opts.stop_words]], dtype=object), "BYTES"))
    return infer_inputs(mod, rows)


def _text(result) -> str:
    arr = result.as_numpy("text_output")
    if arr is None:
        return ""
    v = arr.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


class Client:
    """A connection to one server. ``url``: ``host:port`` of gRPC (default) or HTTP (``protocol="http"``)."""

    def __init__(self, url: str, protocol: str = "grpc", model: Optional[str] = None):
        self.url = url.split("://", 1)[-1]
        self.protocol = protocol
        if protocol not in ("grpc", "http"):
            raise ServingError(f"protocol must be grpc or http, got {protocol!r}")
        mod = require(f"tritonclient.{protocol}", "a Triton client (trtpipe infer, bench)")
        self.mod = mod
        self.client = mod.InferenceServerClient(self.url)
        self._model = model
        self._decoupled: dict[str, bool] = {}

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # closing a connection to a dead server must not hide the error that ended the work
            pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def models(self) -> list[str]:
        try:
            index = self.client.get_model_repository_index()
        except Exception as exc:  # connection refused (OSError) or tritonclient's InferenceServerException
            raise ServingError(f"{self.url}: cannot reach the server ({_message(exc)})") from None
        if self.protocol == "grpc":
            return [m.name for m in index.models if m.state == "READY"]
        return [m["name"] for m in index if m.get("state") == "READY"]

    def front_model(self, stream: bool) -> str:
        """The model a request goes to: the one asked for, else BLS for streams when present, else the ensemble."""
        if self._model:
            return self._model
        names = self.models()
        if stream and BLS_MODEL in names:
            return BLS_MODEL
        ensembles = [n for n in names if self._platform(n) == "ensemble"]
        if not ensembles:
            raise ServingError(f"{self.url}: no ensemble model is ready (models: {', '.join(names) or 'none'})")
        return ensembles[0]

    def _config(self, model: str) -> dict:
        try:
            cfg = self.client.get_model_config(model)
        except Exception as exc:  # unknown model, or the server went away
            raise ServingError(f"{self.url}: model {model}: {_message(exc)}") from None
        if self.protocol == "grpc":
            cfg = cfg.config
            return {"platform": cfg.platform, "decoupled": cfg.model_transaction_policy.decoupled}
        return {
            "platform": cfg.get("platform", ""),
            "decoupled": cfg.get("model_transaction_policy", {}).get("decoupled", False),
        }

    def _platform(self, model: str) -> str:
        return self._config(model)["platform"]

    def decoupled(self, model: str) -> bool:
        if model not in self._decoupled:
            cfg = self._config(model)
            decoupled = cfg["decoupled"]
            if cfg["platform"] == "ensemble":  # an ensemble streams when a step is decoupled
                decoupled = self._config("tensorrt_llm")["decoupled"]
            self._decoupled[model] = decoupled
        return self._decoupled[model]

    def generate(self, prompt: str, opts: Optional[GenerateOptions] = None) -> str:
        """The whole answer at once."""
        opts = opts or GenerateOptions()
        model = self.front_model(stream=False)
        if self.decoupled(model):
            if self.protocol != "grpc":
                raise ServingError(f"{model} is decoupled (streaming repository): use gRPC (--protocol grpc)")
            return "".join(self._stream(model, prompt, opts, stream=False))
        try:
            return _text(self.client.infer(model, text_inputs(self.mod, prompt, opts, stream=False)))
        except Exception as exc:  # tritonclient raises InferenceServerException with the server's message
            raise ServingError(f"{model}: {_message(exc)}") from None

    def stream(self, prompt: str, opts: Optional[GenerateOptions] = None) -> Iterator[str]:
        """The answer piece by piece (gRPC stream; needs a decoupled model, recipe ``triton.streaming: true``)."""
        opts = opts or GenerateOptions()
        if self.protocol != "grpc":
            raise ServingError("streaming needs gRPC (--protocol grpc)")
        model = self.front_model(stream=True)
        if not self.decoupled(model):
            raise ServingError(f"{model} is not decoupled: build the repository with triton.streaming: true to stream")
        yield from self._stream(model, prompt, opts, stream=True)

    def _stream(self, model: str, prompt: str, opts: GenerateOptions, stream: bool) -> Iterator[str]:
        results: queue.Queue = queue.Queue()
        try:
            self.client.start_stream(callback=lambda result, error: results.put((result, error)))
        except Exception as exc:  # the server went away between calls
            raise ServingError(f"{model}: {_message(exc)}") from None
        finished = False
        try:
            try:
                self.client.async_stream_infer(
                    model, text_inputs(self.mod, prompt, opts, stream), enable_empty_final_response=True
                )
            except Exception as exc:  # the stream broke before the request went out (server gone)
                raise ServingError(f"{model}: {_message(exc)}") from None
            while True:
                try:
                    result, error = results.get(timeout=STREAM_TIMEOUT_S)
                except queue.Empty:
                    raise ServingError(f"{model}: no response for {STREAM_TIMEOUT_S:.0f} s") from None
                if error is not None:
                    raise ServingError(f"{model}: {_message(error)}")
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                if response.outputs:
                    piece = _text(result)
                    if piece:
                        yield piece
                if final is not None and final.bool_param:
                    finished = True
                    return
        finally:
            try:  # left early (caller stopped reading, error, timeout): cancel, never wait for a server that may not answer
                self.client.stop_stream(cancel_requests=not finished)
            except Exception:  # a broken stream: its error was raised above, do not replace it
                pass


def _message(exc: BaseException) -> str:
    msg = getattr(exc, "message", None)
    text = msg() if callable(msg) else str(exc)
    return " ".join(str(text).split())
