"""The build manifest: what was built, from what, with what, and the sha256 of every output file.

``<work_dir>/manifest.json`` is the latest build; ``<work_dir>/manifests/<build_id>.json`` keeps every build.
Both are written atomically. Artifact paths inside are relative to the work dir, so a work dir can be copied
to a serving machine and still be verified there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trtpipe.errors import TrtpipeError
from trtpipe.pipeline.cache import MARKER, atomic_write_json, sha256_file
from trtpipe.jsonfile import load_json

MANIFEST_FORMAT = 1
MANIFEST_NAME = "manifest.json"
HISTORY_DIR = "manifests"


class ManifestError(TrtpipeError):
    """A manifest that is missing or cannot be read."""


def write_manifest(work_dir: Path, manifest: dict) -> Path:
    """Write the history copy, then the latest ``manifest.json``; return the latter's path."""
    work_dir = Path(work_dir)
    atomic_write_json(work_dir / HISTORY_DIR / f"{manifest['build_id']}.json", manifest)
    atomic_write_json(work_dir / MANIFEST_NAME, manifest)
    return work_dir / MANIFEST_NAME


def load_manifest(path: Path) -> dict:
    path = Path(path)
    try:
        data = load_json(path, ManifestError)
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest (run `trtpipe build` first)") from None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: cannot read manifest: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or "stages" not in data:
        raise ManifestError(f"{path}: not a trtpipe manifest (format {MANIFEST_FORMAT})")
    return data


def summary(manifest: dict) -> dict:
    """The manifest without per-file hashes: what ``trtpipe build --json`` prints."""
    keep = ("build_id", "status", "error", "work_dir", "manifest", "recipe_path", "wall_s", "peak_rss_bytes")
    out = {k: manifest.get(k) for k in keep}
    out["stages"] = [{k: v for k, v in s.items() if k not in ("files", "material")} for s in manifest["stages"]]
    out["versions"] = manifest.get("versions", {})
    return out


@dataclass(frozen=True)
class Mismatch:
    path: str  # relative to the work dir
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


def _work_dir_of(path: Path, manifest: dict) -> Path:
    """The work dir a manifest describes: beside ``manifest.json``, above ``manifests/``, or as recorded."""
    for candidate in (path.parent, path.parent.parent, Path(manifest.get("work_dir", path.parent))):
        if (candidate / "artifacts").is_dir():
            return candidate
    return path.parent


def verify_manifest(path: Path, work_dir: Optional[Path] = None) -> list[Mismatch]:
    """Re-hash every output file a manifest lists; return what differs (empty when all match).

    Reports files that are missing, have another size or sha256, or were added to an artifact afterwards.
    """
    path = Path(path)
    manifest = load_manifest(path)
    base = Path(work_dir) if work_dir is not None else _work_dir_of(path, manifest)
    problems: list[Mismatch] = []
    for stage in manifest["stages"]:
        if stage.get("files") is None:
            continue
        folder = base / stage["artifact"]
        for rel, meta in stage["files"].items():
            shown = f"{stage['artifact']}/{rel}"
            file = folder / rel
            if not file.is_file():
                problems.append(Mismatch(shown, "missing"))
                continue
            size = file.stat().st_size
            if size != meta["size"]:
                problems.append(Mismatch(shown, f"size {size}, manifest says {meta['size']}"))
                continue
            digest = sha256_file(file)
            if digest != meta["sha256"]:
                problems.append(Mismatch(shown, f"sha256 {digest[:16]}..., manifest says {meta['sha256'][:16]}..."))
        if folder.is_dir():
            listed = set(stage["files"]) | {MARKER}
            for extra in sorted(p for p in folder.rglob("*") if p.is_file()):
                rel = extra.relative_to(folder).as_posix()
                if rel not in listed:
                    problems.append(Mismatch(f"{stage['artifact']}/{rel}", "not in the manifest"))
    return problems
