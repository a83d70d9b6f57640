"""Run a build: plan every stage's key, skip what is cached, run the rest in order, write the manifest.

Read top to bottom, :func:`run_build` is: lock the work dir, clean what killed builds left, plan, check the
selection (``--from``/``--until``/``--force``), then for each stage either reuse its artifact or run it into a
temporary folder that :class:`~trtpipe.pipeline.cache.ArtifactStore` seals and renames into place. The
manifest is written whatever happens (ok, failed, interrupted).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

from rich.console import Console
from rich.markup import escape

from trtpipe.errors import StageError, TrtpipeError
from trtpipe.pipeline.cache import ArtifactStore, WorkDirLock, sha256_file
from trtpipe.pipeline.keys import stage_key
from trtpipe.pipeline.logs import BuildLogs, new_build_id, timestamp
from trtpipe.pipeline.manifest import MANIFEST_FORMAT, summary, write_manifest
from trtpipe.pipeline.measure import PeakRss
from trtpipe.pipeline.stage import Stage, StageContext
from trtpipe.pipeline.versions import collect_versions
from trtpipe.recipe.schema import Recipe

logger = logging.getLogger(__name__)


class StageSelectionError(TrtpipeError):
    """``--force``/``--from``/``--until`` name a stage that does not exist or cannot be selected."""

    exit_code = 2


@dataclass
class StagePlan:
    """One stage of a planned build (before anything runs)."""

    name: str
    stage: Optional[Stage]  # None when its module is not available
    runnable: bool = False  # available, enabled, and every input it reads is available
    reason: str = ""  # why it is not runnable
    disabled: bool = False  # enabled(recipe) is False: skipped, and absent from later stages' inputs
    key: Optional[str] = None
    material: Optional[dict] = None
    cached: bool = False


@dataclass
class BuildResult:
    manifest: dict
    manifest_path: Path

    @property
    def status(self) -> str:
        return self.manifest["status"]

    def stage(self, name: str) -> dict:
        return next(s for s in self.manifest["stages"] if s["name"] == name)

    def artifact(self, name: str) -> Path:
        """The artifact folder of a stage this build ran or found cached."""
        entry = self.stage(name)
        if entry["status"] not in ("ran", "cached"):
            raise StageError(f"stage {name} has no artifact in this build ({entry.get('reason') or entry['status']})")
        return Path(self.manifest["work_dir"]) / entry["artifact"]

    def summary(self) -> dict:
        return summary(self.manifest)


# --- planning ------------------------------------------------------------------------------------


def _check_order(stages: Sequence[Stage]) -> None:
    seen: set[str] = set()
    for stage in stages:
        if stage.name in seen:
            raise ValueError(f"stage {stage.name!r} is listed twice")
        missing = [i for i in stage.inputs if i not in seen]
        if missing:
            raise ValueError(f"stage {stage.name!r} reads {missing}, which are not earlier stages")
        seen.add(stage.name)


def plan_build(recipe: Recipe, stages: Sequence[Stage]) -> list[StagePlan]:
    """Every stage's key and whether its artifact is complete, computed from the recipe and files only.

    Args:
        stages: the stages to build, in order (the application's table is ``trtpipe.app.stage_table``;
            the library does not import it, so tests and embedders pass their own).

    """
    _check_order(stages)
    store = ArtifactStore(recipe.work_path)
    plans: dict[str, StagePlan] = {}
    for stage in stages:
        name = stage.name
        plan = plans[name] = StagePlan(name, stage)
        if not stage.enabled(recipe):
            plan.reason, plan.disabled = "disabled by the recipe", True
            continue
        inputs = [plans[i] for i in stage.inputs]
        blocked = [i.name for i in inputs if not i.runnable and not i.disabled]
        if blocked:
            plan.reason = f"needs {', '.join(blocked)}, which cannot run"
            continue
        input_keys = {i.name: i.key for i in inputs if i.runnable}
        plan.key, plan.material = stage_key(stage, recipe, input_keys)
        plan.runnable = True
        plan.cached = store.marker(name, plan.key) is not None
    return list(plans.values())


def _index(plans: list[StagePlan], name: Optional[str], flag: str) -> Optional[int]:
    if name is None:
        return None
    names = [p.name for p in plans]
    if name not in names:
        raise StageSelectionError(f"{flag} {name}: no such stage (stages: {', '.join(names)})")
    plan = plans[names.index(name)]
    if plan.stage is None:
        raise StageSelectionError(f"{flag} {name}: stage {plan.reason}")
    return names.index(name)


def _selection(plans: list[StagePlan], force: Iterable[str], from_stage: Optional[str], until: Optional[str]):
    """``(first, last, forced names)`` of the stages this build may run."""
    first = _index(plans, from_stage, "--from") or 0
    last = _index(plans, until, "--until")
    last = len(plans) - 1 if last is None else last
    if first > last:
        raise StageSelectionError(f"--from {from_stage} comes after --until {until}")
    forced: set[str] = set()
    for name in force:
        if name == "all":
            forced.update(p.name for p in plans if p.runnable)
            continue
        plan = plans[_index(plans, name, "--force")]
        if not plan.runnable:
            raise StageSelectionError(f"--force {name}: stage is {plan.reason}")
        forced.add(name)
    forced.update(p.name for p in plans[first : last + 1] if p.runnable and from_stage is not None)
    missing = [p.name for p in plans[:first] if p.runnable and not p.cached]
    if missing:
        raise StageSelectionError(
            f"--from {from_stage}: earlier stages are not built yet ({', '.join(missing)}); "
            f"run `trtpipe build RECIPE --until {missing[-1]}` first"
        )
    return first, last, forced


# --- running -------------------------------------------------------------------------------------


class _Reporter:
    """One line per stage on stderr (nothing when quiet)."""

    def __init__(self, quiet: bool):
        self.console = None if quiet else Console(stderr=True, highlight=False)

    def line(self, name: str, text: str) -> None:
        if self.console is not None:
            self.console.print(f"[bold]{name:<11}[/bold] {text}", soft_wrap=True)


def _one_line(exc: BaseException) -> str:
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text if isinstance(exc, TrtpipeError) else f"{type(exc).__name__}: {text}"


_NO_SPACE = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EFBIG: "file size limit reached"}


def _out_of_space(exc: BaseException, tmp: Path) -> Optional[str]:
    """'disk full writing PATH (...)' when a stage ran out of space, naming the file it was writing.

    A failed ``write()`` carries no file name, so the file is the newest one in the stage's temporary folder
    (the artifact is discarded either way: nothing half-written is kept).
    """
    code = getattr(exc, "errno", None)
    text = str(exc)
    if code not in _NO_SPACE:
        code = next((c for c in _NO_SPACE if os.strerror(c) in text), None)
        if code is None:
            return None
    path = getattr(exc, "filename", None)
    if not path:
        files = [p for p in tmp.rglob("*") if p.is_file()] if tmp.exists() else []
        path = max(files, key=lambda p: p.stat().st_mtime_ns) if files else tmp
    return f"{_NO_SPACE[code]} writing {path} ({os.strerror(code)}): free space and build again"


def _json_data(info: dict) -> dict:
    return json.loads(json.dumps(info, default=str))


def _rel(path: Path, base: Path) -> str:
    return path.relative_to(base).as_posix()


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"


@dataclass
class _Build:
    """State of one build while it runs."""

    recipe: Recipe
    store: ArtifactStore
    logs: BuildLogs
    build_id: str
    quiet: bool
    report: _Reporter
    entries: list[dict] = field(default_factory=list)

    def run_stage(self, plan: StagePlan, inputs: dict[str, Path]) -> dict:
        """Run one stage into a temporary folder and seal it; return its manifest entry."""
        entry = {"log": _rel(self.logs.stage_log(plan.name), self.store.work_dir)}
        self.report.line(plan.name, f"running (key {plan.key}) ...")
        started = time.perf_counter()
        try:
            tmp = self.store.begin(plan.name, plan.key)
            with PeakRss() as peak, self.logs.capture_stage(plan.name) as log:
                marker, error = self._run_and_seal(plan, tmp, inputs, log)
        except BaseException:  # interrupted (Ctrl-C), even inside begin(): leave nothing that looks like output
            self.store.discard_mine(plan.name, plan.key)
            raise
        entry.update(
            wall_s=round(time.perf_counter() - started, 3),
            peak_rss_bytes=peak.total_bytes,
            peak_rss_self_bytes=peak.self_bytes,
            peak_rss_children_bytes=peak.children_bytes,
        )
        if error is not None:
            message = _out_of_space(error, tmp) or _one_line(error)  # before discard: it names the file
            self.store.discard(tmp)
            entry.update(status="failed", error=message)
            self.report.line(plan.name, f"[red]failed[/red] after {entry['wall_s']:.1f} s: {escape(entry['error'])}")
            return entry
        entry.update(status="ran", info=marker["info"], files=marker["files"])
        self.report.line(plan.name, f"[green]ran[/green] in {entry['wall_s']:.1f} s, peak RSS {_gb(peak.total_bytes)}")
        return entry

    def _run_and_seal(self, plan: StagePlan, tmp: Path, inputs: dict[str, Path], log: logging.Logger):
        """``(marker, None)`` when the stage ran and its artifact is in place, else ``(None, exception)``."""
        ctx = StageContext(self.recipe, tmp, inputs, log, self.store.work_dir, quiet=self.quiet)
        log.info("stage %s, key %s, inputs %s", plan.name, plan.key, {k: str(v) for k, v in inputs.items()})
        try:
            plan.stage.run(ctx)
            sealed = {
                "material": plan.material,
                "info": _json_data(ctx.info),
                "build_id": self.build_id,
                "created": timestamp(),
            }
            return self.store.commit(tmp, plan.name, plan.key, sealed), None
        except Exception as exc:  # bad input, a bug, or a failed seal: all become a one-line StageError
            log.exception("stage %s failed", plan.name)
            return None, exc


def run_build(
    recipe: Recipe,
    stages: Sequence[Stage],
    force: Iterable[str] = (),
    from_stage: Optional[str] = None,
    until: Optional[str] = None,
    quiet: bool = False,
    overrides: Sequence[str] = (),
) -> BuildResult:
    """Build ``recipe``: run every stage whose artifact is not cached, then write the manifest.

    Args:
        stages: the stages, in order (the application passes ``trtpipe.app.stage_table.STAGES``).
        force: stage names to rerun even when cached (``"all"`` for every stage).
        from_stage: rerun this stage and every later one; earlier stages must be cached.
        until: stop after this stage.
        quiet: no progress output on stderr (``--json``).
        overrides: the ``--set`` overrides the recipe was loaded with (recorded in the manifest).

    Raises:
        StageError: a stage failed (names the stage and its log). ``exc.result`` holds the BuildResult.
        StageSelectionError: bad ``--force``/``--from``/``--until``.
        BuildLockedError: another build holds this work dir.
    """
    work_dir = recipe.work_path
    store = ArtifactStore(work_dir)
    build_id = new_build_id()
    started_at, started = timestamp(), time.perf_counter()
    with WorkDirLock(work_dir):
        cleaned = store.clean_stale()
        plans = plan_build(recipe, stages)
        first, last, forced = _selection(plans, force, from_stage, until)
        with BuildLogs(work_dir, build_id) as logs:
            for action in cleaned:
                logger.info("%s", action)
            build = _Build(recipe, store, logs, build_id, quiet, _Reporter(quiet))
            manifest = _manifest_head(recipe, work_dir, build_id, started_at, overrides, force, from_stage, until)
            manifest.update(versions=collect_versions(), cleaned=cleaned)
            status, failure = "interrupted", None
            try:
                failure = _run_stages(build, plans, first, last, forced)
                status = "failed" if failure else "ok"
            finally:
                for entry in build.entries:
                    entry.setdefault("status", "interrupted")
                manifest.update(
                    status=status,
                    error=failure.args[0] if failure else None,
                    finished=timestamp(),
                    wall_s=round(time.perf_counter() - started, 3),
                    peak_rss_bytes=max((e.get("peak_rss_bytes", 0) for e in build.entries), default=0),
                    stages=build.entries,
                )
                path = write_manifest(work_dir, manifest)
                logger.info("build %s %s; manifest %s", build_id, status, path)
    result = BuildResult(manifest, path)
    if failure is not None:
        failure.result = result
        raise failure
    return result


def _run_stages(build: _Build, plans: list[StagePlan], first: int, last: int, forced: set[str]) -> Optional[StageError]:
    """Walk the plan; append one manifest entry per stage; return the StageError of a failed stage."""
    failed: Optional[str] = None
    failure: Optional[StageError] = None
    work_dir = build.store.work_dir
    for i, plan in enumerate(plans):
        entry: dict = {"name": plan.name, "key": plan.key}
        build.entries.append(entry)
        if plan.key is not None:
            entry["artifact"] = _rel(build.store.path(plan.name, plan.key), work_dir)
        if not plan.runnable:
            entry.update(status="skipped", reason=plan.reason)
            build.report.line(plan.name, f"[dim]skipped: {escape(plan.reason)}[/dim]")
            continue
        if failed is not None or i > last:
            reason = f"{failed} failed" if failed else f"after --until {plans[last].name}"
            entry.update(status="skipped", reason=reason, cached=build.store.marker(plan.name, plan.key) is not None)
            build.report.line(plan.name, f"[dim]skipped: {escape(reason)}[/dim]")
            continue
        marker = build.store.marker(plan.name, plan.key)
        if marker is not None and plan.name not in forced:
            entry.update(
                status="cached", info=marker.get("info", {}), built_by=marker.get("build_id"), files=marker["files"]
            )
            build.report.line(plan.name, f"cached ({plan.key})")
            continue
        inputs = {n: build.store.path(n, _plan(plans, n).key) for n in plan.stage.inputs if _plan(plans, n).runnable}
        entry.update(build.run_stage(plan, inputs))
        if entry["status"] == "failed":
            failed = plan.name
            failure = StageError(f"stage {plan.name} failed: {entry['error']} (log: {work_dir / entry['log']})")
    return failure


def _plan(plans: list[StagePlan], name: str) -> StagePlan:
    return next(p for p in plans if p.name == name)


def _manifest_head(recipe, work_dir, build_id, started_at, overrides, force, from_stage, until) -> dict:
    path = recipe.path
    text = path.read_text(encoding="utf-8") if path is not None and path.is_file() else None
    return {
        "format": MANIFEST_FORMAT,
        "build_id": build_id,
        "status": "running",
        "started": started_at,
        "work_dir": str(work_dir),
        "manifest": str(work_dir / "manifest.json"),
        "log": f"logs/{build_id}/build.log",
        "recipe_path": str(path) if path is not None else None,
        "recipe": {
            "text": text,
            "sha256": sha256_file(path) if text is not None else None,
            "overrides": list(overrides),
        },
        "resolved": recipe.model_dump(mode="json"),
        "selection": {"force": list(force), "from": from_stage, "until": until},
    }


def build_status(recipe: Recipe, stages: Sequence[Stage], verify: bool = False) -> dict:
    """What a build of ``recipe`` would do now, and what the last build recorded (``trtpipe status``).

    Args:
        verify: also re-hash every file the work dir's ``manifest.json`` lists (see ``verify_manifest``).
    """
    from trtpipe.pipeline.manifest import MANIFEST_NAME, ManifestError, load_manifest, verify_manifest

    work_dir = recipe.work_path
    store = ArtifactStore(work_dir)
    plans = plan_build(recipe, stages)
    rows = []
    for plan in plans:
        state = ("cached" if plan.cached else "to build") if plan.runnable else "skipped"
        row = {"name": plan.name, "state": state, "key": plan.key, "reason": plan.reason or None}
        if plan.key is not None:
            row["artifact"] = _rel(store.path(plan.name, plan.key), work_dir)
        row["other_keys"] = [k for k in store.keys(plan.name) if k != plan.key]
        rows.append(row)
    out: dict = {"work_dir": str(work_dir), "stages": rows, "last_build": None}
    manifest_path = work_dir / MANIFEST_NAME
    try:
        last = load_manifest(manifest_path)
        out["last_build"] = {k: last.get(k) for k in ("build_id", "status", "finished", "error")}
    except ManifestError:
        last = None
    if verify:
        out["verify"] = [str(m) for m in verify_manifest(manifest_path)]  # no manifest: ManifestError
    return out


def collect_garbage(recipe: Recipe, stages: Sequence[Stage], delete: bool = False) -> dict:
    """Artifacts of ``recipe``'s work dir that neither its current keys nor the last manifest use.

    A 70B build leaves a few hundred GB per key, and every changed setting makes new keys, so old ones pile up.
    Kept: every artifact the recipe (with its overrides) would use now, and every artifact the last build's
    manifest names (a server may be serving it). Leftovers of killed builds are always removed. Nothing is
    deleted unless ``delete`` is true; the result lists each folder and its size either way.
    """
    from trtpipe.pipeline.manifest import MANIFEST_NAME, ManifestError, load_manifest

    work_dir = recipe.work_path
    store = ArtifactStore(work_dir)
    plans = plan_build(recipe, stages)
    keep = {(p.name, p.key) for p in plans if p.key is not None}
    try:
        last = load_manifest(work_dir / MANIFEST_NAME)
        keep |= {(s["name"], s["key"]) for s in last["stages"] if s.get("key")}
    except ManifestError:
        pass
    unused = []
    if store.root.is_dir():
        for stage_dir in sorted(p for p in store.root.iterdir() if p.is_dir()):
            for folder in sorted(p for p in stage_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
                if (stage_dir.name, folder.name) not in keep:
                    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
                    unused.append({"artifact": _rel(folder, work_dir), "bytes": size})
    out = {
        "work_dir": str(work_dir),
        "unused": unused,
        "bytes": sum(u["bytes"] for u in unused),
        "deleted": False,
        "kept": sorted(f"{stage}/{key}" for stage, key in keep),
    }
    if delete:
        with WorkDirLock(work_dir):  # no build may be writing (or reading inputs) while folders go away
            out["stale"] = store.clean_stale()
            for u in unused:
                shutil.rmtree(work_dir / u["artifact"])
        out["deleted"] = True
    return out


def render_status(report: dict) -> str:
    """``trtpipe status``'s table: one line per stage (state, artifact or reason), the last build, mismatches."""
    lines = [f"{row['name']:<11} {row['state']:<9} {row.get('artifact') or row['reason']}" for row in report["stages"]]
    last = report["last_build"]
    lines.append(f"last build: {last['build_id']} {last['status']}" if last else "last build: none")
    lines += [f"mismatch: {problem}" for problem in report.get("verify") or []]
    return "\n".join(lines)


def render_garbage(report: dict, delete: bool) -> str:
    """``trtpipe gc``'s lines: each unused (or deleted) artifact and its size, then the total."""
    verb = "deleted" if report["deleted"] else "unused"
    lines = [f"{verb:<8} {u['artifact']}  {u['bytes'] / 2**30:.2f} GiB" for u in report["unused"]]
    total = f"{len(report['unused'])} artifacts, {report['bytes'] / 2**30:.2f} GiB"
    lines.append(
        f"{verb} {total}" + ("" if delete or not report["unused"] else " (trtpipe gc RECIPE --delete frees them)")
    )
    return "\n".join(lines)
