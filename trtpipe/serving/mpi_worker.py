"""A worker rank of a leader-mode job (``python -m mpi4py -m trtpipe.serving.mpi_worker ENGINE_DIR``).

It serves nothing: it loads its shard of ``ENGINE_DIR/checkpoint`` (the collective load reports to rank 0), and with
``--draft DRAFT_DIR`` its shard of the two-model form's draft (:mod:`trtpipe.serving.draft_proxy`), then runs its part of every step rank 0 broadcasts until rank 0 says stop. Run under ``python -m mpi4py`` so
an uncaught error aborts the whole job instead of leaving the other ranks waiting.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="trtpipe.serving.mpi_worker")
    ap.add_argument("engine_dir", help="CPU twin engine dir (its checkpoint/ holds the rank files)")
    ap.add_argument("--draft", help="the two-model form's draft engine dir (its shard is loaded after the target's)")
    args = ap.parse_args(argv)
    import torch

    from trtpipe.processes import record_exit
    from trtpipe.runtime.distributed import RankLoadError, load_all_ranks
    from trtpipe.serving.mpi_engine import worker_loop

    torch.set_num_threads(int(os.environ.get("TRTPIPE_CPU_THREADS", "1")))
    try:
        model, _ = load_all_ranks(os.path.join(args.engine_dir, "checkpoint"))
        draft = load_all_ranks(os.path.join(args.draft, "checkpoint"))[0] if args.draft else None
    except RankLoadError as exc:
        print(f"trtpipe worker: {exc}", file=sys.stderr, flush=True)
        record_exit(f"failed to load its shard: {exc}")
        return 1
    print(f"trtpipe worker: rank {model.layout.rank} loaded layers {[l.layer_idx for l in model.layers]}", flush=True)
    try:
        worker_loop(model, draft)
    except BaseException as exc:  # the leader is gone (an MPI error) or we are told to end: say so, then go
        record_exit(f"ended by {type(exc).__name__}: {exc}")
        raise
    record_exit("stopped by rank 0")
    print(f"trtpipe worker: rank {model.layout.rank} stopped", flush=True)
    # Out at once, without MPI_Finalize: rank 0 is already leaving (tritonserver is stopping), and with the launcher's
    # clean-up off nothing would end a finalize that waits for it.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
