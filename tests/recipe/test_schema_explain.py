"""`trtpipe schema` is a JSON Schema that accepts the example recipes and rejects bad ones;
`trtpipe explain` shows every setting, marks every default, and round-trips to the loaded recipe."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from recipe_helpers import RECIPES, run_cli

from pydantic import BaseModel

from trtpipe.recipe import Recipe
from trtpipe.app.validation import load_recipe

JSON_TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}


@pytest.fixture(scope="module")
def schema() -> dict:
    result = run_cli("schema")
    assert result.exit_code == 0
    return json.loads(result.stdout)


def _resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        assert node["$ref"].startswith("#/$defs/"), node["$ref"]
        node = schema["$defs"][node["$ref"].split("/")[-1]]
    return node


def _errors(schema: dict, node: dict, value, where: str = "") -> list[str]:
    """A small JSON Schema checker for the keywords pydantic emits (jsonschema is not a dependency)."""
    node = _resolve(schema, node)
    if "anyOf" in node:
        options = [_errors(schema, option, value, where) for option in node["anyOf"]]
        return [] if any(not o for o in options) else min(options, key=len)
    kind = node.get("type")
    checks = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if kind == "integer" and not (isinstance(value, int) and not isinstance(value, bool)):
        return [f"{where}: not an integer"]
    if kind == "number" and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return [f"{where}: not a number"]
    if kind in checks and not isinstance(value, checks[kind]):
        return [f"{where}: not {kind}"]
    if "enum" in node and value not in node["enum"]:
        return [f"{where}: not in {node['enum']}"]
    if "const" in node and value != node["const"]:
        return [f"{where}: not {node['const']}"]
    out = []
    for key, test in (
        ("minimum", lambda v, b: v >= b),
        ("maximum", lambda v, b: v <= b),
        ("exclusiveMinimum", lambda v, b: v > b),
        ("exclusiveMaximum", lambda v, b: v < b),
    ):
        if key in node and not test(value, node[key]):
            out.append(f"{where}: {key} {node[key]}")
    if "pattern" in node and not re.search(node["pattern"], value):
        out.append(f"{where}: pattern")
    if kind == "object":
        props = node.get("properties", {})
        out += [f"{where}.{k}: required" for k in node.get("required", []) if k not in value]
        for k, v in value.items():
            if k in props:
                out += _errors(schema, props[k], v, f"{where}.{k}")
            elif node.get("additionalProperties") is False:
                out.append(f"{where}.{k}: additional property")
            elif isinstance(node.get("additionalProperties"), dict):
                out += _errors(schema, node["additionalProperties"], v, f"{where}.{k}")
    if kind == "array" and "items" in node:
        for i, item in enumerate(value):
            out += _errors(schema, node["items"], item, f"{where}.{i}")
    return out


def _walk(schema: dict, node, seen=None):
    """Every sub-schema, following $refs once."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(schema, v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(schema, v)


def test_schema_is_well_formed(schema):
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert set(schema["required"]) == {"name", "model"}
    for node in _walk(schema, schema):
        if "$ref" in node:
            _resolve(schema, node)  # every reference resolves
        if "type" in node:
            assert node["type"] in JSON_TYPES
        if node.get("type") == "object" and "properties" in node:
            assert node["additionalProperties"] is False  # unknown keys are errors in editors too


def test_schema_covers_every_field(schema):
    def fields(model, node):
        node = _resolve(schema, node)
        assert set(node["properties"]) == set(model.model_fields), model.__name__
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                prop = node["properties"][name]
                fields(sub, prop["anyOf"][0] if "anyOf" in prop else prop)

    fields(Recipe, schema)
    engine = _resolve(schema, schema["properties"]["engine"])
    assert _resolve(schema, engine["properties"]["kv_cache"])["properties"]["tokens_per_block"]["default"] == 32
    quant = _resolve(schema, schema["properties"]["quantization"])
    assert quant["properties"]["algo"]["enum"] == [
        "none",
        "fp8",
        "fp8_pc_pt",
        "int8_sq",
        "int8_wo",
        "int4_wo",
        "int4_awq",
        "w4a8_awq",
        "nvfp4",
    ]
    assert quant["properties"]["group_size"]["enum"] == [32, 64, 128, 256]


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_schema_accepts_the_examples(schema, path):
    assert _errors(schema, schema, yaml.safe_load(path.read_text())) == []


def test_schema_accepts_shorthands_and_rejects_what_the_loader_rejects(schema):
    ok = {
        "name": "t",
        "model": {"source": "m"},
        "engine": {"plugins": "fp8-hopper"},
        "quantization": {"exclude": "*lm_head"},
    }
    assert _errors(schema, schema, ok) == []
    for bad in [
        {"name": "t"},
        {"name": "t", "model": {"source": "m"}, "paralel": {}},
        {"name": "t", "model": {"source": "m"}, "parallel": {"tp": 0}},
        {"name": "t", "model": {"source": "m"}, "quantization": {"algo": "int3"}},
        {"name": "t", "model": {"source": "m"}, "engine": {"max_batch_size": "8"}},
        {"name": "bad name", "model": {"source": "m"}},
    ]:
        assert _errors(schema, schema, bad), bad


def _leaves(data: dict, prefix: str = ""):
    for k, v in data.items():
        if isinstance(v, dict) and v and prefix + k != "engine.plugins.overrides":
            yield from _leaves(v, prefix + k + ".")
        else:
            yield prefix + k, v


@pytest.mark.parametrize("name", ["stories-fp8", "stories-tp2", "llama70b-fp8"])
def test_explain_shows_and_marks_every_default(name):
    path = RECIPES / f"{name}.yaml"
    result = run_cli("explain", str(path))
    assert result.exit_code == 0, result.stderr
    recipe = load_recipe(path)
    assert yaml.safe_load(result.stdout) == recipe.model_dump(mode="json")  # every setting, comments aside
    written = yaml.safe_load(path.read_text())
    lines = result.stdout.splitlines()
    for dotted, _ in _leaves(recipe.model_dump(mode="json")):
        node = written
        for part in dotted.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        key = dotted.split(".")[-1]
        matching = [ln for ln in lines if ln.strip().startswith(f"{key}:")]
        assert matching, dotted
        if node is KeyError:
            assert any("# default" in ln for ln in matching), dotted
        else:
            assert any("# default" not in ln for ln in matching), dotted


def test_explain_notes_overrides_and_deduced_values():
    result = run_cli(
        "explain", str(RECIPES / "stories-fp16.yaml"), "--set", "parallel.tp=2", "--set", "engine.max_seq_len=null"
    )
    assert result.exit_code == 0, result.stderr
    assert "  tp: 2  # --set\n" in result.stdout
    assert "  max_seq_len: null  # --set; deduced from the model: 512\n" in result.stdout
    as_json = run_cli("explain", "--json", str(RECIPES / "stories-fp16.yaml"))
    assert json.loads(as_json.stdout) == load_recipe(RECIPES / "stories-fp16.yaml").model_dump(mode="json")


def test_explain_of_a_bad_recipe_exits_2(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: t\nmodel:\n  source: nowhere\n")
    result = run_cli("explain", str(path))
    assert result.exit_code == 2
    assert result.stderr.startswith(f"{path}:3:11: model.source: model directory not found: ")


def test_recipes_readme_reference_is_current():
    text = (RECIPES / "README.md").read_text()
    block = text.split("<!-- reference: begin -->\n", 1)[1].split("<!-- reference: end -->", 1)[0]
    assert block == run_cli("schema", "--markdown").stdout, "regenerate with: trtpipe schema --markdown"
