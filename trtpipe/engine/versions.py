"""What is installed: the version facts an engine is coupled to, gathered without importing them.

A TensorRT plan only loads with the TensorRT version and GPU SM it was built with, and TRT-LLM engines only with the
TRT-LLM release that built them; the engine's config.json records none of TensorRT, CUDA or SM, so the engine stage
records them here (the lockfile) and ``trtpipe doctor`` compares against it
(docs/reference/trtllm-build.md#version-compatibility).
"""

from __future__ import annotations

import os
import platform
from typing import Any, Optional

from trtpipe.pipeline.versions import PACKAGES, package_version, query_gpus, torch_cuda_version

# releases with the trtllm-build TensorRT-engine path (docs/reference/trtllm-build.md#versions)
SUPPORTED_TRTLLM = ("1.0", "1.1", "1.2")
_CONTAINER_ENV = ("TRTPIPE_CONTAINER_TAG", "NVIDIA_TRITON_SERVER_VERSION", "NVIDIA_PYTORCH_VERSION", "NVIDIA_BUILD_ID")


def container_tag() -> Optional[str]:
    for name in _CONTAINER_ENV:
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return None


def trtllm_supported(version: Optional[str]) -> bool:
    return bool(version) and version.split(".")[0] + "." + (version.split(".") + ["0"])[1] in SUPPORTED_TRTLLM


def lockfile() -> dict[str, Any]:
    """The environment an engine is built in: TensorRT-LLM, TensorRT, CUDA, driver, GPUs, container, Python."""
    gpus = query_gpus()[0]
    return {
        "tensorrt_llm": package_version(*PACKAGES["tensorrt_llm"]),
        "tensorrt": package_version(*PACKAGES["tensorrt"]),
        "cuda": torch_cuda_version(),  # the CUDA torch was built with (None on CPU builds)
        "driver": gpus[0]["driver"] if gpus else None,
        "gpus": [{"name": g["name"], "compute_capability": g["compute_capability"]} for g in gpus],
        "container": container_tag(),
        "python": platform.python_version(),
        "torch": package_version("torch"),
    }
