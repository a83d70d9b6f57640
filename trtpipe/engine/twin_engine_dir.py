"""The CPU twin engine: the engine directory trtllm-build would write, minus the TensorRT plans.

Where TensorRT-LLM or a GPU is absent the engine stage writes, into its output directory:

* ``config.json`` — what ``trtllm-build`` writes (``version``, ``pretrained_config``, ``build_config``), no ``rank{N}.engine``;
* ``trtpipe_twin.json`` — ``{"kind": "cpu-twin", "reason": ..., "command": "trtpipe build RECIPE --from engine"}``;
* ``checkpoint/`` — the TensorRT-LLM checkpoint the reference runtime executes (hardlinked, so no bytes are copied),
  including the tokenizer and generation-config files that sit beside it.

The Triton repository's twin model runs ``checkpoint/`` with the reference runtime.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

from trtpipe.errors import EngineError
from trtpipe.jsonfile import load_json

TWIN_FILE = "trtpipe_twin.json"
TWIN_KIND = "cpu-twin"


def link_tree(src: Path, dst: Path) -> int:
    """Recreate ``src`` under ``dst`` with hardlinks (a copy across filesystems); return the file count."""
    count = 0
    for root, dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            s, d = Path(root) / name, dst / rel / name
            try:
                os.link(s, d)
            except OSError:  # EXDEV (other filesystem), or a filesystem without hardlinks
                shutil.copy2(s, d)
            count += 1
    return count


def write_twin_engine(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    build_config_json: dict,
    reason: str = "TensorRT-LLM 1.2.x and a CUDA GPU are not available here",
    recipe_path: Optional[str] = None,
) -> Path:
    """Write the twin engine of ``checkpoint_dir`` into ``out_dir`` (which must be empty or absent).

    Args:
        checkpoint_dir: a TensorRT-LLM checkpoint (``config.json``, ``rank{N}.safetensors``, tokenizer files).
        out_dir: the engine directory to fill.
        build_config_json: the engine ``config.json`` object (``engine_config_json``), or only its
            ``build_config`` part, in which case ``pretrained_config`` is the checkpoint's config.json.
        reason: why no TensorRT engine was built (recorded in ``trtpipe_twin.json``).
        recipe_path: the recipe, for the command to run on a GPU machine.

    Returns:
        ``out_dir``.

    Raises:
        EngineError: the checkpoint has no config.json or no rank{N}.safetensors, or out_dir is not empty.
    """
    ckpt, out = Path(checkpoint_dir), Path(out_dir)
    if not (ckpt / "config.json").is_file():
        raise EngineError(f"{ckpt}: not a TensorRT-LLM checkpoint (no config.json)")
    ranks = sorted(ckpt.glob("rank*.safetensors"))
    if not ranks:
        raise EngineError(f"{ckpt}: no rank{{N}}.safetensors in the checkpoint")
    if out.exists() and any(out.iterdir()):
        raise EngineError(f"{out}: engine output directory is not empty")
    if "build_config" in build_config_json and "pretrained_config" in build_config_json:
        engine_cfg = dict(build_config_json)
    else:
        from trtpipe.engine.build_config import TARGET_TRTLLM_VERSION

        pretrained = load_json(ckpt / "config.json")
        (pretrained.get("mapping") or {}).pop("rank", None)
        engine_cfg = {
            "version": TARGET_TRTLLM_VERSION,
            "pretrained_config": pretrained,
            "build_config": build_config_json,
        }
    world = int((engine_cfg["pretrained_config"].get("mapping") or {}).get("world_size", 1))
    if len(ranks) != world:
        raise EngineError(f"{ckpt}: {len(ranks)} rank files for world_size {world} in config.json")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        link_tree(ckpt, out / "checkpoint")
    except OSError as exc:  # no half-written engine dir
        shutil.rmtree(out / "checkpoint", ignore_errors=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise EngineError(f"{out}: cannot write the twin engine: {exc}") from None
    (out / "config.json").write_text(json.dumps(engine_cfg, indent=4) + "\n")  # Engine.save: indent=4
    command = f"trtpipe build {recipe_path or 'RECIPE'} --from engine"
    twin = {
        "kind": TWIN_KIND,
        "reason": reason,
        "command": command,
        "target": {"tensorrt_llm": engine_cfg["version"]},
        "ranks": world,
    }
    (out / TWIN_FILE).write_text(json.dumps(twin, indent=2) + "\n")
    return out
