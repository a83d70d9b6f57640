"""llm-compressor's own W4A16 checkpoints of the synthetic Qwen3-MoE, for the MoE INT4 import tests.

    .venv-producers/bin/python tests/tools/make_moe_w4a16.py OUTDIR

Runs in the producers' venv (scripts/install_producers.sh). Writes ``OUTDIR/base`` (trtpipe's synthetic Qwen3-MoE,
seed 2, bfloat16: hidden 64, 8 experts of width 32, 2 layers) and, from it, ``OUTDIR/sym`` / ``OUTDIR/asym``:
``oneshot`` with a ``QuantizationModifier`` of one config group, int4 weights per group of 16, symmetric /
asymmetric, on every Linear but ``lm_head`` and the router (``re:.*mlp.gate$``, as llm-compressor's Qwen3-MoE
examples ignore it). Group 16 because the expert width is 32: moe_tp 2 leaves 16 inputs of down_proj per rank.
llm-compressor unfuses transformers 5's stacked experts for calibration, so the checkpoint holds one
``weight_packed`` / ``weight_scale`` / ``weight_shape`` per expert projection (``mlp.experts.<e>.up_proj``...),
as a published Qwen3-MoE W4A16 checkpoint does. Weight-only round-to-nearest with a min-max observer needs no
calibration data, so none is given. Each directory gets ``producer.json`` (versions and the call).

Kept apart from tests/tools/make_prequantized.py on purpose: that script's fixtures are cached under a hash of its
text and every one of them is checked by tests parametrized over all fixtures (dense-model expectations); this
one takes about 10 s and is made by the test that reads it (tests/quant/imported/test_moe_int4_import.py).
"""

from __future__ import annotations

import json
import shutil
import sys
from importlib import metadata
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # trtpipe.models.synthetic (needs only torch + transformers)

GROUP = 64  # the engine's group-wise INT4 GEMM runs 64 or 128 (trtpipe.engine.upstream)
# wider than the families' synthetic Qwen3-MoE (64 / 32), so every linear holds whole groups of 64 at moe_tp 2
SHAPE = dict(hidden_size=128, moe_intermediate_size=128)
IGNORE = ["lm_head", "re:.*mlp.gate$"]


def make(outdir: Path) -> None:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    from trtpipe.models.synthetic import make_synthetic

    outdir.mkdir(parents=True, exist_ok=True)
    base = make_synthetic("qwen3_moe", outdir / "base", seed=2, dtype=torch.bfloat16, **SHAPE)
    for name, symmetric in (("sym", True), ("asym", False)):
        tmp, final = outdir / f"{name}.tmp", outdir / name
        shutil.rmtree(tmp, ignore_errors=True)
        groups = {
            "group_0": QuantizationScheme(
                targets=["Linear"],
                weights=QuantizationArgs(
                    num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=GROUP
                ),
            )
        }
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()
        oneshot(
            model=model,
            recipe=QuantizationModifier(config_groups=groups, ignore=IGNORE),
            output_dir=str(tmp),
            log_dir=None,
        )
        info = dict(
            producer="llmcompressor",
            versions={p: metadata.version(p) for p in ("torch", "transformers", "llmcompressor", "compressed-tensors")},
            call=(
                f"oneshot(model=synthetic qwen3_moe seed 2 bf16, recipe=QuantizationModifier(config_groups="
                f"int4 group {GROUP} symmetric={symmetric}, ignore={IGNORE}), output_dir=...)"
            ),
        )
        (tmp / "producer.json").write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)


if __name__ == "__main__":
    make(Path(sys.argv[1]).resolve())
