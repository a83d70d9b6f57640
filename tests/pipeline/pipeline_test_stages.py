"""Small real stages for the pipeline tests: they read real files and write real artifacts.

Shape of the test build (mirrors the real one: a source, an optional stage, a stage reading both):
  source (model)        copies every model file into one blob, prints to stdout (fd 1 and a child process)
  scale  (quantization) reads source; XORs the blob with a byte derived from the quantization section
  calib  (quantization.calibration; enabled when quantization.algo != none) reads source; writes stats
  pack   (engine)       reads scale and calib; records which inputs it got; a child process allocates 64 MiB

Switches, read from the environment so a test can drive a build running in another process:
  TRTPIPE_TEST_BLOCK="<stage>:<flag file>"  write part of the output, create the flag file, then sleep
  TRTPIPE_TEST_FAIL="<stage>"               raise a TrtpipeError
  TRTPIPE_TEST_DELAY="<seconds>"            sleep this long after each output chunk (for kill-anywhere tests)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from trtpipe.errors import QuantizationError
from trtpipe.pipeline.stage import Stage, StageContext

CHILD_ALLOC_MIB = 64


def _switch(ctx: StageContext, stage: str, point: str) -> None:
    if os.environ.get("TRTPIPE_TEST_FAIL") == stage and point == "start":
        raise QuantizationError(f"{stage}: refused on purpose by the test")
    block = os.environ.get("TRTPIPE_TEST_BLOCK", "")
    if block.startswith(f"{stage}:") and point == "middle":
        ctx.log.info("blocking as the test asked")
        Path(block.split(":", 1)[1]).write_text(str(os.getpid()))
        time.sleep(600)
    delay = float(os.environ.get("TRTPIPE_TEST_DELAY", "0"))
    if delay and point == "middle":
        time.sleep(delay)


def _write_chunks(path: Path, chunks: list[bytes], ctx: StageContext, stage: str) -> None:
    """Write ``chunks`` one by one; the block/delay switches act after the first chunk."""
    with open(path, "wb") as f:
        for i, chunk in enumerate(chunks):
            f.write(chunk)
            f.flush()
            if i == 0:
                _switch(ctx, stage, "middle")


def run_source(ctx: StageContext) -> None:
    _switch(ctx, "source", "start")
    src = ctx.recipe.resolve(ctx.recipe.model.source)
    files = sorted(p for p in src.rglob("*") if p.is_file())
    print("source: chatter on stdout that must not reach --json output")
    subprocess.run(["echo", "source: a child process writing to fd 1"], check=True)
    chunks = []
    with ctx.progress("reading model files", total=len(files)) as bar:
        for p in files:
            chunks.append(p.read_bytes())
            bar.advance()
    (ctx.out_dir / "meta").mkdir()
    (ctx.out_dir / "meta" / "names.json").write_text(json.dumps([p.relative_to(src).as_posix() for p in files]))
    _write_chunks(ctx.out_dir / "blob.bin", chunks, ctx, "source")
    ctx.info["files"] = len(files)


def _xor_byte(ctx: StageContext) -> int:
    digest = hashlib.sha256(json.dumps(ctx.recipe.section("quantization"), sort_keys=True).encode()).digest()
    return digest[0] | 1


def run_scale(ctx: StageContext) -> None:
    _switch(ctx, "scale", "start")
    blob = (ctx.inputs["source"] / "blob.bin").read_bytes()
    x = _xor_byte(ctx)
    data = bytes(b ^ x for b in blob)
    step = max(1, len(data) // 8)
    _write_chunks(ctx.out_dir / "scaled.bin", [data[i : i + step] for i in range(0, len(data), step)], ctx, "scale")
    ctx.info["xor"] = x


def run_calib(ctx: StageContext) -> None:
    _switch(ctx, "calib", "start")
    blob = (ctx.inputs["source"] / "blob.bin").read_bytes()
    cal = ctx.recipe.quantization.calibration
    stats = {"amax": max(blob[: cal.num_samples * cal.seq_len]), "num_samples": cal.num_samples}
    (ctx.out_dir / "stats.json").write_text(json.dumps(stats))


def run_pack(ctx: StageContext) -> None:
    _switch(ctx, "pack", "start")
    parts = [(ctx.inputs["scale"] / "scaled.bin").read_bytes()]
    if "calib" in ctx.inputs:
        parts.append((ctx.inputs["calib"] / "stats.json").read_bytes())
    header = json.dumps(ctx.recipe.section("engine"), sort_keys=True).encode()
    _write_chunks(ctx.out_dir / "engine.bin", [header, *parts], ctx, "pack")
    hold = float(os.environ.get("TRTPIPE_TEST_CHILD_HOLD_S", "0.3"))  # long enough for the 50 ms sampler to see it
    alloc = (
        f"import time; x = bytearray({CHILD_ALLOC_MIB} << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep({hold})"
    )
    subprocess.run([sys.executable, "-c", alloc], check=True)
    ctx.info["inputs"] = sorted(ctx.inputs)


SOURCE = Stage("source", ("model",), (), run_source, files=lambda r: [r.resolve(r.model.source)])
SCALE = Stage("scale", ("quantization",), ("source",), run_scale)
CALIB = Stage(
    "calib", ("quantization.calibration",), ("source",), run_calib, enabled=lambda r: r.quantization.algo != "none"
)
PACK = Stage("pack", ("engine",), ("scale", "calib"), run_pack)
STAGES = [SOURCE, SCALE, CALIB, PACK]


def tree_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (hashlib directly, independent of trtpipe's own hashing)."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
