"""The model facts the cost model works from (trtpipe/perf/models.py): each published model's parsed parameter counts
agree with its model card's headline figures, and the config.json files the recipes ship (recipes/configs/, one per
Hugging Face repository) give the very shapes the published table holds for that repository -- one set of facts."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from trtpipe.perf.models import CARD_PARAMS_B, PUBLISHED, facts, facts_table, published_spec, spec_of

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "configs"


@pytest.mark.parametrize("name", sorted(CARD_PARAMS_B))
def test_parsed_parameters_match_the_model_card(name):
    total_b, active_b, counts_embedding = CARD_PARAMS_B[name]
    spec = published_spec(name)
    active = spec.active_params - (0 if counts_embedding else spec.vocab * spec.hidden)
    # model cards round to 2-3 significant digits (Scout's 109B also counts its vision encoder): 3 %
    assert spec.total_params / 1e9 == pytest.approx(total_b, rel=0.03)
    assert active / 1e9 == pytest.approx(active_b, rel=0.03)


def test_facts_name_the_routing_and_layer_types():
    f = facts(published_spec("DeepSeek R1 0528"))
    assert (f["experts"], f["top_k"], f["shared_experts"], f["attention"]) == (256, 8, 1, "MLA (latent KV)")
    assert f["layers"] == "3 x dense + 58 x MoE"
    g = facts(published_spec("GPT-OSS 120B"))
    assert g["layers"] == "18 x MoE (sliding window 128) + 18 x MoE" and g["mxfp4_experts"]
    # MoE every 2nd layer, no-RoPE (global attention) every 4th, the RoPE layers chunked (attention_chunk_size)
    assert facts(published_spec("Llama 4 Maverick 17B-128E"))["layers"] == (
        "12 x MoE (chunked attention 8192) + 12 x MoE + 24 x dense (chunked attention 8192)"
    )
    assert facts(published_spec("Llama 4 Scout"))["layers"] == "36 x MoE (chunked attention 8192) + 12 x MoE"
    assert len(facts_table().splitlines()) == len(PUBLISHED) + 2


def _shipped_configs() -> list[tuple[str, str]]:
    """(dir, Hugging Face repository) from recipes/configs/README.md's table."""
    text = (CONFIGS / "README.md").read_text()
    return re.findall(r"^\| `([\w.-]+)/` \| ([\w.-]+/[\w.-]+) \|", text, re.M)


def test_shipped_recipe_configs_agree_with_the_published_facts():
    by_repo = {repo: name for name, (repo, _) in PUBLISHED.items()}
    checked = 0
    for d, repo in _shipped_configs():
        if repo not in by_repo:
            continue
        cfg = json.loads((CONFIGS / d / "config.json").read_text())
        name = by_repo[repo]
        assert replace(spec_of(cfg, name), name=name) == published_spec(name), d
        checked += 1
    assert checked >= 3, "the Llama 3 8B, Llama 3.1 70B and Mixtral configs are shipped"
