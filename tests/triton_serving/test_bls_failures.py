"""One request's failure is its own through Triton's BLS (issue 38 item 1), on a real tritonserver: poison
sampling values (top_p 0, top_p 1e-300 and temperature 1e-40, sent as the FP32 inputs they become) streamed beside 6
innocent requests; every innocent gets its text alone, and the BLS answers the same 6 again afterwards. Before, the
poison failed the step of every request in it, and the failed streams hung the BLS (item 2) for every later request.
Waits have limits only to turn a hang into a failure.

The python stubs import trtpipe from the environment tritonserver runs in (the venv's editable install): run this
from the checkout that venv installs, or the stub serves another tree's executor."""

from __future__ import annotations

import threading

import pytest
from test_chaos import _cleanup, _serve_foreground, streaming_repo  # noqa: F401 - the fixture is used by name

from trtpipe.triton.client import Client, GenerateOptions

pytestmark = pytest.mark.slow

INNOCENTS = ["Once upon a time", "The cat", "Lily and Ben", "One day", "Tom was", "She saw a"]
POISON = [dict(temperature=1.0, top_p=0.0), dict(temperature=1.0, top_p=1e-300), dict(temperature=1e-40, top_p=1.0)]
HANG_S = 120  # a limit, not a timing: a stream that has not ended by then is hung


def _stream(url: str, prompt: str, **options) -> tuple[list[str], str]:
    """(pieces, error or '') of one BLS stream (8 tokens unless ``max_tokens`` says)."""
    pieces = []
    try:
        with Client(url) as c:
            for piece in c.stream(prompt, GenerateOptions(**{"max_tokens": 8, "end_id": -1, **options})):
                pieces.append(piece)
    except Exception as exc:  # noqa: BLE001 - the error is the outcome under test
        return pieces, str(exc)
    return pieces, ""


def _concurrently(url: str, calls: list[tuple[str, dict]]) -> list:
    out: list = [None] * len(calls)
    threads = [
        threading.Thread(target=lambda i=i, p=p, o=o: out.__setitem__(i, _stream(url, p, **o)), daemon=True)
        for i, (p, o) in enumerate(calls)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert None not in out, f"BLS streams hung: {[c for c, o in zip(calls, out) if o is None]}"
    return out


def test_poison_values_beside_six_innocents_and_the_bls_goes_on(streaming_repo):  # noqa: F811
    proc, url, server_pid = _serve_foreground(streaming_repo)
    try:
        alone = _concurrently(url, [(p, dict(temperature=0.0)) for p in INNOCENTS])
        assert all(not e and "".join(p) for p, e in alone), alone
        out = _concurrently(url, [(INNOCENTS[0], o) for o in POISON] + [(p, dict(temperature=0.0)) for p in INNOCENTS])
        assert out[len(POISON) :] == alone  # 6 of 6 innocents: their text alone
        assert out[: len(POISON)] == [alone[0]] * len(POISON)  # each poison samples greedily, as TensorRT-LLM's does
        after = _concurrently(url, [(p, dict(temperature=0.0)) for p in INNOCENTS])  # nothing left stuck
        assert after == alone
    finally:
        _cleanup(proc, server_pid)


TIMEOUT_S = 1.0  # serving.request_timeout_s of the repository below: the long streams fail after their first tokens
LONG = dict(temperature=0.0, max_tokens=500)  # with max_seq_len 512: far more steps than fit in TIMEOUT_S


@pytest.fixture(scope="module")
def timeout_repo(stories_engine, stories_recipe, tmp_path_factory):
    from trtpipe.triton.repo import write_repo

    engine = stories_engine(1)
    repo = tmp_path_factory.mktemp("bls_timeout") / "repo"
    recipe = stories_recipe("triton.streaming=true", f"serving.request_timeout_s={TIMEOUT_S}")
    write_repo(recipe, engine, engine / "checkpoint", repo)
    return repo


def test_streams_that_fail_after_tokens_end_with_their_error_and_the_bls_goes_on(timeout_repo):
    """Issue 38 item 2: long streams time out in tensorrt_llm after they streamed tokens; each ends with its error,
    and later streams are answered. Before, the python backend of tritonserver 2.51 delivered the error final of a
    decoupled BLS call to no iterator (python_backend r24.10 src/infer_response.cc writes a response's id only when
    it has no error), the BLS waited for it forever inside the request gate, and every later stream hung."""
    proc, url, server_pid = _serve_foreground(timeout_repo)
    try:
        errors = []
        for _ in range(3):  # each round: 4 failing streams at once, then 6 innocents that must still be answered
            failed = _concurrently(url, [(p, LONG) for p in INNOCENTS[:4]])
            for pieces, error in failed:
                assert pieces and "timed out" in error, (pieces, error)  # the twin's error, or the BLS's "lost"
                errors.append(error)
            after = _concurrently(url, [(p, dict(temperature=0.0)) for p in INNOCENTS])
            assert all("".join(p) and not e for p, e in after), after
        lost = sum("lost its error response" in e for e in errors)
        print(f"{len(errors) - lost} errors delivered, {lost} lost by the python backend and reported by the BLS")
    finally:
        _cleanup(proc, server_pid)
