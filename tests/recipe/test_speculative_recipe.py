"""The recipe's ``speculative:`` section: each misuse is one line naming its key, and a valid one becomes
TensorRT-LLM's ``speculative_config`` in the trtllm-serve YAML, the Triton llmapi model.yaml and the Dynamo worker's
--extra-engine-args, or trtllm-build's --speculative_decoding_mode on the engine path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trtpipe.app.validation import check_recipe, load_recipe
from trtpipe.errors import RecipeError
from trtpipe.export.serving import llm_api_options, model_yaml

BASE = """\
name: spec
target: {target}
model:
  source: {model}
engine:
  gpu: {gpu}
  max_batch_size: 4
  max_input_len: 256
  max_seq_len: 512
  max_num_tokens: {tokens}
accuracy:
  enabled: false
speculative:
{spec}
"""


def _write(tmp_path: Path, stories_dir, spec: str, target="llmapi", gpu="h100-sxm-80gb", tokens=2048, model=None):
    p = tmp_path / "r.yaml"
    text = BASE.format(target=target, model=model or stories_dir, gpu=gpu, tokens=tokens, spec=spec)
    p.write_text(text)
    return p


def _problems(path) -> list[str]:
    return [f"{p.key}: {p.message}" for p in check_recipe(load_recipe(path, check_rules=False))]


def _draft_copy(tmp_path: Path, stories_dir, tokenizer_edit=None, **config) -> Path:
    d = tmp_path / "draft"
    shutil.copytree(stories_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(config)
    (d / "config.json").write_text(json.dumps(cfg))
    if tokenizer_edit:
        tok = json.loads((d / "tokenizer.json").read_text())
        tokenizer_edit(tok)
        (d / "tokenizer.json").write_text(json.dumps(tok))
    return d


def test_ngram_and_draft_target_are_valid_and_written(tmp_path, stories_dir):
    draft = _draft_copy(tmp_path, stories_dir, num_hidden_layers=2)  # a shrunk draft: same family, same tokenizer
    r = load_recipe(
        _write(tmp_path, stories_dir, f"  decoding_type: DraftTarget\n  max_draft_len: 4\n  speculative_model: {draft}")
    )
    opts = llm_api_options(r, "1.2")
    assert opts["speculative_config"] == {
        "decoding_type": "DraftTarget",
        "max_draft_len": 4,
        "speculative_model": str(draft),
    }
    assert llm_api_options(r, "1.1")["speculative_config"]["speculative_model_dir"] == str(draft)
    assert model_yaml(r, "/m")["speculative_config"] == opts["speculative_config"]  # the Triton llmapi model
    ng = load_recipe(
        _write(tmp_path, stories_dir, "  decoding_type: NGram\n  max_draft_len: 3\n  max_matching_ngram_size: 4")
    )
    assert llm_api_options(ng)["speculative_config"] == {
        "decoding_type": "NGram",
        "max_draft_len": 3,
        "max_matching_ngram_size": 4,
    }


def test_dynamo_worker_args_carry_the_speculative_config(tmp_path, stories_dir):
    from trtpipe.deploy.dynamo import ROLES, engine_options

    r = load_recipe(_write(tmp_path, stories_dir, "  decoding_type: NGram\n  max_draft_len: 2"))
    for role in ROLES:
        assert engine_options(r, role)["speculative_config"]["decoding_type"] == "NGram", role


def test_off_by_default_writes_nothing(tmp_path, stories_dir):
    r = load_recipe(_write(tmp_path, stories_dir, "  decoding_type: none"))
    assert "speculative_config" not in llm_api_options(r)


CASES = {
    "engine-name-on-llmapi": (
        "  decoding_type: draft_tokens_external\n  speculative_model: /x",
        {},
        "speculative.decoding_type: draft_tokens_external is a trtllm-build mode",
    ),
    "llmapi-name-on-engine": (
        "  decoding_type: NGram",
        {"target": "engine"},
        "speculative.decoding_type: NGram is a PyTorch-backend",
    ),
    "draft-missing": (
        "  decoding_type: DraftTarget",
        {},
        "speculative.speculative_model: decoding_type DraftTarget needs a draft model",
    ),
    "ngram-with-model": (
        "  decoding_type: NGram\n  speculative_model: /x",
        {},
        "speculative.speculative_model: decoding_type NGram takes no draft model",
    ),
    "mtp-without-layers": (
        "  decoding_type: MTP\n  max_draft_len: 1",
        {},
        "speculative.decoding_type: MTP needs a model with MTP layers",
    ),
    "mtp-on-ampere": (
        "  decoding_type: MTP\n  max_draft_len: 1",
        {"gpu": "a100-sxm-80gb"},
        "speculative.decoding_type: MTP needs SM >= 90",
    ),
    "eagle3-two-model-reuse": (
        "  decoding_type: Eagle3\n  eagle3_one_model: false\n  speculative_model: /x",
        {},
        "speculative.eagle3_one_model: EAGLE-3 two-model does not run with KV cache reuse",
    ),
    "eagle3-shallow-target": (  # stories260k has 5 layers: upstream's default capture needs more
        "  decoding_type: Eagle3\n  eagle3_one_model: true\n  speculative_model: {head}",
        {},
        "speculative.decoding_type: EAGLE-3 captures target layers (1, L/2 - 1, L - 4)",
    ),
    "eagle3-head-width": (
        "  decoding_type: Eagle3\n  eagle3_one_model: true\n  speculative_model: {head}",
        {},
        "speculative.speculative_model: EAGLE-3 head: hidden_size 32 differs from the target's 64",
    ),
    "tokens-per-step": (
        "  decoding_type: NGram\n  max_draft_len: 7",
        {"tokens": 16},
        "engine.max_num_tokens: 16 tokens per step cannot verify a full batch",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_misuse_is_one_line_naming_the_key(case, tmp_path, stories_dir):
    spec, kw, expected = CASES[case]
    if "{head}" in spec:  # a head config.json as published EAGLE-3 heads carry (LlamaForCausalLMEagle3)
        head = tmp_path / "head"
        head.mkdir()
        width = 32 if case == "eagle3-head-width" else 64
        cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": width, "vocab_size": 512}
        (head / "config.json").write_text(json.dumps({**cfg, "draft_vocab_size": 128, "num_hidden_layers": 1}))
        spec = spec.format(head=head)
    problems = _problems(_write(tmp_path, stories_dir, spec, **kw))
    assert any(p.startswith(expected) for p in problems), problems


def test_draft_with_another_tokenizer_or_family_is_refused(tmp_path, stories_dir):
    def edit(tok):
        vocab = tok["model"]["vocab"]
        a, b = list(vocab)[10:12]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    draft = _draft_copy(tmp_path, stories_dir, tokenizer_edit=edit)
    spec = f"  decoding_type: DraftTarget\n  speculative_model: {draft}"
    assert any("draft tokenizer (tokenizer.json) differs" in p for p in _problems(_write(tmp_path, stories_dir, spec)))
    shutil.rmtree(draft)
    draft = _draft_copy(tmp_path, stories_dir, architectures=["NoSuchForCausalLM"])
    problems = _problems(_write(tmp_path, stories_dir, spec))
    assert any(p.startswith("speculative.speculative_model: draft model:") for p in problems), problems
    with pytest.raises(RecipeError):
        load_recipe(_write(tmp_path, stories_dir, spec))


def test_engine_target_builds_with_the_trtllm_build_mode(tmp_path, stories_dir):
    from trtpipe.engine.build_config import resolve_build, to_argv, to_json
    from trtpipe.engine.ckptconfig import predicted_checkpoint_config
    from trtpipe.models.dims import read_hf_config

    r = load_recipe(
        _write(
            tmp_path,
            stories_dir,
            "  decoding_type: draft_tokens_external\n  max_draft_len: 5\n  speculative_model: /d",
            target="engine",
        ),
        check_rules=False,
    )
    build = resolve_build(r, predicted_checkpoint_config(read_hf_config(stories_dir), r))
    argv = to_argv(build, "ckpt", "out")
    i = argv.index("--speculative_decoding_mode")
    assert argv[i : i + 4] == ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", "5"]
    js = to_json(build.config)
    assert (js["speculative_decoding_mode"], js["max_draft_len"]) == (
        2,
        5,
    )  # SpeculativeDecodingMode.DRAFT_TOKENS_EXTERNAL


def test_the_twin_executor_config_follows_the_recipe(tmp_path, stories_dir):
    from trtpipe.serving.config import from_recipe, to_json, from_json

    draft = _draft_copy(tmp_path, stories_dir, num_hidden_layers=2)
    spec = f"  decoding_type: DraftTarget\n  max_draft_len: 4\n  speculative_model: {draft}"
    c = from_recipe(load_recipe(_write(tmp_path, stories_dir, spec)), 512)
    assert (c.speculative_decoding_type, c.max_draft_len, c.speculative_model) == ("DraftTarget", 4, str(draft))
    assert from_json(to_json(c)) == c  # the one serialized form carries it to every front end
    engine = f"  decoding_type: draft_tokens_external\n  speculative_model: {draft}"  # trtllm-build's draft-target
    c = from_recipe(load_recipe(_write(tmp_path, stories_dir, engine, target="engine"), check_rules=False), 512)
    assert (c.speculative_decoding_type, c.max_draft_len) == ("DraftTarget", 3)
    from trtpipe.recipe.knobs import twin_extras

    extras = json.loads(
        twin_extras(load_recipe(_write(tmp_path, stories_dir, engine, target="engine"), check_rules=False))
    )
    assert extras["speculative_decoding_type"] == "DraftTarget"  # the Triton twin's executor_extras carry it
    eagle = "  decoding_type: Eagle3\n  speculative_model: /heads"  # the twin drafts with the head
    c = from_recipe(load_recipe(_write(tmp_path, stories_dir, eagle), check_rules=False), 512)
    assert (c.speculative_decoding_type, c.max_draft_len, c.speculative_model) == ("Eagle3", 3, "/heads")
    mtp = "  decoding_type: MTP\n  max_draft_len: 2"  # with the target checkpoint's own MTP layer
    r = load_recipe(_write(tmp_path, stories_dir, mtp), check_rules=False)
    c = from_recipe(r, 512)
    assert (c.speculative_decoding_type, c.max_draft_len, c.speculative_model) == ("MTP", 2, "")
    written = {"decoding_type": "MTP", "max_draft_len": 2, "num_nextn_predict_layers": 2}
    assert llm_api_options(r, "1.2")["speculative_config"] == written  # what trtllm-serve loads: no draft path


def test_plan_counts_the_draft_weights_kv_and_positions(tmp_path, stories_dir):
    from trtpipe.app.planning import render_plan, resolve

    draft = _draft_copy(tmp_path, stories_dir, num_hidden_layers=5)  # same files: the draft weighs what stories does
    plain = resolve(_write(tmp_path, stories_dir, "  decoding_type: none"))
    spec = f"  decoding_type: DraftTarget\n  max_draft_len: 4\n  speculative_model: {draft}"
    r = resolve(_write(tmp_path, stories_dir, spec))
    d = r.plan.draft
    assert d.weight_bytes == (draft / "model.safetensors").stat().st_size  # tp 1: the whole draft on the GPU
    assert d.kv_bytes_per_token == 2 * 5 * 4 * 8 * 2  # K and V x 5 layers x 4 kv heads x head 8 x 2 bytes (float16)
    assert r.plan.ranks[0].weight_bytes == plain.plan.ranks[0].weight_bytes + d.weight_bytes
    assert r.plan.ranks[0].kv_bytes_per_token == plain.plan.ranks[0].kv_bytes_per_token + d.kv_bytes_per_token
    assert r.plan.blocks_per_sequence == -(-(r.plan.max_seq_len + 4) // r.plan.tokens_per_block)
    assert "draft weights" in render_plan(r)
    ngram = resolve(_write(tmp_path, stories_dir, "  decoding_type: NGram\n  max_draft_len: 2")).plan.draft
    assert (ngram.weight_bytes, ngram.kv_bytes_per_token, ngram.counted_from) == (0, 0.0, "none")


def test_mtp_drafts_beyond_the_checkpoints_layers_are_one_line(tmp_path, stories_dir):
    """A checkpoint of two MTP layers runs vanilla MTP, one layer per draft: max_draft_len 3 is refused naming the
    key (TensorRT-LLM would cut it to 2, speculative/utils.py@011d0933); 2 is valid; a one-layer checkpoint (MTP-Eagle)
    reuses its layer for any max_draft_len."""
    two = _draft_copy(tmp_path, stories_dir, num_nextn_predict_layers=2)
    over = _problems(_write(tmp_path, stories_dir, "  decoding_type: MTP\n  max_draft_len: 3", model=two))
    assert over == [
        "speculative.max_draft_len: 3 drafts need 3 MTP layers: the checkpoint has num_nextn_predict_layers 2, and "
        "TensorRT-LLM's vanilla MTP drafts one token per layer (it would cut max_draft_len to 2); set max_draft_len "
        "<= 2"
    ]
    assert _problems(_write(tmp_path, stories_dir, "  decoding_type: MTP\n  max_draft_len: 2", model=two)) == []
    shutil.rmtree(two)
    one = _draft_copy(tmp_path, stories_dir, num_nextn_predict_layers=1)
    assert _problems(_write(tmp_path, stories_dir, "  decoding_type: MTP\n  max_draft_len: 3", model=one)) == []


@pytest.mark.parametrize("layers, kv_layers", [(1, 1), (2, 2)], ids=["mtp-eagle", "vanilla-mtp"])
def test_plan_counts_the_mtp_layers_kv_in_the_pool(layers, kv_layers, tmp_path, stories_dir):
    """MTP layers cache every token in the target's pool: get_num_spec_layers (speculative/utils.py@011d0933) adds 1
    layer for MTP-Eagle and num_nextn_predict_layers for vanilla MTP, each the size of a target layer's KV."""
    from trtpipe.app.planning import render_plan, resolve

    model = _draft_copy(tmp_path, stories_dir, num_nextn_predict_layers=layers)
    plain = resolve(_write(tmp_path, stories_dir, "  decoding_type: none", model=model))
    r = resolve(_write(tmp_path, stories_dir, f"  decoding_type: MTP\n  max_draft_len: {layers}", model=model))
    d = r.plan.draft
    per_layer = 2 * 4 * 8 * 2  # K and V x 4 kv heads x head 8 x 2 bytes (float16): stories' one layer
    assert plain.plan.ranks[0].kv_bytes_per_token == 5 * per_layer  # its 5 decoder layers
    assert (d.weight_bytes, d.kv_bytes_per_token) == (0, kv_layers * per_layer)
    assert r.plan.ranks[0].kv_bytes_per_token == (5 + kv_layers) * per_layer
    assert r.plan.ranks[0].kv_tokens < plain.plan.ranks[0].kv_tokens  # the same memory holds fewer tokens
    assert f"draft KV {kv_layers * per_layer} bytes/token" in render_plan(r)
