"""The software and hardware a build ran on, recorded in every manifest.

Serving checks an engine against the lockfile the engine stage wrote (``triton.launch.check_engine_versions``),
the one version check; this module only reads what is installed.

Policy: read versions from installed package metadata and ``nvidia-smi`` without importing heavy packages
(importing TensorRT-LLM takes seconds and initialises CUDA). Anything absent is ``None``, never guessed.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from trtpipe import __version__

# Report name -> distribution names to try, first found wins (TensorRT ships under several names).
PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "safetensors": ("safetensors",),
    "numpy": ("numpy",),
    "pydantic": ("pydantic",),
    "tensorrt_llm": ("tensorrt_llm", "tensorrt-llm"),
    "tensorrt": ("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt_cu13", "tensorrt_cu12"),
    "modelopt": ("nvidia-modelopt",),
    "tritonclient": ("tritonclient",),
    "nvidia_pytriton": ("nvidia-pytriton",),
}

_SMI_FIELDS = ("name", "driver_version", "compute_cap", "memory.total")


def package_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def torch_cuda_version() -> Optional[str]:
    """``torch.version.cuda`` read from torch's ``version.py`` without importing torch (which takes seconds)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    text = (Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text()
    found = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else None


def parse_nvidia_smi(csv_text: str) -> list[dict]:
    """Rows of ``nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader``."""
    gpus = []
    for line in csv_text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(_SMI_FIELDS):
            continue
        name, driver, cap, memory = cells
        gpus.append({"name": name, "driver": driver, "compute_capability": cap, "memory_total": memory})
    return gpus


def query_gpus(timeout_s: float = 15.0) -> tuple[list[dict], Optional[str]]:
    """``(gpus, cuda_driver_version)`` from nvidia-smi, or ``([], None)`` when there is none or it fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], None
    try:
        rows = subprocess.run(
            [smi, f"--query-gpu={','.join(_SMI_FIELDS)}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
        header = subprocess.run([smi], capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return [], None
    found = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return parse_nvidia_smi(rows), (found.group(1) if found else None)


def collect_versions() -> dict:
    """Versions for the manifest. Keys are always present; absent software is ``None``."""
    gpus, cuda_driver = query_gpus()
    out = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "trtpipe": __version__,
    }
    out.update({name: package_version(*dists) for name, dists in PACKAGES.items()})
    out.update(
        {
            "cuda": torch_cuda_version(),  # the CUDA torch was built against
            "cuda_driver": cuda_driver,  # the newest CUDA the installed driver supports
            "driver": gpus[0]["driver"] if gpus else None,
            "gpu_compute_capability": gpus[0]["compute_capability"] if gpus else None,
            "gpus": gpus,
        }
    )
    return out
