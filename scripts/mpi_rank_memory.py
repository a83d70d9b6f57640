"""Per-rank host memory of one-process-per-rank loading against the one-process twin, measured in the same run.

Usage: python scripts/mpi_rank_memory.py [--tp 2 --pp 2] [--hidden 768 --layers 6]
Makes a synthetic Llama (float16 checkpoint), then measures RSS growth while loading (a) the whole checkpoint in one
process (ReferenceModel, every rank's shard) and (b) each rank's own file under mpiexec (one process per rank).
Prints the ratio of each rank's growth to the one-process growth (expect about 1/world, plus the replicated norms).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def rank_main(ckpt: str) -> None:
    from trtpipe.runtime.distributed import load_all_ranks, mpi, rss_mb

    start = rss_mb()
    world = mpi().COMM_WORLD
    world.Barrier()  # MPI initialised and its shared memory touched: counted apart from the weights
    before = rss_mb()
    model, statuses = load_all_ranks(ckpt)
    grown = world.gather((before - start, rss_mb() - before), root=0)
    if model.layout.rank == 0:
        print(
            json.dumps(
                {
                    "grown_mb": [g for _, g in grown],
                    "mpi_mb": [m for m, _ in grown],
                    "weights_mb": [s["weights_mb"] for s in statuses],
                }
            )
        )


def single_main(ckpt: str) -> None:
    from trtpipe.runtime import load_checkpoint
    from trtpipe.runtime.distributed import rss_mb

    before = rss_mb()
    model = load_checkpoint(ckpt)
    print(json.dumps({"grown_mb": rss_mb() - before, "layers": len(model.layers)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rank", help=argparse.SUPPRESS)
    ap.add_argument("--single", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank:
        return rank_main(a.rank)
    if a.single:
        return single_main(a.single)
    from trtpipe.checkpoint.convert import convert
    from trtpipe.models.synthetic import make_synthetic

    tmp = Path(tempfile.mkdtemp(prefix="rankmem"))
    hf = make_synthetic(
        "llama",
        tmp / "hf",
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 64,
        num_key_value_heads=a.hidden // 128,
        vocab_size=8192,
    )
    ckpt = convert(hf, tmp / "ckpt", tp=a.tp, pp=a.pp, dtype="float16")
    files = sum(p.stat().st_size for p in ckpt.glob("rank*.safetensors")) / 2**20
    single = json.loads(
        subprocess.check_output([sys.executable, __file__, "--single", str(ckpt)]).decode().splitlines()[-1]
    )
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    ranks = json.loads(
        subprocess.check_output([mpiexec, "-n", str(a.tp * a.pp), sys.executable, __file__, "--rank", str(ckpt)])
        .decode()
        .splitlines()[-1]
    )
    world = a.tp * a.pp
    print(f"checkpoint: {files:.1f} MiB float16 in {world} rank files (tp {a.tp} x pp {a.pp})")
    print(f"one process (all ranks): RSS grew {single['grown_mb']:.1f} MiB while loading")
    for r, (g, m, w) in enumerate(zip(ranks["grown_mb"], ranks["mpi_mb"], ranks["weights_mb"])):
        print(
            f"rank {r}: MPI init {m:.1f} MiB; read {w:.1f} MiB, RSS grew {g:.1f} MiB while loading = "
            f"{g / single['grown_mb']:.3f} of one process (1/world = {1 / world:.3f})"
        )
    print(f"sum over ranks: {sum(ranks['grown_mb']):.1f} MiB vs {single['grown_mb']:.1f} MiB in one process")


if __name__ == "__main__":
    main()
