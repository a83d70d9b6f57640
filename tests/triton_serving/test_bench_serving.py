"""trtpipe bench against a real tritonserver serving the stories260k CPU twin (streaming repository).

One server for the module: model_warmup really runs before readiness; a two-point AIPerf sweep writes
result files whose numbers equal AIPerf's own export, with the server view joined in; compare of a run
with itself passes its gate. The AIPerf parts skip when its venv is absent (scripts/install_aiperf.sh).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import struct
from pathlib import Path

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from click.testing import CliRunner

from trtpipe.app.bench_cold import timed_request
from trtpipe.app.launch_triton import has_warmup
from trtpipe.bench.server_view import scrape
from trtpipe.cli import main
from trtpipe.errors import TrtpipeError
from trtpipe.triton.repo import WARMUP_DATA, read_configs, write_repo
from trtpipe.triton.server_process import start_server

pytestmark = [pytest.mark.triton, pytest.mark.slow]


def _aiperf_or_skip():
    from trtpipe.bench.aiperf import find_aiperf

    try:
        return find_aiperf()
    except TrtpipeError as exc:
        pytest.skip(f"AIPerf is not installed here ({exc})")


@pytest.fixture(scope="module")
def repo(stories_engine, stories_recipe, tmp_path_factory):
    engine = stories_engine(1)
    out = tmp_path_factory.mktemp("bench") / "repo"
    write_repo(stories_recipe("triton.streaming=true"), engine, engine / "checkpoint", out)
    return out


@pytest.fixture(scope="module")
def server(repo):
    with start_server(repo, timeout=300) as s:
        yield s


def _successes(samples: dict) -> dict:
    return {dict(labels)["model"]: v for (name, labels), v in samples.items() if name == "nv_inference_request_success"}


def test_repository_warms_models_up_before_ready(repo, server, stories_engine, stories_recipe, tmp_path):
    configs = read_configs(repo)
    assert {n for n, c in configs.items() if c.model_warmup} == set(WARMUP_DATA)
    ids = (repo / "tensorrt_llm" / "warmup" / "input_ids").read_bytes()
    assert struct.unpack("<8i", ids) == tuple(range(1, 9))
    query = (repo / "preprocessing" / "warmup" / "QUERY").read_bytes()
    assert struct.unpack("<I", query[:4])[0] == len(query) - 4
    # the warm-up requests ran inside the server before it reported ready (and nothing else did)
    ok = _successes(scrape(f"http://{server.bind}:{server.ports.metrics}/metrics"))
    assert ok["tensorrt_llm"] == ok["preprocessing"] == ok["postprocessing"] == 1 and ok["tensorrt_llm_bls"] == 0
    engine = stories_engine(1)
    write_repo(stories_recipe("triton.warmup=false"), engine, engine / "checkpoint", tmp_path / "cold")
    assert not has_warmup(tmp_path / "cold") and not (tmp_path / "cold" / "tensorrt_llm" / "warmup").exists()


def test_timed_request_streams_and_not(server):
    s = timed_request(server.http_url, "tensorrt_llm_bls", True, "Once upon a time", 8)
    assert s["pieces"] >= 4 and 0 < s["ttft_ms"] < s["e2e_ms"]
    whole = timed_request(server.http_url, "ensemble", False, "Once upon a time", 8)
    assert whole["pieces"] == 1 and 0 < whole["ttft_ms"] <= whole["e2e_ms"]


def test_sweep_numbers_equal_aiperf_export_and_join_the_server_view(repo, server, tmp_path, monkeypatch):
    _aiperf_or_skip()
    # the temp dir (short: AIPerf's ZMQ socket paths live there): the bench must leave nothing in it (AIPerf alone
    # leaves its socket folders and an aiperf_mmap_* folder per run)
    temp = Path(tempfile.mkdtemp(prefix="tp"))
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # this process's too (Python reads TMPDIR once)
    out = tmp_path / "sweep"
    res = CliRunner().invoke(
        main,
        [
            "bench",
            str(repo),
            "--url",
            server.http_url,
            "--metrics-url",
            f"http://{server.bind}:{server.ports.metrics}/metrics",
            "-c",
            "1,2",
            "-n",
            "6",
            "--warmup",
            "1",
            "--isl",
            "16",
            "--osl",
            "8",
            "--slo",
            "ttft:2s",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    rows = (out / "sweep.csv").read_text().splitlines()
    assert rows[0].startswith("label,concurrency") and [r.split(",")[0] for r in rows[1:]] == ["c1", "c2"]
    for png in ("throughput_latency.png", "latency_cdf.png", "pareto.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for label, c in (("c1", 1), ("c2", 2)):
        doc = json.loads((out / label / "result.json").read_text())
        assert doc["run"]["ok"] == 6 and doc["run"]["failed"] == 0 and doc["load"]["concurrency"] == c
        agree = doc["aiperf"]["agreement"]
        for metric in ("ttft", "itl", "e2e", "osl"):
            for stat in ("avg", "p50", "p99"):
                ours, theirs, rel = agree[metric][stat]
                assert rel < 1e-9, (label, metric, stat, ours, theirs)
        assert len(doc["samples"]["ttft"]) == 6
        assert doc["metrics"]["good_request_fraction"]["slo_ms"] == {"ttft": 2000.0}
        view = doc["server"]
        # 6 measured requests + AIPerf's 1 warm-up request went through the BLS and tensorrt_llm
        assert view["models"]["tensorrt_llm_bls"]["requests"] == 7 and view["models"]["tensorrt_llm"]["requests"] == 7
        # nothing on the server limits c <= 2: the executor schedules every active request (at most 2 of its 8
        # slots, none waiting), they hold 2 of its 128 KV blocks, and Triton's queue (the second of two requests
        # arriving together waits ~1 ms for preprocessing) is far below 10% of the ~30-50 ms E2E (measured here)
        gauge = view["gauges"]
        assert gauge["nv_trt_llm_request_metrics:max"]["max"] == 8
        assert gauge["nv_trt_llm_request_metrics:scheduled"]["max"] <= c
        assert gauge["nv_trt_llm_request_metrics:waiting"]["max"] == 0
        assert view["limiter"] == "none", view["evidence"]
        # the twin's executor publishes the backend's families (its token histograms are observed every
        # stats_check_period_ms, so a delta may also hold requests that finished just before the first scrape)
        assert view["trt_llm_metrics"] is True
        assert view["histograms"]["nv_llm_output_token_len"]["count"] >= 7
        # the front model declares min_tokens (the BLS carries it to tensorrt_llm, as upstream's does), so the bench
        # forces the length with it rather than end_id=-1 (trtpipe/bench/target.py)
        assert doc["token_counts"]["fixed_by"] == "min_tokens=max_tokens" and doc["token_counts"]["requested_osl"] == 8
        prov = doc["provenance"]
        assert prov["repo"]["engine"] == "cpu-twin" and len(prov["repo"]["engine_config_sha256"]) == 64
        assert set(prov["repo"]["config_pbtxt_sha256"]) >= {"tensorrt_llm", "tensorrt_llm_bls", "ensemble"}
        assert prov["versions"]["aiperf"] == "0.13.0" and prov["server"]["version"] == "2.51.0"
    left = list(temp.iterdir())
    shutil.rmtree(temp)
    assert not left and not list(out.rglob("aiperf_mmap_*")), left
    same = CliRunner().invoke(
        main, ["bench", "compare", str(out / "c1"), str(out / "c1"), "--fail-if", "ttft.p99>+10%"]
    )
    assert same.exit_code == 0 and "pass ttft.p99>+10%" in same.output
