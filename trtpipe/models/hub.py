"""Resolve ``hf://org/name[@revision]`` recipe sources to a local directory through huggingface_hub."""

from __future__ import annotations

from pathlib import Path

from trtpipe.errors import CheckpointError


def parse_hf_uri(uri: str) -> tuple[str, str | None]:
    body = uri[len("hf://") :]
    repo, _, revision = body.partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise CheckpointError(f"model.source: '{uri}' must look like hf://org/name[@revision]")
    return repo, revision or None


def resolve_hf(uri: str) -> Path:
    """Download (or find in the local cache) a hub snapshot: config, tokenizer and safetensors only."""
    repo, revision = parse_hf_uri(uri)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - huggingface_hub ships with transformers
        raise CheckpointError(
            "model.source: hf:// sources need huggingface_hub (pip install huggingface_hub)"
        ) from None
    patterns = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.tiktoken"]
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # the hub raises many types (offline, 401, 404): report one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"model.source: cannot resolve {uri}: {first}") from None
