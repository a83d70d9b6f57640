"""Fuzzing the served models over HTTP and gRPC: wrong dtypes and shapes, empty and huge tensors, invalid UTF-8,
negative/huge/NaN numbers, malformed stop/bad word lists, unknown inputs and parameters, 1 MB prompts,
out-of-vocabulary token ids.

Every case must get an error or a valid answer; the server must stay up; a valid request afterwards (and every
``--check-every`` cases) must still give the right answer. Run against a repository (a server is started on
127.0.0.1 and stopped at the end)::

    python tests/tools/fuzz_serving.py REPO [--seed 0] [--limit N]

Here: the cases (:func:`cases`, from the served models' own configs) and :func:`run`, which sends them and returns a
summary (cases per model and protocol, outcomes, ``failures``); the script prints it. A fixed sample runs in
tests/triton_serving/test_fuzz.py.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

NP = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_UINT64": np.uint64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
WIRE = {
    np.bool_: "BOOL",
    np.uint8: "UINT8",
    np.int32: "INT32",
    np.int64: "INT64",
    np.uint64: "UINT64",
    np.float16: "FP16",
    np.float32: "FP32",
    np.float64: "FP64",
    np.object_: "BYTES",
}
PROMPT_IDS = [1, 403, 407, 261, 378]  # "Once upon a time" in stories260k
CHECK_TEXT = ", there was a"  # its greedy 4-token continuation


def baselines(models: set[str]) -> dict[str, dict[str, np.ndarray]]:
    """A valid request per model (batch dimension included)."""
    s = lambda *v: np.array([[x.encode() if isinstance(x, str) else x for x in v]], dtype=np.object_)  # noqa: E731
    i32 = lambda *v: np.array([list(v)], dtype=np.int32)  # noqa: E731
    out = {
        "ensemble": {"text_input": s("Once upon a time"), "max_tokens": i32(4)},
        "tensorrt_llm_bls": {"text_input": s("Once upon a time"), "max_tokens": i32(4)},
        "tensorrt_llm": {
            "input_ids": i32(*PROMPT_IDS),
            "input_lengths": i32(5),
            "request_output_len": i32(4),
            "end_id": i32(2),
        },
        "preprocessing": {"QUERY": s("Once upon a time"), "REQUEST_OUTPUT_LEN": i32(4)},
        "postprocessing": {"TOKENS_BATCH": np.array([[PROMPT_IDS]], dtype=np.int32), "SEQUENCE_LENGTH": i32(5)},
    }
    return {k: v for k, v in out.items() if k in models}


@dataclass
class Case:
    model: str
    what: str
    inputs: dict  # name -> np.ndarray (None: omitted)
    parameters: Optional[dict] = None


def _values(dtype) -> list:
    """Edge values of one element type."""
    if dtype == np.object_:
        return [b"", b"\xff\xfe\xfd", b"\x00", "é€😀".encode(), b"a" * (1 << 20), b"Once upon a time " * 4000]
    if dtype == np.bool_:
        return [True, False]
    if np.issubdtype(dtype, np.floating):
        return [float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 1e30, 1e-30]
    info = np.iinfo(dtype)
    return sorted(v for v in {info.min, -1, 0, 1, 511, 512, 1 << 20, info.max} if info.min <= v <= info.max)


def _cast(a: np.ndarray, dtype) -> np.ndarray:
    if dtype == np.object_:
        return np.array([[str(x).encode() for x in row] for row in a.reshape(a.shape[0], -1)], dtype=np.object_)
    if a.dtype == np.object_:
        return np.zeros(a.shape, dtype=dtype)
    with np.errstate(all="ignore"):
        return a.astype(dtype)


def cases(configs: dict[str, dict], rng: random.Random) -> list[Case]:
    """Every mutation of every input of every model's valid request."""
    out = []
    for model, base in baselines(set(configs)).items():
        inputs = {i["name"]: i for i in configs[model]["input"]}
        out.append(Case(model, "valid", dict(base)))
        out.append(Case(model, "unknown input", {**base, "no_such_input": np.array([[1]], np.int32)}))
        out.append(Case(model, "unknown parameters", dict(base), {"no_such_param": "x", "max_tokens": -5}))
        for name, spec in inputs.items():
            want = NP[spec["data_type"]]
            ref = base.get(name)
            proto = ref if ref is not None else np.zeros((1, 1), dtype=want)
            if ref is not None:
                out.append(Case(model, f"{name} omitted", {k: v for k, v in base.items() if k != name}))
            for other in set(WIRE) - {want}:
                out.append(Case(model, f"{name} as {WIRE[other]}", {**base, name: _cast(proto, other)}))
            out.append(Case(model, f"{name} empty", {**base, name: np.zeros((1, 0), dtype=want)}))
            out.append(Case(model, f"{name} batch 0", {**base, name: np.zeros((0,) + proto.shape[1:], dtype=want)}))
            out.append(Case(model, f"{name} batch 2", {**base, name: np.concatenate([proto, proto])}))
            out.append(Case(model, f"{name} extra dim", {**base, name: proto[..., None]}))
            big = np.resize(proto.reshape(-1), 100_000).reshape(1, -1).astype(want)
            out.append(Case(model, f"{name} 100k elements", {**base, name: big}))
            for v in _values(want):
                shape = proto.shape
                out.append(Case(model, f"{name}={str(v)[:24]!s}", {**base, name: np.full(shape, v, dtype=want)}))
            if want == np.int32 and proto.size > 1:  # token lists: out-of-vocabulary / random ids
                for v in (-1, 512, 1 << 30):
                    bad = proto.copy()
                    bad.reshape(-1)[rng.randrange(bad.size)] = v
                    out.append(Case(model, f"{name} holds id {v}", {**base, name: bad}))
        if model == "tensorrt_llm":  # stop / bad word lists: [1, 2, L] ids + cumulative offsets padded with -1
            for label, arr in {
                "offsets past the ids": [[[5, 6], [3, -1]]],
                "decreasing offsets": [[[5, 6, 7], [2, 1, -1]]],
                "negative ids": [[[-3, -4], [1, 2]]],
                "huge ids": [[[1 << 30, 7], [1, 2]]],
                "no -1 and zero offsets": [[[5, 6], [0, 0]]],
                "shape [1, 3, 2]": [[[5, 6], [1, 2], [0, 0]]],
                "empty word": [[[5, 6], [0, 2]]],
            }.items():
                a = np.array(arr, dtype=np.int32)
                for name in ("stop_words_list", "bad_words_list"):
                    out.append(Case(model, f"{name} {label}", {**base, name: a}))
        if model in ("ensemble", "tensorrt_llm_bls"):
            for words in ([b""], [b"\xff"], [b"x" * 100_000], [b"a", b"b"] * 500):
                for name in ("stop_words", "bad_words"):
                    out.append(
                        Case(
                            model,
                            f"{name} {len(words)}x{len(words[0])}B",
                            {**base, name: np.array([words], dtype=np.object_)},
                        )
                    )
    return out


def _send(client, mod, case: Case, protocol: str):
    inputs = []
    for name, a in case.inputs.items():
        t = mod.InferInput(name, list(a.shape), WIRE[a.dtype.type])
        t.set_data_from_numpy(a)
        inputs.append(t)
    return client.infer(case.model, inputs, parameters=case.parameters)


def _check(client, mod, protocol: str) -> str:
    """'' when a valid request gives the expected text, else what went wrong."""
    case = Case("ensemble", "check", baselines({"ensemble"})["ensemble"])
    try:
        res = _send(client, mod, case, protocol)
    except Exception as exc:  # noqa: BLE001 - reported
        return f"valid request failed: {exc}"
    text = b"".join(res.as_numpy("text_output").reshape(-1)).decode()
    return "" if text == CHECK_TEXT else f"valid request answered {text!r}"


def run(
    http_url: str,
    grpc_url: str,
    limit: Optional[int] = None,
    seed: int = 0,
    check_every: int = 50,
    alive: Optional[Callable[[], bool]] = None,
    keep: tuple[str, ...] = ("valid", "holds id"),
) -> dict:
    """Send every case over both protocols; returns the summary (``failures`` lists what broke).

    ``limit``: a random sample of that many cases, always including those whose description contains one
    of ``keep`` (by default the valid requests and the out-of-vocabulary ids, the bugs found so far).
    """
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    http_url = http_url.split("://", 1)[-1]
    clients = {
        "http": (httpclient.InferenceServerClient(http_url, network_timeout=300.0), httpclient),
        "grpc": (grpcclient.InferenceServerClient(grpc_url), grpcclient),
    }
    http = clients["http"][0]
    configs = {m["name"]: http.get_model_config(m["name"]) for m in http.get_model_repository_index()}
    rng = random.Random(seed)
    todo = cases(configs, rng)
    if limit is not None and len(todo) > limit:
        kept = [c for c in todo if any(k in c.what for k in keep)]
        chosen = {id(c) for c in kept}
        todo = kept + rng.sample([c for c in todo if id(c) not in chosen], max(0, limit - len(kept)))
    counts: Counter = Counter()
    failures: list[str] = []
    started = time.monotonic()
    for n, (case, protocol) in enumerate(itertools.product(todo, ("http", "grpc"))):
        client, mod = clients[protocol]
        try:
            _send(client, mod, case, protocol)
            outcome = "answer"
        except mod.InferenceServerException as exc:
            outcome = "error"
            msg = str(exc)
            if "generation failed" in msg or "Traceback" in msg:  # an unhandled exception inside the model
                failures.append(f"{protocol} {case.model} [{case.what}]: unhandled: {msg[:300]}")
        except Exception as exc:  # noqa: BLE001 - the client refused to send it (e.g. its own checks)
            outcome = "client refused"
            counts[f"client refused: {type(exc).__name__}"] += 1
        counts[f"{protocol} {outcome}"] += 1
        if case.what == "valid" and outcome != "answer":
            failures.append(f"{protocol} {case.model}: the valid request failed")
        if alive is not None and not alive():
            failures.append(f"server died after {protocol} {case.model} [{case.what}]")
            break
        if (n + 1) % check_every == 0:
            problem = _check(client, mod, protocol)
            if problem:
                failures.append(f"after {protocol} {case.model} [{case.what}]: {problem}")
    for protocol, (client, mod) in clients.items():
        problem = _check(client, mod, protocol)
        if problem:
            failures.append(f"final {protocol} check: {problem}")
    return {
        "cases": len(todo),
        "requests": 2 * len(todo),
        "models": sorted(configs),
        "outcomes": dict(sorted(counts.items())),
        "failures": failures,
        "seconds": round(time.monotonic() - started, 1),
    }
