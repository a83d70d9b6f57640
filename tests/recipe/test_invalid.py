"""Invalid recipes: each gives its one-line error, at the right line and column, and `trtpipe validate` exits 2.

Each case is (recipe text, line, col, dotted key, message regex). ``{S}`` is the tiny model's directory,
``{MIX}`` a directory with Mixtral-8x7B's published config.json, ``{M}`` a model made for the case (see MODELS).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from recipe_helpers import MIXTRAL, RECIPES, run_cli

from trtpipe.errors import RecipeError
from trtpipe.app.validation import load_recipe

HEAD = "name: t\nmodel:\n  source: {S}\n"  # lines 1-3 of most cases

CASES = {
    # --- unknown keys (did you mean) ---
    "unknown-top-key": (
        HEAD + "paralel:\n  tp: 2\n",
        4,
        1,
        "paralel",
        r"unknown key; did you mean 'parallel'\? \(allowed: name, work_dir, model, .*\)",
    ),
    "unknown-nested-key": (
        HEAD + "engine:\n  max_batch: 8\n",
        5,
        3,
        "engine.max_batch",
        r"unknown key; did you mean 'max_batch_size'\?.*",
    ),
    "key-in-wrong-section": (HEAD + "tp: 2\n", 4, 1, "tp", r"unknown key here; did you mean 'parallel.tp'\?.*"),
    "unknown-deep-key": (
        HEAD + "engine:\n  kv_cache:\n    tokens_per_blok: 64\n",
        6,
        5,
        "engine.kv_cache.tokens_per_blok",
        r"unknown key; did you mean 'tokens_per_block'\?.*",
    ),
    "unknown-key-no-match": (
        HEAD + "triton:\n  colour: blue\n",
        5,
        3,
        "triton.colour",
        r"unknown key \(allowed: model_name, max_batch_size, .*\)",
    ),
    "non-string-key": (HEAD + "7: seven\n", 4, 1, "7", r"keys must be strings \(got 7\)"),
    # --- missing keys ---
    "missing-model": ("name: t\nwork_dir: w\n", 1, 1, "model", r"required key is missing"),
    "missing-source": ("name: t\nmodel:\n  dtype: float16\n", 2, 1, "model.source", r"required key is missing"),
    "missing-name": ("model:\n  source: {S}\n", 1, 1, "name", r"required key is missing"),
    # --- wrong types ---
    "string-for-int": (HEAD + 'parallel:\n  tp: "2"\n', 5, 7, "parallel.tp", r"must be an integer \(got '2'\)"),
    "float-for-int": (
        HEAD + "engine:\n  max_batch_size: 1.5\n",
        5,
        19,
        "engine.max_batch_size",
        r"must be an integer \(got 1\.5\)",
    ),
    "string-for-bool": (
        HEAD + "  allow_pickle: maybe\n",
        4,
        17,
        "model.allow_pickle",
        r"must be true or false \(got 'maybe'\)",
    ),
    "dead-key-trust-remote-code": (  # nothing read it: every tokenizer and model load passes trust_remote_code=False
        HEAD + "  trust_remote_code: true\n",
        4,
        3,
        "model.trust_remote_code",
        r"unknown key.*",
    ),
    "int-for-string": ("name: t\nmodel:\n  source: 5\n", 3, 11, "model.source", r"must be a string \(got 5\)"),
    "mapping-for-list": (
        HEAD + "quantization:\n  exclude: {{a: 1}}\n",
        5,
        3,
        "quantization.exclude",
        r"must be a pattern or a list of patterns \(got a mapping\)",
    ),
    "list-item-type": (
        HEAD + "quantization:\n  exclude: ['*lm_head', 3]\n",
        5,
        25,
        "quantization.exclude.1",
        r"must be a string \(got 3\)",
    ),
    "list-for-section": (HEAD + "parallel: [1, 2]\n", 4, 1, "parallel", r"must be a mapping of keys \(got a list\)"),
    "null-section": (HEAD + "engine:\n", 4, 8, "engine", r"must be a mapping of keys \(got null\)"),
    "scalar-for-section": (HEAD + "triton: fast\n", 4, 9, "triton", r"must be a mapping of keys \(got 'fast'\)"),
    "plugin-override-not-scalar": (
        HEAD + "engine:\n  plugins:\n    overrides: {{gemm_plugin: [1]}}\n",
        6,
        5,
        "engine.plugins.overrides",
        r"'gemm_plugin' must be a string, number, true/false or null",
    ),
    # --- out of range ---
    "below-minimum": (HEAD + "parallel:\n  tp: 0\n", 5, 7, "parallel.tp", r"must be ≥ 1 \(got 0\)"),
    "negative": (HEAD + "parallel:\n  pp: -1\n", 5, 7, "parallel.pp", r"must be ≥ 1 \(got -1\)"),
    "above-maximum": (
        HEAD + "engine:\n  max_beam_width: 17\n",
        5,
        19,
        "engine.max_beam_width",
        r"must be ≤ 16 \(got 17\)",
    ),
    "fraction-one": (
        HEAD + "engine:\n  kv_cache:\n    free_gpu_memory_fraction: 1.0\n",
        6,
        31,
        "engine.kv_cache.free_gpu_memory_fraction",
        r"must be < 1\.0 \(got 1\.0\)",
    ),
    "huge-int": (
        HEAD + "engine:\n  max_input_len: " + "9" * 40 + "\n",
        5,
        18,
        "engine.max_input_len",
        r"must be ≤ 2147483647 \(got a 40-digit integer\)",
    ),
    "nan": (
        HEAD + "quantization:\n  smoothquant_alpha: .nan\n",
        5,
        22,
        "quantization.smoothquant_alpha",
        r"must be a finite number \(got nan\)",
    ),
    "port-range": (HEAD + "triton:\n  http_port: 70000\n", 5, 14, "triton.http_port", r"must be ≤ 65535 \(got 70000\)"),
    "tokens-per-block": (
        HEAD + "engine:\n  kv_cache:\n    tokens_per_block: 48\n",
        6,
        23,
        "engine.kv_cache.tokens_per_block",
        r"must be a power of two from 1 to 1024 \(got 48\)",
    ),
    "moe-ep-zero": (
        HEAD + "parallel:\n  moe_ep: 0\n",
        5,
        11,
        "parallel.moe_ep",
        r"must be -1 \(derived\) or a positive size \(got 0\)",
    ),
    # --- bad enum / pattern values ---
    "bad-algo": (
        HEAD + "quantization:\n  algo: int3\n",
        5,
        9,
        "quantization.algo",
        r"'int3' is not allowed \(allowed: none, fp8, fp8_pc_pt, int8_sq, int8_wo, int4_wo, int4_awq, w4a8_awq, nvfp4\)",
    ),
    "bad-kv-cache": (
        HEAD + "quantization:\n  kv_cache: fp4\n",
        5,
        13,
        "quantization.kv_cache",
        r"'fp4' is not allowed \(allowed: none, fp8, int8\)",
    ),
    "bad-group-size": (
        HEAD + "quantization:\n  group_size: 100\n",
        5,
        15,
        "quantization.group_size",
        r"100 is not allowed \(allowed: 32, 64, 128, 256\)",
    ),
    "bad-dtype": (
        HEAD + "  dtype: fp16\n",
        4,
        10,
        "model.dtype",
        r"'fp16' is not allowed \(allowed: auto, float16, bfloat16, float32\)",
    ),
    "bad-scheduler": (
        HEAD + "triton:\n  scheduler_policy: fcfs\n",
        5,
        21,
        "triton.scheduler_policy",
        r"'fcfs' is not allowed \(allowed: max_utilization, guaranteed_no_evict\)",
    ),
    "bad-name": (
        "name: my recipe\nmodel:\n  source: {S}\n",
        1,
        7,
        "name",
        r"must be letters, digits, '_', '\.', '-' only, starting with a letter or digit \(got 'my recipe'\)",
    ),
    "bad-bind": (
        HEAD + "triton:\n  bind: 10.0.0\n",
        5,
        9,
        "triton.bind",
        r"must be an IP address such as 127\.0\.0\.1 or 0\.0\.0\.0, or localhost \(got '10\.0\.0'\)",
    ),
    "bad-hf-uri": (
        "name: t\nmodel:\n  source: hf://just-a-name\n",
        3,
        11,
        "model.source",
        r"must look like hf://org/name or hf://org/name@revision \(got 'hf://just-a-name'\)",
    ),
    # --- cross-field rules (need the model's config.json) ---
    "tp-vs-heads": (
        HEAD + "parallel:\n  tp: 3\n",
        5,
        7,
        "parallel.tp",
        r"the model's 8 attention heads do not divide by tp=3",
    ),
    "tp-vs-kv-heads": (
        "name: t\nmodel:\n  source: {M}\nparallel:\n  tp: 4\n",
        5,
        7,
        "parallel.tp",
        r"the model's 6 KV heads do not divide by tp=4",
    ),
    "tp-vs-replicated-kv": (
        "name: t\nmodel:\n  source: {M}\nparallel:\n  tp: 6\n",
        5,
        7,
        "parallel.tp",
        r"tp=6 is not a multiple of the model's 4 KV heads \(KV heads are replicated tp/kv times\)",
    ),
    "tp-vs-intermediate": (
        HEAD + "parallel:\n  tp: 8\n",
        5,
        7,
        "parallel.tp",
        r"the model's intermediate_size 172 does not divide by tp=8",
    ),
    "pp-vs-layers": (HEAD + "parallel:\n  pp: 6\n", 5, 7, "parallel.pp", r"pp=6 exceeds the model's 5 layers"),
    "moe-on-dense": (
        HEAD + "parallel:\n  tp: 2\n  moe_ep: 2\n",
        6,
        11,
        "parallel.moe_ep",
        r"moe_ep/moe_tp apply only to mixture-of-experts models \(LlamaForCausalLM has no experts\)",
    ),
    "moe-product": (
        "name: t\nmodel:\n  source: {MIX}\nparallel:\n  tp: 4\n  moe_ep: 3\n",
        6,
        11,
        "parallel.moe_ep",
        r"moe_ep \(3\) x moe_tp \(1\) must equal tp \(4\)",
    ),
    "moe-experts": (
        "name: t\nmodel:\n  source: {MIX}\nparallel:\n  tp: 16\n  moe_ep: 16\n",
        6,
        11,
        "parallel.moe_ep",
        r"the model's 8 experts do not divide by moe_ep=16",
    ),
    "input-vs-seq-len": (
        HEAD + "engine:\n  max_input_len: 600\n  max_seq_len: 512\n",
        5,
        18,
        "engine.max_input_len",
        r"engine.max_input_len 600 exceeds engine.max_seq_len 512",
    ),
    "seq-len-below-default-input": (
        HEAD + "engine:\n  max_seq_len: 512\n",
        5,
        16,
        "engine.max_seq_len",
        r"engine.max_input_len 1024 exceeds engine.max_seq_len 512",
    ),
    "seq-len-past-the-models-context": (  # stories260k: max_position_embeddings 512, no rope_scaling
        HEAD + "engine:\n  max_seq_len: 4096\n",
        5,
        16,
        "engine.max_seq_len",
        r"4096 exceeds the model's context of 512 tokens \(config.json max_position_embeddings, times a rope_scaling .*",
    ),
    "input-vs-deduced-seq-len": (
        HEAD + "engine:\n  max_input_len: 1024\n",
        5,
        18,
        "engine.max_input_len",
        r"1024 exceeds the max_seq_len 512 deduced from the model \(trtllm-build would clip it\); .*",
    ),
    "triton-batch": (
        HEAD + "engine:\n  max_batch_size: 8\ntriton:\n  max_batch_size: 16\n",
        7,
        19,
        "triton.max_batch_size",
        r"triton.max_batch_size 16 exceeds engine.max_batch_size 8",
    ),
    "engine-batch-below-triton-default": (
        HEAD + "engine:\n  max_batch_size: 8\n",
        5,
        19,
        "engine.max_batch_size",
        r"triton.max_batch_size 64 exceeds engine.max_batch_size 8",
    ),
    "int8-kv-reuse": (
        HEAD + "quantization:\n  kv_cache: int8\n",
        5,
        13,
        "quantization.kv_cache",
        r"int8 KV cache disables paged context FMHA and with it KV reuse .*",
    ),
    "ports-clash": (
        HEAD + "triton:\n  http_port: 8000\n  grpc_port: 8000\n",
        6,
        14,
        "triton.grpc_port",
        r"port 8000 is already triton.http_port",
    ),
    "workers-vs-ranks": (
        HEAD + "engine:\n  workers: 4\n",
        5,
        12,
        "engine.workers",
        r"4 workers for 1 engine\(s\) \(tp\*pp\); trtllm-build caps workers at that",
    ),
    "world-size": (
        HEAD + "parallel:\n  tp: 16\n  pp: 8\n",
        4,
        1,
        "parallel",
        r"tp\*pp = 128 ranks; at most 64 are supported",
    ),
    # --- files the recipe names ---
    "missing-model-dir": (
        "name: t\nmodel:\n  source: no/such/model\n",
        3,
        11,
        "model.source",
        r"model directory not found: /.*/no/such/model",
    ),
    "model-dir-without-config": (
        "name: t\nmodel:\n  source: .\n",
        3,
        11,
        "model.source",
        r"/.*/config\.json: not found \(is .* a Hugging Face model directory\?\)",
    ),
    "model-source-is-a-file": (
        "name: t\nmodel:\n  source: recipe.yaml\n",
        3,
        11,
        "model.source",
        r"is a file, not a model directory: /.*/recipe\.yaml",
    ),
    "missing-calibration-file": (
        HEAD + "quantization:\n  algo: int8_sq\n  calibration:\n    dataset: data/calib.jsonl\n",
        7,
        14,
        "quantization.calibration.dataset",
        r"not found: /.*/data/calib\.jsonl \(or use 'self'\)",
    ),
    "calibration-file-type": (
        HEAD + "quantization:\n  algo: fp8\n  calibration:\n    dataset: recipe.yaml\n",
        7,
        14,
        "quantization.calibration.dataset",
        r"recipe\.yaml: must be a \.txt, \.jsonl or \.json file, a directory, or 'self'",
    ),
    "missing-eval-data": (
        HEAD + "accuracy:\n  eval_data: heldout.txt\n",
        5,
        14,
        "accuracy.eval_data",
        r"not found: /.*/heldout\.txt \(or use 'self'\)",
    ),
    # --- YAML itself ---
    "duplicate-key": (
        HEAD + "parallel:\n  tp: 1\n  tp: 2\n",
        6,
        3,
        "parallel.tp",
        r"duplicate key \(first at line 5\)",
    ),
    "unclosed-bracket": (
        HEAD + "quantization:\n  exclude: ['*lm_head'\nengine: {{}}\n",
        6,
        1,
        "",
        r"invalid YAML: expected ',' or '\]', but got '<scalar>' \(while parsing a flow sequence\)",
    ),
    "bad-indentation": ("name: t\n model: x\n", 2, 7, "", r"invalid YAML: mapping values are not allowed here"),
    "tab-indentation": (
        HEAD + "parallel:\n\ttp: 2\n",
        5,
        1,
        "",
        r"invalid YAML: found character '\\t' that cannot start any token.*",
    ),
    "not-a-mapping": (
        "- name: t\n- model: x\n",
        1,
        1,
        "",
        r"a recipe must be a YAML mapping of sections \(got a list\)",
    ),
    "empty-file": ("", 1, 1, "", r"a recipe must be a YAML mapping of sections \(got null\)"),
    "two-documents": (
        HEAD + "---\nname: u\n",
        4,
        1,
        "",
        r"invalid YAML: but found another document \(expected a single document in the stream\)",
    ),
    "python-tag": (
        HEAD + "work_dir: !!python/object:os.system x\n",
        4,
        11,
        "",
        r"invalid YAML: could not determine a constructor for the tag 'tag:yaml\.org,2002:python/object:os\.system'",
    ),
    "complex-key": (HEAD + "? [a, b]\n: 1\n", 4, 3, "", r"invalid YAML: keys must be plain names"),
}

# Models made for a case: the head layouts stories260k does not have.
MODELS = {
    "tp-vs-kv-heads": dict(num_attention_heads=16, num_key_value_heads=6, hidden_size=128, intermediate_size=256),
    "tp-vs-replicated-kv": dict(num_attention_heads=12, num_key_value_heads=4, hidden_size=96, intermediate_size=192),
}


def _recipe(case: str, write, model_config, stories_dir):
    text, line, col, key, message = CASES[case]
    model = model_config("m", **MODELS[case]) if case in MODELS else None
    path = write(text.format(S=stories_dir, MIX=MIXTRAL, M=model))
    where = f"{path}:{line}:{col}: " if line else f"{path}: "
    return path, where + (f"{key}: " if key else ""), message


def test_there_are_at_least_thirty_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_recipe_cli(case, write, model_config, stories_dir):
    path, prefix, message = _recipe(case, write, model_config, stories_dir)
    result = run_cli("validate", str(path))
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert any(re.fullmatch(re.escape(prefix) + message, ln) for ln in lines), f"{prefix}{message}\n{result.stderr}"
    # every line is one problem in the same format: file:line:col: key: message
    for ln in lines:
        assert re.fullmatch(re.escape(str(path)) + r":\d+:\d+: ([\w.]+: )?\S.*", ln), ln
    assert result.stdout == ""


@pytest.mark.parametrize("case", ["bad-algo", "tp-vs-heads", "duplicate-key", "unclosed-bracket", "missing-model-dir"])
def test_library_raises_recipe_error_with_the_same_line(case, write, model_config, stories_dir):
    path, prefix, message = _recipe(case, write, model_config, stories_dir)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert info.value.exit_code == 2
    assert any(re.fullmatch(re.escape(prefix) + message, str(p)) for p in info.value.problems)


def test_all_problems_are_reported_together(write, stories_dir):
    path = write(
        f"name: t\nmodel:\n  source: {stories_dir}\n  dtype: fp16\nparallel:\n  tp: 0\n  pp: x\nengine:\n  gpuu: a\n"
    )
    result = run_cli("validate", str(path))
    assert result.exit_code == 2
    assert [ln.split(": ")[1] for ln in result.stderr.splitlines()] == [
        "model.dtype",
        "parallel.tp",
        "parallel.pp",
        "engine.gpuu",
    ]
    assert [ln.split(":")[1] for ln in result.stderr.splitlines()] == ["4", "6", "7", "9"]


def test_cross_field_problems_are_reported_together(write, stories_dir):
    path = write(f"name: t\nmodel:\n  source: {stories_dir}\nparallel:\n  tp: 3\n  pp: 6\n")
    result = run_cli("validate", str(path))
    keys = [ln.split(": ")[1] for ln in result.stderr.splitlines()]
    assert keys.count("parallel.tp") == 3 and keys.count("parallel.pp") == 1


def test_missing_recipe_file(tmp_path):
    result = run_cli("validate", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2
    assert result.stderr == f"{tmp_path / 'nope.yaml'}: recipe file not found\n"


def test_directory_instead_of_recipe(tmp_path):
    result = run_cli("validate", str(tmp_path))
    assert result.exit_code == 2
    assert result.stderr == f"{tmp_path}: is a directory, not a recipe file\n"


def test_not_utf8(write, tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: t\n# caf\u00e9\n".encode("latin-1"))
    result = run_cli("validate", str(path))
    assert result.exit_code == 2
    assert result.stderr == f"{path}:2:6: not UTF-8 text (byte 13)\n"


def test_good_and_bad_recipes_in_one_call(write, stories_dir):
    bad = write("name: t\nmodel:\n  source: 1\n", "bad.yaml")
    good = RECIPES / "stories-fp16.yaml"
    result = run_cli("validate", str(good), str(bad))
    assert result.exit_code == 2
    assert result.stdout == f"{good}: ok\n"
    assert result.stderr.startswith(f"{bad}:3:11: model.source:")


def test_override_errors_name_the_override(stories_dir):
    good = RECIPES / "stories-fp16.yaml"
    result = run_cli("validate", str(good), "--set", "parallel.tp=3", "--set", "engine.max_beam_width=99")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert f"{good} (--set engine.max_beam_width=99): engine.max_beam_width: must be ≤ 16 (got 99)" in lines
    result = run_cli("validate", str(good), "--set", "parallel.tp=3")
    assert (
        f"{good} (--set parallel.tp=3): parallel.tp: the model's 8 attention heads do not divide by tp=3"
        in result.stderr
    )
    result = run_cli("validate", str(good), "--set", "parallel", "--set", "name.x=1", "--set", "engine.gpu=[")
    assert result.stderr.splitlines() == [
        f"{good} (--set parallel): an override must look like dotted.key=value",
        f"{good} (--set name.x=1): name: is not a section",
        f"{good} (--set engine.gpu=[): engine.gpu: value is not valid YAML: "
        "expected the node content, but found '<stream end>' (while parsing a flow node)",
    ]


def test_overrides_that_fix_a_recipe(write, stories_dir):
    path = write(f"name: t\nmodel:\n  source: {stories_dir}\nparallel:\n  tp: 3\n")
    assert run_cli("validate", str(path)).exit_code == 2
    result = run_cli("validate", str(path), "--set", "parallel.tp=2")
    assert result.exit_code == 0, result.stderr
    assert load_recipe(path, ["parallel.tp=2"]).parallel.tp == 2


@pytest.mark.slow  # trtpipe in a child process
def test_real_subprocess_exit_code_and_message(write, stories_dir):
    path = write(f"name: t\nmodel:\n  source: {stories_dir}\nquantization:\n  algo: int3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "trtpipe.cli", "validate", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (
        f"{path}:5:9: quantization.algo: 'int3' is not allowed "
        "(allowed: none, fp8, fp8_pc_pt, int8_sq, int8_wo, int4_wo, int4_awq, w4a8_awq, nvfp4)\n"
    )


def test_special_files_are_refused_not_read(tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)  # reading it would block forever
    result = run_cli("validate", str(fifo))
    assert (result.exit_code, result.stderr) == (2, f"{fifo}: is not a regular file\n")


def test_oversized_file_is_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 200_000)
    result = run_cli("validate", str(big))
    assert (result.exit_code, result.stderr) == (2, f"{big}: is 2000000 bytes; a recipe is a small YAML file\n")


def test_yaml_alias_bomb_is_reported_quickly(write, stories_dir):
    """9 levels of 9 aliases: 387 million strings if expanded; positions and validation must not expand them."""
    lines = ["a: &a [" + ", ".join(["lol"] * 9) + "]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    lines += ["name: t", "model:", f"  source: {stories_dir}", "quantization:", "  exclude: *i"]
    path = write("\n".join(lines) + "\n")
    result = run_cli("validate", str(path))
    assert result.exit_code == 2
    assert (
        f"{path}:1:1: a: unknown key (allowed: name, work_dir, model, quantization, parallel, engine, accuracy, "
        "triton, target, llmapi, deploy, serving, lora, speculative)"
    ) in result.stderr
    # an aliased value is reported where it is defined: exclude's items are *h, anchored at line 8 column 4
    assert f"{path}:8:4: quantization.exclude.8: must be a string (got a list)" in result.stderr
