"""Make pre-quantized checkpoints with the real producers, for trtpipe's importer tests.

    .venv-producers/bin/python tests/tools/make_prequantized.py OUTDIR [--only NAME ...] [--list]

Runs in the producers' venv (scripts/install_producers.sh): NVIDIA ModelOpt (``mtq.quantize`` +
``export_hf_checkpoint``), llm-compressor (``oneshot``) and, where installed, GPTQModel. Each fixture is one
directory ``OUTDIR/NAME``: the producer's own Hugging Face checkpoint (config.json with ``quantization_config``
and/or hf_quant_config.json, safetensors, tokenizer files) plus

* ``producer.json``: producer, package versions, the call that made it, the format, the base model, how the
  oracle was made, whether transformers could load the checkpoint (and why not);
* ``oracle.safetensors``: the producer library's own dequantization of every quantized weight, float32, keyed by
  the HF weight name (``model.layers.0.self_attn.q_proj.weight``);
* ``oracle_logits.safetensors`` (where transformers loads the quantized checkpoint on CPU): ``input_ids`` and
  ``logits`` (stored float64) of transformers' forward pass over the fixed prompt, run in float64 where
  transformers lets the model be cast (not GPTQ: float32; producer.json says which).

Base models: ``stories`` is models/stories260k (a real trained Llama, hidden 64, intermediate 172: group formats
use group 32 with ``down_proj`` kept unquantized, since 172 inputs have no whole groups); ``qwen3`` is trtpipe's
synthetic Qwen3 widened to hidden 128 / intermediate 256, head_dim 32 (q 256 wide, k/v 64: GPTQModel's AWQ
clip search needs out % 64), so that group 128 divides every input width (written to
``OUTDIR/base-qwen3`` with stories' tokenizer). Everything is seeded: a rerun gives the same bytes.
A fixture is written to ``NAME.tmp`` and renamed when complete, so an interrupted run leaves no half fixture.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # trtpipe.models.synthetic (needs only torch + transformers)

STORIES = ROOT / "models" / "stories260k"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"
CALIB_TEXTS = [
    "Once upon a time, there was a little dog named Max. Max liked to run in the park.",
    "Tom and Sue went to the beach. They built a big sand castle and found a shell.",
    "The sun was hot. A little bird sat on a tree and sang a happy song for her friends.",
    "One day, a boy named Tim found a red ball. He kicked it high into the blue sky.",
    "Lily had a cat. The cat was soft and white. Every night it slept on her bed.",
    "There was a big, old tree in the garden. Many animals lived in it and were happy.",
    "Anna wanted to bake a cake. Her mom helped her mix the eggs, the milk and the flour.",
    "The little car went fast down the hill. It stopped near a shop that sold toys.",
    "Ben was sad because it rained. Then his sister came and they played a game inside.",
    "A fish lived in a small pond. It wanted to see the sea, so it swam down the river.",
    "Sam and his dad went fishing. They sat by the lake and waited for a long time.",
    "The girl saw a rainbow after the storm. She ran to tell her brother about the colors.",
    "Mia found a key under a rock. She tried it on the old box and the box opened.",
    "A bear woke up from a long sleep. He was very hungry and looked for some honey.",
    "Jack had a new red bike. He rode it to school and showed it to all his friends.",
    "The moon was bright. A little owl flew over the houses and said hello to the stars.",
]
QWEN3_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    num_hidden_layers=2,
    bos_token_id=1,
    eos_token_id=2,
)
STORIES_GROUP = 64  # the engine's group-wise INT4 GEMM runs 64 or 128 (trtpipe.engine.upstream)
AWQ_CALIB_TEXTS = 4  # AWQ searches per batch: the first 4 texts keep it to seconds on a loaded 2-core CPU
AWQ_ALPHA_STEP = 0.25
STORIES_BLOCKED_SKIP = ("down_proj", "o_proj")  # down_proj: 172 inputs; o_proj: 32 per rank at tp 2


def versions(*packages: str) -> dict:
    return {p: metadata.version(p) for p in ("torch", "transformers", *packages)}


# ---------------------------------------------------------------- base models, data


def base_model(name: str, outdir: Path) -> Path:
    """The unquantized source of a fixture: stories260k in the repository, or the synthetic Qwen3 (made once)."""
    if name == "stories":
        return STORIES
    path = outdir / f"base-{name}"
    if not (path / "config.json").exists():
        from trtpipe.models.synthetic import make_synthetic

        tmp = outdir / f"base-{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        make_synthetic("qwen3", tmp, seed=5, dtype=torch.bfloat16, **QWEN3_SHAPE)
        copy_tokenizer(tmp)
        tmp.rename(path)
    return path


def copy_tokenizer(dst: Path) -> None:
    for f in TOKENIZER_FILES:
        if (STORIES / f).exists() and not (dst / f).exists():
            shutil.copy(STORIES / f, dst / f)


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(STORIES)


def calib_batches() -> list[torch.Tensor]:
    """The calibration token batches every producer sees: the 16 texts, each its own batch (no padding)."""
    tok = tokenizer()
    return [torch.tensor([tok(t)["input_ids"]]) for t in CALIB_TEXTS]


def calib_dataset():
    """The same texts as a datasets.Dataset of token ids, for llm-compressor's oneshot."""
    from datasets import Dataset

    tok = tokenizer()
    rows = [tok(t) for t in CALIB_TEXTS]
    return Dataset.from_dict(
        {"input_ids": [r["input_ids"] for r in rows], "attention_mask": [r["attention_mask"] for r in rows]}
    )


def prompt_ids() -> torch.Tensor:
    return torch.tensor([tokenizer()(PROMPT)["input_ids"]])


def load_base(path: Path, dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


class NotLoadable(Exception):
    """transformers would load the checkpoint without its quantization (so its logits are no oracle)."""


def transformers_logits(path: Path, **kwargs) -> tuple[torch.Tensor, torch.dtype]:
    """Logits of transformers' own loading of the quantized checkpoint on CPU (in float64 where transformers
    allows the cast) and the dtype it ran in. Refused where
    transformers has no quantizer for the checkpoint's ``quant_method`` (it warns, skips the quantization and
    loads the raw codes without their scales) or leaves any stored tensor unused."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    method = json.loads((path / "config.json").read_text()).get("quantization_config", {}).get("quant_method")
    if method not in AUTO_QUANTIZER_MAPPING:
        raise NotLoadable(
            f"transformers {transformers.__version__} has no quantizer for quant_method {method!r} "
            "(it would skip the quantization and read the raw codes without their scales)"
        )
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    unused = sorted(info.get("unexpected_keys") or [])
    if unused:
        raise NotLoadable(
            f"transformers {transformers.__version__} leaves {len(unused)} stored tensors unused (e.g. {unused[0]})"
        )
    model = model.eval()
    try:
        model = model.to(torch.float64)
    except ValueError:  # transformers refuses to cast GPTQ models ("You cannot cast a GPTQ model in a new dtype")
        pass
    with torch.no_grad():
        return model(prompt_ids()).logits[0].to(torch.float64), next(model.parameters()).dtype


def logits_or_reason(out: Path, **kwargs) -> dict:
    """Save transformers' logits for the checkpoint where it loads on CPU, else say why it does not (its own
    error's first line): producer.json's ``oracle_logits`` / ``oracle_logits_absent``."""
    try:
        logits, dtype = transformers_logits(out, **kwargs)
    except Exception as e:  # the reason goes into producer.json; the fixture is still complete without logits
        return dict(oracle_logits=None, oracle_logits_absent=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    save_logits(out, logits)
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return dict(
        oracle_logits=f"transformers AutoModelForCausalLM.from_pretrained(dir, {args}), forward over "
        f"input_ids on CPU with the model in {str(dtype).replace('torch.', '')} (float64 "
        "where transformers lets the model be cast); a quantized kernel may dequantize in "
        "its scales' dtype"
    )


def save_oracle(out: Path, weights: dict[str, torch.Tensor]) -> None:
    save_file(
        {k: v.to(torch.float32).contiguous() for k, v in sorted(weights.items())}, str(out / "oracle.safetensors")
    )


def save_logits(out: Path, logits: torch.Tensor) -> None:
    save_file(
        {"input_ids": prompt_ids()[0].contiguous(), "logits": logits.contiguous()},
        str(out / "oracle_logits.safetensors"),
    )


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        if f.name not in ("oracle.safetensors", "oracle_logits.safetensors"):
            out.update(load_file(str(f)))
    return out


# ---------------------------------------------------------------- ModelOpt


MODELOPT_MODES = {
    # fixture format -> (ModelOpt configs merged in order, group-quantized weights?)
    "fp8": (("FP8_DEFAULT_CFG",), False),
    "fp8_pcpt": (("FP8_PER_CHANNEL_PER_TOKEN_CFG",), False),
    "fp8_kv": (("FP8_DEFAULT_CFG", "FP8_KV_CFG"), False),
    "w4a16_awq": (("INT4_AWQ_CFG",), True),
    "w4a8_awq": (("W4A8_AWQ_BETA_CFG",), True),
    "nvfp4": (("NVFP4_DEFAULT_CFG",), True),
}


def modelopt_config(mtq, mode: str, group: int, skip: tuple[str, ...]) -> dict:
    names, grouped = MODELOPT_MODES[mode]
    cfg = copy.deepcopy(getattr(mtq, names[0]))
    for extra in names[1:]:
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + list(copy.deepcopy(getattr(mtq, extra))["quant_cfg"])
    if grouped and mode != "nvfp4":  # NVFP4's block of 16 is the format's own
        for entry in cfg["quant_cfg"]:
            c = entry.get("cfg")
            for cc in c if isinstance(c, list) else [c]:
                if isinstance(cc, dict) and cc.get("num_bits") == 4 and "block_sizes" in cc:
                    cc["block_sizes"] = {-1: group, "type": "static"}
    for m in skip if grouped else ():
        cfg["quant_cfg"].append({"quantizer_name": f"*{m}*", "enable": False})
    if "awq" in mode:  # AWQ's search runs a forward per candidate scale: 5 candidates, not ModelOpt's 11
        cfg["algorithm"] = {"method": "awq_lite", "alpha_step": AWQ_ALPHA_STEP}
    return cfg


def modelopt_oracle(out: Path) -> dict[str, torch.Tensor]:
    """ModelOpt's own dequantization of each exported weight: ``from_quantized_weight`` for FP8 per tensor,
    ``FP8QTensor.dequantize`` for FP8 per channel, ``NVFP4QTensor.dequantize`` for NVFP4. INT4 (AWQ, W4A8):
    ModelOpt 0.47 has no reader for its ``pack_int4_in_uint8`` layout, so the codes are unpacked as that packer
    writes them (two adjacent output rows per byte, low nibble first, signed) and dequantized as
    ``INT4QTensor`` does per block (code * weight_scale)."""
    from modelopt.torch.export.model_config import QUANTIZATION_FP8
    from modelopt.torch.export.quant_utils import from_quantized_weight
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor

    algo = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    quant_algo, group = algo["quant_algo"], algo.get("group_size")
    t = checkpoint_tensors(out)
    oracle = {}
    for name, w in t.items():
        if not name.endswith(".weight") or name[: -len("weight")] + "weight_scale" not in t:
            continue
        s = t[name[: -len("weight")] + "weight_scale"]
        if quant_algo == "FP8":
            oracle[name] = from_quantized_weight(w, s.float(), QUANTIZATION_FP8, torch.float32)
        elif quant_algo == "FP8_PER_CHANNEL_PER_TOKEN":
            oracle[name] = FP8QTensor(w.shape, torch.float32, w).dequantize(
                torch.float32, scale=s.float().reshape(-1, 1)
            )
        elif quant_algo == "NVFP4":
            s2 = t[name[: -len("weight")] + "weight_scale_2"]
            shape = (w.shape[0], w.shape[1] * 2)
            oracle[name] = NVFP4QTensor(shape, torch.float32, w).dequantize(
                torch.float32, scale=s, double_scale=s2.float(), block_sizes={-1: group or 16}
            )
        elif quant_algo in ("W4A16_AWQ", "W4A8_AWQ"):
            lo = (w & 0x0F).to(torch.int8)
            hi = (w >> 4).to(torch.int8)
            lo, hi = torch.where(lo > 7, lo - 16, lo), torch.where(hi > 7, hi - 16, hi)
            codes = torch.stack([lo, hi], dim=1).reshape(w.shape[0] * 2, w.shape[1]).float()
            oracle[name] = codes * s.float().repeat_interleave(group, dim=1)
        else:
            raise SystemExit(f"{out}: no ModelOpt oracle for quant_algo {quant_algo}")
    return oracle


def make_modelopt(mode: str, model: str) -> Callable[[Path, Path], dict]:
    def run(out: Path, outdir: Path) -> dict:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint

        base = base_model(model, outdir)
        group, skip = (STORIES_GROUP, STORIES_BLOCKED_SKIP) if model == "stories" else (128, ())
        # calibrated in float32 (bf16 matmuls are several times slower on CPUs without bf16 units; the stories
        # checkpoint is float32 anyway), exported in bf16 as ModelOpt's own examples do
        hf = load_base(base, torch.float32)
        cfg = modelopt_config(mtq, mode, group, skip)
        batches = calib_batches()[: AWQ_CALIB_TEXTS if "awq" in mode else None]

        def loop(m):
            with torch.no_grad():
                for b in batches:
                    m(b)

        mtq.quantize(hf, cfg, loop)
        export_hf_checkpoint(hf, export_dir=out, dtype=torch.bfloat16)
        copy_tokenizer(out)
        save_oracle(out, modelopt_oracle(out))
        grouped = MODELOPT_MODES[mode][1]
        return dict(
            producer="modelopt",
            versions=versions("nvidia-modelopt"),
            call=(
                f"mtq.quantize(model_float32, {'+'.join(MODELOPT_MODES[mode][0])}"
                + (f" with weight block {group}" if grouped and mode != "nvfp4" else "")
                + (f", {list(skip)} disabled" if grouped and skip else "")
                + (f", algorithm awq_lite alpha_step {AWQ_ALPHA_STEP}" if "awq" in mode else "")
                + f", forward_loop over {len(batches)} calibration texts); "
                "export_hf_checkpoint(model, export_dir, dtype=torch.bfloat16)"
            ),
            oracle="modelopt_oracle(): " + " ".join(modelopt_oracle.__doc__.split()),
            **logits_or_reason(out, dtype=torch.float32),
        )

    return run


# ---------------------------------------------------------------- llm-compressor


def llmc_recipe(fmt: str, model: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    ignore = ["lm_head"]
    group = 128
    if model == "stories" and fmt.startswith(("w4a16", "gptq")):
        group = STORIES_GROUP
        ignore += [f"re:.*{m}$" for m in STORIES_BLOCKED_SKIP]

    def w4(actorder=None, symmetric=True):
        return {
            "group_0": QuantizationScheme(
                targets=["Linear"],
                weights=QuantizationArgs(
                    num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group, actorder=actorder
                ),
            )
        }

    table = {
        "fp8_static": lambda: QuantizationModifier(targets="Linear", scheme="FP8", ignore=ignore),
        "fp8_dynamic": lambda: QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=ignore),
        "fp8_block": lambda: QuantizationModifier(targets="Linear", scheme="FP8_BLOCK", ignore=ignore),
        "fp8_kv": lambda: QuantizationModifier(
            targets="Linear",
            scheme="FP8",
            ignore=ignore,
            kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
        ),
        "w8a8_int8": lambda: GPTQModifier(targets="Linear", scheme="W8A8", ignore=ignore),
        "w4a16": lambda: QuantizationModifier(config_groups=w4(), ignore=ignore),
        "w4a16_asym": lambda: QuantizationModifier(config_groups=w4(symmetric=False), ignore=ignore),
        "gptq_w4a16": lambda: GPTQModifier(config_groups=w4(), ignore=ignore),
        "gptq_w4a16_actorder": lambda: GPTQModifier(config_groups=w4(actorder="weight"), ignore=ignore),
    }
    return table[fmt]()


def make_llmc(fmt: str, model: str) -> Callable[[Path, Path], dict]:
    def run(out: Path, outdir: Path) -> dict:
        from llmcompressor import oneshot
        from transformers import CompressedTensorsConfig

        base = base_model(model, outdir)
        hf = load_base(base)
        recipe = llmc_recipe(fmt, model)
        torch.manual_seed(0)
        oneshot(
            model=hf,
            recipe=recipe,
            dataset=calib_dataset(),
            num_calibration_samples=len(CALIB_TEXTS),
            max_seq_length=64,
            shuffle_calibration_samples=False,
            output_dir=str(out),
            tokenizer=tokenizer(),
            log_dir=None,
        )
        copy_tokenizer(out)
        # compressed-tensors' own decompression, as transformers calls it on load (run_compressed=False):
        # the dense weights it gives are the oracle, and the same model's forward the logits
        from transformers import AutoModelForCausalLM

        dense = AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
        ).eval()
        sd = dense.state_dict()
        stored = checkpoint_tensors(out)
        quantized = sorted({k.rsplit(".", 1)[0] for k in stored if k.endswith(("weight_scale", "weight_packed"))})
        save_oracle(out, {f"{m}.weight": sd[f"{m}.weight"] for m in quantized})
        logits = logits_or_reason(
            out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
        )
        return dict(
            producer="llmcompressor",
            versions=versions("llmcompressor", "compressed-tensors"),
            call=f"oneshot(model=model_bf16, recipe={recipe!r}, dataset=16 calibration texts, "
            "max_seq_length=64, shuffle_calibration_samples=False, output_dir=...)",
            oracle=(
                "compressed_tensors' decompression (ModelCompressor.decompress_model, which "
                "transformers runs when loading with CompressedTensorsConfig(run_compressed=False)), "
                "float32 weights of the modules that carry weight_scale / weight_packed"
            ),
            activations_in_logits=ct_activation_note(out),
            **logits,
        )

    return run


def ct_activation_note(out: Path) -> str:
    """What transformers' forward of a decompressed compressed-tensors checkpoint does to activations: the
    loaded Linears keep their scheme and fake-quantize their inputs (static: with the stored ``input_scale``;
    dynamic: per token/group at run time), so these oracle logits include it."""
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    notes = []
    for name, group in sorted(qc["config_groups"].items()):
        a = group.get("input_activations")
        if a:
            notes.append(
                f"{name}: inputs of {group['targets']} fake-quantized to {a['type']}{a['num_bits']} "
                f"{a['strategy']} " + ("dynamic" if a["dynamic"] else "static (stored input_scale)")
            )
    if qc.get("kv_cache_scheme"):
        notes.append(f"kv cache scheme {qc['kv_cache_scheme']} (k_scale / v_scale on self_attn)")
    return "; ".join(notes) or "none: weight-only (logits = dense forward of oracle.safetensors' weights)"


# ---------------------------------------------------------------- GPTQModel

GPTQMODEL_MODES = {
    # fixture format -> (method, checkpoint format, desc_act, sym)
    "gptq_v1": ("gptq", "gptq", False, True),
    "gptq_v2": ("gptq", "gptq_v2", False, True),
    "gptq_v1_asym": ("gptq", "gptq", False, False),
    "gptq_v1_actorder": ("gptq", "gptq", True, True),
    "awq_gemm": ("awq", "gemm", False, False),
}


def gptqmodel_oracle(out: Path, method: str) -> dict[str, torch.Tensor]:
    """GPTQModel's own dequantization. GPTQ: the checkpoint loaded back by ``GPTQModel.load`` on the torch
    kernel (which turns v1 zero points into v2 as it loads), ``PackableQuantLinear.dequantize_weight`` (its
    generic unpacker: ``scales[g_idx] * (codes - zeros[g_idx])``) per Linear, transposed to [out, in]. AWQ GEMM: ``gptqmodel.quantization.awq.utils.packing_utils.dequantize_gemm``
    on the stored qweight / qzeros / scales. Scales are the checkpoint's, upcast to float32, so each value is
    the exact (code - zero) * scale (the library otherwise multiplies in fp16 / the model dtype)."""
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    if method == "awq":
        from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

        t = checkpoint_tensors(out)
        return {
            f"{m}.weight": dequantize_gemm(
                t[f"{m}.qweight"], t[f"{m}.qzeros"], t[f"{m}.scales"].float(), qc["bits"], qc["group_size"]
            ).T
            for m in sorted(k[: -len(".qweight")] for k in t if k.endswith(".qweight"))
        }
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear

    # the torch kernel wraps its dequantizer in torch.compile on load (minutes of C++ builds on a small CPU)
    torch._dynamo.config.disable = True
    try:
        model = GPTQModel.load(str(out), device="cpu", backend=BACKEND.GPTQ_TORCH)
    finally:
        torch._dynamo.config.disable = False
    stored = checkpoint_tensors(out)
    oracle = {}
    for name, mod in model.model.named_modules():
        if isinstance(mod, PackableQuantLinear):
            # the loaded module holds its scales in the model dtype (bf16 here: fp16 -> bf16 is lossy); the
            # checkpoint's fp16 scales, upcast, give the exact products
            mod.scales = stored[f"{name}.scales"].float()
            oracle[f"{name}.weight"] = PackableQuantLinear.dequantize_weight(mod).T
    return oracle


def make_gptqmodel(mode: str, model: str) -> Callable[[Path, Path], dict]:
    def run(out: Path, outdir: Path) -> dict:
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its default asks for more CPU workers than 1
        os.environ.setdefault("GPTQMODEL_DISABLE_PACK_EXT", "1")  # pure-torch packer, no C++ JIT build
        from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
        from gptqmodel.quantization.config import FORMAT, METHOD

        method, fmt, desc_act, sym = GPTQMODEL_MODES[mode]
        base = base_model(model, outdir)
        tok = tokenizer()
        calib = [
            {"input_ids": r["input_ids"], "attention_mask": r["attention_mask"]} for r in (tok(t) for t in CALIB_TEXTS)
        ]
        qc = QuantizeConfig(
            bits=4,
            group_size=128,
            method=METHOD(method),
            format=FORMAT(fmt),
            desc_act=desc_act,
            sym=sym,
            offload_to_disk=False,
        )
        torch.manual_seed(0)
        q = GPTQModel.load(str(base), qc, device="cpu")
        # AWQ: the portable torch kernel (GPTQModel's default AWQ GEMM kernel needs CUDA: "AWQ: CUDA is not
        # available"); GPTQ picks its torch kernel on CPU by itself
        backend = BACKEND.AWQ_TORCH if method == "awq" else BACKEND.AUTO
        q.quantize(calib, batch_size=1, tokenizer=tok, backend=backend)
        q.save(str(out))
        copy_tokenizer(out)
        save_oracle(out, gptqmodel_oracle(out, method))
        import gptqmodel

        return dict(
            producer="gptqmodel",
            versions=versions("gptqmodel"),
            call=(
                f"GPTQModel.load(base, QuantizeConfig(bits=4, group_size=128, method={method!r}, "
                f"format={fmt!r}, desc_act={desc_act}, sym={sym}), device='cpu'); "
                f"quantize(16 calibration texts, batch_size=1, backend={backend.value!r}); save(dir)  [gptqmodel "
                f"{gptqmodel.__version__}, GPTQMODEL_DISABLE_PACK_EXT=1]"
            ),
            oracle="gptqmodel_oracle(): " + " ".join(gptqmodel_oracle.__doc__.split()),
            **logits_or_reason(out, dtype=torch.float32, device_map="cpu"),
        )

    return run


# ---------------------------------------------------------------- registry


def registry() -> dict[str, tuple[str, str, Callable]]:
    """fixture name -> (producer, format, function(out_dir, outdir) -> producer.json fields)."""
    reg = {}
    for mode in MODELOPT_MODES:
        for model in ("stories", "qwen3") if MODELOPT_MODES[mode][1] else ("stories",):
            reg[f"modelopt-{mode}-{model}"] = ("modelopt", mode, make_modelopt(mode, model))
    for fmt in (
        "fp8_static",
        "fp8_dynamic",
        "fp8_kv",
        "w8a8_int8",
        "w4a16",
        "w4a16_asym",
        "gptq_w4a16",
        "gptq_w4a16_actorder",
    ):
        reg[f"llmc-{fmt}-stories"] = ("llmcompressor", fmt, make_llmc(fmt, "stories"))
    for fmt in ("fp8_block", "w4a16", "gptq_w4a16"):
        reg[f"llmc-{fmt}-qwen3"] = ("llmcompressor", fmt, make_llmc(fmt, "qwen3"))
    for mode in GPTQMODEL_MODES:
        reg[f"gptqmodel-{mode}-qwen3"] = ("gptqmodel", mode, make_gptqmodel(mode, "qwen3"))
    return reg


def build(name: str, outdir: Path) -> float:
    producer, fmt, fn = registry()[name]
    final, tmp = outdir / name, outdir / f"{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    start = time.perf_counter()
    info = fn(tmp, outdir)
    model = name.rsplit("-", 1)[1]
    info = dict(
        name=name,
        format=fmt,
        base=("models/stories260k" if model == "stories" else f"base-{model}"),
        prompt=PROMPT,
        **info,
    )
    (tmp / "producer.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--only", nargs="*", help="fixture names (default: all)")
    ap.add_argument("--list", action="store_true", help="print the fixture names and exit")
    args = ap.parse_args(argv)
    reg = registry()
    if args.list:
        print("\n".join(reg))
        return 0
    names = args.only or list(reg)
    unknown = [n for n in names if n not in reg]
    if unknown:
        print(f"unknown fixture {unknown[0]!r} (--list shows them)", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.outdir = args.outdir.resolve()
    args.outdir.mkdir(parents=True, exist_ok=True)
    os.chdir(args.outdir)  # GPTQModel writes its logs/ into the working directory
    total = time.perf_counter()
    for n in names:
        print(f"{n}: {build(n, args.outdir):.1f} s", flush=True)
    print(f"{len(names)} fixtures in {time.perf_counter() - total:.1f} s -> {args.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
