"""``trtpipe convert``: a Hugging Face model to a TensorRT-LLM checkpoint, outside a recipe."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("hf_dir", type=click.Path(file_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--tp", default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", default=1, show_default=True, help="Pipeline-parallel size.")
@click.option(
    "--dtype", default="auto", show_default=True, type=click.Choice(["auto", "float16", "bfloat16", "float32"])
)
@click.option("--moe-ep", default=-1, show_default=True, help="MoE expert-parallel size (-1: derived).")
@click.option("--moe-tp", default=-1, show_default=True, help="MoE tensor-parallel size (-1: derived).")
@click.option("--parallel-embedding", is_flag=True, help="Shard the embedding table over tp (vocab dim).")
@click.option(
    "--attention-dp",
    is_flag=True,
    help="Attention data parallel (MoE, tp > 1): every rank file holds all weights but its block of routed experts.",
)
@click.option("--allow-pickle", is_flag=True, help="Accept .bin checkpoints (loaded with weights_only=True).")
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it exists.")
def convert(
    hf_dir, out_dir, tp, pp, dtype, moe_ep, moe_tp, parallel_embedding, attention_dp, allow_pickle, overwrite
) -> None:
    """Convert a Hugging Face model to a TensorRT-LLM checkpoint (rank files for tp x pp)."""
    from trtpipe.checkpoint.convert import convert as run_convert

    run_convert(
        hf_dir,
        out_dir,
        tp=tp,
        pp=pp,
        dtype=dtype,
        moe_tp=moe_tp,
        moe_ep=moe_ep,
        allow_pickle=allow_pickle,
        use_parallel_embedding=parallel_embedding,
        overwrite=overwrite,
        attention_dp=attention_dp,
    )
    click.echo(str(out_dir))
