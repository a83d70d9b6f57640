"""llm-compressor's INT8 W8A8 (per-channel symmetric INT8 weights, dynamic per-token INT8 activations) converted for
the engine target into TensorRT-LLM's plugin SmoothQuant layout ``W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN``: every
rank's codes and ``per_channel_scale`` are the source's (sliced here independently, from the layout's definition),
``smoother`` and ``scale_to_int`` are ones; read back by the engine's CPU twin the float64 logits equal the reference
runtime's on the source as stored once both quantize activations per token with the same divisor (the twin uses
TensorRT-LLM's ``amax / 127``, compressed-tensors' own forward ``amax / 127.5``: that difference is measured too).

stories260k has an intermediate size of 172, which leaves 86 inputs per rank to ``mlp.proj`` at tp 2, and
TensorRT-LLM's SmoothQuant linears need a multiple of 4: tp 2 is refused on it, and the tp 2 cases run on the
producer's checkpoint cut to an intermediate size of 168 (the first 168 rows of gate/up, columns of down: the
producer's codes and scales, a smaller model).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from imported_helpers import IDS, convert_source
from numerics import float64_copy
from prequantized import prequantized
from trtpipe.errors import CheckpointError
from trtpipe.quant.imported.detect import detect
from trtpipe.runtime import load_checkpoint
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from trtpipe.runtime.linear import INT8_TOKEN_DIVISOR, TokenInt8Linear, token_int8

pytestmark = pytest.mark.slow
NAME = "llmc-w8a8_int8-stories"
ALGO = "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
CUT = 168  # an intermediate size whose half is a multiple of 4


def _source(tmp_path: Path, tp: int) -> Path:
    """The fixture (tp 1) or the fixture cut to CUT intermediate features (tp 2), as a checkpoint directory."""
    src = prequantized(NAME)
    if tp == 1:
        return src
    out = tmp_path / "cut"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("oracle*.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["intermediate_size"] = CUT
    (out / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(out / "model.safetensors"))
    for k in list(t):
        if ".mlp.gate_proj." in k or ".mlp.up_proj." in k:
            t[k] = t[k][:CUT].contiguous()
        elif k.endswith(".mlp.down_proj.weight"):
            t[k] = t[k][:, :CUT].contiguous()
    save_file(t, str(out / "model.safetensors"))
    return out


def _expected_rank(src: dict, cfg: dict, layer: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """One rank's plugin SmoothQuant tensors of one layer, sliced from the source's codes and scales."""
    pre, lin = f"model.layers.{layer}.", f"transformer.layers.{layer}."
    heads, kv, hd = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["hidden_size"] // cfg["num_attention_heads"],
    )

    def rows(t, n):  # this rank's contiguous block of n output rows
        return t.reshape(n * tp, *t.shape[1:])[rank * n : (rank + 1) * n] if t.dim() else t

    def col_shard(module):
        w, s = src[pre + module + ".weight"], src[pre + module + ".weight_scale"].float().reshape(-1)
        n = w.shape[0] // tp
        return w[rank * n : (rank + 1) * n], s[rank * n : (rank + 1) * n]

    q, k, v = (col_shard(f"self_attn.{p}_proj") for p in "qkv")
    assert q[0].shape[0] == heads // tp * hd and k[0].shape[0] == kv // tp * hd
    out = {
        "attention.qkv.weight": torch.cat([q[0], k[0], v[0]]),
        "attention.qkv.per_channel_scale": torch.cat([q[1], k[1], v[1]]).reshape(1, -1),
    }
    for trt, hf in (("mlp.fc", "mlp.gate_proj"), ("mlp.gate", "mlp.up_proj")):
        w, s = col_shard(hf)
        out[trt + ".weight"], out[trt + ".per_channel_scale"] = w, s.reshape(1, -1)
    for trt, hf in (("attention.dense", "self_attn.o_proj"), ("mlp.proj", "mlp.down_proj")):
        w = src[pre + hf + ".weight"]
        n = w.shape[1] // tp
        out[trt + ".weight"] = w[:, rank * n : (rank + 1) * n]
        out[trt + ".per_channel_scale"] = src[pre + hf + ".weight_scale"].float().reshape(1, -1)
        out[trt + ".smoother"] = torch.ones(1, n)
    for norm in ("input_layernorm", "post_layernorm"):
        out[norm + ".scale_to_int"] = torch.ones(1, dtype=torch.bfloat16)
    return {lin + k: t for k, t in out.items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_w8a8_converts_byte_for_byte_to_the_plugin_smoothquant_layout(tp, tmp_path):
    src_dir = _source(tmp_path, tp)
    fmt = detect(src_dir)
    assert (fmt.quant_algo, fmt.engine.kind, fmt.llmapi.kind) == (ALGO, "converted", "refused")
    assert "no INT8 W8A8 method" in fmt.llmapi.why
    ckpt = convert_source(src_dir, tmp_path / "ckpt", tp=tp)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == ALGO and cfg["quantization"]["kv_cache_quant_algo"] is None
    hf = json.loads((src_dir / "config.json").read_text())
    src = load_file(str(src_dir / "model.safetensors"))
    for rank in range(tp):
        got = load_file(str(ckpt / f"rank{rank}.safetensors"))
        for layer in range(hf["num_hidden_layers"]):
            want = _expected_rank(src, hf, layer, tp, rank)
            mine = {
                k: v
                for k, v in got.items()
                if k.startswith(f"transformer.layers.{layer}.") and not k.endswith(("layernorm.weight",))
            }
            assert sorted(mine) == sorted(want), (rank, layer)
            for k, t in want.items():
                assert mine[k].dtype == t.dtype and torch.equal(mine[k], t), (rank, k)


class RankwiseInt8(torch.nn.Module):
    """A row-parallel linear as ``tp`` ranks run it: each rank quantizes its own slice of the input per token
    (its own amax: ``quantize_per_token`` sees the rank's features only), the partial products are summed."""

    def __init__(self, m: TokenInt8Linear, tp: int):
        super().__init__()
        self.m, self.tp = m, tp

    def forward(self, x):
        xq = torch.cat([token_int8(c, self.m.divisor) for c in x.chunk(self.tp, -1)], -1)
        return torch.nn.functional.linear(xq.to(x.dtype), self.m.weight, self.m.bias)


def _engine_math(model, tp: int):
    """The source-as-stored model with TensorRT-LLM's per-token divisor, its row linears quantizing per rank."""
    for m in model.modules():
        if isinstance(m, TokenInt8Linear):
            m.divisor = INT8_TOKEN_DIVISOR["tensorrt-llm"]
    for layer in model.layers:
        layer.attention[0].dense = RankwiseInt8(layer.attention[0].dense, tp)
        layer.mlp[0].proj = RankwiseInt8(layer.mlp[0].proj, tp)
    return model


@pytest.mark.parametrize("tp", [1, 2])
def test_w8a8_twin_logits_equal_the_source_as_stored(tp, tmp_path):
    """float64 on both sides, the same codes, scales and quantizer (TensorRT-LLM's ``amax / 127``; at tp 2 the row
    linears' inputs quantized per rank, as each rank's ``quantize_per_token`` sees only its slice): the only
    difference is summation order (q/k/v and the tp partial sums are separate GEMMs in one and fused in the other),
    far below one INT8 step. The bound is the one test_producer_fixtures.py uses for two float64 evaluations of
    the same weights. The same comparison against compressed-tensors' own divisor (one rank, amax / 127.5) is
    measured and must be far outside it: the quantizer is what the test pins."""
    src_dir = _source(tmp_path, tp)
    twin = float64_copy(load_checkpoint(convert_source(src_dir, tmp_path / "ckpt", tp=tp)))
    stored = float64_copy(load_hf_checkpoint(src_dir))
    assert {m.divisor for m in twin.modules() if isinstance(m, TokenInt8Linear)} == {INT8_TOKEN_DIVISOR["tensorrt-llm"]}
    with torch.no_grad():
        ours = twin.forward(IDS)
        as_stored = stored.forward(IDS)  # compressed-tensors' amax / 127.5
        same = _engine_math(stored, tp).forward(IDS)
    bound = 2.0**-24 * float(same.abs().max()) * 64
    err = float((ours - same).abs().max())
    assert err <= bound, (tp, err, bound)
    gap = float((ours - as_stored).abs().max())
    assert gap > 100 * bound, (tp, gap, bound)  # the divisor is visible: this comparison can fail
    print(
        f"tp {tp}: twin vs the engine's math on the source {err:.3g} (bound {bound:.3g}); vs the source as "
        f"stored (one rank, amax / 127.5) {gap:.3g}"
    )


def test_w8a8_tp_that_breaks_the_plugin_alignment_is_refused(tmp_path):
    """At validate (parallel.tp, naming the linear) and again by the conversion, nothing written."""
    from trtpipe.app.validation import check_recipe, load_recipe

    def problems(tp: int) -> list:
        p = tmp_path / f"tp{tp}.yaml"
        p.write_text(
            f"name: t\nwork_dir: {tmp_path / 'w'}\ntarget: engine\nmodel:\n  source: {prequantized(NAME)}\n"
            f"parallel:\n  tp: {tp}\n"
        )
        return [(x.key, x.message) for x in check_recipe(load_recipe(p, check_rules=False))]

    assert [k for k, _ in problems(1)] == []
    ((key, msg),) = [(k, m) for k, m in problems(2) if "SmoothQuant" in m]
    assert key == "parallel.tp" and "mlp.proj has 86 input features per rank at tp 2" in msg, msg
    with pytest.raises(
        CheckpointError,
        match=r"transformer\.layers\.0\.mlp\.proj has 86 input features per rank at "
        r"tp 2; .* multiple of 4",
    ):
        convert_source(prequantized(NAME), tmp_path / "ckpt", tp=2)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("damage", ["missing", "shape"])
def test_w8a8_bad_weight_scale_is_refused_naming_it(damage, tmp_path):
    src = tmp_path / "bad"
    shutil.copytree(prequantized(NAME), src)
    t = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight_scale"
    if damage == "missing":
        del t[name]
        pattern = rf"tensor '{name}' is missing"
    else:
        t[name] = t[name].reshape(2, -1).contiguous()
        pattern = rf"tensor '{name}' has shape \[2, 86\], .* one scale per output row \(\[172, 1\]\)"
    save_file(t, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=pattern) as err:
        convert_source(src, tmp_path / "ckpt")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "ckpt").exists()


def test_w8a8_with_a_decoder_linear_left_unquantized_is_refused(tmp_path):
    src = tmp_path / "ignored"
    shutil.copytree(prequantized(NAME), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", "model.layers.0.self_attn.o_proj"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError,
        match=r"model\.layers\.0\.self_attn\.o_proj is left unquantized, .* ignores "
        r"exclude_modules",
    ):
        convert_source(src, tmp_path / "ckpt")


def test_twin_refuses_a_plugin_smoothquant_checkpoint_without_its_smoother(tmp_path):
    ckpt = convert_source(prequantized(NAME), tmp_path / "ckpt")
    t = load_file(str(ckpt / "rank0.safetensors"))
    del t["transformer.layers.0.attention.dense.smoother"]
    save_file(t, str(ckpt / "rank0.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'transformer\.layers\.0\.attention\.dense\.smoother' is missing "
        rf"for quant_algo {ALGO}",
    ):
        load_checkpoint(ckpt)
