#!/usr/bin/env python
"""Benchmark the streaming HF -> TensorRT-LLM conversion on Llama-3-70B layer shapes.

For each N (default 2, 4, 8 layers) it writes a synthetic bf16 HF checkpoint with Llama-3-70B shapes
(hidden 8192, intermediate 28672, 64 heads, 8 KV heads, head 128, vocab 128256; 5 GB safetensors shards
plus index), tensor by tensor from a 64 MB random pool (never a whole model in memory). It then measures,
in the same run:

* a plain read-and-write copy of the same bytes: the input files read sequentially (16 MB ``readinto``)
  and written to ``world_size`` files until as many bytes as the conversion writes have been written
  (the conversion writes more than it reads: the embedding is replicated on every tp rank);
* the conversion at tp=4, in a fresh subprocess so its peak RSS (``ru_maxrss``) is its own.

After one discarded warm-up copy (the first large write after generating the model was up to 2x slower
than the following ones here), copies and conversions alternate ``--repeat`` times and the ratio is
median(convert) / median(copy): on a shared disk single timings vary by +-40 %.

Every timing ends with ``os.sync()`` so dirty pages are flushed inside the measured interval.
Everything lives in a temporary directory under ``--tmp`` (default /tmp) and is deleted afterwards.

    python scripts/bench_convert.py --layers 2 4 8 --tp 4
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

HIDDEN, INTER, HEADS, KV_HEADS, HEAD, VOCAB = 8192, 28672, 64, 8, 128, 128256
SHARD_BYTES = 5 << 30


def hf_tensors(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    q, kv = HEADS * HEAD, KV_HEADS * HEAD
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (q, HIDDEN)),
            (p + "self_attn.k_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.v_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, q)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER)),
        ]
    out += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return out


def write_synthetic(model_dir: Path, layers: int) -> int:
    """Write config.json, the shards and the index; returns the bytes of tensor data written."""
    import torch
    from transformers import LlamaConfig

    from trtpipe.checkpoint.writer import RankFile

    model_dir.mkdir(parents=True)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(model_dir)
    pool = torch.randn(32 << 20, generator=torch.Generator().manual_seed(0)).mul_(0.02).bfloat16()
    pool = memoryview(pool.view(torch.uint8).numpy())
    groups, size = [[]], 0
    for name, shape in hf_tensors(layers):
        nbytes = 2 * int(torch.tensor(shape).prod())
        if size and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, torch.bfloat16, shape))
        size += nbytes
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        f = RankFile(model_dir / fname, group)
        for name, dtype, shape in group:
            _, _, offset = f.slots[name]
            pos, left = f.base + offset, 2 * int(torch.tensor(shape).prod())
            while left:
                n = os.pwrite(f.fd, pool[: min(left, len(pool))], pos)
                pos, left = pos + n, left - n
            f.written.add(name)
            weight_map[name] = fname
        total += f.size - f.base
        f.close()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    os.sync()
    return total


def plain_copy(model_dir: Path, dst: Path, out_bytes: int, files: int) -> float:
    """Read the input shards in order (cycling) and write ``out_bytes`` into ``files`` files; seconds incl. sync."""
    srcs = sorted(model_dir.glob("*.safetensors"))
    dst.mkdir()
    buf = bytearray(16 << 20)
    per_file = -(-out_bytes // files)
    start = time.perf_counter()
    written, k, src_i, src = 0, 0, 0, open(srcs[0], "rb", buffering=0)
    while written < out_bytes:
        with open(dst / f"copy{k}.bin", "wb", buffering=0) as out:
            left = min(per_file, out_bytes - written)
            while left:
                n = src.readinto(memoryview(buf)[: min(len(buf), left)])
                if not n:
                    src.close()
                    src_i = (src_i + 1) % len(srcs)
                    src = open(srcs[src_i], "rb", buffering=0)
                    continue
                out.write(memoryview(buf)[:n])
                left -= n
                written += n
        k += 1
    src.close()
    os.sync()
    seconds = time.perf_counter() - start
    shutil.rmtree(dst)
    return seconds


def convert_worker(model_dir: str, out_dir: str, tp: int) -> None:
    """Runs in a fresh subprocess: convert and report wall time and this process's peak RSS as JSON."""
    import torch

    from trtpipe.checkpoint.convert import convert

    torch.set_num_threads(2)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    convert(model_dir, out_dir, tp=tp)
    os.sync()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out_bytes = sum(p.stat().st_size for p in Path(out_dir).glob("rank*.safetensors"))
    print(json.dumps({"seconds": seconds, "peak_rss": peak, "rss_after_imports": rss_before, "out_bytes": out_bytes}))


def convert_once(hf: Path, out: Path, tp: int) -> dict:
    res = subprocess.run([sys.executable, __file__, "--convert-worker", str(hf), str(out), str(tp)],
                         check=True, capture_output=True, text=True)
    shutil.rmtree(out)
    return json.loads(res.stdout.strip().splitlines()[-1])


def bench_one(layers: int, tp: int, tmp_root: Path, repeat: int) -> dict:
    """Generate, one discarded warm-up copy, then ``repeat`` x (copy, convert) interleaved; medians compared."""
    with tempfile.TemporaryDirectory(prefix="trtpipe-bench-", dir=tmp_root) as tmp:
        tmp = Path(tmp)
        hf = tmp / "hf"
        t0 = time.perf_counter()
        in_bytes = write_synthetic(hf, layers)
        gen_s = time.perf_counter() - t0
        out_bytes = planned_bytes(hf, tp)  # the conversion's output size, from the plan (headers only)
        warmup = plain_copy(hf, tmp / "copy", out_bytes, tp)  # the first big write after generating is slow
        copies, converts = [], []
        for _ in range(repeat):
            copies.append(plain_copy(hf, tmp / "copy", out_bytes, tp))
            converts.append(convert_once(hf, tmp / "ckpt", tp))
    conv_s = statistics.median(c["seconds"] for c in converts)
    copy_s = statistics.median(copies)
    return {"layers": layers, "tp": tp, "in_bytes": in_bytes, "out_bytes": converts[0]["out_bytes"],
            "generate_s": gen_s, "copy_s_warmup": warmup, "copy_s": copies, "convert_s": [c["seconds"] for c in converts],
            "ratio": conv_s / copy_s, "copy_median_s": copy_s, "convert_median_s": conv_s,
            "peak_rss": max(c["peak_rss"] for c in converts), "rss_after_imports": converts[0]["rss_after_imports"]}


def planned_bytes(hf: Path, tp: int) -> int:
    from trtpipe.checkpoint.convert import make_plan, plan_files
    from trtpipe.checkpoint.hf import HFReader

    with HFReader(hf) as reader:
        plan = make_plan(hf, tp=tp, source_dtype=str(reader.dtype("model.embed_tokens.weight")).replace("torch.", ""))
        entries = plan_files(reader, plan)
    total = 0
    for rank in entries:
        for _, dtype, shape in rank:
            n = dtype.itemsize
            for s in shape:
                n *= s
            total += n
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--tmp", type=Path, default=Path("/tmp"))
    ap.add_argument("--repeat", type=int, default=2, help="interleaved (copy, convert) pairs per N; medians are compared")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    ap.add_argument("--convert-worker", nargs=3, metavar=("HF_DIR", "OUT_DIR", "TP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.convert_worker:
        convert_worker(args.convert_worker[0], args.convert_worker[1], int(args.convert_worker[2]))
        return
    free = shutil.disk_usage(args.tmp).free
    need = max(args.layers) * 2 * 1.75e9 + 4 * 2.2e9 * 2
    if free < need:
        sys.exit(f"{args.tmp}: {free / 1e9:.0f} GB free, the largest run needs about {need / 1e9:.0f} GB")
    print(f"{'layers':>6} {'in GB':>6} {'out GB':>6} {'copy s (median)':>15} {'convert s (median)':>18} {'ratio':>6} "
          f"{'peak RSS GB':>11}", flush=True)
    for n in sorted(args.layers):
        r = bench_one(n, args.tp, args.tmp, args.repeat)
        if args.json:
            print(json.dumps(r), flush=True)
        print(f"{n:>6} {r['in_bytes'] / 1e9:>6.1f} {r['out_bytes'] / 1e9:>6.1f} {r['copy_median_s']:>15.1f} "
              f"{r['convert_median_s']:>18.1f} {r['ratio']:>6.2f} {r['peak_rss'] / 1e9:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
