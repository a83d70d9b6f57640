"""Fixtures of the Triton tests: stories260k converted (fp16, tp 1/2), its CPU twin engine, a repository,
a real tritonserver per module, and transformers' greedy generation of the same fp16 weights as the oracle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from numerics import suite_threads

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
from triton_helpers import BUILD_CONFIG  # noqa: E402


@pytest.fixture(scope="session")
def stories_engine(tmp_path_factory, stories_dir):
    """tp -> CPU twin engine dir of stories260k at float16 (converted once per session)."""
    from trtpipe.checkpoint.convert import convert
    from trtpipe.engine.twin_engine_dir import write_twin_engine

    made: dict[int, Path] = {}

    def make(tp: int) -> Path:
        if tp not in made:
            root = tmp_path_factory.mktemp(f"stories_tp{tp}")
            ckpt = convert(stories_dir, root / "ckpt", tp=tp, dtype="float16")
            made[tp] = write_twin_engine(ckpt, root / "engine", dict(BUILD_CONFIG))
        return made[tp]

    return make


@pytest.fixture(scope="session")
def tokenizer_with_eos(stories_dir):
    """(dir, eos ids) -> the stories tokenizer with a generation_config listing several EOS ids (as Llama-3 does)."""

    def make(tmp: Path, eos_ids: list[int]) -> Path:
        tmp.mkdir(parents=True, exist_ok=True)
        for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
            shutil.copy(stories_dir / f, tmp / f)
        gen = json.loads((stories_dir / "generation_config.json").read_text())
        gen["eos_token_id"] = eos_ids
        (tmp / "generation_config.json").write_text(json.dumps(gen))
        return tmp

    return make


@pytest.fixture(scope="session")
def hf_stories(stories_dir):
    """(tokenizer, model): transformers' Llama with the weights rounded to float16, computed in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(suite_threads())
    tok = AutoTokenizer.from_pretrained(stories_dir)
    model = AutoModelForCausalLM.from_pretrained(stories_dir).half().float().eval()
    return tok, model


@pytest.fixture(scope="session")
def hf_greedy(hf_stories):
    """prompt, max_new_tokens, eos ids -> (new token ids, completion text) from transformers' generate."""
    import torch

    from numerics import first_near_tie, hf_float64

    tok, model = hf_stories
    model64 = hf_float64(model)
    cache: dict = {}

    def run(prompt: str, max_new_tokens: int, eos=(2,)):
        key = (prompt, max_new_tokens, tuple(eos))
        if key not in cache:
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(
                    ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0]
                )
            new = out[0, ids.shape[1] :].tolist()
            end = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))  # through the first end id
            decided, tie = first_near_tie(model, model64, ids[0].tolist(), new[:end])
            cache[key] = (new, tok.decode(new, skip_special_tokens=True), tie)
        new, text, tie = cache[key]
        if tie:  # exact text equality is not well posed past a genuine near-tie (tests/numerics.py)
            pytest.skip(f"{prompt!r}: {tie}")
        return new, text

    return run


@pytest.fixture(scope="session")
def stories_recipe():
    from trtpipe.app.validation import load_recipe

    def load(*overrides: str):
        return load_recipe(RECIPES / "stories-fp16.yaml", list(overrides))

    return load


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used a tritonserver gets the server's fate and log tail in its report: CI keeps no
    server logs, and 'connection reset' alone cannot tell a crashed server from a refused request."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    from trtpipe.processes import log_tail
    from trtpipe.supervisor import Server
    from trtpipe.triton.server_process import exit_cause

    for name, value in getattr(item, "funcargs", {}).items():
        if isinstance(value, Server):
            fate = "still running" if value.alive() else exit_cause(value)
            report.sections.append(
                (f"tritonserver of fixture {name!r}: {fate}; log {value.log}", log_tail(Path(value.log), 80))
            )
