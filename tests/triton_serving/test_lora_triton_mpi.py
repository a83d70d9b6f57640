"""LoRA through a real tritonserver in leader mode under a real mpiexec: a ``target: engine`` build of stories260k
(float32) at tp 2 with three adapters prefetched (tasks 0, 1, 2), served by ``mpi_launch.start_job`` as ``trtpipe
serve`` runs it (rank 0 tritonserver + the twin executor, rank 1 an MPI worker). Per task, greedy text through the
ensemble and the BLS equals peft's on transformers (float64-checked) and the OpenAI twin's at tp 1; an adapter sent
with its tensors is cached under its task id on every rank; a concurrent batch mixing the tasks, the sent one and
the base answers each request as its solo run.

Which code runs: the run dir is every rank's working directory (the tritonserver python stub and ``python -m``
workers put it first on ``sys.path``), so this test links the tree under test there as ``trtpipe`` (the editable
install would run otherwise); before this change the leader refused LoRA, so a pass shows these paths ran."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")

from lora_adapters import ENGINE_ADAPTERS, SENT_ADAPTER, build_lora_engine
from test_lora_triton import MODELS, PROMPTS, SENT_TASK, _opts, adapters, openai_text, peft_text  # noqa: F401
from trtpipe.engine.lora_convert import convert
from trtpipe.triton.client import Client

pytestmark = [
    pytest.mark.triton,
    pytest.mark.mpi,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
TREE = Path(__file__).resolve().parents[2] / "trtpipe"


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_dir, adapters):  # noqa: F811
    from trtpipe.app.launch_triton import repo_info
    from trtpipe.supervisor import Ports, free_ports
    from trtpipe.triton import mpi_launch

    prefetched = {k: adapters[k] for k in ENGINE_ADAPTERS}
    tmp = tmp_path_factory.mktemp("build_tp2")
    _, _, repo = build_lora_engine(
        stories_dir, prefetched, tmp, parallel={"tp": 2}, triton={"max_batch_size": 8, "bls": True}
    )
    made = mpi_launch.run_dir_for

    def run_dir_for(r):
        d = made(r)
        (d / "trtpipe").symlink_to(TREE, target_is_directory=True)
        return d

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRTPIPE_CACHE", str(tmp / "cache"))
        mp.setattr(mpi_launch, "run_dir_for", run_dir_for)
        server, state = mpi_launch.start_job(repo, repo_info(repo), "127.0.0.1", Ports(*free_ports(3)), 600)
    try:
        assert [r["rank"] for r in state["ranks"]] == [0, 1]
        assert (server.run_dir / "trtpipe").resolve() == TREE
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("model", MODELS)
def test_each_task_answers_as_peft_and_tp1(server, model, peft_text, openai_text):  # noqa: F811
    with Client(server.grpc_url, model=model) as c:
        for task, name in [*enumerate(ENGINE_ADAPTERS), (None, None)]:
            got = c.generate(PROMPTS[0], _opts(task))
            assert got == peft_text(name, PROMPTS[0]), (model, name)
            assert got == openai_text(name, PROMPTS[0]), (model, name)


def test_sent_adapter_and_a_concurrent_mixed_batch(server, adapters, peft_text):  # noqa: F811
    w, cfg = convert(adapters[SENT_ADAPTER[0]], "float32")
    with Client(server.grpc_url, model="ensemble") as c:
        first = c.generate(PROMPTS[2], _opts(SENT_TASK, lora_weights=w[0], lora_config=cfg[0]))
        again = c.generate(PROMPTS[2], _opts(SENT_TASK))  # the task id alone: cached on every rank
        assert first == again == peft_text(SENT_ADAPTER[0], PROMPTS[2])
        jobs = [(p, t) for p in PROMPTS[:2] for t in (0, 1, 2, SENT_TASK, None)]
        solo = {job: c.generate(job[0], _opts(job[1])) for job in jobs}
    results, errors = {}, []

    def one(job):
        try:
            with Client(server.grpc_url, model="ensemble") as cc:
                results[job] = cc.generate(job[0], _opts(job[1]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert results == solo
    assert len({solo[(PROMPTS[0], t)] for t in (0, 1, 2, SENT_TASK, None)}) == 5, "each adapter its own text"
    assert os.path.isdir(server.run_dir)
