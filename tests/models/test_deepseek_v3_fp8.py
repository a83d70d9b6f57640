"""DeepSeek-V3's block-scaled FP8 checkpoints (``quant_method: fp8``, ``weight_block_size [128, 128]``): every decoder
projection's weight in float8_e4m3fn with one ``weight_scale_inv`` per 128 x 128 block (amax / 448, the format's
definition), the router and norms unquantized, an MTP layer after the decoder's.

* the llmapi export passes the checkpoint through byte for byte (MTP layer included);
* the runtime executes it as stored: its weights are transformers' own dequantization of the stored codes (with the
  activations left unrounded, the logits are transformers float64's on those weights within the float32 scale), and
  with the activations rounded to FP8 per token and group of 128 inputs the logits lie within the FP8 error of the
  dequantized float64 reference, that error measured by an independent float64 implementation of the same rounding.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from numerics import assert_as_accurate, error_scale, hf_float64
from trtpipe.models.synthetic import load_hf, make_synthetic

FP8_MAX = 448.0
BLOCK = (128, 128)
# wide enough that weights span several 128 x 128 blocks (and ragged edges: 192 = 128 + 64), the ratios of "deepseek_v3"
SHAPE = dict(
    hidden_size=256,
    intermediate_size=384,
    moe_intermediate_size=128,
    q_lora_rank=192,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
)


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes and ``weight_scale_inv`` [ceil(out/128), ceil(in/128)] with scale = block amax / 448."""
    out_f, in_f = w.shape
    rows, cols = -(-out_f // BLOCK[0]), -(-in_f // BLOCK[1])
    s = torch.ones(rows, cols)
    for r in range(rows):
        for c in range(cols):
            amax = w[r * BLOCK[0] : (r + 1) * BLOCK[0], c * BLOCK[1] : (c + 1) * BLOCK[1]].abs().max().float()
            s[r, c] = amax / FP8_MAX if amax > 0 else 1.0
    full = s.repeat_interleave(BLOCK[0], 0)[:out_f].repeat_interleave(BLOCK[1], 1)[:, :in_f]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def _quantized(name: str) -> bool:
    return ".layers." in name and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(bf16-style source dir, FP8 dir, transformers float32 on the dequantized weights, its float64 copy)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    root = tmp_path_factory.mktemp("dsfp8")
    src = make_synthetic("deepseek_v3", root / "src", seed=3, **SHAPE)
    tensors = load_file(str(src / "model.safetensors"))
    # an MTP layer (model.layers.3.*, num_nextn_predict_layers 1) as the released checkpoints carry, FP8 too
    tensors["model.layers.3.eh_proj.weight"] = torch.randn(256, 512) / 16
    tensors["model.layers.3.enorm.weight"] = torch.ones(256)
    for k in [k for k in tensors if _quantized(k)]:
        tensors[k], tensors[k[: -len("weight")] + "weight_scale_inv"] = block_quantize(tensors[k])
    out = root / "fp8"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (out / "config.json").write_text(json.dumps(cfg))

    def deq(w: str) -> torch.Tensor:
        return _dequantize_fp8_weight(
            tensors[w], tensors[w[: -len("weight")] + "weight_scale_inv"], list(BLOCK), torch.float32
        )

    hf = load_hf(src)
    state = hf.state_dict()
    with torch.no_grad():
        for k in [k for k in tensors if _quantized(k) and ".experts." not in k and not k.startswith("model.layers.3.")]:
            state[k].copy_(deq(k))
        for name, p in hf.named_parameters():  # transformers holds the experts fused: [gate; up] and down
            pre = name.rsplit(".", 1)[0] + "."
            if name.endswith("experts.gate_up_proj"):
                for e in range(p.shape[0]):
                    p[e].copy_(torch.cat([deq(f"{pre}{e}.gate_proj.weight"), deq(f"{pre}{e}.up_proj.weight")]))
            elif name.endswith("experts.down_proj"):
                for e in range(p.shape[0]):
                    p[e].copy_(deq(f"{pre}{e}.down_proj.weight"))
    return src, out, hf, hf_float64(hf)


IDS = torch.randint(3, 250, (2, 14), generator=torch.Generator().manual_seed(4))


def test_the_llmapi_export_passes_the_checkpoint_through_byte_for_byte(fp8, tmp_path):
    from trtpipe.export.imported import write_llmapi
    from trtpipe.quant.imported.detect import detect

    _, src, _, _ = fp8
    fmt = detect(src)
    assert (fmt.family, fmt.quant_algo, fmt.llmapi.ok) == ("fp8_block", "FP8_BLOCK_SCALES", True)
    out = tmp_path / "hf"
    out.mkdir()
    write_llmapi(fmt, src, out)
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    stored = load_file(str(out / "model.safetensors"))
    assert stored["model.layers.3.eh_proj.weight"].dtype == torch.float8_e4m3fn  # the MTP layer kept
    assert stored["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"].shape == (2, 1)  # 256 x 128: two blocks
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router as shipped


def test_weights_are_transformers_dequantization_of_the_stored_codes(fp8, monkeypatch):
    """Activations left unrounded, the FP8 checkpoint computes transformers float64 on its dequantized weights."""
    import trtpipe.runtime.hf_loader as hf_loader

    _, out, hf32, hf64 = fp8
    monkeypatch.setattr(hf_loader, "token_fp8", lambda x: x)
    model = hf_loader.load_hf_checkpoint(out)
    kinds = {type(m).__name__ for m in (model.layers[1].attention[0].kv_a, model.layers[0].mlp[0].fc)}
    assert kinds == {"GroupFP8Linear"}
    assert type(model.layers[1].shared[0].proj).__name__ == "GroupFP8Linear"
    with torch.no_grad():
        ref32, ref64 = hf32(IDS).logits, hf64(IDS).logits
    assert_as_accurate(model(IDS), ref64, error_scale(ref32, ref64), "deepseek_v3 FP8 block weights")


def _round_activations(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' model with every decoder projection's input rounded to FP8 per token and group of 128 inputs
    (scale amax / 448), the experts' too: an implementation of the format's forward apart from the runtime's."""

    def q(x: torch.Tensor) -> torch.Tensor:
        parts = []
        for p in x.split(BLOCK[1], dim=-1):
            s = p.abs().amax(-1, keepdim=True) / FP8_MAX
            s = torch.where(s > 0, s, torch.ones_like(s))
            parts.append((p / s).to(torch.float8_e4m3fn).to(p.dtype) * s)
        return torch.cat(parts, dim=-1)

    def experts(self, hs, idx, w):
        out = torch.zeros_like(hs)
        for e in range(self.num_experts):
            tok, pos = torch.where(idx == e)
            if tok.numel():
                g, u = F.linear(q(hs[tok]), self.gate_up_proj[e]).chunk(2, dim=-1)
                out.index_add_(0, tok, F.linear(q(self.act_fn(g) * u), self.down_proj[e]) * w[tok, pos, None])
        return out

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name and not name.endswith("mlp.gate"):
            mod.register_forward_pre_hook(lambda m, args: (q(args[0]),))
        elif type(mod).__name__ == "DeepseekV3Experts":
            mod.forward = types.MethodType(experts, mod)
    return model


def test_fp8_activations_within_the_fp8_error_of_the_dequantized_reference(fp8):
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    import copy

    _, out, _, hf64 = fp8
    rounded64 = _round_activations(copy.deepcopy(hf64))
    with torch.no_grad():
        ref64, fp8_64 = hf64(IDS).logits, rounded64(IDS).logits
    fp8_error = float((fp8_64 - ref64).abs().max())  # what FP8 activations cost, in float64
    got = load_hf_checkpoint(out)(IDS)
    err = float((got.double() - ref64).abs().max())
    assert 0 < fp8_error < float(ref64.abs().max())
    assert err <= 1.25 * fp8_error, f"max |FP8 runtime - float64| {err:.3g} vs the FP8 error {fp8_error:.3g}"


def test_the_source_with_mtp_validates_for_llmapi(fp8, tmp_path):
    from click.testing import CliRunner

    from trtpipe.cli import main

    _, out, _, _ = fp8
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: t\ntarget: llmapi\nmodel:\n  source: {out}\n")
    r = CliRunner().invoke(main, ["validate", str(recipe)])
    assert r.exit_code == 0, r.output


def test_block_quantize_is_the_format_definition():
    """Codes times scale reproduce each weight within e4m3's half ulp (3 mantissa bits) of its block's range."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(1))
    codes, s = block_quantize(w)
    assert codes.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    assert float(s[0, 0]) == float(w[:128, :128].abs().max()) / FP8_MAX
    full = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert bool(((codes.float() * full - w).abs() <= 2.0**-4 * w.abs() + 2.0**-9 * full).all())
