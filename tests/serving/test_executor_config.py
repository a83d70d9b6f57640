"""The one executor configuration: one constructor (``trtpipe.serving.config``), one serialized form, and the four
consumers (the Triton twin, the OpenAI twin, the Dynamo workers, the simulator) given equal configs by one recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtpipe.serving import config as C
from trtpipe.serving.api import CapacityPolicy

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
STORIES = RECIPES / "stories-fp16.yaml"
# a pool that is not a whole number of blocks (1000 / 32 = 31.25), and one queue bound for both twins
OVERRIDES = [
    "engine.kv_cache.max_tokens=1000",
    "triton.max_queue_size=64",
    "serving.max_queue_size=64",
    "serving.request_timeout_s=42",
    "triton.scheduler_policy=max_utilization",
]


def limits(**kw):
    return {
        "max_batch_size": 4,
        "max_num_tokens": 256,
        "max_input_len": 100,
        "max_seq_len": 128,
        "tokens_per_block": 32,
        **kw,
    }


@pytest.mark.parametrize("tokens, blocks", [(1000, 32), (1024, 32), (1025, 33), (10, 4)])
def test_kv_blocks_round_up_as_tensorrt_llm_and_hold_one_sequence(tokens, blocks):
    # ceilDiv(maxTokens, tokensPerBlock) (kvCacheManager.cpp); 10 tokens still get one 128-token sequence's 4 blocks
    assert C.executor_config(**limits(kv_tokens=tokens)).num_blocks == blocks


def test_kv_pool_defaults_to_one_sequence_per_batch_slot_and_reuse_on():
    c = C.executor_config(**limits())
    assert c.num_blocks == 4 * 128 // 32 and c.enable_kv_cache_reuse is True


def test_the_serialized_form_round_trips_and_refuses_unknown_fields():
    c = C.executor_config(**limits(capacity_policy="max_utilization", request_timeout_s=2.5, max_queue_size=3))
    assert C.from_json(C.to_json(c)) == c
    assert json.loads(C.to_json(c))["capacity_policy"] == "max_utilization"
    with pytest.raises(ValueError, match="unknown field.*speculation"):
        C.from_dict({**C.to_dict(c), "speculation": 1})
    assert C.replace_knobs(c, enable_kv_cache_reuse=False).enable_kv_cache_reuse is False


def test_every_consumer_gets_the_same_config_from_one_recipe(tmp_path):
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from trtpipe.checkpoint.convert import convert
    from trtpipe.engine.build_config import resolve_build, to_json as build_json
    from trtpipe.engine.twin_engine_dir import write_twin_engine
    from trtpipe.app.predictor import recipe_setup
    from trtpipe.app.launch_dynamo import DynamoGraph, graph_from_spec, graph_spec
    from trtpipe.serving.triton_adapter import settings_from_model_config
    from trtpipe.triton import repo as R
    from trtpipe.app.validation import load_recipe

    recipe = load_recipe(STORIES, OVERRIDES)
    model = recipe.resolve(recipe.model.source)
    # the OpenAI twin (trtpipe serve of an llmapi recipe)
    openai = C.from_recipe(recipe, json.loads((model / "config.json").read_text())["max_position_embeddings"])
    # the Triton twin: the repository the recipe builds, read back as the stub reads it
    ckpt = convert(model, tmp_path / "ckpt", tp=1, dtype="float16")
    build = resolve_build(recipe, json.loads((ckpt / "config.json").read_text()))
    engine = write_twin_engine(ckpt, tmp_path / "engine", build_json(build.config))
    R.write_repo(recipe, engine, engine / "checkpoint", tmp_path / "repo")
    pbtxt = text_format.Parse((tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").read_text(), mc.ModelConfig())
    triton = settings_from_model_config(
        json_format.MessageToDict(pbtxt, preserving_proto_field_name=True), str(tmp_path / "repo" / "tensorrt_llm")
    ).executor
    # a Dynamo worker: the graph's config through the spec and the worker's --executor-config
    graph = DynamoGraph(model, "m", 1, "kv", "127.0.0.1", 1, openai, tmp_path / "run")
    dynamo = C.from_json(C.to_json(graph_from_spec(json.loads(json.dumps(graph_spec(graph)))).config))
    # the simulator (trtpipe predict) takes the engine limits and the KV pool from the recipe; its knobs are a
    # benchmark's own (no deadline, no queue bound, chunked context as the engine's paged context FMHA, no prefix
    # reuse for prompts that share none)
    sim = recipe_setup(STORIES, OVERRIDES, gpu="h100-sxm-80gb").config(isl=64, osl=32)
    limits_and_pool = (
        "max_batch_size",
        "max_num_tokens",
        "max_input_len",
        "max_seq_len",
        "num_blocks",
        "tokens_per_block",
        "max_beam_width",
    )
    assert openai.num_blocks == 32 and openai.capacity_policy == CapacityPolicy.MAX_UTILIZATION
    assert openai.request_timeout_s == 42 and openai.max_queue_size == 64
    assert triton == openai == dynamo
    assert {k: getattr(sim, k) for k in limits_and_pool} == {k: getattr(openai, k) for k in limits_and_pool}


def test_an_hf_directory_gets_the_recipe_schemas_default_knobs():
    from trtpipe.app.validation import load_recipe

    plain = C.twin_default(512)  # what the OpenAI twin serves an HF directory with
    recipe = load_recipe(STORIES)  # sets no serving knob: the schema's defaults
    want = C.from_recipe(recipe, 512)
    assert (
        {
            k: getattr(plain, k)
            for k in ("capacity_policy", "enable_kv_cache_reuse", "max_queue_size", "request_timeout_s")
        }
        == {
            k: getattr(want, k)
            for k in ("capacity_policy", "enable_kv_cache_reuse", "max_queue_size", "request_timeout_s")
        }
        == {
            "capacity_policy": CapacityPolicy.GUARANTEED_NO_EVICT,
            "enable_kv_cache_reuse": True,
            "max_queue_size": 64,
            "request_timeout_s": 600.0,
        }
    )
