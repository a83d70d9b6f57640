"""Security defaults: loopback unless asked (then a warning), no pickle without consent, trust_remote_code never
implied, recipe paths never reach a shell, no Hugging Face token in any artifact."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpipe.cli import main
from triton_helpers import tiny_recipe
from optional import needs

pytestmark = pytest.mark.slow

SHELL_BAIT = "w$(touch MARK1);touch MARK2 `touch MARK3`|touch MARK4"  # every way a shell would run code
TOKENS = {"HF_TOKEN": "hf_trtpipeSECRETtoken1", "HUGGING_FACE_HUB_TOKEN": "hf_trtpipeSECRETtoken2"}


def _cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trtpipe.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
    )


def _no_markers(root: Path) -> None:
    made = [p for p in root.rglob("MARK*") if p.name.startswith("MARK") and p.is_file()]
    assert not made and not any(Path(f"MARK{i}").exists() for i in range(1, 5)), made


@pytest.fixture(scope="module")
def bait_build(tmp_path_factory, stories_dir):
    """A whole build (convert -> twin -> repository) whose work dir is shell syntax, with HF tokens set."""
    root = tmp_path_factory.mktemp("sec")
    recipe = root / "recipe.yaml"
    recipe.write_text(tiny_recipe("sec", work=SHELL_BAIT, model=stories_dir))
    res = _cli("build", str(recipe), cwd=root, env=TOKENS)
    assert res.returncode == 0, res.stderr
    return root, recipe


@needs("tritonclient")
def test_shell_syntax_in_recipe_paths_is_only_ever_a_file_name(bait_build):
    root, recipe = bait_build
    work = root / SHELL_BAIT
    assert (work / "manifest.json").is_file()
    _no_markers(root)
    res = _cli("serve", str(recipe), "--dry-run", cwd=root)
    assert res.returncode == 0, res.stderr
    argv = shlex.split(res.stdout.strip().splitlines()[-1])  # what a user pastes into a shell
    repo = next(a.split("=", 1)[1] for a in argv if a.startswith("--model-repository="))
    assert SHELL_BAIT in repo and Path(repo).is_dir()
    _no_markers(root)


@needs("tritonclient")
def test_no_token_in_any_artifact(bait_build):
    root, _ = bait_build
    leaks = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            leaks += [f"{path}: {name}" for name, value in TOKENS.items() if value.encode() in data]
    assert not leaks, leaks
    manifest = (root / SHELL_BAIT / "manifest.json").read_text()
    assert "SECRET" not in manifest and "HF_TOKEN" not in manifest


def _dry_run(recipe: Path, *extra: str):
    res = CliRunner().invoke(main, ["serve", str(recipe), "--dry-run", *extra])
    assert res.exit_code == 0, res.output
    return res.stdout, getattr(res, "stderr", "")


@needs("tritonclient")
def test_loopback_by_default_and_a_warning_otherwise(bait_build):
    _, recipe = bait_build
    out, err = _dry_run(recipe)
    argv = shlex.split(out.strip().splitlines()[-1])
    assert {a for a in argv if "-address=" in a} == {f"--{k}-address=127.0.0.1" for k in ("http", "grpc", "metrics")}
    assert "warning" not in err
    for extra in (["--bind", "0.0.0.0"], ["--set", "triton.bind=0.0.0.0"]):
        out, err = _dry_run(recipe, *extra)
        assert "--http-address=0.0.0.0" in out
        assert err.startswith("warning: serving on 0.0.0.0:") and "without authentication" in err, err
    from trtpipe.triton.server_process import exposure_warning

    assert exposure_warning("127.0.0.1") is None and exposure_warning("::1") is None
    assert exposure_warning("localhost") is None and exposure_warning("10.0.0.5")


def test_schema_defaults_are_the_safe_ones():
    from trtpipe.recipe.schema import ModelSection, TritonSection

    fields = ModelSection.model_fields
    assert "trust_remote_code" not in fields and fields["allow_pickle"].default is False  # remote code: never
    assert TritonSection.model_fields["bind"].default == "127.0.0.1"


@needs("tritonclient")
def test_remote_code_tokenizer_is_refused_and_never_run(stories_dir, tmp_path):
    import shutil

    from trtpipe.errors import TrtpipeError
    from trtpipe.quant.data import load_tokenizer as calib_tokenizer
    from trtpipe.runtime.text import load_tokenizer as runtime_tokenizer
    from trtpipe.triton.repo import token_ids

    evil = tmp_path / "evil"
    shutil.copytree(stories_dir, evil)
    cfg = json.loads((evil / "tokenizer_config.json").read_text())
    cfg.update(auto_map={"AutoTokenizer": ["evil_tok.EvilTokenizer", None]}, tokenizer_class="EvilTokenizer")
    (evil / "tokenizer_config.json").write_text(json.dumps(cfg))
    (evil / "evil_tok.py").write_text("import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('x')\n")
    for load in (runtime_tokenizer, calib_tokenizer, token_ids):
        with pytest.raises(TrtpipeError) as info:
            load(evil)
        assert str(evil) in str(info.value) and "custom code" in str(info.value)
        assert len(str(info.value).splitlines()) == 1
    assert not (evil / "RAN").exists()


def test_pickle_checkpoint_needs_consent(stories_dir, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file

    model = tmp_path / "pickled"
    shutil.copytree(stories_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(str(stories_dir / "model.safetensors")), model / "pytorch_model.bin")
    res = CliRunner().invoke(main, ["convert", str(model), str(tmp_path / "out")])
    err = getattr(res, "stderr", res.output)
    assert res.exit_code != 0 and len(err.strip().splitlines()) == 1, err
    assert "pytorch_model.bin" in err and "pickle" in err
    assert not (tmp_path / "out").exists()  # nothing half-written
    ok = CliRunner().invoke(main, ["convert", str(model), str(tmp_path / "out"), "--allow-pickle"])
    assert ok.exit_code == 0, ok.output
