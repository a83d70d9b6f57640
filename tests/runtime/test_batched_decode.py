"""Batched decoding (one [B, 1] forward per step over a BatchKVCache) against the per-sequence path.

Same tokens (greedy and seeded sampling), same ``on_step`` stream, and each row's logits independent of the
batch, on stories260k at tp/pp layouts and on synthetic models that stress the per-row parts: a sliding
window (Mistral), experts (Mixtral), "dynamic" NTK rope (base depends on each row's length) and an fp8 KV cache.
"""

from __future__ import annotations

import pytest
import torch

from trtpipe.checkpoint.convert import convert
from trtpipe.models.synthetic import make_synthetic
from numerics import assert_as_accurate, error_scale, float64_copy
from trtpipe.runtime import BatchKVCache, KVCache, generate, load_checkpoint

STORY = [1, 403, 407, 261, 378]  # "Once upon a time"
PROMPTS = [STORY, [1, 365], STORY + [261, 300, 400, 410, 300, 261, 403], [1], [1, 365, 1, 300]]


def _run(model, prompts, max_new_tokens, batched, **kw):
    steps = []
    out = generate(model, prompts, max_new_tokens, on_step=steps.append, batched=batched, **kw)
    return out, steps


def assert_batched_matches(model, prompts, max_new_tokens, **kw):
    """Batched generate == per-sequence generate, tokens and streamed steps; returns the tokens."""
    ref, ref_steps = _run(model, prompts, max_new_tokens, False, **kw)
    out, steps = _run(model, prompts, max_new_tokens, True, **kw)
    assert out == ref
    assert steps == ref_steps
    return out


def _kv_codes(model, key, x: torch.Tensor):
    """Quantized KV-cache codes of dequantized cache values ``x`` as integers ordered like the values."""
    from trtpipe.formats.primitives import quantize

    layer, rank = key
    attn = next(m for m in model.layers if m.layer_idx == layer).attention[rank]
    fmt = model.args.quantization["kv_cache_quant_algo"].lower()
    q = quantize(x, attn.kv_scale.float().reshape(1), fmt, "tensor")
    if q.dtype == torch.float8_e4m3fn:  # sign-magnitude byte -> ordinal, so neighbours differ by 1
        b = q.view(torch.uint8).to(torch.int32)
        mag = b & 0x7F
        return torch.where(b >= 0x80, -mag, mag)
    return q.to(torch.int32)


def _kv_ties(model, batch, b, cache, length) -> int:
    """Entries where row b of the batch cache and the sequence's own cache hold different quantized values.

    Each must be a neighbouring code (its float32 input sat on a rounding boundary and the two paths'
    round-off fell on either side): a genuine tie, counted. Anything else is a bug and fails.
    """
    ties = 0
    for key, (k1, v1) in cache.store.items():
        kb, vb = batch.store[key]
        for alone, batched in ((k1[0, :, :length], kb[b, :, :length]), (v1[0, :, :length], vb[b, :, :length])):
            if torch.equal(alone, batched):
                continue
            diff = (_kv_codes(model, key, alone) - _kv_codes(model, key, batched)).abs()
            assert int(diff.max()) <= 1, f"KV cache {key} differs by {int(diff.max())} codes: not a rounding tie"
            ties += int((diff > 0).sum())
    return ties


def assert_rows_independent(model, prompts, steps=3):
    """Decode logits of each row in one batch == that sequence alone, over a few steps; a row dropped midway.

    "==" within float32's error, measured on this machine against a float64 copy of the model: the batched
    row may be off the float64 logits by at most ORDER_FACTOR x the unbatched run's largest error (gemm for B
    rows and gemv for one sum in different orders; see tests/numerics.py). With a quantized KV cache a value
    on a rounding boundary can land on either neighbouring code: such rows are counted as ties and no
    longer compared (their inputs now differ by one quantization step), and at most one row may tie.
    """
    ref_model = float64_copy(model)
    caches, ref_caches = [KVCache() for _ in prompts], [KVCache() for _ in prompts]
    logits = [model(torch.tensor([p]), c, 0)[0, -1] for p, c in zip(prompts, caches)]  # [V] each
    ref = [ref_model(torch.tensor([p]), c, 0)[0, -1] for p, c in zip(prompts, ref_caches)]
    scale = max(error_scale(x, r) for x, r in zip(logits, ref))
    batch = BatchKVCache.from_caches(caches, max(map(len, prompts)) + steps)
    rows, lengths = list(range(len(prompts))), [len(p) for p in prompts]
    checks, tied = [], set()
    for step in range(steps):
        if step == 1 and len(rows) > 2:  # a sequence finishes: its row leaves the batch
            batch.keep(torch.tensor([0] + list(range(2, len(rows)))))
            rows = [rows[0]] + rows[2:]
        nxt = [int(logits[i].argmax()) for i in rows]
        batched = model(torch.tensor(nxt)[:, None], batch, torch.tensor([lengths[i] for i in rows]))[:, -1]  # [B, V]
        for b, i in enumerate(rows):
            logits[i] = model(torch.tensor([[nxt[b]]]), caches[i], lengths[i])[0, -1]
            ref[i] = ref_model(torch.tensor([[nxt[b]]]), ref_caches[i], lengths[i])[0, -1]
            lengths[i] += 1
            scale = max(scale, error_scale(logits[i], ref[i]))
            if model.layers[0].attention[0].kv_quant is not None and _kv_ties(model, batch, b, caches[i], lengths[i]):
                tied.add(i)
            if i not in tied:
                checks.append((step, i, batched[b], ref[i]))
    assert len(tied) <= 1, f"rows {sorted(tied)} hit KV quantization ties: more than rounding boundaries explain"
    for step, i, got, want in checks:
        assert_as_accurate(got, want, scale, f"step {step}, sequence {i} (batched)")


@pytest.fixture(scope="module")
def stories(tmp_path_factory, stories_dir):
    """stories260k at tp=1 and tp=2 (float32); tp=2 x pp=2 comes from the runtime conftest."""
    root = tmp_path_factory.mktemp("batched")
    return {tp: load_checkpoint(convert(stories_dir, root / f"tp{tp}", tp=tp, dtype="float32")) for tp in (1, 2)}


@pytest.fixture(params=["tp1", "tp2", "tp2pp2"])
def stories_layout(request, stories, stories_model):
    return stories_model if request.param == "tp2pp2" else stories[int(request.param[2])]


def test_greedy_with_end_ids_and_stop_words(stories_layout):
    greedy = assert_batched_matches(stories_layout, PROMPTS, 24)
    assert len({len(o) for o in greedy}) == 1  # no end id: everyone runs to the limit
    # per-sequence end ids and stop words taken from the greedy text, so rows finish at different steps
    ends = [greedy[0][6], None, greedy[2][3], 2, None]
    stops = [[], [greedy[1][8:10]], [], [], [[greedy[4][12]]]]
    out = assert_batched_matches(stories_layout, PROMPTS, 24, end_ids=ends, stop_words=stops)
    assert len({len(o) for o in out}) >= 3, out


@pytest.mark.parametrize("max_new_tokens", [1, 2, 17])
def test_seeded_sampling(stories_layout, max_new_tokens):
    out = assert_batched_matches(
        stories_layout, PROMPTS, max_new_tokens, temperature=1.0, top_k=40, top_p=0.9, seed=11, end_ids=2
    )
    alone = generate(
        stories_layout, [PROMPTS[2]], max_new_tokens, temperature=1.0, top_k=40, top_p=0.9, seed=13, end_ids=2
    )
    assert out[2] == alone[0]  # sequence 2 of the batch draws with seed + 2


def test_unseeded_sampling_draws_in_the_same_order(stories):
    runs = []
    for batched in (False, True):
        torch.manual_seed(0)  # torch's global generator: draws go sequence by sequence within each step
        runs.append(generate(stories[1], PROMPTS, 12, temperature=1.0, end_ids=2, batched=batched))
    assert runs[0] == runs[1]


def test_row_logits_do_not_depend_on_the_batch(stories_layout):
    assert_rows_independent(stories_layout, PROMPTS)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """Synthetic checkpoints (float32) by name, made on first use."""
    root, made = tmp_path_factory.mktemp("synth"), {}

    def get(name, kind, tp=1, **overrides):
        if name not in made:
            hf = make_synthetic(kind, root / f"{name}_hf", **overrides)
            made[name] = load_checkpoint(convert(hf, root / name, tp=tp, dtype="float32"))
        return made[name]

    return get


LONG = [list(range(3, 6)), list(range(10, 30)), list(range(40, 52)), [7]]  # around a window of 8 / 16 positions


@pytest.mark.parametrize(
    "name, kind, tp, overrides",
    [
        ("mistral", "mistral", 1, {}),  # sliding_window=8: rows slide past it at different steps
        ("mixtral_tp2", "mixtral", 2, {}),
        (
            "dynamic",
            "llama",
            1,
            {
                "max_position_embeddings": 16,
                "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
            },
        ),
    ],
)
def test_synthetic_models(synthetic, name, kind, tp, overrides):
    model = synthetic(name, kind, tp, **overrides)
    if name == "mistral":
        assert model.args.sliding_window == 8
    assert_batched_matches(model, LONG, 16)
    assert_batched_matches(model, LONG, 16, temperature=1.0, seed=3)
    assert_rows_independent(model, LONG, steps=10)


@pytest.mark.slow
def test_fp8_kv_cache_checkpoint(stories_dir, tmp_path):
    from trtpipe.quant.calibrate import CalibSettings, calibrate, save_layer_stats
    from trtpipe.quant.writer import TrtllmSource, quantize_checkpoint

    base = tmp_path / "base"
    convert(stories_dir, base, tp=1, dtype="bfloat16")
    tokens = torch.randint(3, 512, (8, 32), generator=torch.Generator().manual_seed(0))
    stats = tmp_path / "stats"
    stats.mkdir()
    calibrate(
        TrtllmSource(base), tokens, CalibSettings(batch_size=8), on_layer=lambda i, st: save_layer_stats(stats, i, st)
    )
    quantize_checkpoint(
        base,
        TrtllmSource(base),
        stats,
        tmp_path / "fp8",
        algo="fp8",
        kv_cache="fp8",
        group_size=128,
        alpha=0.5,
        exclude=["*lm_head"],
    )
    model = load_checkpoint(tmp_path / "fp8")
    assert model.layers[0].attention[0].kv_quant is not None
    assert_batched_matches(model, PROMPTS, 16)
    assert_batched_matches(model, PROMPTS, 16, temperature=1.0, seed=5)
    assert_rows_independent(model, PROMPTS)
