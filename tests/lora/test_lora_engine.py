"""The engine target with LoRA adapters: trtllm-build's LoRA flags, the adapters converted into the Triton
``lora_prefetch_dir`` layout, the ``lora_cache_*`` parameters sized from them, and what validation refuses.

A real build of stories260k (checkpoint, engine twin, repo) with two rank-8 adapters; without TensorRT-LLM the
engine stage writes the CPU twin and records the trtllm-build command it would run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from trtpipe.app.validation import check_recipe, load_recipe
from trtpipe.engine import build_config as bc
from trtpipe.engine import lora_build, lora_cache
from trtpipe.engine.lora_convert import MODULE_IDS, convert
from trtpipe.errors import EngineError
from trtpipe.models.dims import checkpoint_dims

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PICKED = ("r8-attn", "r8-all-rslora")


def _recipe(tmp_path, stories_dir, adapters: dict, **sections):
    doc = {
        "name": "stories-lora-engine",
        "target": "engine",
        "work_dir": str(tmp_path / "work"),
        "model": {"source": str(stories_dir), "dtype": "float32"},
        "accuracy": {"enabled": False},
        "engine": {"max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 2048},
        "triton": {"max_batch_size": 8},
        "lora": {"adapters": {k: str(v) for k, v in adapters.items()}, "max_lora_rank": 64, "max_loras": 2},
    }
    for key, value in sections.items():
        doc[key] = {**doc.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_recipe(path, check_rules=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory, stories_dir, adapters):
    """(recipe, engine artifact, repo artifact) of a real build through the repo stage."""
    from lora_adapters import build_lora_engine

    return build_lora_engine(stories_dir, {k: adapters[k] for k in PICKED}, tmp_path_factory.mktemp("lora-engine"))


def test_trtllm_build_command_and_engine_config(built, adapters):
    recipe, engine, _ = built
    from trtpipe.engine.doctor import LOCK_FILE

    argv = json.loads((engine / LOCK_FILE).read_text())["command"]  # what trtllm-build runs (or would, on a GPU)
    bc.check_argv(argv)  # every flag and value is one 1.2's argparse takes (nargs="+" included)
    flags = {}
    for flag, values in bc._flags(argv):  # noqa: SLF001 - the parser under test
        flags[flag] = values
    dirs = [str(adapters[k].resolve()) for k in PICKED]
    assert flags["--lora_plugin"] == ["auto"]
    assert flags["--lora_dir"] == dirs
    assert flags["--lora_ckpt_source"] == ["hf"] and flags["--max_lora_rank"] == ["64"]
    # r8-all-rslora targets all seven linears: every module, in LORA_MODULE_IDS order (attn_qkv is not used)
    assert flags["--lora_target_modules"] == [m for m in MODULE_IDS if m != "attn_qkv"]
    cfg = json.loads((engine / "config.json").read_text())["build_config"]
    assert cfg["plugin_config"]["lora_plugin"] == "auto"
    assert cfg["lora_config"]["lora_dir"] == dirs and cfg["lora_config"]["max_lora_rank"] == 64
    assert cfg["lora_config"]["lora_target_modules"] == flags["--lora_target_modules"]


def test_prefetch_dir_holds_each_adapter_as_the_converter_writes_it(built, adapters):
    """<engine>/lora_prefetch/<task id>/model.lora_{weights,config}.npy, the folders named by digits only (the C++
    loader skips any other name), task ids in lora.adapters order, tasks.json naming them."""
    _, engine, _ = built
    prefetch = engine / lora_build.PREFETCH_DIR
    assert sorted(p.name for p in prefetch.iterdir() if p.is_dir()) == ["0", "1"]
    assert lora_build.read_tasks(prefetch) == {0: "r8-attn", 1: "r8-all-rslora"}
    for task, name in enumerate(PICKED):
        w, c = convert(adapters[name], "float32")  # the engine is float32: the tensors at its dtype
        assert np.array_equal(np.load(prefetch / str(task) / "model.lora_weights.npy"), w)
        assert np.array_equal(np.load(prefetch / str(task) / "model.lora_config.npy"), c)


def test_lora_cache_parameters_hold_the_recipe_bounds(built):
    """The host cache holds max_cpu_loras (8) of the largest adapter and the device cache max_loras (2), in whole
    pages of the backend's page shape, and each at least one adapter of max_lora_rank; the optimal adapter size is the adapters' rank, the largest max_lora_rank."""
    from trtpipe.engine.planner import PLAN_FILE, kv_pool
    from trtpipe.triton.repo import EngineInfo, read_configs, trtllm_parameters

    recipe, engine, repo = built
    params = trtllm_parameters(recipe, EngineInfo.read(engine))  # the C++ backend's model on this engine
    assert params["lora_cache_optimal_adapter_size"] == 8 and params["lora_cache_max_adapter_size"] == 64
    assert params["lora_prefetch_dir"] == str(engine / lora_build.PREFETCH_DIR)
    twin = {k: v.string_value for k, v in read_configs(repo)["tensorrt_llm"].parameters.items()}
    assert twin["lora_prefetch_dir"] == "engine/lora_prefetch"  # the twin: inside its engine link
    assert twin["lora_cache_host_memory_bytes"] == str(params["lora_cache_host_memory_bytes"])
    cfg = json.loads((engine / "config.json").read_text())
    host = int(params["lora_cache_host_memory_bytes"])
    assert lora_cache.host_capacity(host, cfg, engine / lora_build.PREFETCH_DIR) == recipe.lora.max_cpu_loras
    shape = lora_cache.cache_shape(cfg, engine / lora_build.PREFETCH_DIR)
    # r8-all-rslora: 5 layers x 7 modules, each row r*(in+out) values in ceil(./page_width) slots
    sizes = lora_cache.module_sizes(checkpoint_dims(cfg["pretrained_config"]))
    assert shape.pages.page_width == min(
        sum(sizes[m]) for m in cfg["build_config"]["lora_config"]["lora_target_modules"]
    )
    slots = 5 * sum(math.ceil(8 * sum(sizes[m]) / shape.pages.page_width) for m in MODULE_IDS if m != "attn_qkv")
    assert shape.largest_pages == math.ceil(slots / shape.pages.slots_per_page)
    plan = json.loads((engine / PLAN_FILE).read_text())
    pool, _ = kv_pool(plan, recipe.engine.kv_cache)
    left = min(f - k for f, k in zip(plan["free_bytes_per_gpu"], pool["kv_pool_bytes"]))
    device = float(params["lora_cache_gpu_memory_fraction"]) * left
    # the backend also needs room for one adapter of max_lora_rank on every module ("Not enough space allocated to
    # device LoRA cache to hold 1 max sized LoRA"): 7 pages here, more than max_loras (2) x 1 page
    floor = math.ceil(shape.pages.min_total_slots / shape.pages.slots_per_page)
    assert floor == 7 and shape.largest_pages == 1
    want = max(recipe.lora.max_loras * shape.largest_pages, floor) * shape.page_bytes
    assert device >= want > device - left * 1e-6 - 1


def test_engine_target_refusals_name_the_key(tmp_path, stories_dir, adapters):
    ok = _recipe(tmp_path, stories_dir, {k: adapters[k] for k in PICKED})
    assert {p.key: p.message for p in check_recipe(ok)} == {}
    bad = _recipe(
        tmp_path,
        stories_dir,
        {"r8-attn": adapters["r8-attn"], "r64-all": adapters["r64-all"]},
        parallel={"tp": 2, "pp": 2},
        model={"source": str(stories_dir), "dtype": "bfloat16"},
        engine={"plugins": {"overrides": {"lora_plugin": "disable"}}},
    )
    problems = {p.key: p.message for p in check_recipe(bad)}
    assert problems["parallel.pp"].startswith("2 does not divide the 5 layers with lora.adapters on target: engine")
    assert "parallel" not in problems and "parallel.tp" not in problems  # tp (and an even pp) are served
    assert "reads prefetched LoRA tasks as float16 or float32 .npy only" in problems["model.dtype"]
    assert problems["lora.adapters.r64-all"].startswith(
        "layer 0 k_proj: r=64 is above one of its sizes (in 64, out 32)"
    )
    assert "would write the wrong adapter_size" in problems["lora.adapters.r64-all"]
    assert "need the LoRA plugin" in problems["engine.plugins.overrides.lora_plugin"]
    assert "lora.adapters.r8-attn" not in problems


def test_prefetch_refuses_bfloat16_before_writing(tmp_path, stories_dir, adapters):
    recipe = _recipe(tmp_path, stories_dir, {"r8-attn": adapters["r8-attn"]})
    with pytest.raises(EngineError, match="lora.adapters: the engine dtype is bfloat16"):
        lora_build.write_prefetch(recipe, tmp_path / "p", "bfloat16")
    assert not (tmp_path / "p").exists()


def test_check_argv_takes_nargs_flags_only_where_argparse_does():
    bc.check_argv(["trtllm-build", "--lora_target_modules", "attn_q", "attn_v", "--max_lora_rank", "8"])
    with pytest.raises(EngineError, match="--lora_target_modules: 'attn_x' is not accepted"):
        bc.check_argv(["trtllm-build", "--lora_target_modules", "attn_q", "attn_x"])
    with pytest.raises(EngineError, match="--max_lora_rank: takes one value"):
        bc.check_argv(["trtllm-build", "--max_lora_rank", "8", "16"])
    with pytest.raises(EngineError, match="--lora_dir: takes one or more values"):
        bc.check_argv(["trtllm-build", "--lora_dir", "--max_lora_rank", "8"])


def test_cache_bounds_rewrite_the_repository_a_retrained_adapter_rebuilds_the_engine(tmp_path, stories_dir, adapters):
    import shutil

    from lora_adapters import build_lora_engine, make_adapter
    from trtpipe.app.stage_table import STAGES
    from trtpipe.pipeline.runner import run_build

    mine = tmp_path / "mine"
    shutil.copytree(adapters["r8-attn"], mine)
    build_lora_engine(stories_dir, {"mine": mine}, tmp_path)

    def statuses(*overrides):
        result = run_build(load_recipe(tmp_path / "recipe.yaml", overrides, check_rules=False), STAGES, quiet=True)
        return {s["name"]: s["status"] for s in result.manifest["stages"]}

    got = statuses("lora.max_loras=1")
    assert got["engine"] == "cached" and got["repo"] == "ran"
    make_adapter(stories_dir, mine, 8, 16, ("q_proj", "v_proj"), False, seed=99)  # retrained in place
    got = statuses("lora.max_loras=1")
    assert got["engine"] == "ran" and got["repo"] == "ran"


def test_lora_cache_is_sized_per_gpu_at_tp_and_pp(built):
    """At tp 2 each rank's cache holds its shard of every row (getPageManagerConfig: localInDim + localOutDim of
    createLoraModules' splits), at pp 5 each stage one layer's rows (determineNumPages): sizes worked by hand for
    stories260k (hidden 64, 8 heads / 4 KV heads of 8, intermediate 172, 5 layers)."""
    _, engine, _ = built
    prefetch = engine / lora_build.PREFETCH_DIR
    cfg = json.loads((engine / "config.json").read_text())
    dims = checkpoint_dims(cfg["pretrained_config"])
    assert lora_cache.module_sizes(dims, 2) == {
        "attn_qkv": (64, 32 + 2 * 16),
        "attn_q": (64, 32),  # out split: 64 / 2
        "attn_k": (64, 16),
        "attn_v": (64, 16),  # 4 KV heads / 2 x 8
        "attn_dense": (32, 64),  # in split
        "mlp_h_to_4h": (64, 86),
        "mlp_4h_to_h": (86, 64),
        "mlp_gate": (64, 86),
    }

    def at(tp, pp):
        c = json.loads(json.dumps(cfg))
        c["pretrained_config"]["mapping"].update(tp_size=tp, pp_size=pp, world_size=tp * pp)
        return lora_cache.cache_shape(c, prefetch)

    one, tp2, pp5 = at(1, 1), at(2, 1), at(1, 5)
    assert (one.tp, one.pp, tp2.tp, pp5.pp) == (1, 1, 2, 5)
    # page width: the smallest in + out of the 7 modules: k/v, 64 + 32 at tp 1, 64 + 16 at tp 2 (tp 1 per layer:
    # q 128, k 96, v 96, dense 128, gate / up / down 236)
    assert one.pages.page_width == 96 and tp2.pages.page_width == 80 and pp5.pages.page_width == 96
    # slots per page: max(optimal 8 x the slots of a layer's 7 modules x local layers, one max-rank row)
    width = 80
    per_layer = [96, 80, 80, 96, 150, 150, 150]  # q, k, v, dense, h_to_4h, 4h_to_h, gate at tp 2
    assert tp2.pages.slots_per_page == max(8 * sum(-(-x // width) for x in per_layer) * 5, -(-64 * 150 // width))
    assert pp5.pages.slots_per_page == max(8 * sum(-(-x // 96) for x in [128, 96, 96, 128, 236, 236, 236]), 158)
    # the max-rank floor per GPU: 64 x (every module's in + out) x local layers, over the page width
    assert tp2.pages.min_total_slots == -(-64 * sum(per_layer) * 5 // width)
    assert pp5.pages.min_total_slots == -(-64 * sum([128, 96, 96, 128, 236, 236, 236]) // 96)
    assert one.pages.min_total_slots == -(-64 * sum([128, 96, 96, 128, 236, 236, 236]) * 5 // 96)
    # a GPU holds a fifth of the rows at pp 5: one layer's 7 rows of r 8 (the rsLoRA adapter) fit one page
    assert pp5.largest_pages == 1 and pp5.pages.slots_per_page < one.pages.slots_per_page
