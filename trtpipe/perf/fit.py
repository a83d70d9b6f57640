"""Fitting the cost model's named efficiencies on published rows, and leave-one-GPU-out cross-validation.

Every row becomes a :class:`~trtpipe.perf.published.Case` once (the raw roofline terms do not depend on the
constants), so one evaluation of all rows is a few numpy operations. The loss is the mean soft-L1 of
log(pred / published) -- relative error, with known typos in the published tables (kept as published) unable
to dominate. The optimizer is a plain Nelder-Mead in log-parameter space from fixed starting constants: no
randomness, so the same data always gives the same constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from trtpipe.errors import TrtpipeError
from trtpipe.perf.cost import Constants, Terms, step_time
from trtpipe.perf.published import Case, published_value, row_case, to_published_unit
from trtpipe.jsonfile import load_json

CONSTANTS_FILE = Path(__file__).with_name("constants.json")
# bounds keep every efficiency physical (a fraction of peak) and overheads non-negative
BOUNDS = {
    "bw_eff": (0.2, 1.0),
    "kv_eff": (0.1, 1.0),
    "gemm_eff": (0.1, 1.0),
    "attn_eff": (0.05, 1.0),
    "link_eff": (0.05, 1.0),
    "seq_layer_us": (0.0, 20.0),
    "serial": (0.0, 1.0),
    "layer_us": (0.5, 200.0),
    "pp_bubble": (0.0, 1.0),
    "flop_drop": (0.0, 2.0),
    "expert_eff": (0.02, 1.0),
    "expert_drop": (0.0, 2.0),
    "copy_ns": (0.0, 1000.0),
}


@dataclass
class Compiled:
    rows: list[dict]
    ok: np.ndarray  # rows with a case
    numer: np.ndarray
    published: np.ndarray  # in the model's unit (total tok/s or ms)
    part_row: np.ndarray
    part_weight: np.ndarray
    terms: Terms  # arrays, one entry per part
    cases: list[Optional[Case]]
    errors: list[str]
    other_gb: float


def compile_rows(rows: Sequence[dict], other_gb: float = Constants.other_gb) -> Compiled:
    cases, errors = [], []
    for r in rows:
        try:
            cases.append(row_case(r, other_gb))
            errors.append("")
        except Exception as exc:  # a row the model cannot express stays unsupported, with the reason kept
            cases.append(None)
            errors.append(str(exc))
    ok = np.array([c is not None for c in cases], dtype=bool)  # bool even with no rows (a mask, not floats)
    pr, pw, ts = [], [], []
    for i, c in enumerate(cases):
        for w, t in c.parts if c else ():
            pr.append(i)
            pw.append(w)
            ts.append(t)
    arr = lambda name: np.array([getattr(t, name) for t in ts], dtype=float)  # noqa: E731
    terms = Terms(*(arr(n) for n in Terms.names()))
    numer = np.array([c.numer if c else 0.0 for c in cases])
    pub = np.array([published_value(r) if c else math.nan for r, c in zip(rows, cases)])
    return Compiled(list(rows), ok, numer, pub, np.array(pr, dtype=int), np.array(pw), terms, cases, errors, other_gb)


def predict(comp: Compiled, c: Constants) -> np.ndarray:
    """Predicted value per row in the model's unit (NaN where unsupported)."""
    t = step_time(comp.terms, c)
    total = np.bincount(comp.part_row, weights=comp.part_weight * t, minlength=len(comp.rows))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(comp.numer > 0, comp.numer / total, total * 1000.0)
    out[~comp.ok] = math.nan
    return out


def _to_vec(c: Constants, names: Sequence[str]) -> np.ndarray:
    return np.log([getattr(c, n) if getattr(c, n) > 0 else 1e-3 for n in names])


def _from_vec(x: np.ndarray, base: Constants, names: Sequence[str]) -> Constants:
    vals = {}
    for n, v in zip(names, x):
        lo, hi = BOUNDS[n]
        vals[n] = float(min(max(math.exp(min(max(v, -60.0), 60.0)), lo), hi))
    return replace(base, **vals)


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, iters: int = 600, step: float = 0.3) -> np.ndarray:
    """Deterministic Nelder-Mead (standard coefficients)."""
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(vals)
        simplex = [simplex[i] for i in order]
        vals = [vals[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        xr = centroid + (centroid - simplex[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = centroid + 2 * (centroid - simplex[-1])
            fe = f(xe)
            simplex[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(xc)
            if fc < vals[-1]:
                simplex[-1], vals[-1] = xc, fc
            else:
                simplex = [simplex[0] + 0.5 * (s - simplex[0]) for s in simplex]
                vals = [f(s) for s in simplex]
    return simplex[int(np.argmin(vals))]


def loss(comp: Compiled, mask: np.ndarray, c: Constants) -> float:
    pred = predict(comp, c)
    e = np.log(pred[mask] / comp.published[mask])
    e = e[np.isfinite(e)]
    return float(np.mean(2 * (np.sqrt(1 + (e / 0.3) ** 2) - 1))) if len(e) else 0.0


def fit(
    comp: Compiled, mask: np.ndarray, names: Sequence[str] = (), start: Constants = Constants(), rounds: int = 3
) -> Constants:
    names = list(names) or fitted_names("engine")
    c = start
    for _ in range(rounds):  # restarts shake Nelder-Mead out of a collapsed simplex
        x = nelder_mead(lambda v: loss(comp, mask, _from_vec(v, c, names)), _to_vec(c, names))
        c = _from_vec(x, c, names)
    return c


OTHER_GB_GRID = (2.0, 3.5, 5.0, 6.5, 8.0, 9.5, 11.0)


def fitted_names(fam: str) -> list[str]:
    """The constants a family's fit frees: all but ``other_gb`` (a grid), and the PyTorch-only ones for "pytorch"."""
    return [n for n in Constants.names() if n != "other_gb" and (fam == "pytorch" or n not in Constants.PYTORCH_ONLY)]


# where the PyTorch-only constants start (0 switches a term off, and a log-space search cannot leave 0)
PYTORCH_START = {"flop_drop": 0.05, "expert_eff": 0.5, "expert_drop": 0.05, "copy_ns": 1.0}


def fit_all(compiled: Sequence[Compiled], mask: np.ndarray, fam: str = "engine") -> tuple[Constants, Compiled]:
    """Fit the efficiencies for each memory reservation in the grid (one compilation each); keep the best."""
    best = None
    names = fitted_names(fam)
    extra = PYTORCH_START if fam == "pytorch" else {}
    for comp in compiled:
        c = fit(comp, mask, names, start=replace(Constants(), other_gb=comp.other_gb, **extra))
        score = loss(comp, mask, c)
        if best is None or score < best[0]:
            best = (score, c, comp)
    c, comp = best[1], best[2]
    rows = np.isin(comp.part_row, np.where(mask)[0])
    if not np.any(comp.terms.pp[rows] > 1):  # no pipeline-parallel rows: the data says nothing about the bubble
        c = replace(c, pp_bubble=Constants.pp_bubble)
    return c, comp


def abs_rel_errors(comp: Compiled, mask: np.ndarray, pred: np.ndarray) -> np.ndarray:
    e = np.abs(pred[mask] / comp.published[mask] - 1)
    return e[np.isfinite(e)]


def summary(e: np.ndarray) -> dict:
    if not len(e):
        return {"n": 0, "median": None, "p90": None}
    return {"n": int(len(e)), "median": float(np.median(e)), "p90": float(np.percentile(e, 90))}


def family(row: dict) -> str:
    """Which constant set a row is predicted with: the TensorRT engine runtime or the PyTorch backend."""
    return "pytorch" if row["backend"].startswith("pytorch:") else "engine"


def load_constants(path: Path = CONSTANTS_FILE) -> dict[str, Constants]:
    """The fitted constants per runtime family (scripts/fit_perf.py writes them)."""
    try:
        data = load_json(Path(path))
        return {k: Constants(**v) for k, v in data["constants"].items()}
    except FileNotFoundError:
        raise TrtpipeError(f"{path}: no fitted constants; run python scripts/fit_perf.py") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise TrtpipeError(f"{path}: not a constants file ({exc})") from None


def predict_rows(rows: Sequence[dict], constants: dict[str, Constants]) -> list[Optional[float]]:
    """Predicted value per row in the row's own published unit (None where unsupported)."""
    out: list[Optional[float]] = [None] * len(rows)
    for fam, c in constants.items():
        comp = compile_rows(rows, c.other_gb)
        pred = predict(comp, c)
        for i, r in enumerate(rows):
            if family(r) == fam and comp.ok[i] and math.isfinite(pred[i]):
                out[i] = to_published_unit(r, float(pred[i]))
    return out
