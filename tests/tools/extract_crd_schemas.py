"""Extract the served versions' openAPIV3Schema of upstream CRD files into tests/data/crds/ (descriptions dropped).

Usage: python tests/tools/extract_crd_schemas.py CRD.yaml [CRD.yaml ...]
Each output is <group>_<plural>_<version>.json; tests/data/crds/SOURCES.md records where each file came from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[2] / "tests" / "data" / "crds"


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main(paths: list[str]) -> None:
    for path in paths:
        crd = yaml.safe_load(Path(path).read_text())
        spec = crd["spec"]
        for version in spec["versions"]:
            if not version.get("served"):
                continue
            out = OUT / f"{spec['group']}_{spec['names']['plural']}_{version['name']}.json"
            out.write_text(json.dumps(strip(version["schema"]["openAPIV3Schema"]), sort_keys=True) + "\n")
            print(out)


if __name__ == "__main__":
    main(sys.argv[1:])
