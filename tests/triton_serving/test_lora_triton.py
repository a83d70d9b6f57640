"""LoRA through a real tritonserver on the CPU twin of a ``target: engine`` build (stories260k float32, three adapters
prefetched as tasks 0, 1, 2): ``lora_task_id`` through the ensemble and the BLS gives, per adapter, peft's greedy text
on transformers (float64-checked) and the OpenAI twin's; an adapter sent with ``lora_weights`` + ``lora_config`` is
cached under its task id; an unknown task id gets the backend's error; a concurrent batch mixing the three tasks, the
sent one and the base answers each request as its solo run.

The python stubs import trtpipe from the editable install unless ``TRTPIPE_CACHE`` points at a cache whose
``logs/trtpipe`` links the tree under test (docs: /work/notes common rules)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")

from lora_adapters import ENGINE_ADAPTERS, SENT_ADAPTER, build_lora_engine, make_engine_adapters, peft_model
from trtpipe.engine.lora_convert import convert
from trtpipe.triton.client import Client, GenerateOptions
from trtpipe.triton.server_process import start_server

pytestmark = [pytest.mark.triton, pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

PROMPTS = ["Once upon a time", "Lily wanted to", "Tom had a big red ball.", "One day, a cat saw a bird"]
N = 24
SENT_TASK = 7
MODELS = ("ensemble", "tensorrt_llm_bls")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, stories_dir):
    return make_engine_adapters(stories_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_dir, adapters):
    """The server, with the twin's iteration records (``TRTPIPE_ITER_STATS``) in ``server.iterations``."""
    prefetched = {k: adapters[k] for k in ENGINE_ADAPTERS}
    tmp = tmp_path_factory.mktemp("build")
    _, _, repo = build_lora_engine(stories_dir, prefetched, tmp, triton={"max_batch_size": 8, "bls": True})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRTPIPE_ITER_STATS", str(tmp / "iterations.jsonl"))
        with start_server(repo, timeout=240) as s:
            s.iterations = tmp / "iterations.jsonl"
            yield s


@pytest.fixture(scope="module")
def peft_text(stories_dir, adapters):
    """(adapter or None, prompt) -> peft's greedy completion on transformers (float32, every token checked against
    float64: a near-tie within float32's error skips the prompt, as hf_greedy does)."""
    import torch
    from transformers import AutoTokenizer

    from numerics import first_near_tie, hf_float64
    from trtpipe.models.synthetic import load_hf

    tok = AutoTokenizer.from_pretrained(stories_dir)
    models = {None: (load_hf(stories_dir).eval(), None)}
    cache: dict = {}

    def run(name, prompt):
        if (name, prompt) not in cache:
            if name not in models:
                models[name] = (peft_model(stories_dir, adapters[name], torch.float32), None)
            model, _ = models[name]
            model64 = peft_model(stories_dir, adapters[name]) if name else hf_float64(model)
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=N, do_sample=False, eos_token_id=[2], pad_token_id=2)
            new = out[0, ids.shape[1] :].tolist()
            end = next((i + 1 for i, t in enumerate(new) if t == 2), len(new))
            _, tie = first_near_tie(model, model64, ids[0].tolist(), new[:end])
            cache[name, prompt] = (tok.decode(new, skip_special_tokens=True), tie)
        text, tie = cache[name, prompt]
        if tie:
            pytest.skip(f"{name} {prompt!r}: {tie}")
        return text

    return run


@pytest.fixture(scope="module")
def openai_text(stories_dir, adapters):
    """(adapter or None, prompt) -> the OpenAI twin's greedy completion (its ServedModel, adapters by name)."""
    from transformers import AutoTokenizer

    from trtpipe.serving.adapters import LoraSettings
    from trtpipe.serving.api import Request
    from trtpipe.serving.config import executor_config
    from trtpipe.serving.openai_server import ServedModel

    tok = AutoTokenizer.from_pretrained(stories_dir)
    config = executor_config(
        max_batch_size=8, max_num_tokens=2048, max_input_len=256, max_seq_len=512, tokens_per_block=32, max_loras=4
    )
    served = ServedModel(stories_dir, "stories", config, lora=LoraSettings(dict(adapters), 64, 4, 8))

    def run(name, prompt):
        done, box = threading.Event(), {}
        req = Request(tok(prompt).input_ids, N, end_id=2, exclude_input_from_output=True, lora=name)
        served.executor.submit(req, lambda r: (box.setdefault("r", r), done.set()) if r.is_final else None)
        assert done.wait(120)
        assert not box["r"].has_error, box["r"].error
        return tok.decode(box["r"].tokens, skip_special_tokens=True)

    yield run
    served.shutdown()


def _opts(task=None, **kw) -> GenerateOptions:
    return GenerateOptions(max_tokens=N, exclude_input_in_output=True, lora_task_id=task, **kw)


@pytest.mark.parametrize("model", MODELS)
def test_each_task_answers_as_peft_and_the_openai_twin(server, model, peft_text, openai_text):
    with Client(server.grpc_url, model=model) as c:
        for task, name in [*enumerate(ENGINE_ADAPTERS), (None, None)]:
            for prompt in PROMPTS[:2]:
                got = c.generate(prompt, _opts(task))
                assert got == peft_text(name, prompt), (model, name, prompt)
                assert got == openai_text(name, prompt), (model, name, prompt)


def test_sent_adapter_is_cached_under_its_task_id(server, adapters, peft_text):
    w, cfg = convert(adapters[SENT_ADAPTER[0]], "float32")
    prompt = PROMPTS[2]
    with Client(server.grpc_url, model="ensemble") as c:
        first = c.generate(prompt, _opts(SENT_TASK, lora_weights=w[0], lora_config=cfg[0]))
        again = c.generate(prompt, _opts(SENT_TASK))  # the task id alone: cached by the first request
    with Client(server.grpc_url, model="tensorrt_llm_bls") as c:
        bls = c.generate(prompt, _opts(SENT_TASK))
    assert first == again == bls == peft_text(SENT_ADAPTER[0], prompt)


def test_unknown_task_gets_the_backends_error_and_the_server_keeps_answering(server, peft_text):
    from trtpipe.errors import ServingError

    for model in MODELS:
        with Client(server.grpc_url, model=model) as c:
            with pytest.raises(ServingError, match="LoRA task 42 not found in cache. Please send LoRA weights"):
                c.generate(PROMPTS[0], _opts(42))
            assert c.generate(PROMPTS[0], _opts(0)) == peft_text("r8-attn", PROMPTS[0])


def test_concurrent_mixed_batch_equals_solo_runs(server, adapters):
    """Fifteen concurrent requests over the ensemble: tasks 0, 1, 2, the sent task 7 and the base, three prompts;
    each equals the same request sent alone, and the twin's iteration records show steps holding four or more."""
    w, cfg = convert(adapters[SENT_ADAPTER[0]], "float32")
    with Client(server.grpc_url, model="ensemble") as c:
        c.generate(PROMPTS[3], _opts(SENT_TASK, lora_weights=w[0], lora_config=cfg[0]))  # cache task 7
        jobs = [(p, t) for p in PROMPTS[:3] for t in (0, 1, 2, SENT_TASK)] + [(p, None) for p in PROMPTS[:3]]
        solo = {job: c.generate(job[0], _opts(job[1])) for job in jobs}
    results, errors = {}, []

    def one(job):
        try:
            with Client(server.grpc_url, model="ensemble") as cc:
                results[job] = cc.generate(job[0], _opts(job[1]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    import json
    import time

    def records():
        return [json.loads(x) for x in server.iterations.read_text().splitlines()] if server.iterations.exists() else []

    before = len(records())  # the solo runs' records may still come: they schedule one request each
    threads = [threading.Thread(target=one, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    deadline = time.monotonic() + 60  # the stats thread writes finished steps every stats_check_period_ms
    while True:
        scheduled = [r["inflightBatchingStats"]["numScheduledRequests"] for r in records()[before:]]
        if max(scheduled, default=0) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert max(scheduled, default=0) >= 4, f"the concurrent requests must share steps: {scheduled}"
    assert results == solo
    assert len({solo[(PROMPTS[0], t)] for t in (0, 1, 2, SENT_TASK, None)}) == 5, "each adapter its own text"
    assert all(results[j] for j in jobs)
