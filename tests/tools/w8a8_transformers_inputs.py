"""Every Linear input of transformers' own forward over a compressed-tensors INT8 W8A8 checkpoint, in float64, with
one documented precision patch: each ``LlamaRMSNorm`` computes in its input's dtype.

    .venv-producers/bin/python tests/tools/w8a8_transformers_inputs.py FIXTURE_DIR OUT.safetensors

Runs in the producers' venv (scripts/install_producers.sh: transformers + compressed-tensors, whose forward
fake-quantizes every Linear input to INT8 per token, scale amax / 127.5). The model is loaded as
tests/tools/make_prequantized.py loads it for its oracle logits (``CompressedTensorsConfig(run_compressed=False)``,
then cast to float64). The patch: transformers' ``LlamaRMSNorm.forward`` casts its input to float32 (and back) even
inside a float64 model; here it computes in float64, the precision of the reference it is compared with. The patch is
applied to each norm instance, since transformers binds ``forward`` per instance (hub kernels), so assigning it on the
class has no effect. Nothing else is changed (the attention and rotary paths already run in float64 or as the
reference runs them). Written: ``<HF module>`` -> its input ``[T, in]`` (before compressed-tensors quantizes it; the
token axis flattened), ``logits`` ``[T, V]``, for the fixture's ``oracle_logits.safetensors`` ``input_ids``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm without its float32 round trip: ``weight * x / sqrt(mean(x^2) + eps)`` in x's dtype."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def main(fixture: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ids = load_file(str(fixture / "oracle_logits.safetensors"))["input_ids"].reshape(1, -1)
    model = AutoModelForCausalLM.from_pretrained(
        fixture, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    ).eval()
    model = model.to(torch.float64)
    captured: dict[str, torch.Tensor] = {}
    hooked = 0
    for name, module in model.named_modules():
        if isinstance(module, LlamaRMSNorm):
            module.forward = types.MethodType(norm_in_input_dtype, module)
        elif isinstance(module, torch.nn.Linear) and getattr(module, "quantization_scheme", None) is not None:
            module.register_forward_pre_hook(
                lambda m, args, key=name: captured.update({key: args[0].reshape(-1, args[0].shape[-1]).clone()})
            )
            hooked += 1
    if not hooked:
        raise SystemExit(f"{fixture}: transformers loaded no quantized Linear (its activations would not be quantized)")
    with torch.no_grad():
        captured["logits"] = model(ids).logits[0].to(torch.float64)
    save_file({k: v.contiguous() for k, v in captured.items()}, str(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
