"""The two-model form's draft model (Triton ``tensorrt_llm_draft``) under the CPU twin's leader mode, sharded over
the target's ranks.

Leader mode runs one MPI rank per shard: rank 0 is tritonserver, whose ``tensorrt_llm`` stub joins the job as rank 0,
and ranks > 0 are :mod:`trtpipe.serving.mpi_worker` processes. The ``tensorrt_llm_draft`` stub is a second process on
rank 0's host that cannot join the same MPI job, so the draft's collective work goes through the target's stub:

- every rank loads its shard of the draft checkpoint after the target's (rank 0 in :func:`~trtpipe.serving.mpi_engine.
  start_leader`, the workers with ``--draft``), and the workers follow ``worker_loop(target, draft)``: each broadcast
  names its model;
- the target's stub serves the draft's step engine calls (``allocate``, ``copy_block``, ``logits``) on a Unix socket in
  the run dir (:class:`DraftServer`, authenticated with a key only the job's files hold), under the lock that orders
  both models' broadcasts on the one communicator (:func:`~trtpipe.serving.mpi_engine.draft_step_engine`);
- the draft's stub runs its own in-flight executor over :class:`DraftClient`, a step engine whose forward is that
  socket: scheduling and sampling (each request's seeded generator) stay in the draft's stub, as in one process.

Upstream's own launch of this form at tp > 1 is orchestrator mode, not leader mode (TensorRT-LLM's "Speculative
Sampling" guide: "``--multi-model`` is necessary if TP mode is used for target model"; docs/reference/speculative.md).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Optional

import torch

from trtpipe.serving.api import StepBatch
from trtpipe.serving.mpi_engine import unwire, wire
from trtpipe.serving.reference_engine import ReferenceEngine

SOCKET, KEY = "draft.sock", "draft.key"


class DraftServer:
    """In the target's stub (rank 0): serve ``engine`` (the draft's :class:`~trtpipe.serving.mpi_engine.MpiStepEngine`)
    to the draft's stub over ``run_dir/draft.sock``."""

    def __init__(self, engine, run_dir: str | Path):
        self.engine = engine
        run_dir = Path(run_dir)
        key = secrets.token_bytes(32)
        tmp = run_dir / (KEY + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key)
        sock = run_dir / SOCKET
        if sock.exists():
            sock.unlink()
        self.listener = Listener(str(sock), "AF_UNIX", authkey=key)
        os.replace(tmp, run_dir / KEY)  # the key appears once the socket listens
        self.thread = threading.Thread(target=self._serve, name="trtpipe-draft-server", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn) -> None:
        with conn:
            while True:
                try:
                    op, args = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    if op == "allocate":
                        out = self.engine.allocate(*args)
                    elif op == "copy":
                        out = self.engine.copy_block(*args)
                    elif op == "move":
                        out = self.engine.move_slots(*args)
                    elif op == "logits":
                        out = self.engine.logits(unwire(args[0])).numpy()  # a torch tensor would travel as an fd
                    else:
                        raise ValueError(f"unknown draft operation {op!r}")
                    conn.send(("ok", out))
                except Exception as exc:  # the draft's stub reports it for the request(s) of that step
                    conn.send(("error", f"{type(exc).__name__}: {exc}"))


class DraftClient(ReferenceEngine):
    """In the draft's stub: the step engine whose ``allocate`` / ``copy_block`` / ``logits`` run on the ranks through
    the target's stub (:class:`DraftServer`); packing, sampling and verification are the reference engine's."""

    captures_hidden_states = False

    def __init__(self, run_dir: str | Path, timeout: float = 600.0):
        run_dir = Path(run_dir)
        deadline = time.monotonic() + timeout
        while not (run_dir / KEY).exists():  # the target's stub loads both models' shards first
            if time.monotonic() > deadline:
                raise RuntimeError(f"{run_dir / SOCKET}: the target's model did not serve the draft in {timeout:.0f} s")
            time.sleep(0.2)
        self.conn = Client(str(run_dir / SOCKET), "AF_UNIX", authkey=(run_dir / KEY).read_bytes())
        self.lock = threading.Lock()
        self.model: Optional[object] = None  # the weights are on the ranks
        self.pools, self.tokens_per_block = {}, 0
        self.capture, self.captured = (), None

    def _call(self, op: str, *args):
        with self.lock:
            self.conn.send((op, args))
            status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"draft model on the ranks: {out}")
        return out

    def allocate(self, num_blocks: int, tokens_per_block: int) -> None:
        self._call("allocate", int(num_blocks), int(tokens_per_block))
        self.tokens_per_block = tokens_per_block

    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        self._call("copy", int(src), int(dst), int(num_tokens))

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        self._call("move", list(map(int, src)), list(map(int, dst)))

    def logits(self, batch: StepBatch) -> torch.Tensor:
        return torch.from_numpy(self._call("logits", wire(batch)))
