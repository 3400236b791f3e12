"""A real tritonserver over the project's model repository, shared by the functional tests.

The server starts once per session on free ports and is stopped at the end with every Python backend
stub it started; the teardown fails the run if any of them is still alive.
"""

from __future__ import annotations

import os
import time

import pytest

from batchlm.triton_server import TritonServer, free_port
from client.triton_llm import LLMClient


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("triton") / "server.log"
    srv = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_path=log)
    srv.start(timeout=300)
    yield srv
    tree = srv.descendants()
    srv.stop()
    time.sleep(0.5)
    alive = [pid for pid in tree if _alive(pid)]
    assert not alive, f"processes left behind by tritonserver: {alive}"


@pytest.fixture
def llm(server):
    client = LLMClient(server.http_url, server.grpc_url, timeout=300)
    yield client
    client.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
