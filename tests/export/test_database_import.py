"""`trtpipe recipe import` of NVIDIA's per-model serving configs (five of NVIDIA/TensorRT-LLM's
examples/configs/database YAMLs, tests/export/data/database/SOURCES.md names each file@commit): the recipe loads,
and the llmapi stage's extra_llm_api_options.yaml is the imported file again, byte for byte (below trtpipe's
comment header); a key trtpipe sets from the recipe changes only its value. The TensorRT-LLM 1.3 key table:
a 1.3-only key is refused for llmapi.version 1.2 in one line naming the key and 1.3, `--set llmapi.version=1.3`
is accepted, an unknown key in a database file is refused before anything is written, and moe_config.backend is
gated per GPU and checkpoint format as DeepSeek-R1's deployment guide gates it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from trtpipe.app.validation import check_recipe, load_recipe
from trtpipe.cli import main
from trtpipe.errors import RecipeError
from trtpipe.export.options_rules import moe_backend_problem
from trtpipe.export.serving import YAML_NAME, write_serving

DATA = Path(__file__).parent / "data" / "database"
FILES = sorted(DATA.rglob("*.yaml"))
SOURCES = (DATA / "SOURCES.md").read_text()
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _import(tmp_path: Path, src: Path, *extra: str) -> Path:
    out = tmp_path / "recipe.yaml"
    result = CliRunner().invoke(main, ["recipe", "import", str(src), "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return out


def _written(tmp_path: Path, recipe) -> str:
    out = tmp_path / "serve"
    out.mkdir()
    write_serving(recipe, tmp_path, out)
    return (out / YAML_NAME).read_text()


def _body(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#"))


def test_five_files_with_their_sources():
    assert len(FILES) == 5
    for f in FILES:
        rel = f.relative_to(DATA).as_posix()
        row = next(line for line in SOURCES.splitlines() if f"`{rel}`" in line)
        commit, chars = [c.strip() for c in row.split("|")[2:4]]
        assert len(commit) == 40 and int(chars) == len(f.read_bytes())


@pytest.mark.parametrize("src", FILES, ids=[f.relative_to(DATA).as_posix() for f in FILES])
def test_round_trip_is_byte_for_byte(tmp_path, src):
    recipe_path = _import(tmp_path, src, "--source", f"examples/configs/database/{src.relative_to(DATA)}")
    recipe = load_recipe(recipe_path, check_rules=False)  # hf:// sources: the model rule needs the hub
    options = yaml.safe_load(src.read_text())
    assert recipe.target == "llmapi" and recipe.llmapi.version == "1.3"
    assert recipe.model.source == f"hf://{src.parts[-4]}/{src.parts[-3]}"
    assert recipe.parallel.tp == options["tensor_parallel_size"]
    assert recipe.engine.gpu == {"H200": "h200-141gb", "B200": "b200-180gb"}[src.parts[-2]]
    assert recipe.engine.max_input_len == int(src.name.split("k")[0]) * 1024
    assert _body(_written(tmp_path, recipe)) == src.read_text()
    # every validate rule (moe_config.backend's gate included) passes on the model's published config.json
    local = RECIPES / "configs" / src.parts[-3].lower()
    assert load_recipe(recipe_path, [f"model.source={local}"]).llmapi.options == options


def test_a_key_trtpipe_sets_changes_only_its_value(tmp_path):
    src = DATA / "deepseek-ai/DeepSeek-R1-0528/H200/1k1k_tp8_conc1.yaml"
    recipe = load_recipe(_import(tmp_path, src), ["parallel.tp=4", "parallel.moe_ep=4"], check_rules=False)
    want = src.read_text().replace("tensor_parallel_size: 8", "tensor_parallel_size: 4")
    want = want.replace("moe_expert_parallel_size: 8", "moe_expert_parallel_size: 4")
    assert want != src.read_text() and _body(_written(tmp_path, recipe)) == want


def test_a_13_only_key_is_refused_for_12_naming_the_key_and_release(tmp_path):
    recipe_path = _import(tmp_path, DATA / "openai/gpt-oss-120b/B200/1k1k_tp8_conc64.yaml")
    local = f"model.source={RECIPES / 'configs' / 'gpt-oss-120b'}"  # its published config.json: no hub at validate
    recipe = load_recipe(recipe_path, [local, "llmapi.version=1.2"], check_rules=False)
    problems = check_recipe(recipe)
    assert [p.key for p in problems] == ["llmapi.options"], problems
    assert "'env_overrides' is a TorchLlmArgs key of TensorRT-LLM 1.3, not of 1.2" in problems[0].message
    assert "\n" not in problems[0].message
    assert load_recipe(recipe_path, [local]).llmapi.version == "1.3"  # every rule passes as imported


def test_set_llmapi_version_13_is_accepted():
    recipe = load_recipe(RECIPES / "stories-llmapi-fp8.yaml", ["llmapi.version=1.3"])
    assert recipe.llmapi.version == "1.3"
    with pytest.raises(RecipeError, match="1.4"):
        load_recipe(RECIPES / "stories-llmapi-fp8.yaml", ["llmapi.version=1.4"])


def test_an_unknown_key_is_refused_in_one_line_and_nothing_written(tmp_path):
    src = tmp_path / "deepseek-ai" / "DeepSeek-R1-0528" / "H200" / "1k1k_tp8_conc1.yaml"
    src.parent.mkdir(parents=True)
    src.write_text((DATA / "deepseek-ai/DeepSeek-R1-0528/H200/1k1k_tp8_conc1.yaml").read_text() + "moe_confg: {}\n")
    out = tmp_path / "recipe.yaml"
    result = CliRunner().invoke(main, ["recipe", "import", str(src), "--out", str(out)])
    assert result.exit_code != 0 and not out.exists() and not list(tmp_path.glob("*.tmp"))
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "'moe_confg' is not a TorchLlmArgs key of TensorRT-LLM 1.3" in lines[0]
    no_org = tmp_path / "database" / "glm-4.7-fp8" / "H100" / "1k1k_tp8_conc128.yaml"  # a real layout upstream
    no_org.parent.mkdir(parents=True)
    no_org.write_text("tensor_parallel_size: 8\n")
    result = CliRunner().invoke(main, ["recipe", "import", str(no_org)])
    assert result.exit_code != 0 and "names no organisation" in result.output and "--model" in result.output
    result = CliRunner().invoke(main, ["recipe", "import", str(no_org), "--model", "hf://some-org/glm-4.7-fp8"])
    assert result.exit_code == 0 and "source: hf://some-org/glm-4.7-fp8" in result.output, result.output
    bad_name = tmp_path / "x.yaml"
    bad_name.write_text("tensor_parallel_size: 1\n")
    result = CliRunner().invoke(main, ["recipe", "import", str(bad_name)])
    assert result.exit_code != 0 and "not a database config path" in result.output


@pytest.mark.parametrize(
    "backend, gpu, fmt, ep, ok",
    [
        ("CUTLASS", "h200-141gb", "fp8", 8, True),
        ("DEEPGEMM", "h200-141gb", "fp8", 8, False),  # the guide: H100/H200 FP8 -> CUTLASS
        ("TRTLLM", "h100-sxm-80gb", "fp8", 8, False),
        ("DEEPGEMM", "b200-180gb", "fp8", 8, True),
        ("TRTLLM", "b200-180gb", "fp8", 8, True),  # NVIDIA's B200 database config @010405f1
        ("CUTLASS", "b200-180gb", "fp8", 8, False),
        ("TRTLLM", "b200-180gb", "nvfp4", 8, True),
        ("DEEPGEMM", "b200-180gb", "nvfp4", 8, False),
        ("WIDEEP", "gb200-186gb", "nvfp4", 16, True),
        ("CUTLASS", "gb200-186gb", "nvfp4", 16, False),
        ("AUTO", "h200-141gb", "fp8", 8, True),
    ],
)
def test_moe_backend_matrix(backend, gpu, fmt, ep, ok):
    why = moe_backend_problem(backend, "deepseek_v3", gpu, fmt, ep)
    assert (why is None) == ok, why
    if not ok:
        assert "deployment-guide-for-deepseek-r1-on-trtllm.md@7c22bbf9" in why and backend in why
    assert moe_backend_problem(backend, "qwen3_moe", gpu, fmt, ep) is None  # the guide is DeepSeek-R1's
    assert "not a MoeConfig backend" in moe_backend_problem("CUTLAS", "qwen3_moe", gpu, fmt, ep)


def test_validate_gates_the_deepseek_recipe_by_its_block_fp8_source():
    """recipes/deepseek-r1-0528-fp8.yaml: eight H200, the shipped block FP8 (detected from its config.json)."""
    path = RECIPES / "deepseek-r1-0528-fp8.yaml"
    base = ["llmapi.version=1.3", "llmapi.options.tensor_parallel_size=8"]
    assert load_recipe(path, [*base, "llmapi.options.moe_config.backend=CUTLASS"]).llmapi.options
    with pytest.raises(RecipeError) as err:
        load_recipe(path, [*base, "llmapi.options.moe_config.backend=DEEPGEMM"])
    assert "moe_config.backend DEEPGEMM does not run FP8 deepseek_v3 MoE on h200-141gb" in str(err.value)
    with pytest.raises(RecipeError, match="'moe_config.backend' is a TorchLlmArgs key of TensorRT-LLM 1.3"):
        load_recipe(path, ["llmapi.options.moe_config.backend=CUTLASS"])  # the recipe pins 1.2


def test_plan_of_the_imported_r1_counts_the_fp8_kv_cache_it_sets(tmp_path):
    """NVIDIA's H200 config sets kv_cache_config.dtype: fp8 (TensorRT-LLM then runs an FP8 cache whatever the
    checkpoint says): the plan counts 61 layers x (512 + 64) values x 1 byte, and the KV pool is the file's 0.8 of
    what is left. The model is the published config.json in recipes/configs (plan reads no weights); the plugin
    preset is named because no preset matches block FP8 (an engine-path table)."""
    import json

    recipe = _import(tmp_path, DATA / "deepseek-ai/DeepSeek-R1-0528/H200/1k1k_tp8_conc1.yaml")
    sets = [
        "--set",
        f"model.source={RECIPES / 'configs' / 'deepseek-r1-0528'}",
        "--set",
        "engine.plugins.preset=hopper-fp16",
    ]
    r = CliRunner().invoke(main, ["plan", str(recipe), *sets, "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)
    assert p["kv_bytes_per_token_model"] == 61 * 576 * 1 == 35136 and p["kv_bytes_per_token_per_gpu"] == [35136]
    assert p["kv_tokens"] == p["kv_pool_bytes"][0] // 35136
    assert p["kv_pool_bytes"][0] == int(0.8 * p["free_bytes_per_gpu"][0])  # free_gpu_memory_fraction: 0.8
    r = CliRunner().invoke(
        main, ["plan", str(recipe), *sets, "--set", "llmapi.options.kv_cache_config.dtype=auto", "--json"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["kv_bytes_per_token_model"] == 61 * 576 * 2  # the checkpoint's bf16 cache
