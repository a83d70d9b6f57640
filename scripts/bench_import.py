#!/usr/bin/env python
"""Benchmark importing pre-quantized checkpoints of Llama-3-70B layer shapes for the engine target at tp=4.

For each format (ModelOpt unified FP8 with per-projection weight scales, and W4A16 AWQ with group 128) and each N
(default 1 and 3 layers) it writes a synthetic pre-quantized HF checkpoint with Llama-3-70B shapes (valid FP8 codes
and random int4 bytes from a 64 MB pool, per-projection scales that differ so FP8 q/k/v and gate/up really are
requantized to their shared scale; bf16 embedding, norms and lm_head), then measures in the same run, exactly as
``scripts/bench_convert.py`` does for dense sources (whose ``plain_copy`` it reuses): a plain read-and-write copy of
as many bytes as the conversion writes, and the conversion in a fresh subprocess (peak RSS its own), interleaved
``--repeat`` times after one discarded warm-up copy; ratio = median(convert) / median(copy).

``--formats nvfp4``: ModelOpt unified NVFP4 of the same dense shapes (random E2M1 bytes, FP8 block scales per 16
inputs, q/k/v and gate/up sharing their global and input scales as ModelOpt's export makes them): codes and block
scales are copied (q/k/v concatenated), nothing is requantized.

``--formats fp8_moe``: a ModelOpt FP8 Qwen3-MoE of Qwen3-30B-A3B's layer shapes instead (128 experts of width 768,
hidden 2048, 32 query / 4 KV heads of 128; each expert's up and gate with different scales, so every expert's up is
requantized), whose experts stream to each rank part by part.

    python scripts/bench_import.py --layers 1 3 --tp 4
    python scripts/bench_import.py --formats fp8_moe --layers 1 3 --tp 4 --repeat 1
    python scripts/bench_import.py --formats nvfp4 --layers 1 3 --tp 4 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import SHARD_BYTES, llama_70b, plain_copy  # noqa: E402

_CFG = llama_70b(1)[0]  # the Llama-3-70B shapes of scripts/bench_convert.py
HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = (
    _CFG[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
)
HEAD = HIDDEN // HEADS
GROUP = 128
NVFP4_BLOCK = 16
PROJ = {
    "self_attn.q_proj": (HEADS * HEAD, HIDDEN),
    "self_attn.k_proj": (KV_HEADS * HEAD, HIDDEN),
    "self_attn.v_proj": (KV_HEADS * HEAD, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HEADS * HEAD),
    "mlp.gate_proj": (INTER, HIDDEN),
    "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}
# Qwen3-30B-A3B's shapes (its config.json on the Hugging Face hub)
MOE = {
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
}


def _fp8_linear(m: str, shape: tuple[int, int], k: int) -> list:
    return [
        (m + ".weight", "fp8", shape, None),
        (m + ".weight_scale", "f32", (), 0.01 + 0.001 * k),
        (m + ".input_scale", "f32", (), 0.05),
    ]


def moe_tensors(layers: int) -> list:
    """The FP8 Qwen3-MoE checkpoint's tensors (as :func:`tensors`): up_proj's scale below gate_proj's."""
    h, i, e = MOE["hidden_size"], MOE["moe_intermediate_size"], MOE["num_experts"]
    q, kv = MOE["num_attention_heads"] * MOE["head_dim"], MOE["num_key_value_heads"] * MOE["head_dim"]
    v = MOE["vocab_size"]
    out = [("model.embed_tokens.weight", "bf16", (v, h), None)]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [
            (p + "input_layernorm.weight", "bf16", (h,), None),
            (p + "post_attention_layernorm.weight", "bf16", (h,), None),
            (p + "self_attn.q_norm.weight", "bf16", (MOE["head_dim"],), None),
            (p + "self_attn.k_norm.weight", "bf16", (MOE["head_dim"],), None),
            (p + "mlp.gate.weight", "bf16", (e, h), None),
        ]
        for k, (o, shape) in enumerate(
            (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q)))
        ):
            out += _fp8_linear(p + "self_attn." + o, shape, k)
        for x in range(e):
            for k, (o, shape) in enumerate((("up_proj", (i, h)), ("gate_proj", (i, h)), ("down_proj", (h, i)))):
                out += _fp8_linear(p + f"mlp.experts.{x}." + o, shape, k)
    return out + [("model.norm.weight", "bf16", (h,), None), ("lm_head.weight", "bf16", (v, h), None)]


def tensors(fmt: str, layers: int):
    """(name, dtype name, shape, scalar value or None) of the synthetic checkpoint, in file order."""
    if fmt == "fp8_moe":
        return moe_tensors(layers)
    out = [("model.embed_tokens.weight", "bf16", (VOCAB, HIDDEN), None)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", "bf16", (HIDDEN,), None),
            (p + "post_attention_layernorm.weight", "bf16", (HIDDEN,), None),
        ]
        for k, (o, n) in enumerate(PROJ.items()):
            out_f, in_f = n
            m = p + o
            if fmt == "fp8":
                out += [
                    (m + ".weight", "fp8", (out_f, in_f), None),
                    (m + ".weight_scale", "f32", (), 0.01 + 0.001 * k),
                    (m + ".input_scale", "f32", (), 0.05),
                ]
            elif fmt == "nvfp4":  # one global / input scale per fused group (q/k/v; gate/up), as ModelOpt exports
                shared = 1e-4 * (1 + ("self_attn" in o) + 2 * (o.endswith(("o_proj", "down_proj"))))
                out += [
                    (m + ".weight", "u8", (out_f, in_f // 2), None),
                    (m + ".weight_scale", "fp8s", (out_f, in_f // NVFP4_BLOCK), None),
                    (m + ".weight_scale_2", "f32", (), shared),
                    (m + ".input_scale", "f32", (), 10 * shared),
                ]
            else:
                out += [
                    (m + ".weight", "u8", (out_f // 2, in_f), None),
                    (m + ".weight_scale", "f32", (out_f, in_f // GROUP), None),
                ]
                if o in ("self_attn.o_proj", "mlp.down_proj"):
                    out.append((m + ".pre_quant_scale", "bf16", (in_f,), None))
    out += [("model.norm.weight", "bf16", (HIDDEN,), None), ("lm_head.weight", "bf16", (VOCAB, HIDDEN), None)]
    return out


def write_synthetic(model_dir: Path, fmt: str, layers: int) -> int:
    import torch
    from transformers import LlamaConfig, Qwen3MoeConfig

    from trtpipe.checkpoint.writer import RankFile

    dt = {
        "bf16": torch.bfloat16,
        "fp8": torch.float8_e4m3fn,
        "fp8s": torch.float8_e4m3fn,
        "u8": torch.uint8,
        "f32": torch.float32,
    }
    model_dir.mkdir(parents=True)
    if fmt == "fp8_moe":
        cfg = Qwen3MoeConfig(
            **MOE,
            intermediate_size=6144,
            num_hidden_layers=layers,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        )
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    else:
        cfg = LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            num_hidden_layers=layers,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            vocab_size=VOCAB,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            tie_word_embeddings=False,
        )
        cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(model_dir)
    algo = {"fp8": "FP8", "fp8_moe": "FP8", "w4a16": "W4A16_AWQ", "nvfp4": "NVFP4"}[fmt]
    hq = {
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {
            "quant_algo": algo,
            "kv_cache_quant_algo": None,
            **(
                {"group_size": GROUP, "has_zero_point": False, "pre_quant_scale": True}
                if fmt == "w4a16"
                else {"group_size": NVFP4_BLOCK}
                if fmt == "nvfp4"
                else {}
            ),
            "exclude_modules": ["lm_head", "model.embed_tokens", "model.layers.*.mlp.gate"],
        },
    }
    (model_dir / "hf_quant_config.json").write_text(json.dumps(hq))
    g = torch.Generator().manual_seed(0)
    pools = {
        "bf16": torch.randn(32 << 20, generator=g).mul_(0.02).bfloat16().view(torch.uint8),
        "fp8": torch.randn(64 << 20, generator=g).mul_(100).to(torch.float8_e4m3fn).view(torch.uint8),
        "u8": torch.randint(0, 256, (64 << 20,), generator=g, dtype=torch.uint8),
        # NVFP4 block scales: positive finite E4M3 (amax / (6 * global) of a block lies in [2^-9, 448])
        "fp8s": torch.rand(16 << 20, generator=g).mul_(400).add_(0.01).to(torch.float8_e4m3fn).view(torch.uint8),
        "f32": torch.rand(16 << 20, generator=g).add_(0.5).mul_(0.01).view(torch.uint8),
    }
    pools = {k: memoryview(v.numpy()) for k, v in pools.items()}
    entries = tensors(fmt, layers)
    groups, size = [[]], 0
    for name, d, shape, _ in entries:
        nbytes = dt[d].itemsize * int(torch.tensor(shape).prod())
        if size and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, dt[d], shape))
        size += nbytes
    info = {name: (d, value) for name, d, _, value in entries}
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        f = RankFile(model_dir / fname, group)
        for name, dtype, shape in group:
            _, _, offset = f.slots[name]
            d, value = info[name]
            pos, left = f.base + offset, dtype.itemsize * int(torch.tensor(shape).prod())
            data = (
                memoryview(torch.tensor([value], dtype=torch.float32).view(torch.uint8).numpy())
                if value is not None
                else pools[d]
            )
            while left:
                n = os.pwrite(f.fd, data[: min(left, len(data))], pos)
                pos, left = pos + n, left - n
            f.written.add(name)
            weight_map[name] = fname
        total += f.size - f.base
        f.close()
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    os.sync()
    return total


def _importer(src: Path):
    from trtpipe.quant.imported.detect import detect
    from trtpipe.quant.imported.lossy import FP8_REQUANTIZE
    from trtpipe.quant.imported.trtllm import ImportedLinears

    fmt = detect(src)  # the FP8 scales differ on purpose (the requantization is part of what is measured): accepted
    return lambda plan, reader: ImportedLinears(fmt, reader.keys(), str(src), (FP8_REQUANTIZE,))


def convert_worker(model_dir: str, out_dir: str, tp: int) -> None:
    import torch

    from trtpipe.checkpoint.convert import convert

    torch.set_num_threads(2)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    convert(model_dir, out_dir, tp=tp, importer=_importer(Path(model_dir)))
    os.sync()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out_bytes = sum(p.stat().st_size for p in Path(out_dir).glob("rank*.safetensors"))
    print(json.dumps({"seconds": seconds, "peak_rss": peak, "rss_after_imports": rss_before, "out_bytes": out_bytes}))


def planned_bytes(hf: Path, tp: int) -> int:
    from trtpipe.checkpoint.convert import make_plan, plan_files
    from trtpipe.checkpoint.hf import HFReader

    with HFReader(hf) as reader:
        plan = make_plan(hf, tp=tp, source_dtype="bfloat16")
        entries = plan_files(reader, plan, importer=_importer(hf)(plan, reader))
    return sum(dtype.itemsize * int(__import__("math").prod(shape)) for rank in entries for _, dtype, shape in rank)


def bench_one(fmt: str, layers: int, tp: int, tmp_root: Path, repeat: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="trtpipe-bench-import-", dir=tmp_root) as tmp:
        tmp = Path(tmp)
        hf = tmp / "hf"
        in_bytes = write_synthetic(hf, fmt, layers)
        out_bytes = planned_bytes(hf, tp)
        plain_copy(hf, tmp / "copy", out_bytes, tp)  # warm-up, discarded
        copies, converts = [], []
        for _ in range(repeat):
            copies.append(plain_copy(hf, tmp / "copy", out_bytes, tp))
            res = subprocess.run(
                [sys.executable, __file__, "--convert-worker", str(hf), str(tmp / "ckpt"), str(tp)],
                check=True,
                capture_output=True,
                text=True,
            )
            shutil.rmtree(tmp / "ckpt")
            converts.append(json.loads(res.stdout.strip().splitlines()[-1]))
    conv_s, copy_s = statistics.median(c["seconds"] for c in converts), statistics.median(copies)
    return {
        "format": fmt,
        "layers": layers,
        "tp": tp,
        "in_bytes": in_bytes,
        "out_bytes": converts[0]["out_bytes"],
        "copy_s": copies,
        "convert_s": [c["seconds"] for c in converts],
        "ratio": conv_s / copy_s,
        "copy_median_s": copy_s,
        "convert_median_s": conv_s,
        "peak_rss": max(c["peak_rss"] for c in converts),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", nargs="+", default=["fp8", "w4a16"], choices=["fp8", "w4a16", "nvfp4", "fp8_moe"])
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--tmp", type=Path, default=Path("/tmp"))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--convert-worker", nargs=3, metavar=("HF_DIR", "OUT_DIR", "TP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.convert_worker:
        convert_worker(args.convert_worker[0], args.convert_worker[1], int(args.convert_worker[2]))
        return
    print(
        f"{'format':>6} {'layers':>6} {'in GB':>6} {'out GB':>6} {'copy s':>7} {'convert s':>9} {'ratio':>6} "
        f"{'peak RSS GB':>11}",
        flush=True,
    )
    for fmt in args.formats:
        for n in sorted(args.layers):
            r = bench_one(fmt, n, args.tp, args.tmp, args.repeat)
            if args.json:
                print(json.dumps(r), flush=True)
            print(
                f"{fmt:>6} {n:>6} {r['in_bytes'] / 1e9:>6.1f} {r['out_bytes'] / 1e9:>6.1f} {r['copy_median_s']:>7.1f} "
                f"{r['convert_median_s']:>9.1f} {r['ratio']:>6.2f} {r['peak_rss'] / 1e9:>11.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
