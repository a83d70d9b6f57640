"""NVIDIA AIPerf as trtpipe's load generator: find it, build its command, run it, read its exports.

AIPerf (``aiperf==0.13.0``) lives in its own virtual environment (``scripts/install_aiperf.sh``): its
dependencies pull numpy 2, which nvidia-pytriton's numpy<2 pin forbids in trtpipe's. trtpipe therefore
runs it as a subprocess and reads its files: ``profile_export.jsonl`` (one record per request, with
``request_start_ns``, ``time_to_first_token``, the gaps between response chunks and the output length) and
``profile_export_aiperf.json`` (AIPerf's own summary, kept beside trtpipe's numbers so they can be checked
against each other).

The ``template`` endpoint drives Triton's HTTP generate extension; the payload template is written to a
file (an inline ``--extra-inputs`` value would be split at commas).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from trtpipe.bench.metrics import PERF_FIELDS, BenchError, Request, server_split
from trtpipe.bench.target import Target
from trtpipe.jsonfile import load_json

AIPERF_VERSION = "0.13.0"
DEFAULT_VENV = ".venv-aiperf"
SUMMARY = "profile_export_aiperf.json"
RECORDS = "profile_export.jsonl"
RAW = "profile_export_raw.jsonl"
SERVER_FLAGS = ("return_perf_metrics", "return_num_output_tokens")
# trtpipe metric -> AIPerf's tag for the same formula (the side-by-side check in every run JSON).
AIPERF_TAGS = {
    "ttft": "time_to_first_token",
    "ttst": "time_to_second_token",
    "itl": "inter_token_latency",
    "e2e": "request_latency",
    "decode": "decode_duration",
    "osl": "output_sequence_length",
    "user_tps": "output_token_throughput_per_user",
    "chunk_gap": "inter_chunk_latency",
    "request_throughput": "request_throughput",
    "output_token_throughput": "output_token_throughput",
    "goodput": "goodput",
}


def find_aiperf() -> Path:
    """``$TRTPIPE_AIPERF``, else ``.venv-aiperf/bin/aiperf`` beside this checkout or the current directory,
    else ``aiperf`` on PATH."""
    env = os.environ.get("TRTPIPE_AIPERF")
    if env:
        if not Path(env).is_file():
            raise BenchError(f"TRTPIPE_AIPERF={env}: no such file")
        return Path(env)
    roots = [Path(__file__).resolve().parents[2], Path.cwd(), Path(sys.prefix).parent]
    for root in roots:
        p = root / DEFAULT_VENV / "bin" / "aiperf"
        if p.is_file():
            return p
    found = shutil.which("aiperf")
    if found:
        return Path(found)
    raise BenchError(
        "AIPerf is not installed: run scripts/install_aiperf.sh (it creates .venv-aiperf with "
        f"aiperf=={AIPERF_VERSION}) or set TRTPIPE_AIPERF to the aiperf executable"
    )


def aiperf_version(binary: Path) -> Optional[str]:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


@dataclass
class Load:
    """One load point: closed loop (concurrency) or open loop (request rate), bounded by count or duration."""

    concurrency: Optional[int] = None
    request_rate: Optional[float] = None
    arrival: str = "poisson"  # constant | poisson (open loop only)
    requests: Optional[int] = None
    duration_s: Optional[float] = None
    warmup_requests: int = 0
    isl: int = 128
    osl: int = 64
    isl_stddev: int = 0
    seed: int = 0

    def label(self) -> str:
        if self.request_rate is not None:
            cap = f"-c{self.concurrency}" if self.concurrency else ""
            return f"rate{self.request_rate:g}-{self.arrival}{cap}"
        return f"c{self.concurrency}"

    def check(self) -> None:
        if self.concurrency is None and self.request_rate is None:
            raise BenchError("give --concurrency or --request-rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise BenchError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise BenchError(f"--request-rate must be positive, got {self.request_rate}")
        if self.arrival not in ("constant", "poisson"):
            raise BenchError(f"--arrival must be constant or poisson, got {self.arrival}")
        if self.requests is None and self.duration_s is None:
            raise BenchError("give --requests or --duration")


@dataclass
class AIPerfRun:
    command: list[str]
    out_dir: Path
    requests: list[Request] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    log_tail: str = ""


def command(
    binary: Path, target: Target, load: Load, out_dir: Path, template: Path, goodput: Optional[dict[str, float]] = None
) -> list[str]:
    """The ``aiperf profile`` command line for one load point."""
    cmd = [
        str(binary),
        "profile",
        "--model",
        target.model,
        "--url",
        target.http_url,
        "--endpoint-type",
        "template",
        "--custom-endpoint",
        target.endpoint,
        "--extra-inputs",
        f"payload_template:{template}",
        "--extra-inputs",
        "response_field:text_output",
        "--tokenizer",
        target.tokenizer,
        "--isl",
        str(load.isl),
        "--isl-stddev",
        str(load.isl_stddev),
        "--osl",
        str(load.osl),
        "--random-seed",
        str(load.seed),
        "--ui",
        "none",
        "--artifact-dir",
        str(out_dir),
        "--export-level",
        "raw" if any(f in target.inputs for f in SERVER_FLAGS) else "records",
        "--no-gpu-telemetry",
        "--no-server-metrics",
    ]  # trtpipe scrapes tritonserver's own metrics port itself
    if target.streaming:
        cmd.append("--streaming")
    if load.concurrency is not None:
        cmd += ["--concurrency", str(load.concurrency)]
    if load.request_rate is not None:
        cmd += ["--request-rate", f"{load.request_rate:g}", "--arrival-pattern", load.arrival]
    if load.requests is not None:
        cmd += ["--request-count", str(load.requests)]
    if load.duration_s is not None:
        cmd += ["--benchmark-duration", f"{load.duration_s:g}"]
    if load.warmup_requests:
        cmd += ["--warmup-request-count", str(load.warmup_requests)]
    if goodput:
        names = {
            "ttft": "time_to_first_token",
            "itl": "inter_token_latency",
            "e2e": "request_latency",
            "ttst": "time_to_second_token",
            "tpot": "inter_token_latency",
        }
        cmd += ["--goodput", " ".join(f"{names[k]}:{v:g}" for k, v in goodput.items())]
    return cmd


def parse_record(rec: dict) -> Request:
    """One ``profile_export.jsonl`` line -> :class:`Request` (response times rebuilt from TTFT and the
    gaps between chunks, all on AIPerf's client clock)."""
    meta, m = rec.get("metadata", {}), rec.get("metrics", {})
    start = int(meta["request_start_ns"])
    err = rec.get("error")
    if err:
        msg = err.get("message") if isinstance(err, dict) else str(err)
        return Request(start, [], error=" ".join(str(msg).split())[:300])

    def val(name: str):
        v = m.get(name)
        return v.get("value") if isinstance(v, dict) else None

    ttft = val("time_to_first_token")
    latency = val("request_latency")
    if ttft is None and latency is not None:  # non-streaming: one response, TTFT = E2E
        ttft = latency
    if ttft is None:
        return Request(start, [], error="no response")
    times = [start + int(round(ttft * 1e6))]
    for gap in val("inter_chunk_latency") or []:
        times.append(times[-1] + int(round(gap * 1e6)))
    if latency is not None:  # the request's end as AIPerf measured it (exact, not a sum of rounded gaps)
        times[-1] = start + int(round(latency * 1e6))
    osl = val("output_sequence_length")
    isl = val("input_sequence_length")
    return Request(start, times, osl=int(osl) if osl is not None else None, isl=int(isl) if isl is not None else None)


def _server_fields(node, found: list) -> None:
    """Collect every dict holding per-response server outputs, parsing JSON / SSE ``data:`` strings on the way."""
    if isinstance(node, str):
        text = node.strip()
        for line in text.splitlines() if "data:" in text else [text]:
            line = line.strip()
            if line.startswith("data:"):
                line = line[5:].strip()
            if line.startswith("{"):
                try:
                    _server_fields(json.loads(line), found)
                except ValueError:
                    pass
    elif isinstance(node, dict):
        if any(k in node for k in (*PERF_FIELDS, "num_output_tokens")):
            found.append(node)
        else:
            for v in node.values():
                _server_fields(v, found)
    elif isinstance(node, list):
        for v in node:
            _server_fields(v, found)


def read_raw_server_fields(out_dir: Path) -> dict[str, list[dict]]:
    """x_request_id -> the server output fields of each of its responses (``--export-level raw`` only)."""
    path = Path(out_dir) / RAW
    out: dict[str, list[dict]] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        found: list = []
        _server_fields(rec.get("responses", []), found)
        rid = rec.get("metadata", {}).get("x_request_id")
        if rid and found:
            out[rid] = found
    return out


def read_records(out_dir: Path) -> list[Request]:
    path = Path(out_dir) / RECORDS
    if not path.exists():
        raise BenchError(f"{path}: AIPerf wrote no per-request records")
    out = []
    raw = read_raw_server_fields(out_dir)
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise BenchError(f"{path}:{i}: not JSON ({exc})") from None
        if rec.get("metadata", {}).get("benchmark_phase", "profiling") != "profiling":
            continue
        r = parse_record(rec)
        fields = raw.get(rec.get("metadata", {}).get("x_request_id"))
        if fields and r.ok:
            r.server = server_split(fields, (r.responses_ns[0] - r.start_ns) / 1e6)
        out.append(r)
    return out


def read_summary(out_dir: Path) -> dict:
    path = Path(out_dir) / SUMMARY
    try:
        return load_json(path, BenchError, finite=False)
    except (OSError, ValueError) as exc:
        raise BenchError(f"{path}: cannot read AIPerf's summary ({exc})") from None


def run(
    binary: Path,
    target: Target,
    load: Load,
    out_dir: Path,
    goodput: Optional[dict[str, float]] = None,
    timeout_s: float = 3600.0,
) -> AIPerfRun:
    """Run AIPerf for one load point into ``out_dir``; raise with its log tail when it fails."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    template = out_dir / "payload_template.json"
    template.write_text(target.template_text(load.osl))
    cmd = command(binary, target, load, out_dir / "aiperf", template, goodput)
    log = out_dir / "aiperf.log"
    # AIPerf gets a temp dir of its own, removed after it: it leaves folders in the temp dir on every run (its
    # ZMQ socket folders and an emptied aiperf_mmap_* folder), and the system's would fill with them. The path
    # stays short: a ZMQ socket path must fit in 107 bytes.
    temp = tempfile.mkdtemp(prefix="trtpipe-aiperf-")
    env = {**os.environ, "NO_COLOR": "1", "TMPDIR": temp}
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(
                cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s, stdin=subprocess.DEVNULL, env=env
            )
        except subprocess.TimeoutExpired:
            raise BenchError(f"AIPerf did not finish in {timeout_s:.0f} s; log {log}") from None
        finally:
            shutil.rmtree(temp, ignore_errors=True)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    if proc.returncode != 0:
        raise BenchError(f"AIPerf exited with {proc.returncode}; log {log}:\n{tail}")
    return AIPerfRun(cmd, out_dir / "aiperf", read_records(out_dir / "aiperf"), read_summary(out_dir / "aiperf"), tail)
