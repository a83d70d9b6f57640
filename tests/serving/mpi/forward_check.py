"""Run under mpiexec: every rank loads only its shard, rank 0 compares the logits with the one-process model.

Prints one JSON line on rank 0: max |distributed - single|, both errors against a float64 copy of the
single-process model, per-rank status (pid, rss, weights). Exit 1 on a mismatch beyond the bound.
"""

import json
import sys

import torch


def main(ckpt: str, rows: int, cols: int) -> int:
    from trtpipe.runtime.distributed import RankLoadError, load_all_ranks

    torch.set_num_threads(1)
    try:
        model, status = load_all_ranks(ckpt)
    except RankLoadError as exc:
        print(exc, file=sys.stderr, flush=True)
        return 2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.args.vocab_size, (rows, cols), generator=g)
    logits = model.forward(ids)
    if model.layout.rank != 0:
        return 0
    from trtpipe.runtime import load_checkpoint

    ref = load_checkpoint(ckpt)
    single = ref(ids)
    exact = float64_logits(ref, ids)
    err_single = float((single.double() - exact).abs().max())
    err_dist = float((logits.double() - exact).abs().max())
    # Both are float32 evaluations of the same function; they differ only in the order the tp partials of each
    # all-reduce are summed (bitwise equal at tp 2: a + b == b + a). Each reordering rounds at most as often
    # as the one-process sum, so the distributed error is bounded by tp times the one-process error.
    bound = model.args.tp * err_single
    print(
        json.dumps(
            {
                "max_abs_diff": float((logits - single).abs().max()),
                "equal": bool(torch.equal(logits, single)),
                "err_single_vs_f64": err_single,
                "err_dist_vs_f64": err_dist,
                "bound": bound,
                "ranks": status,
            }
        ),
        flush=True,
    )
    return 0 if err_dist <= bound else 1


@torch.no_grad()
def float64_logits(model, ids):
    """The one-process model evaluated in float64 (weights as loaded, every op in double)."""
    from trtpipe.runtime.model import rms_norm

    model.double()
    model.embedding, model.ln_f = model.embedding.double(), model.ln_f.double()
    for layer in model.layers:
        layer.input_ln, layer.post_ln = layer.input_ln.double(), layer.post_ln.double()
        for name in ("dense_bias", "proj_bias", "router"):
            if getattr(layer, name, None) is not None:
                setattr(layer, name, getattr(layer, name).double())
    x = model.embed(ids)
    for layer in model.layers:
        x = layer(x, 0, None)
    h = rms_norm(x, model.ln_f, model.args.norm_epsilon)
    return torch.cat([m(h) for m in model.lm_head], dim=-1)[..., : model.args.vocab_size]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
