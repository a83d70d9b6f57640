"""INT4 mixture-of-experts sources (llm-compressor W4A16 pack-quantized and GPTQ without act-order, symmetric and with
zero points) converted to the engine's INT4 AWQ expert layout (docs/reference/trtllm-checkpoint.md "MoE INT4 AWQ
experts").

The sources: llm-compressor 0.14's own ``oneshot`` W4A16 (group 64) of a synthetic Qwen3-MoE (hidden and expert width 128), symmetric and
asymmetric (tests/tools/make_moe_w4a16.py, run in the producers' venv: ~10 s), and a GPTQ v1 checkpoint packed by the
format's definition (gptq.py's docstring; GPTQModel, which makes the dense GPTQ fixtures, was not run on a MoE) from the
symmetric one's codes and scales. Neither has a pre-quant scale or a zero point, so the conversion is exact: each
expert's codes and group scales are copied into ``mlp.fc`` [E, I, H] (its up rows then its gate rows, two rows
per byte) / ``mlp.proj`` [E, H/2, I], scales F32 [E, 2I, H/g] / [E, H, I/g], and the one pre-quant scale per
linear is ones (model dtype, [H] / [I]).

Logits: the reference runtime on the converted checkpoint (tp1, moe_tp 2, moe_ep 2) against the source's reference
model (its weights dequantized as stored, codes x group scale) evaluated in float64; bound: ORDER_FACTOR x that
model's own float32 error (tests/numerics.py). The weights are the same numbers, so only summation order differs; a
wrong code, nibble order, scale row or shard moves the logits by orders of magnitude more.

Zero points (the asymmetric export, and GPTQ ``sym: false`` packed from it by the format's definition): the same
layout plus ``mlp.fc.zero`` [E, H/g, 2I] / ``mlp.proj.zero`` [E, I/g, H] = -zero_point * s in the model dtype. At
model dtype float32 that is exact (no lossy step to accept), so the codes, scales and zeros are checked for
equality and the logits against the source as stored under the same bound; at bfloat16 the rounding of ``zero`` is
the ``zero_point_rounding`` step, refused until the recipe lists it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from imported_helpers import convert_source
from numerics import assert_as_accurate, error_scale, float64_copy
from prequantized import producers_python
from trtpipe.checkpoint.convert import convert
from trtpipe.formats.primitives import unpack_int4_rows
from trtpipe.errors import CheckpointError
from trtpipe.quant.imported.detect import detect
from trtpipe.quant.imported.lossy import ZERO_POINT_ROUNDING
from trtpipe.quant.imported.trtllm import (
    MOE_INT4_ACT_ORDER,
    MOE_INT4_PREQUANT,
    MOE_INT4_ZERO,
    ImportedLinears,
    moe_refusal,
)
from trtpipe.runtime import load_checkpoint
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from trtpipe.app.validation import check_recipe, load_recipe

ROOT = Path(__file__).resolve().parents[3]
G, LAYERS, EXPERTS, HIDDEN, WIDTH = 64, 2, 8, 128, 128  # tests/tools/make_moe_w4a16.py GROUP, SHAPE
LAYOUTS = {"tp1": dict(tp=1), "mtp2": dict(tp=2, moe_ep=1, moe_tp=2), "ep2": dict(tp=2, moe_ep=2, moe_tp=1)}
PER_RANK = {"tp1": (EXPERTS, WIDTH), "mtp2": (EXPERTS, WIDTH // 2), "ep2": (EXPERTS // 2, WIDTH)}
PRE = "model.layers.{}.mlp.experts.{}."
PROJS = {"fc": ("up_proj", "gate_proj"), "proj": ("down_proj",)}  # the fc rule's order: up rows, then gate rows
IDS = torch.tensor([[1, 50, 100, 200, 30, 20, 7, 41, 3, 90, 17, 249]])


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    py = producers_python()
    if not py.exists():
        pytest.skip(f"producer venv not installed ({py} missing): run scripts/install_producers.sh")
    out = tmp_path_factory.mktemp("moe_w4a16")
    proc = subprocess.run(
        [str(py), str(ROOT / "tests" / "tools" / "make_moe_w4a16.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return out


def _words(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Unsigned 4-bit codes -> int32 words of 8, LSB first, along ``dim`` (GPTQModel ``pack_original``)."""
    c = codes.to(torch.int64)
    c = c.unflatten(dim, (c.shape[dim] // 8, 8))
    words = sum(c.select(dim + 1, j) << (4 * j) for j in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 unsigned 4-bit codes each, LSB first, along ``dim``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * j)) & 0xF for j in range(8)], dim + 1).flatten(dim, dim + 1)


def _as_gptq(src: Path, out: Path) -> Path:
    """An llm-compressor W4A16 checkpoint repacked as GPTQ v1: unsigned codes (signed + 8) in qweight [in/8, out];
    true zeros (8 for a symmetric source, zero_point + 8 otherwise) packed 8 per int32 along the outputs and stored
    minus 0x11111111 (v1, integer wraparound: gptq.py reads them back by adding it), so a symmetric source's qzeros
    are 0x77777777; fp16 scales [in/g, out] (the bf16 scales, exactly); a contiguous g_idx."""
    shutil.copytree(src, out)
    t = load_file(str(out / "model.safetensors"))
    symmetric = True
    for name in [k for k in t if k.endswith(".weight_packed")]:
        m = name[: -len(".weight_packed")]
        out_f, in_f = (int(x) for x in t.pop(m + ".weight_shape").tolist())
        q = _nibbles(t.pop(name), 1)[:, :in_f]  # [out, in] unsigned (signed + 8)
        if m + ".weight_zero_point" in t:
            symmetric = False
            z = _nibbles(t.pop(m + ".weight_zero_point"), 0)[:out_f]  # [out, in/g] unsigned (signed + 8)
        else:
            z = torch.full((out_f, in_f // G), 8)
        words = (_words(z.t(), 1).to(torch.int64) - 0x11111111) & 0xFFFFFFFF
        t[m + ".qweight"] = _words(q.t(), 0)
        t[m + ".qzeros"] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
        t[m + ".scales"] = t.pop(m + ".weight_scale").t().contiguous().half()
        t[m + ".g_idx"] = (torch.arange(in_f) // G).to(torch.int32)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": G,
        "sym": symmetric,
        "desc_act": False,
        "checkpoint_format": "gptq",
    }
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def gptq(made, tmp_path_factory) -> Path:
    """The symmetric source repacked as GPTQ v1, as GPTQModel writes a sym: true, desc_act: false checkpoint."""
    return _as_gptq(made / "sym", tmp_path_factory.mktemp("moe_gptq") / "src")


@pytest.fixture(scope="module", params=["llmc", "gptq"])
def source(request, made, gptq) -> Path:
    return made / "sym" if request.param == "llmc" else gptq


def _stored(src: Path, module: str, t: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(signed codes [out, in], float32 group scales [out, in/g]) of one projection, by the format's definition."""
    if module + ".qweight" in t:  # GPTQ: unsigned codes along the inputs, zero 8 (sym)
        return (_nibbles(t[module + ".qweight"], 0) - 8).t(), t[module + ".scales"].float().t()
    in_f = int(t[module + ".weight_shape"][1])  # compressed-tensors: signed + 8, 8 per int32 along the inputs
    return _nibbles(t[module + ".weight_packed"], 1)[:, :in_f] - 8, t[module + ".weight_scale"].float()


def test_codes_and_scales_are_the_sources(source, tmp_path):
    """Every expert's codes (after unpacking both sides) and group scales equal the source's; unit pre-quant
    scales; config.json W4A16_AWQ with the source's group size, no zero point, the router float32."""
    src = load_file(str(source / "model.safetensors"))
    ckpt = convert_source(source, tmp_path / "tp1")
    t = load_file(str(ckpt / "rank0.safetensors"))
    q = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert (q["quant_algo"], q["group_size"], q["has_zero_point"], q["pre_quant_scale"]) == (
        "W4A16_AWQ",
        G,
        False,
        True,
    )
    assert "*router" in q["exclude_modules"] and not any(
        p.endswith(("mlp", "mlp.fc", "mlp.proj")) for p in q["exclude_modules"]
    )
    for i in range(LAYERS):
        pre = f"transformer.layers.{i}.mlp."
        assert t[pre + "router.weight"].dtype == torch.float32
        for lin, projs in PROJS.items():
            codes = unpack_int4_rows(t[pre + f"{lin}.weight"])  # [E, out, in]
            wsf = t[pre + f"{lin}.weights_scaling_factor"]
            pqs = t[pre + f"{lin}.prequant_scaling_factor"]
            assert pqs.dtype == torch.bfloat16 and bool((pqs == 1).all()), (i, lin)
            for e in range(EXPERTS):
                rows = 0
                for p in projs:
                    want_q, want_s = _stored(source, PRE.format(i, e) + p, src)
                    n = want_q.shape[0]
                    assert torch.equal(codes[e, rows : rows + n], want_q.to(torch.int8)), (i, e, p)
                    assert torch.equal(wsf[e, rows : rows + n], want_s), (i, e, p)
                    rows += n
                assert rows == codes.shape[1] == wsf.shape[1]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_per_rank_is_the_tp1_tensors_sharded(source, tmp_path, layout):
    """Names, dtypes and shapes per rank as trtpipe's own INT4 AWQ experts (tests/quant/test_moe_awq_engine.py);
    each rank holds exactly its moe_ep block of experts and its moe_tp slice of each expert's up and gate rows
    (fc) or input columns (proj) of the tp1 tensors."""
    full = {k: v for k, v in load_file(str(convert_source(source, tmp_path / "tp1") / "rank0.safetensors")).items()}
    kw = LAYOUTS[layout]
    ckpt = convert_source(source, tmp_path / layout, **kw) if layout != "tp1" else tmp_path / "tp1"
    e_r, w_r = PER_RANK[layout]
    ep = kw.get("moe_ep", 1)
    for rank in range(kw["tp"]):
        t = load_file(str(ckpt / f"rank{rank}.safetensors"))
        ep_rank, tp_rank = rank % ep, rank // ep
        experts = slice(ep_rank * e_r, (ep_rank + 1) * e_r)
        for i in range(LAYERS):
            p = f"transformer.layers.{i}.mlp."
            got = {k[len(p) :]: v for k, v in t.items() if k.startswith(p)}
            assert {k: (v.dtype, tuple(v.shape)) for k, v in got.items()} == {
                "router.weight": (torch.float32, (EXPERTS, HIDDEN)),
                "fc.weight": (torch.int8, (e_r, w_r, HIDDEN)),
                "fc.weights_scaling_factor": (torch.float32, (e_r, 2 * w_r, HIDDEN // G)),
                "fc.prequant_scaling_factor": (torch.bfloat16, (HIDDEN,)),
                "proj.weight": (torch.int8, (e_r, HIDDEN // 2, w_r)),
                "proj.weights_scaling_factor": (torch.float32, (e_r, HIDDEN, w_r // G)),
                "proj.prequant_scaling_factor": (torch.bfloat16, (w_r,)),
            }, (layout, rank, i)
            for suffix, per in (("weight", 2), ("weights_scaling_factor", 1)):  # fc rows per code row
                whole = full[p + f"fc.{suffix}"][experts]
                halves = whole.split(WIDTH // per, dim=1)  # [up; gate]
                n = w_r // per
                want = torch.cat([h[:, tp_rank * n : (tp_rank + 1) * n] for h in halves], dim=1)
                assert torch.equal(got[f"fc.{suffix}"], want), (layout, rank, i, suffix)
                cols = got[f"proj.{suffix}"].shape[-1]
                want = full[p + f"proj.{suffix}"][experts][..., tp_rank * cols : (tp_rank + 1) * cols]
                assert torch.equal(got[f"proj.{suffix}"], want), (layout, rank, i, suffix)


def test_logits_at_tp1_moe_tp2_and_moe_ep2(source, tmp_path):
    reference = load_hf_checkpoint(source)
    with torch.no_grad():
        ref32 = reference.forward(IDS)
        ref64 = float64_copy(reference).forward(IDS)
    scale = error_scale(ref32, ref64)
    for name, kw in LAYOUTS.items():
        model = load_checkpoint(convert_source(source, tmp_path / name, **kw))
        assert (model.args.moe_tp, model.args.moe_ep) == (kw.get("moe_tp", 1), kw.get("moe_ep", 1))
        with torch.no_grad():
            assert_as_accurate(model.forward(IDS), ref64, scale, f"{detect(source).family} {name}")


def _recipe(
    tmp_path: Path, source: Path, name: str, parallel: str = "", dtype: str = "bfloat16", lossy: str = ""
) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(
        f"name: t\nwork_dir: {tmp_path / name}\ntarget: engine\nmodel:\n  source: {source}\n"
        f"  dtype: {dtype}\n{lossy}{parallel}engine:\n  max_batch_size: 8\n  max_input_len: 64\n"
        "  max_seq_len: 128\n  max_num_tokens: 256\n"
    )
    return p


SOURCE_KEYS = ("target", "parallel.tp", "model.source", "model.allow_lossy_import")  # the pre-quantized source rules


def _findings(tmp_path: Path, source: Path, name: str, parallel: str = "", **kw) -> list[tuple[str, str]]:
    return [
        (x.key, x.message)
        for x in check_recipe(load_recipe(_recipe(tmp_path, source, name, parallel, **kw), check_rules=False))
        if x.key in SOURCE_KEYS
    ]


def test_validate_takes_the_symmetric_sources_and_names_split_groups(source, tmp_path):
    """validate agrees with the conversion: no finding at moe_tp 2; at moe_tp 4 each rank's down_proj slice has 32
    inputs, half a group, refused naming the linear (the conversion could not cut the source's groups)."""
    assert moe_refusal(detect(source)) is None
    assert _findings(tmp_path, source, "ok", "parallel:\n  tp: 2\n  moe_tp: 2\n") == []
    bad = [m for k, m in _findings(tmp_path, source, "tp4", "parallel:\n  tp: 4\n  moe_tp: 4\n") if k == "parallel.tp"]
    assert any(
        "at tp=4 (moe_tp=4) mlp.proj in_features 32 per rank is not a multiple of group_size 64" in m for m in bad
    ), bad


def _refused(tmp_path: Path, src: Path, why: str) -> None:
    """Refused with ``why`` at validate (the target finding) and at conversion (one line), nothing written."""
    assert moe_refusal(detect(src)) == why
    found = [m for k, m in _findings(tmp_path, src, "r") if k == "target"]
    assert len(found) == 1 and found[0].endswith(
        f"its mixture-of-experts layers are refused for target engine: {why}"
    ), found
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as exc:
        convert_source(src, out, allow_lossy=("zero_point_rounding",))
    msg = str(exc.value)
    assert "\n" not in msg and msg.endswith(f"mixture-of-experts layers are not converted for the engine target: {why}")
    assert not out.exists() and not any(tmp_path.glob(".out.tmp-*"))


def test_autoawq_zero_point_experts_are_refused(made, tmp_path):
    """AutoAWQ GEMM (zero points, no AutoAWQ MoE checkpoint checked against its producer): refused at validate
    (config only: the asymmetric source's config.json under AutoAWQ's quantization_config)."""
    src = tmp_path / "awq"
    src.mkdir()
    cfg = json.loads((made / "asym" / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": G,
        "zero_point": True,
        "version": "gemm",
    }
    (src / "config.json").write_text(json.dumps(cfg))
    shutil.copy(made / "asym" / "model.safetensors", src / "model.safetensors")
    assert moe_refusal(detect(src)) == MOE_INT4_ZERO
    found = [m for k, m in _findings(tmp_path, src, "r") if k == "target"]
    assert len(found) == 1 and found[0].endswith(
        f"its mixture-of-experts layers are refused for target engine: {MOE_INT4_ZERO}"
    ), found


def test_gptq_act_order_experts_are_refused(gptq, tmp_path):
    src = tmp_path / "desc_act" / "src"
    shutil.copytree(gptq, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["desc_act"] = True
    (src / "config.json").write_text(json.dumps(cfg))
    _refused(tmp_path / "desc_act", src, MOE_INT4_ACT_ORDER)


def test_a_per_expert_pre_quant_scale_is_refused_naming_the_tensor(made, tmp_path):
    """ModelOpt's W4A16_AWQ form of the same experts (unified tensors with a per-expert pre_quant_scale): the
    format is refused at validate and conversion (MOE_INT4_PREQUANT, pinned in test_moe_import.py for ModelOpt's own
    config); here the check on the tensors themselves, via the converter's expert stacking."""
    from trtpipe.quant.imported.trtllm import MOE_STACK

    fuse, _ = MOE_STACK["W4A16_AWQ"]
    m = {
        "weight": torch.zeros(16, 64, dtype=torch.uint8),
        "weight_scale": torch.ones(32, 4),
        "pre_quant_scale": torch.ones(64),
    }
    with pytest.raises(CheckpointError) as exc:
        fuse([m], ["model.layers.0.mlp.experts.3.down_proj"], "src: transformer.layers.0.mlp.proj expert 3")
    assert str(exc.value) == (
        "src: transformer.layers.0.mlp.proj expert 3: tensor "
        f"'model.layers.0.mlp.experts.3.down_proj' has a pre_quant_scale: {MOE_INT4_PREQUANT}"
    )


def test_the_docs_table_states_each_refusal():
    doc = (ROOT / "docs" / "reference" / "prequantized.md").read_text()
    for why in (MOE_INT4_PREQUANT, MOE_INT4_ZERO, MOE_INT4_ACT_ORDER):
        assert f"refused: {why} |" in doc, why[:60]


# --- zero-point experts: llm-compressor's asymmetric W4A16 and GPTQ sym: false packed from it -----------------------


@pytest.fixture(scope="module")
def gptq_asym(made, tmp_path_factory) -> Path:
    """The asymmetric source repacked as GPTQ v1 ``sym: false`` (its zero points kept)."""
    return _as_gptq(made / "asym", tmp_path_factory.mktemp("moe_gptq_asym") / "src")


@pytest.fixture(scope="module", params=["llmc", "gptq"])
def zsource(request, made, gptq_asym) -> Path:
    return made / "asym" if request.param == "llmc" else gptq_asym


def _stored_zero(module: str, t: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(signed codes [out, in], float32 group scales [out, in/g], signed zero points [out, in/g]) of one
    projection, by the format's definition: W = (q - zp) * s."""
    if module + ".qweight" in t:  # GPTQ v1: unsigned codes along the inputs, true zeros = stored + 0x11111111
        zw = (t[module + ".qzeros"].to(torch.int64) + 0x11111111) & 0xFFFFFFFF
        return (
            (_nibbles(t[module + ".qweight"], 0) - 8).t(),
            t[module + ".scales"].float().t(),
            (_nibbles(zw, 1) - 8).t(),
        )
    out_f, in_f = (int(x) for x in t[module + ".weight_shape"].tolist())
    return (
        _nibbles(t[module + ".weight_packed"], 1)[:, :in_f] - 8,
        t[module + ".weight_scale"].float(),
        _nibbles(t[module + ".weight_zero_point"], 0)[:out_f] - 8,
    )


def _convert(src: Path, out: Path, dtype: str, allow_lossy: tuple[str, ...] = (), **kw) -> Path:
    fmt = detect(src)
    return convert(
        src,
        out,
        dtype=dtype,
        overwrite=True,
        **kw,
        importer=lambda plan, reader: ImportedLinears(fmt, reader.keys(), str(src), allow_lossy),
    )


def test_zero_point_experts_are_the_sources_at_float32(zsource, tmp_path):
    """At model dtype float32 (no lossy step to accept): has_zero_point true; each expert's codes and scales are the
    source's, and its ``zero`` columns (fc: up, then gate) are -zp * s exactly, [in/g, out] per expert."""
    src = load_file(str(zsource / "model.safetensors"))
    ckpt = _convert(zsource, tmp_path / "tp1", "float32")
    q = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert (q["quant_algo"], q["group_size"], q["has_zero_point"]) == ("W4A16_AWQ", G, True)
    t = load_file(str(ckpt / "rank0.safetensors"))
    for i in range(LAYERS):
        pre = f"transformer.layers.{i}.mlp."
        for lin, projs in PROJS.items():
            codes, wsf, zero = (
                unpack_int4_rows(t[pre + f"{lin}.weight"]),
                t[pre + f"{lin}.weights_scaling_factor"],
                t[pre + f"{lin}.zero"],
            )
            assert zero.dtype == torch.float32 and bool((t[pre + f"{lin}.prequant_scaling_factor"] == 1).all())
            for e in range(EXPERTS):
                rows = 0
                for p in projs:
                    want_q, want_s, want_zp = _stored_zero(PRE.format(i, e) + p, src)
                    n = want_q.shape[0]
                    assert torch.equal(codes[e, rows : rows + n], want_q.to(torch.int8)), (i, e, p)
                    assert torch.equal(wsf[e, rows : rows + n], want_s), (i, e, p)
                    assert torch.equal(zero[e, :, rows : rows + n], (-want_zp * want_s).t()), (i, e, p)
                    rows += n
                assert rows == zero.shape[-1]
            assert bool((zero != 0).any()), (i, lin)  # real zero points, not all 8


def test_zero_point_layout_per_rank(zsource, tmp_path):
    """moe_tp 2 / moe_ep 2: every rank's tensors as the symmetric layout's plus ``zero`` [E_r, in_r/g, out_r] in
    the model dtype, its moe_ep block of experts and its moe_tp slice of the tp1 zero (fc: of each half's
    columns; proj: of the groups)."""
    full = load_file(str(_convert(zsource, tmp_path / "tp1", "float32") / "rank0.safetensors"))
    for layout in ("mtp2", "ep2"):
        kw = LAYOUTS[layout]
        ckpt = _convert(zsource, tmp_path / layout, "float32", **kw)
        e_r, w_r = PER_RANK[layout]
        ep = kw["moe_ep"]
        for rank in range(kw["tp"]):
            t = load_file(str(ckpt / f"rank{rank}.safetensors"))
            experts, tp_rank = slice(rank % ep * e_r, (rank % ep + 1) * e_r), rank // ep
            for i in range(LAYERS):
                p = f"transformer.layers.{i}.mlp."
                got = {k[len(p) :]: (v.dtype, tuple(v.shape)) for k, v in t.items() if k.startswith(p)}
                assert got == {
                    "router.weight": (torch.float32, (EXPERTS, HIDDEN)),
                    "fc.weight": (torch.int8, (e_r, w_r, HIDDEN)),
                    "fc.weights_scaling_factor": (torch.float32, (e_r, 2 * w_r, HIDDEN // G)),
                    "fc.prequant_scaling_factor": (torch.float32, (HIDDEN,)),
                    "fc.zero": (torch.float32, (e_r, HIDDEN // G, 2 * w_r)),
                    "proj.weight": (torch.int8, (e_r, HIDDEN // 2, w_r)),
                    "proj.weights_scaling_factor": (torch.float32, (e_r, HIDDEN, w_r // G)),
                    "proj.prequant_scaling_factor": (torch.float32, (w_r,)),
                    "proj.zero": (torch.float32, (e_r, w_r // G, HIDDEN)),
                }, (layout, rank, i)
                halves = full[p + "fc.zero"][experts].split(WIDTH, dim=-1)  # [up | gate] columns
                want = torch.cat([h[..., tp_rank * w_r : (tp_rank + 1) * w_r] for h in halves], dim=-1)
                assert torch.equal(t[p + "fc.zero"], want), (layout, rank, i)
                groups = slice(tp_rank * w_r // G, (tp_rank + 1) * w_r // G)
                assert torch.equal(t[p + "proj.zero"], full[p + "proj.zero"][experts][:, groups]), (layout, rank, i)


def test_zero_point_logits_at_tp1_moe_tp2_and_moe_ep2(zsource, tmp_path):
    """The reference runtime on the float32 conversion against the source's reference model ((q - zp) * s as
    stored) in float64; bound from that model's own float32 error (the weights are the same numbers)."""
    reference = load_hf_checkpoint(zsource)
    with torch.no_grad():
        ref32 = reference.forward(IDS)
        ref64 = float64_copy(reference).forward(IDS)
    scale = error_scale(ref32, ref64)
    for name, kw in LAYOUTS.items():
        model = load_checkpoint(_convert(zsource, tmp_path / name, "float32", **kw))
        assert model.args.quantization["has_zero_point"] is True
        with torch.no_grad():
            assert_as_accurate(model.forward(IDS), ref64, scale, f"{detect(zsource).family} zero point {name}")


def test_zero_point_experts_at_bfloat16_need_zero_point_rounding(made, tmp_path):
    """At model dtype bfloat16 ``zero`` is rounded once: validate names the step, the conversion refuses in one line
    and writes nothing, until ``zero_point_rounding`` is listed; then ``zero`` is -zp * s rounded to bfloat16."""
    src = made / "asym"
    assert moe_refusal(detect(src)) is None
    found = _findings(tmp_path, src, "bf16")
    assert (
        len(found) == 1
        and found[0][0] == "model.source"
        and "zero_point_rounding" in found[0][1]
        and "bfloat16" in found[0][1]
    ), found
    assert _findings(tmp_path, src, "f32", dtype="float32") == []
    assert _findings(tmp_path, src, "ok", lossy="  allow_lossy_import: [zero_point_rounding]\n") == []
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as exc:
        _convert(src, out, "bfloat16")
    assert "\n" not in str(exc.value) and str(exc.value).endswith(
        f"add {ZERO_POINT_ROUNDING} to model.allow_lossy_import to accept"
    ), exc.value
    assert not out.exists() and not any(tmp_path.glob(".out.tmp-*"))
    t = load_file(str(_convert(src, out, "bfloat16", (ZERO_POINT_ROUNDING,)) / "rank0.safetensors"))
    stored = load_file(str(src / "model.safetensors"))
    _, s, zp = _stored_zero(PRE.format(1, 5) + "down_proj", stored)
    zero = t["transformer.layers.1.mlp.proj.zero"]
    assert zero.dtype == torch.bfloat16 and torch.equal(zero[5], (-zp.double() * s.double()).to(torch.bfloat16).t())
