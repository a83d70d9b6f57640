"""Drill trtpipe's twin workers behind NVIDIA Dynamo's real frontend and router, in a network namespace of its own.

    python scripts/dynamo_drill.py TARGET [--quick] [--json OUT] [--aiperf PATH]

TARGET: an exported HF checkpoint, or a ``target: llmapi`` recipe (built up to its export first, e.g.
recipes/stories-llmapi-fp8.yaml). The script
re-runs itself under ``unshare -rn`` (Dynamo's workers bind their ZMQ event publishers to 0.0.0.0; inside the
namespace nothing is reachable from outside), then, each part on a fresh graph:

1. correctness: 3 workers, router kv; the official ``openai`` client, completions and chat, streaming and not:
   greedy token ids (and text) recorded for the caller to compare with transformers; AIPerf (chat and
   completions endpoint types) when it is installed: its error count;
2. routing: 8 distinct 256-token prefixes, each followed by short questions, over 3 workers, with ``--router kv``
   and with ``--router round-robin``: prefix-cache hit rate from the workers' own block counters
   (``trtpipe_kv_cache_{reused,missed}_blocks``), against the ideal (one cache that saw everything), TTFT p50/p99;
3. scaling: output tokens/s with 1, 2, 3 workers at a concurrency that saturates one;
4. kill -9 of one worker under streaming load: which requests failed, time until a new request succeeds, and
   that nothing (process, listening socket) is left after the stop;
5. cli: ``trtpipe serve TARGET --dynamo --replicas 2 --detach``, a completion, ``trtpipe stop TARGET``, and what is
   left after it.

Prints one JSON document (and writes it to --json). Numbers are this machine's: docs/results/dynamo.md says which run made them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEMPLATE = ROOT / "tests" / "export" / "data" / "chat_template.jinja"
GREEDY_PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a big"]
NAME = "stories-dynamo"


def in_netns(argv: list[str]) -> None:
    """Re-run this script inside a new user + network namespace with only loopback up."""
    inner = f"ip link set lo up && exec {sys.executable} {' '.join(map(repr, argv))} --in-netns"
    os.execvp("unshare", ["unshare", "-rn", "sh", "-c", inner])


def graph(model_dir: Path, replicas: int, router: str, run_dir: Path, port: int):
    from trtpipe.serving.config import replace_knobs, twin_default
    from trtpipe.app.launch_dynamo import DynamoGraph

    max_pos = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings") or 2048
    config = replace_knobs(twin_default(int(max_pos)), enable_kv_cache_reuse=True)
    return DynamoGraph(
        model_dir, NAME, replicas, router, "127.0.0.1", port, config, run_dir, chat_template=TEMPLATE.read_text()
    )


class Running:
    """A started graph (context manager): its supervisor, URL and an OpenAI client."""

    def __init__(self, model_dir: Path, replicas: int, router: str, port: int):
        from trtpipe.app.launch_dynamo import Supervisor

        self.run_dir = Path(tempfile.mkdtemp(prefix="dyn-drill-"))
        self.graph = graph(model_dir, replicas, router, self.run_dir / "run", port)
        self.sup = Supervisor(self.graph, echo=lambda s: print(s, file=sys.stderr, flush=True))

    def __enter__(self):
        from openai import OpenAI

        t0 = time.perf_counter()
        self.sup.start()
        self.ready_s = time.perf_counter() - t0
        self.client = OpenAI(base_url=self.graph.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return self

    def __exit__(self, *exc):
        self.sup.stop()

    def counters(self) -> dict:
        """Sums over live workers of their own counters (each worker's /metrics): blocks reused and missed by
        the pool, KV events published."""
        names = {
            "reused": "trtpipe_kv_cache_reused_blocks_total",
            "missed": "trtpipe_kv_cache_missed_blocks_total",
            "published": "trtpipe_kv_events_published_total",
        }
        total = dict.fromkeys(names, 0.0)
        for w in self.sup.workers:
            if w.proc.poll() is None:
                text = scrape(f"http://127.0.0.1:{w.system_port}/metrics")
                for k, name in names.items():
                    total[k] += metric_sum(text, name)
        return total

    def wait_events_applied(self, timeout: float = 120.0) -> dict:
        """Block until the router has applied every KV event the workers published (its own counter
        ``dynamo_component_kv_cache_events_applied``): the next request is routed on the index as it stands."""
        deadline = time.monotonic() + timeout
        while True:
            published = self.counters()["published"]
            text = scrape(self.graph.url + "/metrics")
            applied = metric_sum(text, "dynamo_component_kv_cache_events_applied")
            bad = sum(
                metric_sum(text, "dynamo_component_kv_cache_events_applied", f'status="{s}"')
                for s in ("parent_block_not_found", "block_not_found", "invalid_block")
            )
            if applied >= published or time.monotonic() > deadline:
                return {"published": published, "applied": applied, "rejected": bad}
            time.sleep(0.1)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def metric_sum(text: str, name: str, label: str = "") -> float:
    """The sum of every sample of ``name`` (with ``label`` among its labels, when given) in a Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in "{ " and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def greedy_part(model_dir: Path, port: int, aiperf: Path | None, kill: bool = False) -> dict:
    """``kill``: then kill a worker of the same graph under load (:func:`kill_checks`), as part "kill" does."""
    out: dict = {"completions": {}, "chat": {}, "stream": {}}
    with Running(model_dir, 3, "kv", port) as g:
        out["ready_s"] = round(g.ready_s, 1)
        greedy_checks(g, out, model_dir, aiperf)
        if kill:
            out["kill"] = kill_checks(g)
            pids = [m.pid for m in [g.sup.frontend, g.sup.ingress, *g.sup.workers]]
    if kill:
        out["kill"].update(leftovers(pids))
    return out


def greedy_checks(g: "Running", out: dict, model_dir: Path, aiperf: Path | None) -> None:
    c = g.client
    for p in GREEDY_PROMPTS:
        r = c.completions.create(model=NAME, prompt=p, max_tokens=24, temperature=0)
        out["completions"][p] = r.choices[0].text
        text = "".join(
            ch.choices[0].text
            for ch in c.completions.create(model=NAME, prompt=p, max_tokens=24, temperature=0, stream=True)
        )
        out["stream"][p] = text
        chat = c.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0
        )
        out["chat"][p] = chat.choices[0].message.content
    with ThreadPoolExecutor(8) as pool:  # eight at once over three workers: the same answers
        futs = [
            pool.submit(c.completions.create, model=NAME, prompt=p, max_tokens=24, temperature=0)
            for p in GREEDY_PROMPTS * 2
        ]
        out["concurrent"] = [f.result().choices[0].text for f in futs]
    if aiperf:
        out["aiperf"] = {t: run_aiperf(aiperf, g.graph.url, model_dir, t, g.run_dir) for t in ("chat", "completions")}


def run_aiperf(binary: Path, url: str, model_dir: Path, endpoint: str, work: Path) -> dict:
    art = work / f"aiperf-{endpoint}"
    cmd = [
        str(binary),
        "profile",
        "--model",
        NAME,
        "--url",
        url,
        "--endpoint-type",
        endpoint,
        "--streaming",
        "--tokenizer",
        str(model_dir),
        "--isl",
        "32",
        "--isl-stddev",
        "0",
        "--osl",
        "16",
        "--random-seed",
        "1",
        "--concurrency",
        "4",
        "--request-count",
        "24",
        "--ui",
        "none",
        "--artifact-dir",
        str(art),
        "--no-gpu-telemetry",
        "--no-server-metrics",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    summary = next(art.rglob("profile_export_aiperf.json"), None)
    data = json.loads(summary.read_text()) if summary else {}
    count = (data.get("request_count") or {}).get("avg")
    errors = (data.get("error_request_count") or {}).get("avg", 0) or 0
    return {
        "rc": proc.returncode,
        "requests": count,
        "errors": errors,
        "output_tps": (data.get("output_token_throughput") or {}).get("avg"),
        "tail": proc.stderr[-400:] if proc.returncode else "",
    }


def routing_workload(tokenizer, n_prefixes: int, rounds: int) -> list[list[list[int]]]:
    """rounds x prefixes prompts: 8 distinct 256-token prefixes (token ids drawn from the story vocabulary),
    each followed by a different short question per round."""
    import random

    rng = random.Random(7)
    vocab = list(range(3, tokenizer.vocab_size))
    prefixes = [[rng.choice(vocab) for _ in range(256)] for _ in range(n_prefixes)]
    questions = [
        "Who was there?",
        "What happened next?",
        "Where did they go?",
        "Why was she sad?",
        "How did it end?",
        "What did he find?",
        "Who helped them?",
        "What was the name?",
    ]
    return [
        [p + tokenizer.encode(questions[r % len(questions)], add_special_tokens=False) for p in prefixes]
        for r in range(rounds)
    ]


def ideal_hit_rate(workload, tokens_per_block: int) -> float:
    """The hit rate of one cache that saw every request in order (nothing evicted): the pool's own accounting."""
    from trtpipe.serving.kv_pool import BlockPool

    n = sum(len(p) for rnd in workload for p in rnd)
    pool = BlockPool(n // tokens_per_block + 64, tokens_per_block, enable_reuse=True)
    for rnd in workload:
        for prompt in rnd:
            table = pool.take_prefix(prompt)
            pool.grow(table, len(prompt), prompt=True)
            pool.store(table, prompt)
            pool.release(table)
    s = pool.stats()
    return s.reused_blocks / (s.reused_blocks + s.missed_blocks)


def routing_part(model_dir: Path, port: int, rounds: int, routers: list[str], sequential: bool) -> dict:
    """Each round: the eight prefixes, each with that round's question, at once (``sequential``: one after the
    other, so that the router's load term is the same for every worker and overlap alone decides); the next
    round only once the router has applied every event the last one caused."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = {"sequential": sequential}
    workload = routing_workload(tok, 8, rounds)
    for router in routers:
        with Running(model_dir, 3, router, port) as g:
            ttfts, barriers = [], []
            # only the KV router indexes events (round-robin applies none): it alone gets the barrier
            wait = g.wait_events_applied if router == "kv" else (lambda: {"published": 0, "applied": 0, "rejected": 0})

            def one(prompt):
                t0 = time.perf_counter()
                stream = g.client.completions.create(
                    model=NAME, prompt=prompt, max_tokens=4, temperature=0, stream=True
                )
                first = None
                for _ in stream:
                    first = first or time.perf_counter() - t0
                return first

            for rnd in workload:
                if sequential:
                    for prompt in rnd:
                        ttfts.append(one(prompt))
                        barriers.append(wait())
                else:
                    with ThreadPoolExecutor(8) as pool:
                        ttfts += list(pool.map(one, rnd))
                    barriers.append(wait())
            c = g.counters()
            out[router] = {
                "hit_rate": round(c["reused"] / (c["reused"] + c["missed"]), 3),
                "reused_blocks": c["reused"],
                "missed_blocks": c["missed"],
                "events_published": c["published"],
                "events_rejected": sum(b["rejected"] for b in barriers),
                "barrier_timeouts": sum(b["applied"] < b["published"] for b in barriers),
                "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
                "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1),
                "requests": len(ttfts),
            }
    out["ideal_hit_rate"] = round(ideal_hit_rate(workload, 32), 3)
    return out


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def scaling_part(model_dir: Path, port: int, concurrency: int, requests: int) -> dict:
    out = {"cpus": len(os.sched_getaffinity(0)), "concurrency": concurrency}
    prompts = [f"{p} {i}" for i in range(requests // 4 + 1) for p in GREEDY_PROMPTS][:requests]
    for n in (1, 2, 3):
        with Running(model_dir, n, "round-robin", port) as g:
            from trtpipe.app.launch_dynamo import worker_cores

            t0 = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                toks = sum(
                    pool.map(
                        lambda p: (
                            g.client.completions.create(
                                model=NAME, prompt=p, max_tokens=32, temperature=0
                            ).usage.completion_tokens
                        ),
                        prompts,
                    )
                )
            dt = time.perf_counter() - t0
            out[f"{n}_workers"] = {
                "output_tok_s": round(toks / dt, 1),
                "seconds": round(dt, 1),
                "cores_per_worker": len(worker_cores(0, n)) or "shared",
            }
    return out


def kill_part(model_dir: Path, port: int) -> dict:
    with Running(model_dir, 3, "round-robin", port) as g:
        out = kill_checks(g)
        pids = [m.pid for m in [g.sup.frontend, g.sup.ingress, *g.sup.workers]]
    return {**out, **leftovers(pids)}


def leftovers(pids: list[int]) -> dict:
    """After the stop: which of the graph's processes still exist (zombies aside), what still listens."""
    left = [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]
    listening = subprocess.run(["ss", "-Htln"], capture_output=True, text=True).stdout.split("\n")
    return {"processes_left": left, "listening_after_stop": [ln for ln in listening if ln.strip()]}


def kill_checks(g: "Running") -> dict:
    """kill -9 of worker 1 once six streams have each produced tokens; what failed, when serving recovered."""
    results, lock, started = [], threading.Lock(), threading.Event()

    def stream(i):
        t0 = time.perf_counter()
        try:
            n = 0
            for _ in g.client.completions.create(
                model=NAME, prompt=f"Once upon a time {i}", max_tokens=96, temperature=0, stream=True
            ):
                n += 1
                if n == 8:
                    started.set()
            ok, err = True, None
        except Exception as exc:  # the requests on the killed worker
            ok, err = False, f"{type(exc).__name__}: {str(exc)[:160]}"
        with lock:
            results.append({"i": i, "ok": ok, "error": err, "s": round(time.perf_counter() - t0, 2)})

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    started.wait(120)
    victim = g.sup.workers[1]
    t_kill = time.perf_counter()
    os.kill(victim.pid, signal.SIGKILL)
    victim.proc.wait(30)
    events = g.sup.poll()
    for t in threads:
        t.join(300)
    recovered = None
    for _ in range(60):  # new requests after the kill: the first that succeeds ends the outage
        try:
            g.client.completions.create(model=NAME, prompt="The little dog", max_tokens=8, temperature=0)
            recovered = round(time.perf_counter() - t_kill, 2)
            break
        except Exception:
            time.sleep(0.5)
    after = []
    for i in range(9):
        try:
            g.client.completions.create(model=NAME, prompt=f"After {i}", max_tokens=8, temperature=0)
            after.append(True)
        except Exception:
            after.append(False)
    return {
        "failed_in_flight": sum(not r["ok"] for r in results),
        "in_flight": len(results),
        "errors": sorted({r["error"] for r in results if r["error"]}),
        "supervisor": events,
        "recovery_s": recovered,
        "after_kill_ok": sum(after),
        "after_kill_total": len(after),
    }


def cli_part(target: Path, port: int) -> dict:
    """``trtpipe serve TARGET --dynamo --replicas 2 --detach``, one completion, ``trtpipe stop TARGET``: what serve
    printed, the answer, and what is left afterwards."""
    from openai import OpenAI

    trtpipe = [sys.executable, "-m", "trtpipe.cli"]
    t0 = time.perf_counter()
    serve = subprocess.run(
        trtpipe
        + [
            "serve",
            str(target),
            "--dynamo",
            "--replicas",
            "2",
            "--detach",
            "--http-port",
            str(port),
            "--served-model-name",
            NAME,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    ready_s = time.perf_counter() - t0
    out = {
        "serve_rc": serve.returncode,
        "serve_printed": serve.stdout.strip().splitlines()[-6:],
        "ready_s": round(ready_s, 1),
    }
    if serve.returncode == 0:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        out["text"] = (
            client.completions.create(model=NAME, prompt=GREEDY_PROMPTS[0], max_tokens=24, temperature=0)
            .choices[0]
            .text
        )
        pids = subprocess.run(
            ["pgrep", "-f", "dynamo.frontend|trtpipe.serving.dynamo_"], capture_output=True, text=True
        ).stdout.split()
        out["processes_while_serving"] = len(pids)
    stop = subprocess.run(trtpipe + ["stop", str(target)], capture_output=True, text=True, timeout=120)
    out["stop_rc"], out["stop_printed"] = stop.returncode, stop.stdout.strip()
    left = subprocess.run(
        ["pgrep", "-f", "dynamo.frontend|trtpipe.serving.dynamo_"], capture_output=True, text=True
    ).stdout.split()
    listening = subprocess.run(["ss", "-Htln"], capture_output=True, text=True).stdout.split("\n")
    out.update({"processes_left": left, "listening_after_stop": [ln for ln in listening if ln.strip()]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and requests (the test's setting)")
    ap.add_argument("--parts", default="greedy,routing,scaling,kill,cli")
    ap.add_argument("--routers", default="kv,round-robin")
    ap.add_argument("--rounds", type=int, default=6, help="routing: questions per prefix")
    ap.add_argument("--sequential", action="store_true", help="routing: one request at a time")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--aiperf", type=Path, default=ROOT / ".venv-aiperf" / "bin" / "aiperf")
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.in_netns:
        in_netns([os.path.abspath(__file__)] + sys.argv[1:])
    model_dir = args.model_dir.resolve()
    if model_dir.is_file():  # a recipe: its export (the build is cached)
        from trtpipe.app.launch_openai import resolve_openai_target

        model_dir = resolve_openai_target(model_dir).model_dir
    aiperf = args.aiperf if args.aiperf and args.aiperf.is_file() else None
    parts = args.parts.split(",")
    if "greedy+kill" in parts:  # one graph for both (the test's setting: one start-up less)
        parts += ["greedy"]
    report: dict = {"model_dir": str(model_dir), "quick": args.quick}
    t0 = time.perf_counter()
    if "greedy" in parts:
        report["greedy"] = greedy_part(model_dir, args.port, aiperf, kill="greedy+kill" in parts)
        if "greedy+kill" in parts:
            report["kill"] = report["greedy"].pop("kill")
    if "routing" in parts:
        report["routing"] = routing_part(model_dir, args.port, args.rounds, args.routers.split(","), args.sequential)
    if "scaling" in parts:
        report["scaling"] = scaling_part(model_dir, args.port, 8, 24 if args.quick else 384)
    if "kill" in parts:
        report["kill"] = kill_part(model_dir, args.port)
    if "cli" in parts:
        report["cli"] = cli_part(model_dir, args.port)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
