#!/usr/bin/env python
"""Benchmark layer-sequential calibration: peak RSS flat in the number of layers, and AWQ time vs ModelOpt.

Part 1 (memory): an unquantized bf16 TRT-LLM checkpoint with Llama-70B layer shapes (hidden 8192, intermediate
28672, 64 heads, 8 KV heads, head 128; vocab 256 so the embedding does not dominate) is written tensor by tensor
with the checkpoint's streaming writer. For each N (default 2, 4, 8) a fresh subprocess calibrates the first N
layers (per-channel amax of every linear input and KV amax, as fp8 / int8_sq / KV calibration needs) and
reports its own peak RSS (``ru_maxrss``). One 70B-shaped layer is 1.7 GB in bf16 and 3.4 GB as the float32
layer the reference runtime computes with, so flat means "one layer plus activations", whatever N is.

``--model qwen3-235b-a22b``: the same on Qwen3-235B-A22B's layers (its published config, vocab 256): per layer a
router and 128 experts of width 1536 (``mlp.fc`` [128, 3072, 4096], ``mlp.proj`` [128, 4096, 1536]), 5.0 GB in
bf16 and 10 GB as the float32 layer; each row also prints the planner's calibrate estimate for the same settings
(``trtpipe.engine.planner.host_estimates`` with recipes/qwen3-235b-a22b-fp8.yaml and this run's samples).

Part 2 (AWQ time): a synthetic Llama (hidden 1024, intermediate 2816, 8 heads, 4 KV heads, 4 layers) and the
same calibration batches through ModelOpt 0.47.0's INT4_AWQ_CFG (``mtq.quantize``, awq_lite) and through
our calibration with the AWQ search (``calibrate`` with ``awq_group_size=128``: scale search + clip search).
Both on CPU, one thread each, timed once.

    python scripts/bench_calibrate.py --layers 2 4 8
    python scripts/bench_calibrate.py --model qwen3-235b-a22b --layers 1 --skip-awq
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, INTER, HEADS, KV_HEADS, HEAD, VOCAB = 8192, 28672, 64, 8, 128, 256


def trtllm_tensors(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    qkv = (HEADS + 2 * KV_HEADS) * HEAD
    out = [("transformer.vocab_embedding.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"transformer.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "attention.qkv.weight", (qkv, HIDDEN)),
            (p + "attention.dense.weight", (HIDDEN, HEADS * HEAD)),
            (p + "post_layernorm.weight", (HIDDEN,)),
            (p + "mlp.fc.weight", (INTER, HIDDEN)),
            (p + "mlp.gate.weight", (INTER, HIDDEN)),
            (p + "mlp.proj.weight", (HIDDEN, INTER)),
        ]
    return out + [("transformer.ln_f.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def config(layers: int) -> dict:
    return {
        "architecture": "LlamaForCausalLM",
        "dtype": "bfloat16",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_size": HEAD,
        "intermediate_size": INTER,
        "hidden_act": "silu",
        "norm_epsilon": 1e-5,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": 500000.0,
        "max_position_embeddings": 8192,
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {"quant_algo": None},
    }


REPO = Path(__file__).resolve().parents[1]
MOE_RECIPE = REPO / "recipes" / "qwen3-235b-a22b-fp8.yaml"


def _moe_info(layers: int):
    from trtpipe.models.dims import parse_hf_config

    hf = json.loads((REPO / "recipes" / "configs" / "qwen3-235b-a22b" / "config.json").read_text())
    hf.update(num_hidden_layers=layers, max_window_layers=layers, vocab_size=VOCAB)
    return parse_hf_config(hf, "qwen3-235b-a22b (bench)")


def moe_checkpoint(layers: int) -> tuple[dict, list]:
    """(config.json, [(name, dtype, shape)]) of the unquantized TRT-LLM checkpoint trtpipe converts Qwen3-235B-A22B
    to (tp 1), from the family's own rules: the shapes the calibration stage reads."""
    import torch

    from trtpipe.models import get_family
    from trtpipe.models.family import shape_symbols
    from trtpipe.models.trtllm_config import build_config

    info = _moe_info(layers)
    family = get_family(info.architecture)
    d = shape_symbols(info)
    entries = []
    for prefix, rules in [("", family.global_rules)] + [
        (f"transformer.layers.{i}.", family.layer_rules) for i in range(layers)
    ]:
        for r in rules:
            if not r.when(info):
                continue
            shapes = [tuple(d[x] for x in sh) for sh in r.shapes]
            if r.combine == "one":
                shape = shapes[0]
            elif "experts" in r.combine:
                shape = (info.num_experts, sum(sh[0] for sh in shapes)) + shapes[0][1:]
            else:
                shape = (sum(sh[0] for sh in shapes),) + shapes[0][1:]
            entries.append((prefix + r.trt, getattr(torch, r.dtype or "bfloat16"), shape))
    return build_config(info, family, "bfloat16", 1, 1), entries


def planner_calibrate_estimate(cfg: dict, samples: int, seq_len: int) -> int:
    """The planner's host-memory estimate of the calibrate stage for this checkpoint and calibration size."""
    from trtpipe.engine.planner import Shapes, host_estimates
    from trtpipe.app.validation import load_recipe

    recipe = load_recipe(
        MOE_RECIPE,
        [
            f"quantization.calibration.num_samples={samples}",
            f"quantization.calibration.seq_len={seq_len}",
            f"quantization.calibration.batch_size={samples}",
        ],
        check_rules=False,
    )
    return host_estimates(Shapes.of({**cfg, "quantization": {"quant_algo": "FP8"}}), 2, 0, 1, recipe)["calibrate"]


def write_checkpoint(out: Path, layers: int, model: str = "llama-70b") -> None:
    """bf16 weights ~ N(0, 1/in) drawn from a 64 MB random pool at a different offset per tensor."""
    import torch

    from trtpipe.checkpoint.writer import RankFile

    out.mkdir(parents=True, exist_ok=True)
    if model == "qwen3-235b-a22b":
        cfg, entries = moe_checkpoint(layers)
    else:
        cfg, entries = config(layers), [(n, torch.bfloat16, s) for n, s in trtllm_tensors(layers)]
    f = RankFile(out / "rank0.safetensors", entries)
    pool = torch.randn(32 << 20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for k, (name, _, shape) in enumerate(entries):
        n = 1
        for s in shape:
            n *= s
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(n, dtype=torch.bfloat16)
            src = torch.roll(pool, k * 104729) * (shape[-1] ** -0.5)
            for lo in range(0, n, src.numel()):
                t[lo : lo + src.numel()] = src[: n - lo]
            t = t.view(shape)
        f.write(name, t)
        del t
    f.close()
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def child_calibrate(ckpt: str, samples: int, seq_len: int) -> None:
    """Runs in a fresh process: calibrate every layer of ``ckpt``; print timing and this process's peak RSS."""
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from trtpipe.quant.calibrate import CalibSettings, calibrate
    from trtpipe.quant.writer import TrtllmSource

    src = TrtllmSource(Path(ckpt))
    tokens = torch.randint(0, VOCAB, (samples, seq_len), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    stats = calibrate(src, tokens, CalibSettings(batch_size=samples))
    elapsed = time.perf_counter() - start
    print(
        json.dumps(
            {
                "layers": src.args.num_layers,
                "seconds": round(elapsed, 1),
                "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
                "qkv_amax_layer0": float(stats[0].groups["attention.qkv"].amax.max()),
            }
        )
    )


def memory_bench(
    layer_counts: list[int], tmp: Path, samples: int, seq_len: int, model: str = "llama-70b"
) -> list[dict]:
    full = tmp / "ckpt_full"
    t0 = time.perf_counter()
    write_checkpoint(full, max(layer_counts), model)
    print(f"wrote {max(layer_counts)} {model} layers in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rows = []
    for n in layer_counts:
        d = tmp / f"ckpt_{n}"
        d.mkdir()
        os.link(full / "rank0.safetensors", d / "rank0.safetensors")  # extra layers are simply never read
        cfg = moe_checkpoint(n)[0] if model == "qwen3-235b-a22b" else config(n)
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(d), str(samples), str(seq_len)],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if model == "qwen3-235b-a22b":
            rows[-1]["planner_calibrate_gb"] = round(planner_calibrate_estimate(cfg, samples, seq_len) / 2**30, 3)
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def awq_bench(tmp: Path, samples: int, seq_len: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from trtpipe.checkpoint.convert import convert
    from trtpipe.models.synthetic import make_synthetic
    from trtpipe.quant.calibrate import CalibSettings, calibrate
    from trtpipe.quant.writer import TrtllmSource

    hf = make_synthetic(
        "llama",
        tmp / "awq_hf",
        seed=5,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=4,
        vocab_size=512,
    )
    base = convert(hf, tmp / "awq_base", dtype="bfloat16")
    tokens = torch.randint(3, 512, (samples, seq_len), generator=torch.Generator().manual_seed(1))

    start = time.perf_counter()
    calibrate(TrtllmSource(base), tokens, CalibSettings(batch_size=8, awq_group_size=128))
    ours = time.perf_counter() - start

    import modelopt.torch.quantization as mtq
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16, trust_remote_code=False).eval()

    def loop(m):
        with torch.no_grad():
            for b in tokens.split(8):
                m(b)

    start = time.perf_counter()
    mtq.quantize(model, mtq.INT4_AWQ_CFG, loop)
    theirs = time.perf_counter() - start
    return {
        "model": "llama hidden 1024, intermediate 2816, 4 layers",
        "tokens": samples * seq_len,
        "ours_s": round(ours, 1),
        "modelopt_s": round(theirs, 1),
        "ratio_ours_over_modelopt": round(ours / theirs, 2),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_calibrate(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--model", choices=["llama-70b", "qwen3-235b-a22b"], default="llama-70b")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--awq-samples", type=int, default=16)
    ap.add_argument("--awq-seq-len", type=int, default=256)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-awq", action="store_true")
    ap.add_argument("--tmp", default="/tmp")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_calibrate_", dir=args.tmp))
    try:
        report = {}
        if not args.skip_memory:
            report["memory"] = memory_bench(args.layers, tmp, args.samples, args.seq_len, args.model)
        if not args.skip_awq:
            report["awq_time"] = awq_bench(tmp, args.awq_samples, args.awq_seq_len)
        print(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
