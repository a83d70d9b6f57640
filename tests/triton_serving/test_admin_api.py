"""tritonserver's admin APIs are closed to clients without trtpipe's key (issue 38, item 3): without it, a client
could register the python backend's own /dev/shm regions over HTTP, read them back and overwrite their headers (a
stub died, tritonserver aborted). Now shared memory, logging and trace answer 403 (gRPC:
UNAVAILABLE) without the launch's header, the server lives on, and with the header they work."""

from __future__ import annotations

from multiprocessing import shared_memory
from pathlib import Path

import pytest
import requests
from optional import needs

from trtpipe.triton.server_process import start_server


def test_every_serving_tritonserver_restricts_the_admin_apis():
    from trtpipe.triton.mpi_launch import mpirun_command
    from trtpipe.triton.server_process import server_command
    from trtpipe.supervisor import Ports

    ports = Ports(1, 2, 3)
    want = [
        "--http-restricted-api=shared-memory,logging,trace:trtpipe-admin-key=k1",
        "--grpc-restricted-protocol=shared-memory,logging,trace:trtpipe-admin-key=k1",
    ]
    cpu = server_command(Path("ts"), Path("b"), Path("r"), "127.0.0.1", ports, "p_", admin_key="k1")
    assert all(flag in cpu for flag in want)
    segments = " ".join(mpirun_command(Path("r"), 2, ports, admin_key="k1")).split(" : ")
    assert all(flag in segments[0].split() for flag in want)  # rank 0 serves: restricted
    assert "restricted" not in segments[1]  # rank 1 opens no endpoint
    fresh = [a for a in server_command(Path("ts"), Path("b"), Path("r"), "h", ports, "p_") if "restricted" in a]
    assert len(fresh) == 2 and "=k1" not in fresh[0]  # no key given: a fresh one, never a fixed default
    with pytest.raises(ValueError, match="admin key"):
        server_command(Path("ts"), Path("b"), Path("r"), "h", ports, "p_", admin_key="a b")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("empty_repo")  # no model: the admin APIs are the server's, not a model's
    with start_server(repo, timeout=120) as s:
        yield s


@pytest.fixture
def region():
    shm = shared_memory.SharedMemory(create=True, size=64)
    try:
        yield shm.name
    finally:
        shm.close()
        shm.unlink()


def _register(server, name: str, headers=None) -> requests.Response:
    body = {"key": "/" + name, "offset": 0, "byte_size": 64}
    url = f"{server.http_url}/v2/systemsharedmemory/region/probe/register"
    return requests.post(url, json=body, headers=headers or {}, timeout=30)


@pytest.mark.slow
@needs("tritonclient")
def test_shared_memory_and_logging_refused_without_the_key(server, region):
    r = _register(server, region)
    assert r.status_code == 403, (r.status_code, r.text)
    assert requests.get(f"{server.http_url}/v2/systemsharedmemory/status", timeout=30).status_code == 403
    assert requests.post(f"{server.http_url}/v2/logging", json={"log_verbose_level": 1}, timeout=30).status_code == 403
    assert requests.get(f"{server.http_url}/v2/trace/setting", timeout=30).status_code == 403
    load = requests.post(f"{server.http_url}/v2/repository/models/any/load", json={}, timeout=30)
    assert load.status_code != 200 and "not allowed" in load.text  # model control "none": no loading, key or not
    assert requests.post(f"{server.http_url}/v2/repository/index", json={}, timeout=30).status_code == 200
    wrong = _register(server, region, {"trtpipe-admin-key": "guess"})
    assert wrong.status_code == 403, wrong.text
    assert server.alive()
    assert requests.get(f"{server.http_url}/v2/health/ready", timeout=30).status_code == 200


@pytest.mark.slow
@needs("tritonclient")
def test_grpc_shared_memory_refused_without_the_key(server, region):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="(?i)restricted|unavailable|header"):
        client.register_system_shared_memory("probe", "/" + region, 64)
    assert client.is_server_ready()
    client.register_system_shared_memory("probe", "/" + region, 64, headers=server.admin_headers)
    client.unregister_system_shared_memory("probe", headers=server.admin_headers)


@pytest.mark.slow
@needs("tritonclient")
def test_with_the_key_the_admin_apis_work(server, region):
    r = _register(server, region, server.admin_headers)
    assert r.status_code == 200, r.text
    url = f"{server.http_url}/v2/systemsharedmemory/region/probe/unregister"
    assert requests.post(url, headers=server.admin_headers, timeout=30).status_code == 200


@pytest.mark.slow
@needs("tritonclient")
def test_the_key_is_not_in_the_log(server):
    key = server.admin_headers["trtpipe-admin-key"]
    assert key not in Path(server.log).read_text()
