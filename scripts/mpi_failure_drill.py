"""Failure drill of leader-mode serving, through the real CLI: for each event, start a foreground
``trtpipe serve REPO`` (one process per rank under mpiexec), do the event, and report what serve printed, its exit
code, the time from the event to serve's exit, the job's processes left and the job's /dev/shm files left.

Usage: python scripts/mpi_failure_drill.py REPO [EVENT ...]
Events: worker (kill -9 rank 1), leader (kill -9 rank 0's tensorrt_llm model process), tritonserver (kill -9),
ctrl-c (SIGINT to serve), stop (trtpipe stop from another process).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

EVENTS = ("worker", "leader", "tritonserver", "ctrl-c", "stop")


def job_processes(marks) -> list[str]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and any(m in cmd for m in marks) and "mpi_failure_drill" not in cmd:
                out.append(f"{d.name} {cmd[:100]}")
    return out


def drill(repo: Path, event: str, trtpipe: str) -> dict:
    detach = ["--detach"] if event == "stop" else []  # trtpipe stop ends detached jobs
    proc = subprocess.Popen(
        [trtpipe, "serve", str(repo), "--timeout", "240", *detach],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Ctrl-C to stop") or line.startswith("  pid "):
            break
    run_dir = Path(next(ln.split()[1] for ln in lines if ln.startswith("  run ")))
    ranks = json.loads((run_dir / "ranks.json").read_text())
    shm_before = set(os.listdir("/dev/shm"))
    target = {
        "worker": lambda: int((run_dir / "rank1.pid").read_text()),
        "leader": lambda: next(r["pid"] for r in ranks if r["rank"] == 0),
        "tritonserver": lambda: int((run_dir / "rank0.pid").read_text()),
    }
    t0 = time.monotonic()
    if event in target:
        os.kill(target[event](), signal.SIGKILL)
    elif event == "ctrl-c":
        proc.send_signal(signal.SIGINT)
    else:
        stop = subprocess.run([trtpipe, "stop", str(repo)], check=False, capture_output=True, text=True)
        lines.append(stop.stdout)
    if event == "stop":
        rest, code = lines[-1], proc.wait(120)
    else:
        rest = proc.stdout.read()
        code = proc.wait(120)
    took = time.monotonic() - t0
    state = json.loads((run_dir / "state.json").read_text())
    job_shm = [n for n in state.get("shm_removed", []) if os.path.exists(f"/dev/shm/{n}")]
    prefix = json.loads((run_dir / "launch.json").read_text())["shm_prefix"]
    new_shm = sorted(
        n
        for n in set(os.listdir("/dev/shm")) - shm_before  # other users' servers come and go
        if n.startswith((prefix, "mpich_shm_"))
    )
    return {
        "event": event,
        "serve_exit_code": code,
        "seconds_to_exit": round(took, 2),
        "serve_printed": rest.strip().splitlines()[:3],
        "state": state["state"],
        "processes_left": job_processes([str(repo), str(run_dir)]),
        "job_shm_left": job_shm,
        "new_job_or_mpich_shm_since_event": new_shm,
    }


def main() -> None:
    repo = Path(sys.argv[1]).resolve()
    events = sys.argv[2:] or list(EVENTS)
    trtpipe = str(Path(sys.executable).parent / "trtpipe")
    for event in events:
        print(json.dumps(drill(repo, event, trtpipe), indent=1), flush=True)


if __name__ == "__main__":
    main()
