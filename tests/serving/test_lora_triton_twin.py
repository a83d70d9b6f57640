"""The Triton twin's LoRA (trtpipe/serving/triton_lora.py) without Triton: the engine's prefetched tasks and a task
sent with its tensors, executed each request its own adapter in one mixed in-flight batch, equal to solo runs and
to peft's greedy text on transformers (float64); the backend's request errors.

The engine: a real ``target: engine`` build of stories260k (float32) with three adapters prefetched (task ids 0,
1, 2) and a fourth sent with a request (task 7)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lora_adapters import ENGINE_ADAPTERS, SENT_ADAPTER, build_lora_engine, make_engine_adapters, peft_model
from numerics import hf_float64
from serving_oracle import check_greedy
from trtpipe.engine.lora_convert import convert
from trtpipe.serving.api import ExecutorConfig, Request
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.reference_engine import ReferenceEngine
from trtpipe.serving.triton_lora import TwinAdapters, checkpoint_layout, not_cached, select

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

EOS = 2
PROMPTS = [
    [1, 403, 407, 261, 378, 261, 300],
    [1, 365, 1, 300, 403, 407, 261, 378, 299],
    [1, 343, 300, 400, 31, 262],
    [1, 403, 300, 262, 319, 378, 261, 300, 407, 31, 400],
    [1, 403, 407, 31, 262],
]
SENT_TASK = 7


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, stories_dir):
    return make_engine_adapters(stories_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory, stories_dir, adapters):
    prefetched = {k: adapters[k] for k in ENGINE_ADAPTERS}
    _, engine, _ = build_lora_engine(stories_dir, prefetched, tmp_path_factory.mktemp("build"))
    return engine


@pytest.fixture(scope="module")
def oracles(stories_dir, adapters):
    from trtpipe.models.synthetic import load_hf

    out = {n: (peft_model(stories_dir, p, torch.float32), peft_model(stories_dir, p)) for n, p in adapters.items()}
    base = load_hf(stories_dir)
    out[None] = (base, hf_float64(base))
    return out


def _twin(engine_dir, max_loras=4, host_bytes=None):
    from trtpipe.engine.lora_build import PREFETCH_DIR
    from trtpipe.runtime import load_checkpoint

    adapters = TwinAdapters(engine_dir, engine_dir / PREFETCH_DIR, max_loras, host_bytes)
    return adapters, adapters.wrap(ReferenceEngine(load_checkpoint(engine_dir / "checkpoint", device="cpu")))


def _config(**kw) -> ExecutorConfig:
    base = dict(max_batch_size=8, max_num_tokens=128, max_input_len=96, max_seq_len=128, num_blocks=96)
    return ExecutorConfig(**{**base, "tokens_per_block": 8, "max_loras": 4, **kw})


def _run(engine, config, jobs):
    final = {}
    core = ExecutorCore(config, engine, lambda r: final.__setitem__(r.request_id, r) if r.is_final else None)
    ids = [core.submit(Request(p, n, end_id=EOS, exclude_input_from_output=True, lora=lora)) for p, n, lora in jobs]
    core.run_until_idle()
    return [final[i] for i in ids], core


def test_checkpoint_layout_is_the_hf_layout(engine_dir, stories_dir):
    import json

    from trtpipe.runtime.lora import BaseLayout

    got = checkpoint_layout(json.loads((engine_dir / "config.json").read_text())["pretrained_config"])
    want = BaseLayout.of(stories_dir)
    assert got.modules == want.modules and got.num_layers == want.num_layers


def test_decoded_rows_are_pefts_deltas(engine_dir, adapters):
    """Each prefetched task's delta B A (scaling folded into B by the converter) equals the PEFT adapter's
    scaling * B A, per linear."""
    from trtpipe.runtime.lora import load_adapter

    twin, _ = _twin(engine_dir)
    for task, name in enumerate(ENGINE_ADAPTERS):
        decoded = twin.cache._read(f"task-{task}", None)  # noqa: SLF001 - the prefetched loader under test
        peft = load_adapter(name, adapters[name], twin.layout)
        assert decoded.pairs.keys() == peft.pairs.keys()
        for key, p in peft.pairs.items():
            d = decoded.pairs[key]
            want = (p.b.double() @ p.a.double()) * p.scaling
            got = (d.b.double() @ d.a.double()) * d.scaling
            assert torch.allclose(got, want, rtol=0, atol=1e-6 * float(want.abs().max())), (name, key)


def test_mixed_batch_of_three_tasks_a_sent_adapter_and_the_base(engine_dir, adapters, oracles):
    """Tasks 0, 1, 2 (prefetched), task 7 (sent with its tensors, float16 as the Triton input is) and the base in
    one batch: each answer equals its solo run and peft's greedy text (a difference only at a float32 near-tie)."""
    twin, engine = _twin(engine_dir)
    w, c = convert(adapters[SENT_ADAPTER[0]], "float32")
    sent = select(twin, np.array([[SENT_TASK]], np.uint64), w.astype(np.float16), c)
    assert sent == f"task-{SENT_TASK}"
    assert select(twin, np.array([[SENT_TASK]], np.uint64), None, None) == sent  # cached: the task id alone now
    names = [*ENGINE_ADAPTERS, SENT_ADAPTER[0], None]
    loras = [f"task-{i}" for i in range(3)] + [sent, None]
    jobs = [(p, 12, lora) for p, lora in zip(PROMPTS, loras)]
    mixed, core = _run(engine, _config(max_loras=4), jobs)
    assert max(len(s.entries) for s in core.iterations) == 5, "the five requests must share steps"
    for (prompt, n, lora), name, got in zip(jobs, names, mixed):
        assert not got.has_error, got.error
        (solo,), _ = _run(engine, _config(), [(prompt, n, lora)])
        f32, f64 = oracles[name]
        assert check_greedy(f32, f64, prompt, solo.tokens, n, EOS) == "", name
        assert got.tokens == solo.tokens, name
    assert all(r.tokens != mixed[-1].tokens for r in mixed[:-1]), "adapters must change the text"


def test_more_tasks_than_max_loras_cycle(engine_dir, oracles):
    twin, engine = _twin(engine_dir, max_loras=1)
    jobs = [(PROMPTS[k % 3], 6, f"task-{k % 3}") for k in range(6)]
    out, _ = _run(engine, _config(max_loras=1), jobs)
    assert all(not r.has_error for r in out), [r.error for r in out if r.has_error]
    assert twin.cache.stats.device_evictions > 0
    for (prompt, n, _), name, got in zip(jobs, [*ENGINE_ADAPTERS] * 2, out):
        f32, f64 = oracles[name]
        assert check_greedy(f32, f64, prompt, got.tokens, n, EOS) == "", name


def test_request_errors_name_the_input(engine_dir, adapters):
    twin, _ = _twin(engine_dir)
    w, c = convert(adapters[SENT_ADAPTER[0]], "float32")
    tid = np.array([[11]], np.uint64)
    with pytest.raises(ValueError) as err:
        select(twin, tid, None, None)
    assert str(err.value) == not_cached(11) == "LoRA task 11 not found in cache. Please send LoRA weights with request"
    with pytest.raises(ValueError, match="need lora_task_id"):
        select(twin, None, w, c)
    with pytest.raises(ValueError, match="lora_config is missing"):
        select(twin, tid, w, None)
    with pytest.raises(ValueError, match="this engine was built without LoRA"):
        select(None, tid, None, None)
    bad = c.copy()
    bad[0, 0, 0] = 0  # attn_qkv: not a module of this engine
    with pytest.raises(ValueError, match="lora_config row 0: module id 0 is not one of the engine's LoRA modules"):
        select(twin, tid, w, bad)
    big = c.copy()
    big[0, 0, 2] = 65
    with pytest.raises(ValueError, match=r"adapter_size 65 is not in \[1, 64\]"):
        select(twin, tid, w, big)
    with pytest.raises(ValueError, match="lora_weights has 9 rows, lora_config 10"):
        select(twin, tid, w[:, :9], c)
    with pytest.raises(ValueError):
        select(twin, tid, None, None)  # nothing was cached by the bad requests
