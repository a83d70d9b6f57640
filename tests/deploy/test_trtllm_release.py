"""`deploy dynamo` and the TensorRT-LLM inside tensorrtllm-runtime:1.6.1 (1.3 release candidates: Dynamo's
releases.json): a 1.3 recipe passes silently, a 1.2 recipe whose engine YAML 1.3 also takes is written with a
warning (stderr and SOURCES.md), and a YAML holding a key the 1.3 table lacks is refused in one line before
anything is written."""

from __future__ import annotations

import pytest
from deploy_helpers import RECIPES, run_cli

from trtpipe.app.validation import load_recipe
from trtpipe.deploy.dynamo import IMAGE
from trtpipe.deploy.trtllm_release import DYNAMO_TRTLLM, DYNAMO_TRTLLM_PIN, runtime_mismatch
from trtpipe.errors import TrtpipeError

STORIES = RECIPES / "stories-llmapi-fp8.yaml"


def test_the_installed_dynamo_wheel_pins_that_release():
    from trtpipe.app.launch_dynamo import dynamo_python
    from trtpipe.errors import ServingError

    try:
        venv = dynamo_python().parent.parent
    except ServingError as e:
        pytest.skip(str(e))
    meta = sorted(venv.glob("lib/python3*/site-packages/ai_dynamo-*.dist-info/METADATA"))
    if not meta:
        pytest.skip(f"no ai_dynamo wheel under {venv}")
    assert meta[-1].parent.name == "ai_dynamo-1.6.1.dist-info" and IMAGE.endswith(":1.6.1")
    pins = [ln for ln in meta[-1].read_text().splitlines() if ln.startswith("Requires-Dist: tensorrt-llm")]
    assert pins == [f"Requires-Dist: tensorrt-llm=={DYNAMO_TRTLLM_PIN}; extra == 'trtllm'"]
    assert DYNAMO_TRTLLM_PIN.startswith(DYNAMO_TRTLLM + ".")


def test_the_runtime_release_and_a_13_recipe():
    assert "tensorrtllm-runtime:1.6.1" in IMAGE and DYNAMO_TRTLLM == "1.3"
    assert runtime_mismatch(load_recipe(STORIES, ["llmapi.version=1.3"]), [{"max_batch_size": 8}], IMAGE) is None


def test_a_key_13_does_not_take_is_refused_in_one_line():
    recipe = load_recipe(STORIES, ["llmapi.version=1.1"])
    with pytest.raises(TrtpipeError) as err:
        runtime_mismatch(recipe, [{"speculative_config": {"speculative_model_dir": "/d"}}], IMAGE)
    msg = str(err.value)
    assert "\n" not in msg and "'speculative_config.speculative_model_dir'" in msg and "1.3.0rc29" in msg
    assert 'set llmapi.version: "1.3"' in msg


def test_cli_warns_for_a_12_recipe(tmp_path):
    out = tmp_path / "dyn"
    result = run_cli("deploy", "dynamo", str(STORIES), "-o", str(out))
    assert result.exit_code == 0, result.stderr
    assert "warning: llmapi.version is 1.2" in result.stderr and "tensorrt-llm==1.3.0rc29" in result.stderr
    assert "warning: llmapi.version is 1.2" in (out / "SOURCES.md").read_text()
    quiet = run_cli("deploy", "dynamo", str(STORIES), "--set", "llmapi.version=1.3", "-o", str(tmp_path / "q"))
    assert quiet.exit_code == 0 and "warning" not in quiet.stderr, quiet.stderr
