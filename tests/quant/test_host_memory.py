"""Host memory of calibrate / quantize / verify: each stage's peak RSS, measured in a subprocess on synthetic
Llamas with 2 and 4 layers, is flat in the number of layers and matches the planner's ``host_estimates``.

Shapes: hidden 2048, intermediate 8192, vocab 16384, bfloat16; one float32 layer is 243 MB and the whole float32
model ~0.75 / 1.24 GB, so holding whole models would show. Every MLP weight in float32 is over glibc's largest
mmap threshold (32 MiB), as in real models, so freed layers go back to the OS.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trtpipe.checkpoint.convert import convert
from trtpipe.engine.planner import Shapes, host_estimates
from trtpipe.models.synthetic import make_synthetic
from trtpipe.app.validation import load_recipe

pytestmark = pytest.mark.slow

SHAPES = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=4, vocab_size=16384)
N, T, BATCH = 8, 64, 4
# measured / estimate: the estimates count live tensors; the measured peaks add allocator slack (glibc keeps
# freed blocks under its 32 MiB mmap threshold). Seen over several runs: calibrate 1.06-1.12, quantize 1.08-1.33,
# verify 1.18-1.22.
LOW, HIGH = 0.9, 1.4
LAYER_F32 = 4 * 60_821_504  # one float32 layer of these shapes
# 4 layers vs 2: less than one float32 layer more (a whole model would add two; run-to-run noise is ~70 MB)

WORKER = """
import sys, psutil, torch
from pathlib import Path
torch.set_num_threads(1)
from trtpipe.quant import accuracy
from trtpipe.quant.calibrate import CalibSettings, calibrate, save_layer_stats
from trtpipe.quant.writer import TrtllmSource, quantize_checkpoint
stage, base, stats, quant = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
tokens = torch.randint(0, {vocab}, ({n}, {t}), generator=torch.Generator().manual_seed(0))
before = psutil.Process().memory_info().rss
if stage == "calibrate":
    stats.mkdir()
    calibrate(TrtllmSource(base), tokens, CalibSettings(batch_size={batch}),
              on_layer=lambda i, st: save_layer_stats(stats, i, st))
elif stage == "quantize":
    quantize_checkpoint(base, TrtllmSource(base), stats, quant, algo="fp8", kv_cache="fp8", group_size=128,
                        alpha=0.5, exclude=["*lm_head"])
else:
    accuracy.teacher_forced(base, quant, tokens, {batch})
# VmHWM: this process's peak RSS (ru_maxrss would also count the parent's peak, inherited across fork)
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(int(hwm.split()[1]) * 1024 - before)
""".format(vocab=SHAPES["vocab_size"], n=N, t=T, batch=BATCH)

RECIPE = """\
name: hostmem
model:
  source: {src}
  dtype: bfloat16
quantization:
  algo: fp8
  kv_cache: fp8
  calibration: {{dataset: {data}/calibration-sample.jsonl, num_samples: {n}, seq_len: {t}, batch_size: {batch}}}
accuracy: {{eval_data: {data}/eval-sample.jsonl, num_samples: {n}, seq_len: {t}}}
"""


def _peak(stage: str, base, stats, quant) -> int:
    out = subprocess.run(
        [sys.executable, "-c", WORKER, stage, str(base), str(stats), str(quant)],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostmem")
    peaks, paths = {}, {}
    for layers in (2, 4):
        hf = make_synthetic("llama", root / f"hf{layers}", dtype=torch.bfloat16, num_hidden_layers=layers, **SHAPES)
        base = convert(hf, root / f"ck{layers}", tp=1, dtype="bfloat16")
        stats, quant = root / f"stats{layers}", root / f"fp8_{layers}"
        for stage in ("calibrate", "quantize", "verify"):
            peaks[layers, stage] = _peak(stage, base, stats, quant)
        paths[layers] = hf, quant
    return peaks, paths


@pytest.mark.parametrize("stage", ["calibrate", "quantize", "verify"])
def test_peak_is_flat_and_as_planned(measured, stage, tmp_path):
    peaks, paths = measured
    data = Path(__file__).parents[2] / "recipes" / "data"
    for layers in (2, 4):
        hf, quant = paths[layers]
        recipe_path = tmp_path / f"r{layers}.yaml"
        recipe_path.write_text(RECIPE.format(src=hf, data=data, n=N, t=T, batch=BATCH))
        shapes = Shapes.of(json.loads((quant / "config.json").read_text()))
        est = host_estimates(shapes, 2, 0, 1, load_recipe(recipe_path))[stage]
        ratio = peaks[layers, stage] / est
        assert LOW <= ratio <= HIGH, (stage, layers, peaks[layers, stage], est)
    assert peaks[4, stage] - peaks[2, stage] < LAYER_F32, peaks
