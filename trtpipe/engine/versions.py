"""What is installed: the version facts an engine is coupled to (contract §8), gathered without importing them.

A TensorRT plan only loads with the TensorRT version and GPU SM it was built with, and TRT-LLM engines only
with the TRT-LLM release that built them; the engine's config.json records none of TensorRT, CUDA or SM, so
the engine stage records them here (the lockfile) and ``trtpipe doctor`` compares against it.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib import metadata
from typing import Any, Optional

SUPPORTED_TRTLLM = ("1.0", "1.1", "1.2")  # releases with the trtllm-build TensorRT-engine path (contract §0)
_CONTAINER_ENV = ("TRTPIPE_CONTAINER_TAG", "NVIDIA_TRITON_SERVER_VERSION", "NVIDIA_PYTORCH_VERSION", "NVIDIA_BUILD_ID")


def package_version(*names: str) -> Optional[str]:
    """The installed distribution version of the first of ``names`` that is installed, else None."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def nvidia_smi(timeout: float = 10.0) -> list[dict[str, Any]]:
    """Visible GPUs (name, compute capability, driver, memory) from nvidia-smi; [] when there is none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    query = "name,compute_cap,driver_version,memory.total"
    try:
        out = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    gpus = []
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            gpus.append({"name": parts[0], "compute_capability": parts[1], "driver": parts[2],
                         "memory_mib": int(float(parts[3])) if parts[3].replace(".", "").isdigit() else None})
    return gpus


def cuda_version() -> Optional[str]:
    """CUDA runtime version torch was built with (the TRT-LLM containers ship a CUDA torch); None on CPU builds."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    return torch.version.cuda


def container_tag() -> Optional[str]:
    for name in _CONTAINER_ENV:
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return None


def trtllm_supported(version: Optional[str]) -> bool:
    return bool(version) and version.split(".")[0] + "." + (version.split(".") + ["0"])[1] in SUPPORTED_TRTLLM


def lockfile() -> dict[str, Any]:
    """The environment an engine is built in: TensorRT-LLM, TensorRT, CUDA, driver, GPUs, container, Python."""
    gpus = nvidia_smi()
    return {
        "tensorrt_llm": package_version("tensorrt_llm", "tensorrt-llm"),
        "tensorrt": package_version("tensorrt", "tensorrt-cu12", "tensorrt_cu12"),
        "cuda": cuda_version(),
        "driver": gpus[0]["driver"] if gpus else None,
        "gpus": [{"name": g["name"], "compute_capability": g["compute_capability"]} for g in gpus],
        "container": container_tag(),
        "python": platform.python_version(),
        "torch": package_version("torch"),
    }
