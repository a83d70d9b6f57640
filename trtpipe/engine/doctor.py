"""``trtpipe doctor``: the environment against what an engine (its config.json and lockfile) needs.

Each check reports what was found; with an engine directory it also says what the engine needs and, for a
mismatch, the fix. Nothing is faked: no GPU or no TensorRT-LLM is reported as exactly that.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trtpipe.pipeline import versions
from trtpipe.engine.twin_engine_dir import TWIN_FILE
from trtpipe.jsonfile import load_json

LOCK_FILE = "trtpipe_lock.json"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok", "missing", "mismatch", "info"
    found: str
    need: str = ""
    fix: str = ""

    def render(self) -> str:
        mark = {"ok": "ok  ", "info": "    ", "missing": "MISS", "mismatch": "FAIL"}[self.status]
        line = f"[{mark}] {self.name:14s} {self.found}"
        if self.need:
            line += f"  (engine needs: {self.need})"
        return line + (f"\n       fix: {self.fix}" if self.fix else "")


def _mpi() -> tuple[str, bool]:
    """mpiexec and mpi4py from the same MPI: a 2-rank job must see COMM_WORLD size 2 on both ranks."""
    beside = Path(sys.executable).parent / "mpiexec"  # an MPI wheel in this environment wins (cpu-environment.md)
    on_path = shutil.which("mpiexec")
    exe = str(beside) if beside.is_file() else on_path
    mpi4py_ver = versions.package_version("mpi4py")
    if exe and on_path and Path(on_path).resolve() != Path(exe).resolve():
        return f"mpiexec on PATH is {on_path}, not this environment's {exe}: ranks would not share COMM_WORLD", False
    if exe is None or mpi4py_ver is None:
        return f"mpiexec {'at ' + exe if exe else 'not found'}, mpi4py {mpi4py_ver or 'not installed'}", False
    code = "from mpi4py import MPI; print(f'size={MPI.COMM_WORLD.Get_size()}', flush=True)"
    try:
        out = subprocess.run([exe, "-n", "2", sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mpiexec at {exe} failed to run: {exc}", False
    import re

    sizes = re.findall(r"size=(\d+)", out.stdout)
    same = out.returncode == 0 and sizes == ["2", "2"]
    return (
        f"mpiexec at {exe}, mpi4py {mpi4py_ver}: 2-rank job saw sizes {' '.join(sizes) or '(none)'}"
        + ("" if same else f" (exit {out.returncode})")
    ), same


def _tritonserver() -> tuple[str, bool, list[str]]:
    """The tritonserver that nvidia-pytriton carries, and its backends."""
    ver = versions.package_version("nvidia-pytriton")
    try:
        import importlib.util

        spec = importlib.util.find_spec("pytriton")
    except (ImportError, ValueError):
        spec = None
    if ver is None or spec is None or spec.origin is None:
        return "not found (nvidia-pytriton is not installed)", False, []
    root = Path(spec.origin).parent / "tritonserver"
    backends = sorted(p.name for p in (root / "backends").iterdir()) if (root / "backends").is_dir() else []
    ok = (root / "bin" / "tritonserver").is_file()
    return (
        f"{root / 'bin' / 'tritonserver'} (nvidia-pytriton {ver}), backends: {', '.join(backends) or 'none'}",
        ok,
        backends,
    )


def _engine_needs(engine_dir: Path) -> dict:
    cfg_path = engine_dir / "config.json"
    try:
        cfg = load_json(cfg_path)
    except (OSError, json.JSONDecodeError) as exc:
        from trtpipe.errors import EngineError

        raise EngineError(f"{cfg_path}: cannot read the engine config: {exc}") from None
    lock = {}
    if (engine_dir / LOCK_FILE).is_file():
        lock = load_json(engine_dir / LOCK_FILE)
    mapping = (cfg.get("pretrained_config") or {}).get("mapping") or {}
    return {
        "twin": (engine_dir / TWIN_FILE).is_file(),
        "version": cfg.get("version"),
        "world_size": int(mapping.get("world_size", mapping.get("tp_size", 1) * mapping.get("pp_size", 1))),
        "lock": lock.get("lockfile", lock),
    }


def diagnose(engine_dir: Optional[Path] = None) -> list[Check]:
    """Every check, in order: python, torch, GPU, driver, CUDA, TensorRT, TensorRT-LLM, MPI, tritonserver."""
    need = _engine_needs(Path(engine_dir)) if engine_dir else None
    real = need is not None and not need["twin"]
    lock = need["lock"] if need else {}
    checks = [
        Check(
            "python",
            "ok" if sys.version_info >= (3, 10) else "mismatch",
            platform.python_version(),
            "",
            "" if sys.version_info >= (3, 10) else "use Python 3.10 or newer",
        )
    ]
    torch_ver = versions.package_version("torch")
    checks.append(
        Check(
            "torch",
            "ok" if torch_ver else "missing",
            torch_ver or "not installed",
            fix="" if torch_ver else "pip install torch",
        )
    )
    gpus = versions.query_gpus()[0]
    gpu_text = (
        "; ".join(f"{g['name']} (SM {g['compute_capability']}, {g['memory_total']})" for g in gpus)
        or "no CUDA GPU visible (nvidia-smi not found or no devices)"
    )
    gpu_need = ", ".join(f"{g['name']} SM {g['compute_capability']}" for g in lock.get("gpus", [])[:1])
    status, fix = ("ok" if gpus else "missing"), ""
    if real:
        want_cc = {g["compute_capability"] for g in lock.get("gpus", [])}
        if not gpus:
            fix = f"run on a machine with {need['world_size']} GPU(s)" + (
                f" of SM {', '.join(want_cc)}" if want_cc else ""
            )
        elif want_cc and not want_cc & {g["compute_capability"] for g in gpus}:
            status, fix = (
                "mismatch",
                f"engines only load on the SM they were built for: rebuild here (trtpipe build RECIPE --from engine) or use SM {', '.join(want_cc)}",
            )
        elif len(gpus) < need["world_size"]:
            status, fix = (
                "mismatch",
                f"the engine has {need['world_size']} ranks: needs {need['world_size']} GPUs, {len(gpus)} visible",
            )
    elif not gpus:
        status = "info" if need is None or need["twin"] else status
    checks.append(Check("GPU", status, gpu_text, gpu_need or (f"{need['world_size']} GPU(s)" if real else ""), fix))
    driver = gpus[0]["driver"] if gpus else None
    checks.append(
        Check("driver", "ok" if driver else "info", driver or "none (no NVIDIA driver)", lock.get("driver") or "")
    )
    cuda = versions.torch_cuda_version()
    checks.append(
        Check("CUDA", "ok" if cuda else "info", cuda or "none (torch is a CPU build)", lock.get("cuda") or "")
    )
    checks += _versioned(
        "TensorRT",
        versions.package_version(*versions.PACKAGES["tensorrt"]),
        lock.get("tensorrt"),
        real,
        "TensorRT plans only load with the TensorRT version that built them",
    )
    trtllm = versions.package_version(*versions.PACKAGES["tensorrt_llm"])
    want = need["version"] if real else None
    checks += _versioned(
        "TensorRT-LLM",
        trtllm,
        want,
        real,
        "engines are valid only for the TensorRT-LLM release that built them",
        note=""
        if trtllm
        else "TensorRT engines need TensorRT-LLM 1.2.x on a GPU (pip install tensorrt_llm==1.2.1 from pypi.nvidia.com, or the tritonserver 25.12 TRT-LLM container)",
    )
    mpi_text, mpi_ok = _mpi()
    multi = need is not None and need["world_size"] > 1
    checks.append(
        Check(
            "MPI",
            "ok" if mpi_ok else ("mismatch" if multi else "info"),
            mpi_text,
            "mpiexec + mpi4py of one MPI" if multi else "",
            ""
            if mpi_ok
            else "install mpi4py and the MPI it links in one environment (pip install mpi4py mpich) and put that mpiexec first on PATH",
        )
    )
    ts_text, ts_ok, backends = _tritonserver()
    if real and "tensorrtllm" not in backends:
        checks.append(
            Check(
                "tritonserver",
                "mismatch",
                ts_text,
                "the tensorrtllm backend",
                f"serve TensorRT engines from nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3 (TRT-LLM {need['version']})",
            )
        )
    else:
        checks.append(
            Check(
                "tritonserver",
                "ok" if ts_ok else "missing",
                ts_text,
                "python backend (CPU twin)" if need and need["twin"] else "",
                "" if ts_ok else "pip install nvidia-pytriton",
            )
        )
    return checks


def _versioned(
    name: str, found: Optional[str], want: Optional[str], real: bool, why: str, note: str = ""
) -> list[Check]:
    if found is None:
        status = "missing" if real else "info"
        return [
            Check(
                name, status, "not installed", want or "", (f"install {name} {want}: {why}" if real and want else note)
            )
        ]
    if real and want and found != want:
        return [Check(name, "mismatch", found, want, f"install {name} {want} or rebuild the engine here: {why}")]
    return [Check(name, "ok", found, want or "")]


def render(checks: list[Check], engine_dir: Optional[Path]) -> str:
    head = f"engine: {engine_dir}" if engine_dir else "environment (no engine given)"
    twin = Path(engine_dir) / TWIN_FILE if engine_dir else None
    if twin is not None and twin.is_file():
        command = load_json(twin).get("command", "trtpipe build RECIPE --from engine")
        head += f" (CPU twin: served by the reference runtime; for TensorRT engines run on a GPU: {command})"
    return "\n".join([head] + [c.render() for c in checks])


def failed(checks: list[Check]) -> bool:
    return any(c.status == "mismatch" or (c.status == "missing" and c.need) for c in checks)
