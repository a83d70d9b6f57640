"""``trtpipe deploy monitoring``: a Prometheus scrape config, the rule file and the Grafana dashboard for servers
run by hand (``trtpipe serve`` / ``trtllm-serve``), written all-or-nothing into one directory.

The scrape target is where the recipe's server listens (``triton.bind:triton.metrics_port`` for the engine
target, ``llmapi.host:llmapi.port`` for llmapi), or the ``targets`` given; the job name is the recipe name, and
the rules select that job.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import yaml

from trtpipe.checkpoint.writer import atomic_dir
from trtpipe.deploy.alerts import Timing, rule_file
from trtpipe.deploy.dashboard import dashboard
from trtpipe.deploy.metrics import BY_TARGET
from trtpipe.recipe.schema import Recipe

RULES, SCRAPE, DASHBOARD = "rules.yaml", "prometheus.yml", "dashboard.json"


def default_target(recipe: Recipe) -> str:
    if recipe.target == "llmapi":
        return f"{recipe.llmapi.host}:{recipe.llmapi.port}"
    t = recipe.triton
    return f"{t.bind}:{t.metrics_port or BY_TARGET['engine'].port}"


def scrape_config(recipe: Recipe, targets: Sequence[str], timing: Timing, rules_path: str = RULES) -> dict:
    interval = timing.interval
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [rules_path],
        "scrape_configs": [
            {
                "job_name": recipe.name,
                "metrics_path": BY_TARGET[recipe.target].path,
                "scrape_interval": interval,
                "static_configs": [{"targets": list(targets)}],
            }
        ],
    }


def dump_yaml(obj) -> str:
    return yaml.safe_dump(obj, sort_keys=False, width=1000, allow_unicode=True)


def write_monitoring(
    recipe: Recipe,
    out_dir: Path,
    targets: Optional[Sequence[str]] = None,
    timing: Optional[Timing] = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write the three files into ``out_dir`` (an existing non-empty directory is refused unless ``overwrite``)."""
    timing = timing or Timing(interval=f"{recipe.deploy.scrape_interval_s}s")
    files = {
        SCRAPE: dump_yaml(scrape_config(recipe, targets or [default_target(recipe)], timing)),
        RULES: dump_yaml(rule_file(recipe, recipe.name, timing)),
        DASHBOARD: json.dumps(dashboard(recipe, recipe.name), indent=2) + "\n",
    }
    return write_all(out_dir, files, overwrite)


def write_all(out_dir: Path, files: dict[str, str], overwrite: bool = False) -> list[Path]:
    """Write ``{relative path: text}`` into ``out_dir`` at once (a sibling temp dir renamed into place: nothing
    half-written is left on an error); an existing non-empty ``out_dir`` is refused unless ``overwrite``."""
    with atomic_dir(out_dir, overwrite) as tmp:
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
    return [Path(out_dir) / rel for rel in files]
