"""The GPU catalog: memory, compute capability and bandwidth of the cards engines are planned for.

One row per card, a table rather than branches. ``memory_mib`` is the total a card reports
(``nvidia-smi --query-gpu=memory.total``) where that is commonly published, else the nominal capacity
(``nominal=True``). Bandwidth is the vendor's peak memory bandwidth in GB/s (10^9 bytes/s).
The roofline columns (for ``trtpipe predict``) are dense (non-sparse) tensor-core peaks in TFLOPS per precision
(datasheets usually print the 2:4-sparse figure, twice these) and the GPU-to-GPU link bandwidth per GPU per
direction in GB/s (NVLink, else the PCIe slot); 0 means not recorded, and the performance model refuses such a card.
A TensorRT engine is valid only for the compute capability it was built on
(docs/reference/trtllm-build.md#version-compatibility), so the catalog's SM is also what the builder's SM-dependent
rules (docs/reference/trtllm-build.md#builder-enforced-combinations) are checked against.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from trtpipe.errors import EngineError


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    memory_mib: int
    sm: int  # compute capability as major*10 + minor (8.0 -> 80)
    bandwidth_gbs: int
    nominal: bool = False  # memory is the nominal capacity, not a reported total
    tflops_16: float = 0.0  # dense BF16/FP16 tensor TFLOPS
    tflops_fp8: float = 0.0  # dense FP8 (Ada, Hopper, Blackwell)
    tflops_fp4: float = 0.0  # dense FP4 (Blackwell)
    tops_int8: float = 0.0  # dense INT8 tensor TOPS
    link_gbs: float = 0.0  # GPU<->GPU per GPU per direction: NVLink, else PCIe
    nvlink: bool = False

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib << 20

    @property
    def arch(self) -> str:
        return arch_of(self.sm)

    @property
    def compute_capability(self) -> str:
        return f"{self.sm // 10}.{self.sm % 10}"


CATALOG: tuple[GPU, ...] = (
    GPU(
        "a100-sxm-40gb",
        "NVIDIA A100-SXM4-40GB",
        40960,
        80,
        1555,
        tflops_16=312,
        tops_int8=624,
        link_gbs=300,
        nvlink=True,
    ),
    GPU("a100-pcie-40gb", "NVIDIA A100-PCIE-40GB", 40960, 80, 1555, tflops_16=312, tops_int8=624, link_gbs=32),
    GPU(
        "a100-sxm-80gb",
        "NVIDIA A100-SXM4-80GB",
        81920,
        80,
        2039,
        tflops_16=312,
        tops_int8=624,
        link_gbs=300,
        nvlink=True,
    ),
    GPU("a100-pcie-80gb", "NVIDIA A100 80GB PCIe", 81920, 80, 1935, tflops_16=312, tops_int8=624, link_gbs=32),
    GPU("a10g-24gb", "NVIDIA A10G", 23028, 86, 600),
    GPU("a10-24gb", "NVIDIA A10", 23028, 86, 600),
    GPU("rtx-a6000-48gb", "NVIDIA RTX A6000", 49140, 86, 768),
    GPU("rtx-3090-24gb", "NVIDIA GeForce RTX 3090", 24576, 86, 936),
    GPU("l4-24gb", "NVIDIA L4", 23034, 89, 300, tflops_16=121, tflops_fp8=242, tops_int8=242, link_gbs=32),
    GPU("l40-48gb", "NVIDIA L40", 46068, 89, 864, tflops_16=181, tflops_fp8=362, tops_int8=362, link_gbs=32),
    GPU("l40s-48gb", "NVIDIA L40S", 46068, 89, 864, tflops_16=362, tflops_fp8=733, tops_int8=733, link_gbs=32),
    GPU("rtx-4090-24gb", "NVIDIA GeForce RTX 4090", 24564, 89, 1008),
    GPU("rtx-6000-ada-48gb", "NVIDIA RTX 6000 Ada Generation", 49140, 89, 960),
    GPU(
        "h100-sxm-80gb",
        "NVIDIA H100 80GB HBM3",
        81559,
        90,
        3350,
        tflops_16=989,
        tflops_fp8=1979,
        tops_int8=1979,
        link_gbs=450,
        nvlink=True,
    ),
    GPU(
        "h100-pcie-80gb",
        "NVIDIA H100 PCIe",
        81559,
        90,
        2000,
        tflops_16=756,
        tflops_fp8=1513,
        tops_int8=1513,
        link_gbs=64,
    ),
    GPU(
        "h100-nvl-94gb",
        "NVIDIA H100 NVL",
        95830,
        90,
        3900,
        tflops_16=835,
        tflops_fp8=1671,
        tops_int8=1671,
        link_gbs=300,
        nvlink=True,
    ),
    GPU(
        "h200-141gb",
        "NVIDIA H200",
        143771,
        90,
        4800,
        tflops_16=989,
        tflops_fp8=1979,
        tops_int8=1979,
        link_gbs=450,
        nvlink=True,
    ),
    GPU(
        "gh200-96gb",
        "NVIDIA GH200 480GB",
        97871,
        90,
        4000,
        tflops_16=989,
        tflops_fp8=1979,
        tops_int8=1979,
        link_gbs=450,
        nvlink=True,
    ),
    GPU(
        "b200-180gb",
        "NVIDIA B200",
        183359,
        100,
        8000,
        tflops_16=2250,
        tflops_fp8=4500,
        tflops_fp4=9000,
        tops_int8=4500,
        link_gbs=900,
        nvlink=True,
    ),
    GPU(
        "gb200-186gb",
        "NVIDIA GB200",
        190464,
        100,
        8000,
        nominal=True,
        tflops_16=2500,
        tflops_fp8=5000,
        tflops_fp4=10000,
        tops_int8=5000,
        link_gbs=900,
        nvlink=True,
    ),
    GPU(
        "b300-288gb",
        "NVIDIA B300",
        274658,
        103,
        7750,
        nominal=True,
        tflops_16=2250,
        tflops_fp8=4500,
        tflops_fp4=14000,
        link_gbs=900,
        nvlink=True,
    ),
    GPU(
        "gb300-288gb",
        "NVIDIA GB300",
        274658,
        103,
        8000,
        nominal=True,
        tflops_16=2500,
        tflops_fp8=5000,
        tflops_fp4=15000,
        link_gbs=900,
        nvlink=True,
    ),
    GPU("rtx-5090-32gb", "NVIDIA GeForce RTX 5090", 32607, 120, 1792),
    GPU(
        "rtx-pro-6000-96gb",
        "NVIDIA RTX PRO 6000 Blackwell",
        97887,
        120,
        1792,
        tflops_16=468,
        tflops_fp8=936,
        tflops_fp4=1871,
        tops_int8=936,
        link_gbs=64,
    ),
)

# SM ranges -> architecture family (used to pick plugin presets).
_ARCH = ((80, 88, "ampere"), (89, 90, "ada"), (90, 100, "hopper"), (100, 130, "blackwell"))


def arch_of(sm: int) -> str:
    for lo, hi, name in _ARCH:
        if lo <= sm < hi:
            return name
    raise EngineError(
        f"compute capability {sm // 10}.{sm % 10} is not supported by TensorRT-LLM 1.2 (needs 8.0 or newer)"
    )


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def _aliases() -> dict[str, GPU]:
    """Full keys, plus each key without its memory suffix when that is unambiguous (``h200``, ``b200``)."""
    out = {g.key: g for g in CATALOG}
    short: dict[str, list[GPU]] = {}
    for g in CATALOG:
        short.setdefault(g.key.rsplit("-", 1)[0], []).append(g)
    for k, gs in short.items():
        if len(gs) == 1:
            out.setdefault(k, gs[0])
    out.setdefault("h100", out["h100-sxm-80gb"])
    out.setdefault("rtx-4090", out["rtx-4090-24gb"])
    out.setdefault("rtx4090", out["rtx-4090-24gb"])
    return out


def get_gpu(name: str) -> GPU:
    """Look a card up by catalog key or unambiguous short name; a one-line error with a suggestion otherwise."""
    table = _aliases()
    g = table.get(_norm(name))
    if g is not None:
        return g
    close = difflib.get_close_matches(_norm(name), list(table), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise EngineError(f"engine.gpu: unknown GPU '{name}'{hint} (trtpipe plan --list-gpus shows the catalog)")


def gpu_from_device_name(device_name: str) -> GPU | None:
    """The catalog row whose reported name matches a CUDA device name exactly (for the lockfile/doctor)."""
    for g in CATALOG:
        if g.name.lower() == device_name.strip().lower():
            return g
    return None
