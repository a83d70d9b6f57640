"""The CLI commands (in process) and the checkpoint build stage."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from click.testing import CliRunner

from trtpipe.cli import main
from trtpipe.runtime import load_checkpoint


@pytest.mark.slow
def test_convert_inspect_generate_cli(stories_dir, tmp_path):
    runner = CliRunner()
    out = tmp_path / "ck"
    res = runner.invoke(main, ["convert", str(stories_dir), str(out), "--tp", "2", "--pp", "2", "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["inspect", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["mapping"]["tp_size"] == 2 and len(summary["ranks"]) == 4
    assert summary["quantization"] == {"quant_algo": None}
    res = runner.invoke(main, ["inspect", str(stories_dir)])
    assert res.exit_code == 0 and "LlamaForCausalLM" in res.output and "parameters: 260032" in res.output
    res = runner.invoke(main, ["generate", str(out), "Once upon a time", "--max-tokens", "12"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("Once upon a time, there was a little girl named Lily")


def test_cli_bad_input_is_one_line_and_exit_1(stories_dir, tmp_path):
    res = CliRunner().invoke(main, ["convert", str(stories_dir), str(tmp_path / "ck"), "--tp", "3"])
    assert res.exit_code == 1
    assert res.output.strip() == "num_attention_heads=8 is not divisible by tp=3"
    assert not (tmp_path / "ck").exists()


def test_checkpoint_stage(stories_dir, tmp_path):
    from trtpipe.stages.checkpoint import CHECKPOINT_STAGE, model_files
    from trtpipe.pipeline.stage import StageContext
    from trtpipe.recipe.schema import Recipe

    recipe = Recipe(name="t", model={"source": str(stories_dir), "dtype": "float32"}, parallel={"tp": 2})
    assert CHECKPOINT_STAGE.sections == ("model", "parallel")
    files = {p.name for p in model_files(recipe)}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
    out = tmp_path / "artifact"
    out.mkdir()  # the runner hands the stage an empty temporary directory
    ctx = StageContext(recipe, out, {}, logging.getLogger("t"), tmp_path, quiet=True)
    CHECKPOINT_STAGE.run(ctx)
    assert ctx.info["architecture"] == "LlamaForCausalLM" and ctx.info["tp"] == 2
    assert (out / "tokenizer.model").exists() and (out / "generation_config.json").exists()
    logits = load_checkpoint(out)(torch.tensor([[1, 403, 407, 261, 378]]))
    assert int(logits[0, -1].argmax()) == 432  # "," as in ", there was a little girl"


def test_generate_on_a_non_checkpoint_prints_nothing_but_the_error(stories_dir):
    """A Hugging Face directory is not a TensorRT-LLM checkpoint: one line on stderr, nothing on stdout."""
    res = CliRunner().invoke(main, ["generate", str(stories_dir), "Once upon a time"])
    assert res.exit_code == 1
    assert res.stdout == ""  # the prompt is not echoed before the checkpoint loaded
    assert res.stderr == f"{stories_dir / 'rank0.safetensors'}: rank file not found\n"
