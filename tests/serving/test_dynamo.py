"""The twin behind NVIDIA Dynamo's real frontend and KV-aware router (ai-dynamo 1.6.1, its own venv), end to end.

scripts/dynamo_drill.py runs the graph in a network namespace of its own (Dynamo's workers bind their ZMQ event
publishers to 0.0.0.0); this test runs it in its quick setting and checks what it reports:
- greedy text through the official ``openai`` client (completions, streaming, chat, 8 at once over 3 workers)
  equals transformers' greedy on the same float16 checkpoint and the ids trtllm-serve would encode: a completion
  with the tokenizer's BOS (Dynamo's frontend alone encodes without special tokens, ai-dynamo 1.6.1
  ``lib/llm/src/tokenizers/hf.rs`` ``encode(input, false)``; trtpipe's ingress hands it trtllm-serve's ids,
  trtpipe/serving/dynamo_ingress.py, issue 38 item 11), chat without (the template's text, as trtllm-serve);
  the same completion through the twin directly gives the same text; AIPerf's chat and completions runs have no
  errors;
- KV-aware routing, one request at a time with a barrier on the router's own applied-events counter (so the
  router's load term is equal and overlap alone decides): the workers' own reuse counters reach exactly the hit
  rate of one cache that saw every request, and the router rejected no event;
- kill -9 of a worker under streaming load: the supervisor names it from its exit status, only requests in flight
  can fail, every request after it succeeds, and after the stop no process or listening socket is left.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DYNAMO_PY = ROOT / ".venv-dynamo" / "bin" / "python"
AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
TEMPLATE = (ROOT / "tests" / "export" / "data" / "chat_template.jinja").read_text()
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a big"]


def _netns_works() -> bool:
    if not shutil.which("unshare") or not shutil.which("ip"):
        return False
    return subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def fp16_export(stories_fp16_export):
    return stories_fp16_export


@pytest.fixture(scope="module")
def drill(fp16_export, tmp_path_factory):
    if not DYNAMO_PY.is_file():
        pytest.skip(f"NVIDIA Dynamo is not installed ({DYNAMO_PY}): bash scripts/install_dynamo.sh")
    if not _netns_works():
        pytest.skip("unshare -rn (a user + network namespace) is not permitted here")
    out = tmp_path_factory.mktemp("drill") / "drill.json"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "dynamo_drill.py"),
        str(fp16_export),
        "--quick",
        "--parts",
        "greedy+kill,routing,cli",
        "--routers",
        "kv",
        "--rounds",
        "2",
        "--sequential",
        "--json",
        str(out),
        "--aiperf",
        str(AIPERF),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=1200, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def hf_greedy(fp16_export):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fp16_export)
    tok.chat_template = TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(fp16_export, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id

    def run(text: str, n: int, special: bool = False) -> str:
        """The new text as an incremental detokenizer sees it: decode(prompt + new) past decode(prompt) (decoding
        the new ids alone would drop the space sentencepiece puts before their first word). ``special``: the
        prompt encoded as the twin's completions encode it (with the tokenizer's BOS)."""
        ids = tok.encode(text, add_special_tokens=special)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos
            )[0, len(ids) :].tolist()
        new = out[: out.index(eos)] if eos in out else out
        prompt_text = tok.decode(ids, skip_special_tokens=True)
        return tok.decode(ids + new, skip_special_tokens=True)[len(prompt_text) :]

    def chat(text: str, n: int) -> str:
        return run(
            tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False), n
        )

    return run, chat


def test_greedy_text_through_dynamo_equals_transformers(drill, hf_greedy):
    run, chat = hf_greedy
    g = drill["greedy"]
    for p in PROMPTS:
        assert g["completions"][p] == run(p, 24, special=True)
        assert g["stream"][p] == g["completions"][p]
        assert g["chat"][p] == chat(p, 16)
    assert g["concurrent"] == [g["completions"][p] for p in PROMPTS * 2]


def test_a_completion_through_dynamo_equals_the_twin_directly(drill, hf_greedy):
    """The same completion through ``trtpipe serve --dynamo`` and through the twin (whose completions encode with
    the tokenizer's special tokens, as trtllm-serve does, and equal transformers on those ids:
    tests/export/test_openai_twin.py) gives the same greedy text."""
    run, _ = hf_greedy
    assert {p: drill["greedy"]["completions"][p] for p in PROMPTS} == {p: run(p, 24, special=True) for p in PROMPTS}


def test_aiperf_chat_and_completions_have_no_errors(drill):
    if not AIPERF.is_file():
        pytest.skip(f"AIPerf is not installed ({AIPERF}): bash scripts/install_aiperf.sh")
    for endpoint, r in drill["greedy"]["aiperf"].items():
        assert r["rc"] == 0 and r["errors"] == 0 and r["requests"] == 24, (endpoint, r)


def test_kv_router_reaches_the_ideal_hit_rate_from_the_workers_own_counters(drill):
    r = drill["routing"]
    kv = r["kv"]
    assert kv["barrier_timeouts"] == 0 and kv["events_rejected"] == 0
    assert kv["reused_blocks"] > 0
    assert kv["hit_rate"] == r["ideal_hit_rate"], r


def test_serve_dynamo_detached_then_stop_leaves_nothing(drill):
    c = drill["cli"]
    assert c["serve_rc"] == 0 and c["stop_rc"] == 0, c
    assert any("frontend + 2 twin workers" in line for line in c["serve_printed"])
    assert any("0.0.0.0" in line for line in c["serve_printed"])  # says which ports Dynamo opens to all interfaces
    assert c["text"] == drill["greedy"]["completions"][PROMPTS[0]]
    assert c["processes_while_serving"] >= 3  # the supervisor's frontend and two workers (and the supervisor)
    assert c["processes_left"] == [] and c["listening_after_stop"] == []


def test_a_killed_worker_is_named_and_the_others_keep_serving(drill):
    k = drill["kill"]
    (event,) = k["supervisor"]
    assert event.startswith("dynamo worker1 (pid ") and "died: Killed (signal 9, SIGKILL)" in event
    assert "2 of 3 workers serving" in event
    assert k["failed_in_flight"] < k["in_flight"]  # only what the dead worker held
    assert k["after_kill_ok"] == k["after_kill_total"] and k["recovery_s"] is not None
    assert k["processes_left"] == [] and k["listening_after_stop"] == []
