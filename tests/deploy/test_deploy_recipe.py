"""The recipe's deploy section: defaults that validate, and one line at `validate` for each thing that cannot hold."""

from __future__ import annotations

import pytest
from deploy_helpers import MULTI_NODE, ONE_NODE, run_cli

from trtpipe.deploy.layout import Layout, layout_of, node_selector, slo_targets
from trtpipe.app.validation import load_recipe


def test_shipped_recipes_lay_out_on_one_node_and_on_two():
    one, multi = load_recipe(ONE_NODE), load_recipe(MULTI_NODE)
    assert layout_of(one) == Layout(world=4, gpus_per_pod=4, pods=1)
    assert layout_of(multi) == Layout(world=16, gpus_per_pod=8, pods=2) and layout_of(multi).multinode
    assert node_selector(one) == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert slo_targets(one) == {"ttft": (0.99, 2.0), "itl": (0.99, 0.1)}  # the defaults
    assert slo_targets(multi) == {"ttft": (0.99, 3.0), "itl": (0.99, 0.15)}


@pytest.mark.parametrize(
    "override, expected",
    [
        ("deploy.replicas.min=5", "deploy.replicas: replicas.min 5 exceeds replicas.max 2"),
        (
            "deploy.gpus_per_node=6",
            "deploy.gpus_per_node: 16 ranks (tp*pp) need more than one node but do not fill nodes of 6 GPUs evenly",
        ),
        (
            "engine.gpu=b300-288gb",
            "engine.gpu: b300-288gb has no known nvidia.com/gpu.product node label; set deploy.node_labels",
        ),
        (
            "deploy.slo=itl_p99=5ms",
            "deploy.slo: itl p99 5 ms cannot hold: one decode step reads 2 pp stage(s) of "
            "weights at 3350 GB/s, at least 16.",
        ),  # ~400e9 FP8 linear bytes / tp 8 + BF16 embeddings: ~54.7 GB
        ("deploy.slo=ttft:200ms", "deploy.slo: 'ttft' bounds every request; alerts watch a percentile"),
        ("deploy.slo=tpot_p99=1s", "deploy.slo: cannot read 'tpot_p99=1s'"),
        ("deploy.replicas.min=0", "deploy.replicas.min: must be ≥ 1 (got 0)"),
        ("deploy.kv_cache_alert=1.5", "deploy.kv_cache_alert: must be ≤ 1.0 (got 1.5)"),
    ],
)
def test_validate_refuses_a_deploy_section_that_cannot_hold_in_one_line(override, expected):
    result = run_cli("validate", str(MULTI_NODE), "--set", override)
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert expected in lines[0], lines[0]
    assert lines[0].startswith(str(MULTI_NODE)), lines[0]


def test_a_gpu_without_a_label_validates_once_the_recipe_names_the_label():
    result = run_cli(
        "validate",
        str(ONE_NODE),
        "--set",
        "engine.gpu=b300-288gb",
        "--set",
        "deploy.node_labels={nvidia.com/gpu.product: NVIDIA-B300}",
    )
    assert result.exit_code == 0, result.stderr


def test_llmapi_nodes_that_need_more_gpus_per_node_than_there_are(tmp_path):
    result = run_cli("validate", str(MULTI_NODE), "--set", "target=llmapi", "--set", "llmapi.nodes=1")
    assert result.exit_code != 0
    assert "llmapi.nodes: 1 nodes need 16 GPUs each; deploy.gpus_per_node is 8" in result.stderr


def test_an_error_in_the_file_names_its_line(tmp_path):
    text = MULTI_NODE.read_text().replace("replicas: {min: 1, max: 2}", "replicas: {min: 3, max: 2}")
    path = MULTI_NODE.parent / f".tmp-{tmp_path.name}.yaml"  # beside the recipe: its relative paths resolve
    path.write_text(text)
    try:
        result = run_cli("validate", str(path))
    finally:
        path.unlink()
    line = next(i for i, t in enumerate(text.splitlines(), 1) if t.startswith("  replicas:"))
    assert result.stderr.startswith(f"{path}:{line}:"), result.stderr
