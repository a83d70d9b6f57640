#!/usr/bin/env python
"""Benchmark the streaming HF -> TensorRT-LLM conversion on the layer shapes of a large model.

``--model llama-3-70b`` (default): hidden 8192, intermediate 28672, 64 heads, 8 KV heads, head 128, vocab 128256.
``--model qwen3-235b-a22b``: the published config (recipes/configs/qwen3-235b-a22b): hidden 4096, 64 heads, 4 KV
heads, head 128 with q/k norms, vocab 151936, and per layer a router [128, 4096] and 128 experts whose gate/up
[1536, 4096] and down [4096, 1536] are separate HF tensors (4.8 GB of the 5.0 GB a layer holds); the converter
fuses them into ``mlp.fc`` [E/ep, 2x1536/moe_tp, 4096] and ``mlp.proj``. ``--moe-ep`` picks expert parallelism
(``--tp 4 --moe-ep 4``: 32 whole experts per rank) instead of the default moe_tp = tp (every expert cut in 4).

For each N (``--layers``) it writes a synthetic bf16 HF checkpoint of N such layers (5 GB safetensors shards
plus index), tensor by tensor from a 64 MB random pool (never a whole model in memory). It then measures,
in the same run:

* a plain read-and-write copy of the same bytes: the input files read sequentially (16 MB ``readinto``)
  and written to ``world_size`` files until as many bytes as the conversion writes have been written
  (the conversion writes more than it reads: the embedding is replicated on every tp rank);
* the conversion, in a fresh subprocess so its peak RSS (``ru_maxrss``) is its own.

After one discarded warm-up copy (the first large write after generating the model was up to 2x slower
than the following ones here), copies and conversions alternate ``--repeat`` times and the ratio is
median(convert) / median(copy): on a shared disk single timings vary by +-40 %.

Every timing ends with ``os.sync()`` so dirty pages are flushed inside the measured interval.
Everything lives in a temporary directory under ``--tmp`` (default /tmp) and is deleted afterwards.

    python scripts/bench_convert.py --layers 2 4 8 --tp 4
    python scripts/bench_convert.py --model qwen3-235b-a22b --layers 1 3 --tp 4 --moe-ep 4 -1
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

REPO = Path(__file__).resolve().parents[1]
SHARD_BYTES = 5 << 30


def llama_70b(layers: int) -> tuple[dict, list[tuple[str, tuple[int, ...]]]]:
    """(config.json, HF tensors) of a Llama-3-70B-shaped model of ``layers`` layers."""
    hidden, inter, heads, kv_heads, head, vocab = 8192, 28672, 64, 8, 128, 128256
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    q, kv = heads * head, kv_heads * head
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (q, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return cfg, out


def qwen3_235b(layers: int) -> tuple[dict, list[tuple[str, tuple[int, ...]]]]:
    """(config.json, HF tensors) of Qwen3-235B-A22B (its published config) cut to ``layers`` layers."""
    cfg = json.loads((REPO / "recipes" / "configs" / "qwen3-235b-a22b" / "config.json").read_text())
    cfg["num_hidden_layers"] = cfg["max_window_layers"] = layers
    hidden, head, vocab = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    q, kv, width = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head, cfg["moe_intermediate_size"]
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (q, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q)),
            (p + "self_attn.q_norm.weight", (head,)),
            (p + "self_attn.k_norm.weight", (head,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate.weight", (cfg["num_experts"], hidden)),
        ]
        for e in range(cfg["num_experts"]):
            x = f"{p}mlp.experts.{e}."
            out += [
                (x + "gate_proj.weight", (width, hidden)),
                (x + "up_proj.weight", (width, hidden)),
                (x + "down_proj.weight", (hidden, width)),
            ]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return cfg, out


MODELS = {"llama-3-70b": llama_70b, "qwen3-235b-a22b": qwen3_235b}


def _nbytes(shape: tuple[int, ...]) -> int:
    n = 2
    for s in shape:
        n *= s
    return n


def write_synthetic(model_dir: Path, model: str, layers: int) -> int:
    """Write config.json, the shards and the index; returns the bytes of tensor data written."""
    import torch

    from trtpipe.checkpoint.writer import RankFile

    model_dir.mkdir(parents=True)
    cfg, tensors = MODELS[model](layers)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    pool = torch.randn(32 << 20, generator=torch.Generator().manual_seed(0)).mul_(0.02).bfloat16()
    pool = memoryview(pool.view(torch.uint8).numpy())
    groups, size = [[]], 0
    for name, shape in tensors:
        nbytes = _nbytes(shape)
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
            pos, left = f.base + offset, _nbytes(shape)
            while left:
                n = os.pwrite(f.fd, pool[: min(left, len(pool))], pos)
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


def convert_worker(model_dir: str, out_dir: str, tp: int, moe_ep: int) -> None:
    """Runs in a fresh subprocess: convert and report wall time and this process's peak RSS as JSON."""
    import torch

    from trtpipe.checkpoint.convert import convert

    torch.set_num_threads(2)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    convert(model_dir, out_dir, tp=tp, moe_ep=moe_ep)
    os.sync()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out_bytes = sum(p.stat().st_size for p in Path(out_dir).glob("rank*.safetensors"))
    print(json.dumps({"seconds": seconds, "peak_rss": peak, "rss_after_imports": rss_before, "out_bytes": out_bytes}))


def convert_once(hf: Path, out: Path, tp: int, moe_ep: int) -> dict:
    res = subprocess.run(
        [sys.executable, __file__, "--convert-worker", str(hf), str(out), str(tp), str(moe_ep)],
        check=True,
        capture_output=True,
        text=True,
    )
    shutil.rmtree(out)
    return json.loads(res.stdout.strip().splitlines()[-1])


def bench_one(model: str, layers: int, tp: int, moe_eps: list[int], tmp_root: Path, repeat: int) -> list[dict]:
    """Generate once; one discarded warm-up copy; then per layout ``repeat`` x (copy, convert) interleaved, medians
    compared (the copy writes as many bytes as that layout's conversion)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="trtpipe-bench-", dir=tmp_root) as tmp:
        tmp = Path(tmp)
        hf = tmp / "hf"
        t0 = time.perf_counter()
        in_bytes = write_synthetic(hf, model, layers)
        gen_s = time.perf_counter() - t0
        warmup = None
        for moe_ep in moe_eps:
            out_bytes = planned_bytes(hf, tp, moe_ep)  # the conversion's output size, from the plan (headers only)
            if warmup is None:
                warmup = plain_copy(hf, tmp / "copy", out_bytes, tp)  # the first big write after generating is slow
            copies, converts = [], []
            for _ in range(repeat):
                copies.append(plain_copy(hf, tmp / "copy", out_bytes, tp))
                converts.append(convert_once(hf, tmp / "ckpt", tp, moe_ep))
            conv_s = statistics.median(c["seconds"] for c in converts)
            copy_s = statistics.median(copies)
            rows.append(
                {
                    "model": model,
                    "layers": layers,
                    "tp": tp,
                    "moe_ep": moe_ep,
                    "in_bytes": in_bytes,
                    "out_bytes": converts[0]["out_bytes"],
                    "generate_s": gen_s,
                    "copy_s_warmup": warmup,
                    "copy_s": copies,
                    "convert_s": [c["seconds"] for c in converts],
                    "ratio": conv_s / copy_s,
                    "copy_median_s": copy_s,
                    "convert_median_s": conv_s,
                    "peak_rss": max(c["peak_rss"] for c in converts),
                    "rss_after_imports": converts[0]["rss_after_imports"],
                }
            )
    return rows


def planned_bytes(hf: Path, tp: int, moe_ep: int = -1) -> int:
    from trtpipe.checkpoint.convert import make_plan, plan_files
    from trtpipe.checkpoint.hf import HFReader

    with HFReader(hf) as reader:
        plan = make_plan(
            hf, tp=tp, moe_ep=moe_ep, source_dtype=str(reader.dtype("model.embed_tokens.weight")).replace("torch.", "")
        )
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
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-3-70b")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument(
        "--moe-ep",
        type=int,
        nargs="+",
        default=[-1],
        help="expert parallelism, one run per value on the same generated model (MoE; -1: moe_tp = tp)",
    )
    ap.add_argument("--tmp", type=Path, default=Path("/tmp"))
    ap.add_argument(
        "--repeat", type=int, default=2, help="interleaved (copy, convert) pairs per N; medians are compared"
    )
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    ap.add_argument("--convert-worker", nargs=4, metavar=("HF_DIR", "OUT_DIR", "TP", "MOE_EP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.convert_worker:
        convert_worker(
            args.convert_worker[0], args.convert_worker[1], int(args.convert_worker[2]), int(args.convert_worker[3])
        )
        return
    free = shutil.disk_usage(args.tmp).free
    _, tensors = MODELS[args.model](max(args.layers))
    model_bytes = sum(_nbytes(shape) for _, shape in tensors)
    need = model_bytes + 1.2 * (model_bytes + (args.tp - 1) * _nbytes(tensors[0][1]))  # input + the larger output
    if free < need:
        sys.exit(f"{args.tmp}: {free / 1e9:.0f} GB free, the largest run needs about {need / 1e9:.0f} GB")
    print(
        f"{'layers':>6} {'moe_ep':>6} {'in GB':>6} {'out GB':>6} {'copy s (median)':>15} {'convert s (median)':>18} "
        f"{'ratio':>6} {'peak RSS GB':>11}",
        flush=True,
    )
    for n in sorted(args.layers):
        for r in bench_one(args.model, n, args.tp, args.moe_ep, args.tmp, args.repeat):
            if args.json:
                print(json.dumps(r), flush=True)
            print(
                f"{n:>6} {r['moe_ep']:>6} {r['in_bytes'] / 1e9:>6.1f} {r['out_bytes'] / 1e9:>6.1f} "
                f"{r['copy_median_s']:>15.1f} {r['convert_median_s']:>18.1f} {r['ratio']:>6.2f} "
                f"{r['peak_rss'] / 1e9:>11.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
