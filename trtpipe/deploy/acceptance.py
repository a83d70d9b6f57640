"""The speculative-decoding acceptance drift rules: a recording rule for the draft acceptance rate over the short
and the baseline window, and a warning when the first falls under ``deploy.acceptance_drift_alert`` times the
second (the drafts a workload accepts changed: a new traffic mix, a drifted draft, a tokenizer mismatch; a recurring
2026 complaint, vllm-project/vllm#41838).

Only for a recipe with ``speculative:`` on a server that exports acceptance counters
(:class:`trtpipe.deploy.metrics.ServerMetrics` ``spec_drafts`` / ``spec_accepted``). An idle server has no drafts
in the window: the ratio is 0/0 = NaN, and a comparison with NaN is false, so it does not fire.
"""

from __future__ import annotations

from trtpipe.deploy.metrics import ServerMetrics
from trtpipe.recipe.schema import Recipe

RATE = "trtpipe:spec_acceptance:ratio"
BASELINE = "trtpipe:spec_acceptance:ratio_baseline"


def applies(recipe: Recipe, m: ServerMetrics) -> bool:
    return recipe.speculative.enabled and m.spec_drafts is not None and m.spec_accepted is not None


def _ratio(m: ServerMetrics, sel: dict[str, str], window: str) -> str:
    accepted, drafts = m.spec_accepted % sel, m.spec_drafts % sel
    return f"sum by (job) (rate({accepted}[{window}])) / sum by (job) (rate({drafts}[{window}]))"


def recording_rules(m: ServerMetrics, sel: dict[str, str], window: str, baseline: str) -> list[dict]:
    return [{"record": RATE, "expr": _ratio(m, sel, window)}, {"record": BASELINE, "expr": _ratio(m, sel, baseline)}]


def alert_rule(recipe: Recipe, baseline: str, for_: str) -> dict:
    drift = recipe.deploy.acceptance_drift_alert
    return {
        "alert": "SpeculativeAcceptanceDrift",
        "expr": f"{RATE} < {drift:g} * {BASELINE}",
        "for": for_,
        "labels": {"recipe": recipe.name, "severity": "warning"},
        "annotations": {
            "summary": f"draft acceptance {{{{ $value | humanizePercentage }}}}, under {drift:g} x its rate over "
            f"{baseline} ({{{{ $labels.job }}}}): check the draft and the traffic"
        },
    }
