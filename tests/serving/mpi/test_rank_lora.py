"""LoRA at tp 2 and tp 2 x pp 2, one process per rank under a real mpiexec: the adapters sharded with the base (row-parallel
``lora_A`` split along its input, every other ``lora_B`` along its output, as TensorRT-LLM's LoraManager does).
A packed step mixing two adapters and the base: every position's logits within the float32 error of the tp 1
model (and of peft in float64); the in-flight executor cycling four adapters through max_loras 2: greedy text
equal to peft's greedy on transformers in float64 (a difference only where float32's error decides a near-tie)."""

from __future__ import annotations

import json

import pytest
import torch

from lora_adapters import make_all, peft_model
from numerics import assert_as_accurate, error_scale

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
LAYOUTS = [(1, 1), (2, 1), (2, 2)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, stories_dir):
    """float32 checkpoints of stories260k at tp 1 and tp 2 (float32: peft's model is the same weights)."""
    from trtpipe.checkpoint.convert import convert

    root = tmp_path_factory.mktemp("lora_ckpt")
    return {(tp, pp): convert(stories_dir, root / f"tp{tp}pp{pp}", tp=tp, pp=pp, dtype="float32") for tp, pp in LAYOUTS}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, stories_dir):
    return make_all(stories_dir, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module", params=[(2, 1), (2, 2)], ids=["tp2", "tp2pp2"])
def ran(request, run_mpi, ckpts, stories_dir, adapters, tmp_path_factory):
    """The check run at tp 2 (2 processes) and tp 2 x pp 2 (4: every stage's shards carry their layers' adapters)."""
    tp, pp = request.param
    tmp = tmp_path_factory.mktemp("lora_run")
    (tmp / "adapters.json").write_text(json.dumps({k: str(v) for k, v in adapters.items()}))
    ckpt = ckpts[tp, pp]
    proc = run_mpi(tp * pp, "lora_check.py", ckpt, stories_dir, tmp / "adapters.json", tmp / "out.pt", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(tmp / "out.pt", weights_only=False)


def test_tp2_logits_equal_tp1_within_float32_error(ran, ckpts, stories_dir, adapters):
    import lora_check

    from numerics import hf_float64
    from trtpipe.models.synthetic import load_hf
    from trtpipe.runtime import load_checkpoint
    from trtpipe.serving.adapters import AdapterCache, LoraStepEngine
    from trtpipe.serving.reference_engine import ReferenceEngine

    names = list(adapters)
    cache = AdapterCache(stories_dir, 2, 4, max_rank=64)
    for name, path in adapters.items():
        cache.register(name, path)
    tp1 = LoraStepEngine(ReferenceEngine(load_checkpoint(ckpts[1, 1])), cache)
    tp1.allocate(16, 8)
    loras = [names[0], names[1], None, names[0]]
    one = tp1.logits(lora_check.packed_batch(loras))
    two = ran["logits"]
    assert two.shape == one.shape == (sum(len(p) for p in lora_check.PROMPTS), one.shape[1])
    t = 0
    for prompt, lora in zip(lora_check.PROMPTS, loras):
        rows = slice(t, t + len(prompt))
        t += len(prompt)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            if lora is None:
                ref32 = load_hf(stories_dir)(ids).logits[0]
                ref64 = hf_float64(load_hf(stories_dir))(ids).logits[0]
            else:
                ref32 = peft_model(stories_dir, adapters[lora], torch.float32)(ids).logits[0]
                ref64 = peft_model(stories_dir, adapters[lora])(ids).logits[0]
        scale = error_scale(ref32, ref64)  # the float32 error of this function (peft's own evaluation)
        assert_as_accurate(two[rows], one[rows].double(), scale, f"{lora} tp2 vs tp1")
        assert_as_accurate(two[rows], ref64, scale, f"{lora} tp2 vs peft float64")
        if lora is not None:  # the adapter moves these logits far beyond that error: it was applied on every shard
            base = load_hf(stories_dir)(ids).logits[0].double()
            assert float((base - ref64).abs().max()) > 1000 * scale


def test_tp2_greedy_text_equals_peft_float64_through_max_loras(ran, stories_dir, adapters):
    from serving_oracle import check_greedy
    from trtpipe.models.synthetic import load_hf
    from numerics import hf_float64

    import lora_check

    assert max(len(s) for s in ran["steps"]) == 2 and ran["evictions"] > 0  # 4 adapters cycled through 2 slots
    oracles = {n: (peft_model(stories_dir, p, torch.float32), peft_model(stories_dir, p)) for n, p in adapters.items()}
    base = load_hf(stories_dir)
    oracles[None] = (base, hf_float64(base))
    for (prompt, lora), got in zip(ran["jobs"], ran["tokens"]):
        assert not isinstance(got, str), got
        f32, f64 = oracles[lora]
        assert check_greedy(f32, f64, prompt, got, lora_check.NEW, 2) == "", lora
