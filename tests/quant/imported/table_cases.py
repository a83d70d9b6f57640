"""One config per row of docs/reference/prequantized.md: (config.json quantization_config, hf_quant_config.json)."""

FP8_T = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}


def _mo(algo, kv=None, **extra):
    return None, {
        "producer": {"name": "modelopt"},
        "quantization": {"quant_algo": algo, "kv_cache_quant_algo": kv, **extra, "exclude_modules": ["lm_head"]},
    }


def _ct(weights, inputs=None, fmt="float-quantized"):
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
    }, None


CASES = {
    "ModelOpt FP8": _mo("FP8"),
    "ModelOpt FP8 KV cache only": _mo(None, "FP8"),
    "ModelOpt FP8_PER_CHANNEL_PER_TOKEN": _mo("FP8_PER_CHANNEL_PER_TOKEN"),
    "ModelOpt W8A16": _mo("W8A16"),
    "ModelOpt W4A16_AWQ": _mo("W4A16_AWQ", group_size=128),
    "ModelOpt W4A8_AWQ": _mo("W4A8_AWQ", group_size=128),
    "ModelOpt NVFP4": _mo("NVFP4", group_size=16),
    "ModelOpt W8A8_SQ_PER_CHANNEL": _mo("W8A8_SQ_PER_CHANNEL"),
    "compressed-tensors FP8 static": _ct(FP8_T, FP8_T),
    "compressed-tensors FP8 dynamic": _ct(
        {**FP8_T, "strategy": "channel"}, {**FP8_T, "strategy": "token", "dynamic": True}
    ),
    "compressed-tensors W4A16 symmetric": _ct(
        {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": True},
        None,
        "pack-quantized",
    ),
    "compressed-tensors W4A16 asymmetric": _ct(
        {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": False},
        None,
        "pack-quantized",
    ),
    "compressed-tensors FP8 block": _ct(
        {**FP8_T, "strategy": "block", "block_structure": [128, 128]},
        {**FP8_T, "strategy": "group", "group_size": 128, "dynamic": True},
    ),
    "compressed-tensors INT8 W8A8": _ct(
        {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True},
        {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True},
        "int-quantized",
    ),
    "compressed-tensors INT8 W8A8 static per-tensor": _ct(
        {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True},
        {"type": "int", "num_bits": 8, "strategy": "tensor", "dynamic": False},
        "int-quantized",
    ),
    "AutoAWQ GEMM": (
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
        None,
    ),
    "AutoAWQ GEMV": (
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"},
        None,
    ),
    "GPTQ 4-bit symmetric (v1 or v2)": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 128,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq_v2",
        },
        None,
    ),
    "GPTQ 4-bit act-order (contiguous g_idx only)": (
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
        None,
    ),
    "GPTQ asymmetric": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False}, None),
    "GPTQ 8-bit": ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False, "sym": True}, None),
    "fbgemm FP8": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, None),
    "FP8 block 128x128": (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        None,
    ),
    "MXFP4": ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}, None),
}
