"""``speculative.draft_quantization`` at ``trtpipe validate`` (config files only): each misuse is one line naming the
key; a plain draft under an INT4-AWQ recipe is valid and is the one the draft_engine stage quantizes."""

from __future__ import annotations

import json
import shutil

from trtpipe.app.validation import check_recipe, load_recipe
from trtpipe.quant.draft_rules import KEY, draft_quant_recipe, quantizes_draft

BASE = """\
name: draftq
target: engine
model:
  source: {model}
  dtype: float16
quantization:
  algo: {algo}
  group_size: 64
  exclude: ["*lm_head", "*mlp.proj"]
engine:
  max_batch_size: 8
  max_input_len: 256
  max_seq_len: 512
  max_num_tokens: 2048
accuracy:
  enabled: false
speculative:
  decoding_type: {kind}
  speculative_model: {draft}
{extra}"""


def _problems(tmp_path, model, draft, algo="int4_awq", kind="draft_tokens_external", extra=""):
    p = tmp_path / "r.yaml"
    p.write_text(BASE.format(model=model, draft=draft, algo=algo, kind=kind, extra=extra))
    r = load_recipe(p, check_rules=False)
    return r, [f"{x.key}: {x.message}" for x in check_recipe(r) if x.key == KEY]


def _draft_copy(tmp_path, stories_dir, name, **config):
    """stories260k's config and tokenizer (the rules read no weights) with ``config`` changed."""
    d = tmp_path / name
    d.mkdir()
    for f in stories_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, d / f.name)
    cfg = json.loads((stories_dir / "config.json").read_text())
    cfg.update(config)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_a_plain_draft_under_an_int4_recipe_is_quantized_with_it(tmp_path, stories_dir):
    r, found = _problems(tmp_path, stories_dir, stories_dir)
    assert found == [] and quantizes_draft(r)
    r, found = _problems(tmp_path, stories_dir, stories_dir, extra="  draft_quantization: none\n")
    assert found == [] and not quantizes_draft(r)
    r, found = _problems(tmp_path, stories_dir, stories_dir, algo="none")
    assert found == [] and not quantizes_draft(r)


def test_an_algorithm_named_quantizes_the_draft_of_an_unquantized_target(tmp_path, stories_dir):
    r, found = _problems(tmp_path, stories_dir, stories_dir, algo="none", extra="  draft_quantization: int4_awq\n")
    assert found == [] and quantizes_draft(r)
    assert draft_quant_recipe(r).quantization.algo == "int4_awq" and r.quantization.algo == "none"
    _, found = _problems(tmp_path, stories_dir, stories_dir, algo="none", extra="  draft_quantization: nvfp4\n")
    assert found == [
        f"{KEY}: nvfp4 is written only for target: llmapi; a draft engine takes recipe, none, stored, "
        "fp8, int8_sq, int8_wo, int4_wo, int4_awq, w4a8_awq"
    ]
    odd = _draft_copy(tmp_path, stories_dir, "odd", intermediate_size=171)
    _, found = _problems(tmp_path, stories_dir, odd, algo="none", extra="  draft_quantization: int4_awq\n")
    assert len(found) == 2 and found[0].startswith(f"{KEY}: int4_awq: int4_awq at tp=1: the draft's mlp.fc 171")


def test_a_draft_the_algorithm_cannot_take_is_one_line(tmp_path, stories_dir):
    """171 MLP rows: int4 packs row pairs, so the draft's mlp.fc / mlp.gate cannot be INT4 (the target's can)."""
    odd = _draft_copy(tmp_path, stories_dir, "odd", intermediate_size=171)
    _, found = _problems(tmp_path, stories_dir, odd)
    assert found == [
        f"{KEY}: recipe: int4_awq at tp=1: the draft's {n} 171 output rows per rank is odd (int4 packs row pairs); "
        f"add '*{n}' to quantization.exclude, change quantization.group_size, or use none"
        for n in ("mlp.fc", "mlp.gate")
    ]
    _, found = _problems(tmp_path, stories_dir, odd, extra="  draft_quantization: none\n")
    assert found == []


def test_a_pre_quantized_draft_is_not_quantized_twice(tmp_path, stories_dir):
    awq = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    pre = _draft_copy(tmp_path, stories_dir, "pre", quantization_config=awq)
    _, found = _problems(tmp_path, stories_dir, pre)
    assert len(found) == 1 and found[0].startswith(f"{KEY}: recipe: the draft {pre} is pre-quantized (awq AutoAWQ gemm")
    assert found[0].endswith(
        "cannot be quantized again with algo int4_awq / kv_cache none; use stored to serve its own format"
    )
    _, found = _problems(tmp_path, stories_dir, pre, extra="  draft_quantization: none\n")
    assert len(found) == 1 and "use stored to serve its own format" in found[0]
    for ok in ("  draft_quantization: stored\n", ""):  # stored; recipe when the recipe quantizes nothing
        _, found = _problems(tmp_path, stories_dir, pre, algo="none" if not ok else "int4_awq", extra=ok)
        assert found == []


def test_draft_quantization_only_where_a_draft_is_built(tmp_path, stories_dir):
    p = tmp_path / "r.yaml"
    text = BASE.format(model=stories_dir, draft=stories_dir, algo="none", kind="NGram", extra="")
    p.write_text(text.replace(f"  speculative_model: {stories_dir}\n", "  draft_quantization: none\n"))
    found = [f"{x.key}: {x.message}" for x in check_recipe(load_recipe(p, check_rules=False)) if x.key == KEY]
    assert found == [
        f"{KEY}: only decoding_type draft_tokens_external (target: engine) builds and quantizes a draft, not NGram: "
        "remove it"
    ]


def _mapping_problems(tmp_path, model, draft, mapping: str, algo="none"):
    p = tmp_path / "r.yaml"
    p.write_text(BASE.format(model=model, draft=draft, algo=algo, kind="draft_tokens_external", extra=mapping))
    r = load_recipe(p, check_rules=False)
    return r, [f"{x.key}: {x.message}" for x in check_recipe(r) if x.key.startswith(KEY)]


def test_a_mapping_quantizes_the_draft_with_its_own_settings(tmp_path, stories_dir):
    """The recipe's section with the mapping's keys replaced (calibration's one by one); the target keeps its own."""
    own = (
        "  draft_quantization:\n    algo: int4_awq\n    group_size: 32\n    exclude: ['*lm_head', '*mlp.proj']\n"
        "    calibration: {num_samples: 8, seq_len: 64}\n"
    )
    r, found = _mapping_problems(tmp_path, stories_dir, stories_dir, own)
    assert found == [] and quantizes_draft(r)
    q = draft_quant_recipe(r).quantization
    assert (q.algo, q.group_size, q.exclude) == ("int4_awq", 32, ["*lm_head", "*mlp.proj"])
    assert (q.calibration.num_samples, q.calibration.seq_len) == (8, 64)
    assert q.calibration.dataset == r.quantization.calibration.dataset  # the keys it does not name: the recipe's
    assert (r.quantization.algo, r.quantization.group_size, r.quantization.calibration.num_samples) == ("none", 64, 64)


def test_a_mapping_with_an_unknown_key_or_a_bad_value_is_one_line(tmp_path, stories_dir):
    keys = "algo, kv_cache, group_size, smoothquant_alpha, exclude, calibration"
    _, found = _mapping_problems(
        tmp_path, stories_dir, stories_dir, "  draft_quantization: {algo: int4_awq, group: 32}\n"
    )
    assert len(found) == 1 and found[0].startswith(
        f"{KEY}: unknown key group: a mapping takes the quantization section's keys ({keys}; calibration's: dataset"
    )
    _, found = _mapping_problems(
        tmp_path, stories_dir, stories_dir, "  draft_quantization: {algo: int4_awq, calibration: {samples: 8}}\n"
    )
    assert len(found) == 1 and found[0].startswith(f"{KEY}: unknown key calibration.samples: ")
    _, found = _mapping_problems(
        tmp_path, stories_dir, stories_dir, "  draft_quantization: {algo: int4_awq, group_size: 7}\n"
    )
    assert found == [f"{KEY}.group_size: Input should be 32, 64, 128 or 256"]
    # its own settings go through the same rules as an algorithm's: the draft's 172-wide mlp.proj and group 64
    _, found = _mapping_problems(
        tmp_path, stories_dir, stories_dir, "  draft_quantization: {algo: int4_awq, exclude: ['*lm_head']}\n"
    )
    assert len(found) == 1
    assert found[0].endswith(f"add '*mlp.proj' to {KEY}.exclude, change {KEY}.group_size, or use none")
