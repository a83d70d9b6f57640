"""Hidden-state heads across a prefix taken from the KV cache (trtpipe/serving/hidden_draft.py, serving/kv_pool.py).

The heads' KV is extra layers of the target's paged pool (TensorRT-LLM's one-model MTP / EAGLE-3 adds its draft layers
to the target's KV cache manager: ``get_num_spec_layers``, ``tensorrt_llm/_torch/speculative/utils.py@011d0933``), so a
reused block brings the head's KV of its positions along. Shown: a request whose prefix comes from the cache drafts
and accepts exactly as the same request run cold (same drafts, counters and text), for one MTP layer reused
(MTP-Eagle), two MTP layers (vanilla) and an EAGLE-3 head.
"""

from __future__ import annotations

import pytest
import torch

from test_hidden_draft import _config, _serve
from trtpipe.models.synthetic import make_synthetic
from trtpipe.models.synthetic_heads import add_mtp_layers, make_eagle3_head
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from trtpipe.serving.api import ExecutorConfig, Request
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.hidden_draft import DRAFT_LAYER, HiddenDrafter
from trtpipe.serving.reference_engine import ReferenceEngine, draft_engine

K = 2


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """name -> (target dir, twin model, executor knobs): DeepSeek-V3 with 1 and 2 MTP layers, Llama-3 + EAGLE-3."""
    root = tmp_path_factory.mktemp("reuse")
    out = {}
    for layers in (1, 2):
        d = make_synthetic("deepseek_v3", root / f"ds{layers}", seed=3)
        blocks = [
            make_synthetic(
                "deepseek_v3", root / f"b{layers}{i}", seed=5 + i, num_hidden_layers=1, first_k_dense_replace=0
            )
            for i in range(layers)
        ]
        add_mtp_layers(d, blocks, seed=6)
        out[f"mtp-{layers}-layer"] = (d, load_hf_checkpoint(d), dict(speculative_decoding_type="MTP"))
    d = make_synthetic("llama3", root / "llama", seed=1, num_hidden_layers=8)
    head = make_eagle3_head(d, root / "head", seed=2)
    out["eagle3"] = (d, load_hf_checkpoint(d), dict(speculative_decoding_type="Eagle3", speculative_model=str(head)))
    return out


def _core(model, d, knobs) -> ExecutorCore:
    cfg = _config(max_draft_len=K, enable_kv_cache_reuse=True, **knobs)
    final = {}
    core = ExecutorCore(
        cfg,
        ReferenceEngine(model),
        lambda r: final.__setitem__(r.request_id, r) if r.is_final else None,
        draft_engine=draft_engine(cfg, model, d),
    )
    core.final = final
    return core


def _run(core, prompt, n=16):
    rid = core.submit(Request(prompt, n, exclude_input_from_output=True, return_perf_metrics=True))
    core.run_until_idle()
    return core.final[rid]


def _drafts(monkeypatch):
    """Every draft proposal, per request: [(drafts, ...)] in order."""
    seen = []
    original = HiddenDrafter.propose

    def spy(self, requests, ks):
        out = original(self, requests, ks)
        seen.append({rid: d for rid, (d, _) in out.items()})
        return out

    monkeypatch.setattr(HiddenDrafter, "propose", spy)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mtp-1-layer", "mtp-2-layer", "eagle3"])
def test_a_reused_prefix_drafts_and_accepts_as_a_cold_request(name, targets, monkeypatch):
    d, model, knobs = targets[name]
    g = torch.Generator().manual_seed(21)
    prompt = [1] + torch.randint(3, 240, (20,), generator=g).tolist()  # 21 tokens: 2 full blocks of 8 reusable
    seen = _drafts(monkeypatch)
    core = _core(model, d, knobs)
    cold = _run(core, prompt)  # computes every position, then publishes its blocks (the head's KV in them)
    cold_drafts = [s[1] for s in seen if 1 in s]
    warm = _run(core, prompt)
    warm_drafts = [s[2] for s in seen if 2 in s]
    assert cold.perf.kv_reused_blocks == 0 and warm.perf.kv_reused_blocks == 2  # positions 0..15 from the cache
    assert not warm.has_error and warm.tokens == cold.tokens
    assert warm_drafts == cold_drafts and len(warm_drafts) > 1  # it drafts from its first step, as the cold one
    assert (warm.perf.total_draft_tokens, warm.perf.total_accepted_draft_tokens) == (
        cold.perf.total_draft_tokens,
        cold.perf.total_accepted_draft_tokens,
    )
    assert cold.perf.total_draft_tokens > 0
    plain = _serve(model, _config(), [prompt], n=16)[0][0]
    assert warm.tokens == plain.tokens  # and the text is the text without speculation
    assert not core.speculator.draft.state  # nothing kept past the requests


@pytest.mark.slow  # the fixture builds three synthetic checkpoints (seconds)
def test_the_heads_kv_is_extra_layers_of_the_target_pool(targets):
    """One pool tensor per head layer, sized by the target pool's blocks (no second pool of blocks)."""
    for name, layers in (("mtp-1-layer", 1), ("mtp-2-layer", 2), ("eagle3", 1)):
        d, model, knobs = targets[name]
        core = _core(model, d, knobs)
        extra = {k: v for k, v in core.engine.pools.items() if k[0] == DRAFT_LAYER}
        assert len({k[1] for k in extra}) == layers, name
        c: ExecutorConfig = core.config
        assert all(k.shape[0] == c.num_blocks * c.tokens_per_block for k, _ in extra.values())
        assert core.speculator.draft.pool is core.pool  # the heads' positions come from the requests' own tables
