#!/usr/bin/env python3
"""One mixed-adapter decode step, this tree's LoRA path against an older commit's, alternated step by step in one
process (on a shared machine the load moves between two benchmark runs by more than the difference sought).

The older commit's ``trtpipe/serving/adapters.py`` and ``trtpipe/runtime/lora.py`` are read with ``git show`` and
their ``LoraStepEngine.step`` and ``LoraLinear.forward`` swapped in on every other step of the same engine (this
tree's cache, its four adapters kept active so no step reads from disk). The older ``AdapterCache._activate`` is
reduced to its hit path (every adapter stays active), so the comparison is that path without the hit counter.

    .venv/bin/python scripts/lora_step_ab.py --base 02e19ac [--steps 800]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def old_module(commit: str, path: str, name: str) -> types.ModuleType:
    text = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{commit}:{path}"], capture_output=True, text=True, check=True
    )
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(text.stdout, f"{commit}:{path}", "exec"), mod.__dict__)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the older commit")
    ap.add_argument("--steps", type=int, default=800)
    args = ap.parse_args()
    import torch

    from lora_adapters import make_all
    from trtpipe.runtime import lora as new_lora
    from trtpipe.runtime.hf_loader import load_hf_checkpoint
    from trtpipe.serving import adapters as new_ad
    from trtpipe.serving.api import StepBatch, StepEntry
    from trtpipe.serving.reference_engine import ReferenceEngine

    torch.set_num_threads(1)
    old_ad = old_module(args.base, "trtpipe/serving/adapters.py", "old_adapters")
    old_lora = old_module(args.base, "trtpipe/runtime/lora.py", "old_lora")
    stories = REPO / "models" / "stories260k"
    adapters = make_all(stories, Path(tempfile.mkdtemp()) / "lora")
    cache = new_ad.AdapterCache(stories, 4, 8, max_rank=64)
    for name, path in adapters.items():
        cache.register(name, path)
    engine = new_ad.LoraStepEngine(ReferenceEngine(load_hf_checkpoint(stories)), cache)
    engine.allocate(64, 8)
    names = sorted(adapters)
    prompt = [1, 403, 407, 261, 378, 261, 300, 31]
    tables = [[i * 4 + j for j in range(4)] for i in range(8)]
    engine.step(StepBatch(0, [StepEntry(i, prompt, 0, tables[i], True, True, lora=names[i % 4]) for i in range(8)]))
    decode = StepBatch(1, [StepEntry(i, [300], 8, tables[i], False, True, lora=names[i % 4]) for i in range(8)])

    def old_activate(self, name, protect):
        with self._lock:
            adapter = self._device.get(name)
            if adapter is None:
                raise AssertionError(f"adapter {name} is not active: this comparison keeps all four active")
            self._device.move_to_end(name)
            return adapter

    new = (new_ad.LoraStepEngine.step, new_ad.AdapterCache._activate, new_lora.LoraLinear.forward)
    old = (old_ad.LoraStepEngine.step, old_activate, old_lora.LoraLinear.forward)

    def use(fns):
        new_ad.LoraStepEngine.step, new_ad.AdapterCache._activate, new_lora.LoraLinear.forward = fns

    times: dict[str, list[float]] = {"old": [], "new": []}
    try:
        for i in range(args.steps):
            which = "old" if i % 2 else "new"
            use(old if which == "old" else new)
            t = time.perf_counter()
            engine.step(decode)
            times[which].append(time.perf_counter() - t)
    finally:
        use(new)
    o, n = statistics.median(times["old"]), statistics.median(times["new"])
    print(
        f"median step over {args.steps // 2} each: {args.base} {o * 1e3:.2f} ms, this tree {n * 1e3:.2f} ms, ratio {n / o:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
