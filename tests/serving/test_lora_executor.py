"""Multi-LoRA in the in-flight batching executor: each request its own adapter in one mixed batch, a device cache
bounded by max_loras (least recently used out, reloaded on demand), KV prefix reuse keyed by adapter."""

from __future__ import annotations

import pytest
import torch

from lora_adapters import peft_model
from numerics import hf_float64
from serving_oracle import check_greedy
from trtpipe.serving.adapters import AdapterCache, LoraStepEngine, within_lora_cache
from trtpipe.serving.api import ExecutorConfig, Request
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.reference_engine import ReferenceEngine

EOS = 2
PROMPTS = [
    [1, 403, 407, 261, 378, 261, 300],
    [1, 365, 1, 300, 403, 407, 261, 378, 299],
    [1, 343, 300, 400, 31, 262],
    [1, 403, 300, 262, 319, 378, 261, 300, 407, 31, 400],
]


def _config(**kw) -> ExecutorConfig:
    base = dict(max_batch_size=8, max_num_tokens=128, max_input_len=96, max_seq_len=128, num_blocks=96)
    return ExecutorConfig(**{**base, "tokens_per_block": 8, **kw})


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, stories_dir):
    from lora_adapters import make_all

    return make_all(stories_dir, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def oracles(stories_dir, adapters):
    """peft on transformers per adapter, float32 (the error scale) and float64 (the reference); None: the base."""
    from trtpipe.models.synthetic import load_hf

    out = {n: (peft_model(stories_dir, p, torch.float32), peft_model(stories_dir, p)) for n, p in adapters.items()}
    base = load_hf(stories_dir)
    out[None] = (base, hf_float64(base))
    return out


def _engine(stories_dir, adapters, max_loras=4, max_cpu_loras=8):
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    cache = AdapterCache(stories_dir, max_loras, max_cpu_loras, max_rank=64)
    for name, path in adapters.items():
        cache.register(name, path)
    return LoraStepEngine(ReferenceEngine(load_hf_checkpoint(stories_dir)), cache)


def _run(engine, config, jobs, stagger=0):
    """jobs: (prompt, max_new, lora); submitted together (or ``stagger`` turns apart); final responses in order."""
    final = {}
    core = ExecutorCore(config, engine, lambda r: final.__setitem__(r.request_id, r) if r.is_final else None)
    ids = []
    for prompt, n, lora in jobs:
        ids.append(core.submit(Request(prompt, n, end_id=EOS, exclude_input_from_output=True, lora=lora)))
        for _ in range(stagger):
            core.iterate()
    core.run_until_idle()
    return [final[i] for i in ids], core


class Recording:
    """The real LoRA engine, recording the distinct adapters of every step it runs."""

    def __init__(self, engine):
        self.engine, self.steps = engine, []

    def allocate(self, *a):
        self.engine.allocate(*a)

    def copy_block(self, *a):
        self.engine.copy_block(*a)

    def step(self, batch):
        self.steps.append({e.lora for e in batch.entries if e.lora is not None})
        return self.engine.step(batch)


def test_mixed_batch_equals_solo_runs_and_peft(stories_dir, adapters, oracles):
    """Three adapters and the base in one concurrent batch: each answer equals its solo run, and peft's greedy text
    on transformers in float64 (a difference only where float32's own error decides a near-tie)."""
    engine = _engine(stories_dir, adapters)
    loras = ["r8-attn", "r64-all", None, "r8-all-rslora"]
    jobs = [(p, 12, lora) for p, lora in zip(PROMPTS, loras)]
    mixed, core = _run(engine, _config(), jobs)
    assert max(len(s.entries) for s in core.iterations) == 4, "the four requests must share steps"
    for (prompt, n, lora), got in zip(jobs, mixed):
        assert not got.has_error, got.error
        (solo,), _ = _run(engine, _config(), [(prompt, n, lora)])
        f32, f64 = oracles[lora]
        assert check_greedy(f32, f64, prompt, solo.tokens, n, EOS) == "", lora
        assert got.tokens == solo.tokens or check_greedy(f32, f64, prompt, got.tokens, n, EOS) == "", lora
    base_answer = mixed[2].tokens
    assert all(r.tokens != base_answer for r in (mixed[0], mixed[1], mixed[3])), "adapters must change the text"


def test_more_adapters_than_max_loras_cycle(stories_dir, adapters, oracles):
    """Four adapters, max_loras 2 and max_cpu_loras 2, eight concurrent requests: no step holds more than two
    adapters, adapters are evicted and read again from disk, and every answer is still its adapter's."""
    rec = Recording(_engine(stories_dir, adapters, max_loras=2, max_cpu_loras=2))
    names = list(adapters)
    jobs = [(PROMPTS[k % 4], 6, names[k % 4]) for k in range(8)]
    out, core = _run(rec, _config(max_loras=2), jobs)
    assert all(not r.has_error for r in out), [r.error for r in out if r.has_error]
    assert max(len(s) for s in rec.steps) == 2
    stats = rec.engine.cache.stats
    assert stats.device_evictions > 0 and stats.disk_loads > len(adapters), stats
    assert len(rec.engine.cache.active()) <= 2 and len(rec.engine.cache.loaded()) <= 2
    for (prompt, n, lora), got in zip(jobs, out):
        f32, f64 = oracles[lora]
        assert check_greedy(f32, f64, prompt, got.tokens, n, EOS) == "", lora


def test_kv_blocks_never_shared_between_adapters(stories_dir, adapters, oracles):
    """The same 25-token prompt (3 full blocks) under two adapters and the base: a second request of the same
    adapter reuses its blocks; another adapter, or the base, reuses none, and both run at once on disjoint blocks."""
    engine = _engine(stories_dir, adapters)
    prompt = (PROMPTS[3] + PROMPTS[1] + PROMPTS[0])[:25]
    config = _config(enable_kv_cache_reuse=True)
    final, tables = {}, {}
    core = ExecutorCore(config, engine, lambda r: final.__setitem__(r.request_id, r) if r.is_final else None)

    def submit(lora):
        return core.submit(
            Request(prompt, 4, end_id=EOS, exclude_input_from_output=True, lora=lora, return_perf_metrics=True)
        )

    first = submit("r8-attn")
    core.run_until_idle()
    a_again, b, base = submit("r8-attn"), submit("r64-all"), submit(None)
    core.iterate()  # the three contexts are scheduled together: their block tables are live now
    for r in core.active:
        tables[r.id] = set(r.block_table)
    core.run_until_idle()
    assert final[a_again].perf.kv_reused_blocks == 3
    assert final[b].perf.kv_reused_blocks == 0 and final[base].perf.kv_reused_blocks == 0
    assert not tables[b] & tables[a_again] and not tables[base] & tables[a_again] and not tables[b] & tables[base]
    for rid, lora in ((first, "r8-attn"), (a_again, "r8-attn"), (b, "r64-all"), (base, None)):
        f32, f64 = oracles[lora]
        assert check_greedy(f32, f64, prompt, final[rid].tokens, 4, EOS) == "", lora


class _R:
    def __init__(self, lora):
        self.request = Request([1], 1, lora=lora)


def test_within_lora_cache_keeps_order_and_base():
    chosen = [_R(x) for x in ("a", None, "b", "a", "c", None, "b", "d")]
    kept = within_lora_cache(chosen, 2)
    assert [r.request.lora for r in kept] == ["a", None, "b", "a", None, "b"]
    assert within_lora_cache(chosen, 0) == chosen
