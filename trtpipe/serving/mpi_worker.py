"""A worker rank of a leader-mode job (``python -m mpi4py -m trtpipe.serving.mpi_worker ENGINE_DIR``).

It serves nothing: it loads its shard of ``ENGINE_DIR/checkpoint`` (the collective load reports to rank 0),
then runs its part of every step rank 0 broadcasts until rank 0 says stop. Run under ``python -m mpi4py`` so
an uncaught error aborts the whole job instead of leaving the other ranks waiting.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="trtpipe.serving.mpi_worker")
    ap.add_argument("engine_dir", help="CPU twin engine dir (its checkpoint/ holds the rank files)")
    args = ap.parse_args(argv)
    import torch

    from trtpipe.runtime.distributed import RankLoadError, load_all_ranks
    from trtpipe.serving.mpi_engine import worker_loop

    torch.set_num_threads(int(os.environ.get("TRTPIPE_CPU_THREADS", "1")))
    try:
        model, _ = load_all_ranks(os.path.join(args.engine_dir, "checkpoint"))
    except RankLoadError as exc:
        print(f"trtpipe worker: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"trtpipe worker: rank {model.layout.rank} loaded layers {[l.layer_idx for l in model.layers]}", flush=True)
    worker_loop(model)
    print(f"trtpipe worker: rank {model.layout.rank} stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
