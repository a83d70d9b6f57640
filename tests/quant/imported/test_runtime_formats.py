"""The reference runtime executes every pre-quantized format as it is stored (``load_hf_checkpoint`` on the source
itself, whatever the targets do with it), dequantizing as the format defines (:mod:`trtpipe.formats.dequant`).

* Producer checkpoints (``tests/prequantized.py``: ModelOpt, llm-compressor, GPTQModel, each with its library's own
  dequantization ``oracle.safetensors`` and transformers' float64 logits where it loads on CPU): every weight the
  runtime multiplies by equals the oracle exactly, and the float64 logits equal transformers' (activations
  quantized as the format's own forward does: INT8 W8A8 per token, FP8 block per token and group).
* Formats no producer here makes (DeepSeek-style FP8 block ``weight_scale_inv``, fbgemm FP8): checkpoints written
  from stories' / a synthetic Qwen3's weights by the format's own rule, dequantized against transformers' own
  dequantizer (FP8 block: ``FineGrainedFP8Config(dequantize=True)`` loading; fbgemm: its ``FbgemmFp8Linear``
  product ``weight * weight_scale``). MXFP4: tests/models/test_gpt_oss.py (against ``convert_moe_packed_tensors``).
* Bad tensors fail in one line naming the tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from imported_helpers import by_hf_name, check_weights, linear_weights
from numerics import float64_copy
from prequantized import info, names, prequantized
from trtpipe.errors import CheckpointError
from trtpipe.formats import dequant
from trtpipe.quant.imported.detect import detect
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from optional import needs

FP8_MAX = 448.0


@pytest.mark.slow
@pytest.mark.parametrize("name", names())
def test_the_runtime_executes_each_producer_checkpoint_as_stored(name):
    fixture = prequantized(name)
    fmt = detect(fixture)
    layers = json.loads((fixture / "config.json").read_text())["num_hidden_layers"]
    model = load_hf_checkpoint(fixture)
    oracle = load_file(str(fixture / "oracle.safetensors"))
    check_weights(
        by_hf_name(linear_weights(model), fixture, layers), oracle, f"{name} as stored", fmt.quant_algo, engine=False
    )
    logits = fixture / "oracle_logits.safetensors"
    # GPTQModel's kernels dequantize in fp16 inside transformers' forward (not a float64 reference); transformers
    # applies KV-cache scales the PyTorch backend (which the runtime follows) ignores
    if not logits.exists() or fmt.kv_cache or info(name)["producer"] == "gptqmodel":
        return
    if "int8 token dynamic" in info(name).get("activations_in_logits", ""):
        # the stored logits come from transformers' float32 norms; and even in float64 each token's negative amax
        # element sits on a rounding tie: test_int8_w8a8_matches_transformers_up_to_rounding_ties compares them
        pytest.skip("INT8 dynamic activations: compared linear by linear up to the first rounding tie (below)")
    ref = load_file(str(logits))
    with torch.no_grad():
        ours = float64_copy(model).forward(ref["input_ids"].reshape(1, -1))
    theirs = ref["logits"].double().reshape(ours.shape)
    err = float((ours - theirs).abs().max())
    # the same bound as test_producer_fixtures: float32's unit roundoff of the largest logit, 64 times
    assert err <= 2.0**-24 * float(theirs.abs().max()) * 64, (name, err)


U64 = 2.0**-53  # float64's unit roundoff
W8A8_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "w8a8_transformers_inputs.py"
# (our runtime's linear, the HF module whose input it is) of a decoder layer, in execution order
W8A8_LINEARS = (
    ("attention", "qkv", "self_attn.q_proj"),
    ("attention", "dense", "self_attn.o_proj"),
    ("mlp", "fc", "mlp.gate_proj"),
    ("mlp", "proj", "mlp.down_proj"),
)


def _int8_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, x / scale) of compressed-tensors' dynamic per-token INT8 (scale amax / 127.5, round half to even)."""
    y = x / (x.abs().amax(-1, keepdim=True) / 127.5)
    return y.round().clamp(-128, 127), y


@pytest.mark.slow
def test_int8_w8a8_matches_transformers_up_to_rounding_ties(tmp_path):
    """llm-compressor INT8 W8A8 against transformers' own forward (compressed-tensors fake-quantizing every Linear
    input), both in float64: transformers' with its RMSNorm computing in float64 too (the one precision patch of
    tests/tools/w8a8_transformers_inputs.py; its float32 round trip alone moves the norm output by ~1 float32 unit).
    Even then the logits cannot be compared end to end: with scale = amax / 127.5, each token's negative amax element
    lands on x / scale = -127.5, a tie of round-half-to-even, and one float64 ulp from a different summation order
    decides -128 or -127, a whole code, after which the two models part by far more than rounding. So: in execution
    order, every linear's input equals transformers' to float64 rounding (8192 units of 2^-53 of its largest
    value) until the first linear whose INT8 codes differ, and there every differing code is a rounding tie on one
    side; if no code differs the logits agree to 64 float32 units of the largest logit, as for the other formats.
    A wrong divisor, scale, norm or layout fails at the first linear, away from any tie."""
    import subprocess

    from prequantized import producers_python

    py = producers_python()
    if not py.exists():
        pytest.skip(f"producer venv not installed ({py} missing): run scripts/install_producers.sh")
    fixture = prequantized("llmc-w8a8_int8-stories")
    out = tmp_path / "inputs.safetensors"
    proc = subprocess.run(
        [str(py), str(W8A8_SCRIPT), str(fixture), str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    theirs = load_file(str(out))
    model = float64_copy(load_hf_checkpoint(fixture))
    ours, order = {}, []
    for i, layer in enumerate(model.layers):
        for owner, attr, hf in W8A8_LINEARS:
            key = f"model.layers.{i}.{hf}"
            order.append(key)
            getattr(getattr(layer, owner)[0], attr).register_forward_pre_hook(
                lambda m, args, key=key: ours.update({key: args[0].reshape(-1, args[0].shape[-1]).clone()})
            )
    ids = load_file(str(fixture / "oracle_logits.safetensors"))["input_ids"].reshape(1, -1)
    with torch.no_grad():
        logits = model.forward(ids)
    for key in order:
        a, b = ours[key], theirs[key]
        assert float((a - b).abs().max()) <= 8192 * U64 * float(b.abs().max()), f"{key}: inputs differ before any tie"
        (ca, ya), (cb, yb) = _int8_codes(a), _int8_codes(b)
        differ = ca != cb
        tie = ((ya.abs() % 1 - 0.5).abs() <= 2.0**-30) | ((yb.abs() % 1 - 0.5).abs() <= 2.0**-30)
        assert bool(tie[differ].all()), f"{key}: INT8 codes differ away from a rounding tie"
        if bool(differ.any()):
            return  # from here on the two models run on different codes
    want = theirs["logits"].reshape(logits.shape)
    assert float((logits - want).abs().max()) <= 2.0**-24 * float(want.abs().max()) * 64


@needs("compressed_tensors")
@pytest.mark.parametrize("kind", ["int token", "float token", "float group"])
def test_dynamic_activations_equal_compressed_tensors(kind):
    """The runtime's dynamic activation quantizers are compressed-tensors' own (0.20: ``compute_dynamic_scales_and_zp``
    then ``fake_quantize``, what its forward runs on each Linear input): INT8 per token (W8A8), FP8 per token
    (FP8_DYNAMIC) and FP8 per token and group of 128 (FP8_BLOCK). The INT8 W8A8 logits cannot be compared with
    transformers' (the skip above), so this pins its activations; its weights are pinned against the producer."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    from trtpipe.runtime.hf_loader import GroupFP8Linear
    from trtpipe.runtime.linear import INT8_TOKEN_DIVISOR, TokenFP8Linear, TokenInt8Linear

    typ, strategy = kind.split()
    args = QuantizationArgs(
        num_bits=8,
        type=typ,
        strategy=strategy,
        dynamic=True,
        symmetric=True,
        group_size=128 if strategy == "group" else None,
    )
    eye = torch.eye(256)  # y = Q(x) @ I: the quantized activations themselves, exactly
    ours = {
        "int token": TokenInt8Linear(eye, INT8_TOKEN_DIVISOR["compressed-tensors"]),
        "float token": TokenFP8Linear(eye),
        "float group": GroupFP8Linear(eye, 128),
    }[kind]
    torch.manual_seed(0)
    x = torch.randn(2, 5, 256) * 3
    x[0, 1] = 0.0  # an all-zero token: the eps scale
    scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Linear(1, 1))
    assert torch.equal(ours(x), fake_quantize(x=x, scale=scale, zero_point=zero, args=args))


# --- FP8 block-scaled (DeepSeek-V3 layout) -------------------------------------------------------------------


def _block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes and ``weight_scale_inv`` [ceil(out/bo), ceil(in/bi)] (amax / 448 per block), DeepSeek's rule."""
    out_f, in_f = w.shape
    rows, cols = -(-out_f // block[0]), -(-in_f // block[1])
    s = torch.ones(rows, cols)
    for r in range(rows):
        for c in range(cols):
            amax = w[r * block[0] : (r + 1) * block[0], c * block[1] : (c + 1) * block[1]].abs().max().float()
            s[r, c] = amax / FP8_MAX if amax > 0 else 1.0
    full = s.repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)[:, :in_f]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (64, 172)])
def test_fp8_block_dequantize_equals_transformers(shape):
    """transformers 5.24 ``integrations/finegrained_fp8.py::_dequantize_fp8_weight`` (ragged edge blocks too)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    torch.manual_seed(1)
    q, s = _block_quantize(torch.randn(shape) * 0.05, (128, 128))
    theirs = _dequantize_fp8_weight(q, s, [128, 128], torch.float32)
    assert torch.equal(dequant.fp8_block({"weight": q, "weight_scale_inv": s}, "m", (128, 128)), theirs)


def _fp8_block_checkpoint(src: Path, out: Path, block=(128, 128)) -> Path:
    """``src`` (an HF checkpoint) with every decoder linear block-quantized, as DeepSeek-V3 ships FP8."""
    out.mkdir()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for k in [k for k in tensors if k.endswith("_proj.weight") and ".layers." in k]:
        tensors[k], tensors[k[: -len("weight")] + "weight_scale_inv"] = _block_quantize(tensors[k], block)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head"],
    }
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    from trtpipe.models.synthetic import make_synthetic

    return make_synthetic(
        "qwen3",
        tmp_path_factory.mktemp("q3") / "m",
        seed=5,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=512,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    )


def test_fp8_block_checkpoint_runs_with_transformers_weights(tmp_path, qwen3_dir):
    """The runtime's weights of a DeepSeek-style FP8 block checkpoint are transformers' own dequantization of its
    stored tensors (``_dequantize_fp8_weight``; its loader needs accelerate, which this venv does not carry), and
    its activations are FP8 per token and group of 128 inputs."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    ckpt = _fp8_block_checkpoint(qwen3_dir, tmp_path / "fp8b")
    stored = load_file(str(ckpt / "model.safetensors"))
    model = load_hf_checkpoint(ckpt)
    got = by_hf_name(linear_weights(model), ckpt, 2)
    assert len(got) == 14
    for k, (_, w, _) in got.items():
        want = _dequantize_fp8_weight(
            stored[k], stored[k[: -len("weight")] + "weight_scale_inv"], [128, 128], torch.float32
        )
        assert torch.equal(w, want), k
    attn = model.layers[0].attention[0].qkv.parts[0]
    assert type(attn).__name__ == "GroupFP8Linear" and attn.group == 128
    x = torch.randn(3, 128)
    assert torch.equal(
        attn.forward(x),
        torch.nn.functional.linear(
            (x / (s := x.abs().amax(-1, keepdim=True) / FP8_MAX)).to(torch.float8_e4m3fn).float() * s, attn.weight
        ),
    )


# --- fbgemm FP8 ---------------------------------------------------------------------------------------------


def test_fbgemm_fp8_rows_and_activation_cap(tmp_path, qwen3_dir):
    """fbgemm FP8 (Meta's Llama 3.1 405B layout): FP8 rows x ``weight_scale`` [out, 1] (``FbgemmFp8Linear``'s
    product), activations FP8 per token with the amax capped at ``activation_scale_ub``."""
    out = tmp_path / "fbgemm"
    out.mkdir()
    t = load_file(str(qwen3_dir / "model.safetensors"))
    want = {}
    for k in [k for k in t if k.endswith("_proj.weight") and ".layers." in k]:
        s = (t[k].abs().amax(1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
        t[k] = (t[k].float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        t[k[: -len("weight")] + "weight_scale"] = s
        want[k] = t[k].float() * s  # the row scale applied in float32, as f8f8bf16_rowwise's epilogue does
    save_file(t, str(out / "model.safetensors"))
    cfg = json.loads((qwen3_dir / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 0.5,
        "modules_to_not_convert": ["lm_head"],
    }
    (out / "config.json").write_text(json.dumps(cfg))
    model = load_hf_checkpoint(out)
    got = by_hf_name(linear_weights(model), out, 2)
    assert sorted(got) == sorted(want) and all(torch.equal(w, want[k]) for k, (_, w, _) in got.items())
    m = model.layers[0].mlp[0].proj
    x = torch.tensor([[4.0, -1.0] + [0.0] * 254])  # amax 4 is capped at 0.5: 4 saturates to 448 * (0.5 / 448)
    xq = torch.tensor([[0.5, -1.0] + [0.0] * 254]).clamp(-0.5, 0.5)
    assert torch.allclose(m.forward(x), torch.nn.functional.linear(xq, m.weight), rtol=0, atol=1e-6)


# --- bad tensors --------------------------------------------------------------------------------------------


def _gptq_tensors(in_f=64, out_f=16, g=32):
    return {
        "qweight": torch.zeros(in_f // 8, out_f, dtype=torch.int32),
        "qzeros": torch.zeros(in_f // g, out_f // 8, dtype=torch.int32),
        "scales": torch.ones(in_f // g, out_f, dtype=torch.float16),
    }


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: dequant.gptq({k: v for k, v in _gptq_tensors().items() if k != "scales"}, "m.q_proj", True),
            r"^tensor 'm.q_proj.scales' is missing \(GPTQ 4-bit\)$",
        ),
        (
            lambda: dequant.gptq({**_gptq_tensors(), "qzeros": torch.zeros(2, 3, dtype=torch.int32)}, "m.q_proj", True),
            r"^tensor 'm.q_proj.qzeros' is torch.int32 \[2, 3\], GPTQ 4-bit stores \[2, 2\] torch.int32$",
        ),
        (
            lambda: dequant.gptq({**_gptq_tensors(), "scales": torch.ones(3, 16)}, "m.q_proj", True),
            r"^tensor 'm.q_proj.scales' has 3 groups, which do not divide in_features 64",
        ),
        (
            lambda: dequant.gptq(_gptq_tensors(), "m.q_proj", True, group_size=16),
            r"^tensor 'm.q_proj.scales' has shape \[2, 16\]: group size 32, the config says 16",
        ),
        (
            lambda: dequant.awq_gemm(
                {
                    "qweight": torch.zeros(64, 2, dtype=torch.int32),
                    "qzeros": torch.zeros(2, 2, dtype=torch.int32),
                    "scales": torch.ones(2, 8),
                },
                "m.o_proj",
                32,
            ),
            r"^tensor 'm.o_proj.scales' has shape \[2, 8\], AutoAWQ GEMM of qweight \[64, 2\] stores \[in/g, 16\]$",
        ),
        (
            lambda: dequant.pack_quantized(
                {"weight_packed": torch.zeros(16, 7, dtype=torch.int32), "weight_scale": torch.ones(16, 2)},
                "m.up_proj",
                16,
                64,
                32,
                True,
            ),
            r"^tensor 'm.up_proj.weight_packed' is torch.int32 \[16, 7\], compressed-tensors pack-quantized 4-bit stores "
            r"\[16, 8\] torch.int32$",
        ),
        (
            lambda: dequant.pack_quantized(
                {"weight_packed": torch.zeros(16, 8, dtype=torch.int32), "weight_scale": torch.ones(16, 2)},
                "m.up_proj",
                16,
                64,
                32,
                False,
            ),
            r"^tensor 'm.up_proj.weight_zero_point' is missing \(asymmetric compressed-tensors pack-quantized 4-bit\)$",
        ),
        (
            lambda: dequant.pack_quantized(
                {"weight_packed": torch.zeros(16, 8, dtype=torch.int32), "weight_scale": torch.ones(16, 2)},
                "m.up_proj",
                16,
                64,
                24,
                True,
            ),
            r"^tensor 'm.up_proj.weight_packed': group size 24 does not divide in_features 64",
        ),
        (
            lambda: dequant.fp8_block({"weight": torch.zeros(256, 64).to(torch.float8_e4m3fn)}, "m.k_proj", (128, 128)),
            r"^tensor 'm.k_proj.weight_scale_inv' is missing \(FP8 block 128x128\)$",
        ),
        (
            lambda: dequant.fp8_block(
                {"weight": torch.zeros(256, 64).to(torch.float8_e4m3fn), "weight_scale_inv": torch.ones(1, 1)},
                "m.k_proj",
                (128, 128),
            ),
            r"^tensor 'm.k_proj.weight_scale_inv' is torch.float32 \[1, 1\], FP8 block 128x128 stores \[2, 1\]$",
        ),
        (
            lambda: dequant.fp8_rowwise(
                {"weight": torch.zeros(8, 4).to(torch.float8_e4m3fn), "weight_scale": torch.ones(4, 1)}, "m.v_proj"
            ),
            r"^tensor 'm.v_proj.weight_scale' has shape \[4, 1\], fbgemm FP8 rowwise stores \[8, 1\]$",
        ),
        (
            lambda: dequant.int8_channel({"weight": torch.zeros(8, 4, dtype=torch.int8)}, "m.gate_proj", 8, 4),
            r"^tensor 'm.gate_proj.weight_scale' is missing \(compressed-tensors INT8\)$",
        ),
    ],
)
def test_bad_tensors_fail_in_one_line_naming_the_tensor(call, match):
    with pytest.raises(CheckpointError, match=match) as exc:
        call()
    assert "\n" not in str(exc.value)


def test_a_checkpoint_missing_a_scale_fails_at_load_naming_it(tmp_path, qwen3_dir):
    ckpt = _fp8_block_checkpoint(qwen3_dir, tmp_path / "fp8b")
    t = load_file(str(ckpt / "model.safetensors"))
    del t["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(t, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.mlp.down_proj.weight_scale_inv' is missing"):
        load_hf_checkpoint(ckpt)
    shutil.rmtree(ckpt)
