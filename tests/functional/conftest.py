"""A real tritonserver over the project's model repository, shared by the functional tests.

The server starts once per session on free ports and is stopped at the end with every Python backend
stub it started; the teardown fails the run if any of them is still alive.
"""

from __future__ import annotations

import contextlib
import csv
import os
import time
from pathlib import Path

import pytest

from batchlm.backend.instance_claim import process_alive
from batchlm.launcher.ports import free_port
from batchlm.launcher.triton_server import TritonServer
from batchlm_client.triton_llm import LLMClient


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("triton") / "server.log"
    # Explicit model control so tests can unload a model with requests in flight; all load at start.
    # NOTE: an exit timeout of 5 s: the configs that test_static_batching.py has refused at load are still
    # counted as live models when the server stops, so the stop takes the whole exit timeout
    # (tests/functional/test_failed_load_stall.py); 15 s would be added to every run
    srv = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_path=log,
                       extra_args=("--model-control-mode=explicit", "--load-model=*"), exit_timeout_s=5)
    srv.start(timeout=300)
    yield srv
    tree = srv.descendants()
    srv.stop()
    time.sleep(0.5)
    alive = [pid for pid in tree if is_alive(pid)]
    assert not alive, f"processes left behind by tritonserver: {alive}"


@pytest.fixture
def llm(server):
    client = LLMClient(server.http_url, server.grpc_url, timeout=300)
    yield client
    client.close()


is_alive = process_alive  # a live process that is not a zombie


def metric_value(server, name: str, model: str) -> float | None:
    """One sample of a Prometheus family for `model` from the server's metrics endpoint, summed over
    the model's instances; None when the model has no such series."""
    import urllib.request

    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") and f'model="{model}"' in line]
    return sum(values) if values else None


def metric_reaches(server, name: str, model: str, value: float, timeout: float, poll: float = 0.05) -> float | None:
    """Poll `metric_value` until it reads `value` or `timeout` seconds pass; the last value read."""
    deadline = time.monotonic() + timeout
    while (last := metric_value(server, name, model)) != value and time.monotonic() < deadline:
        time.sleep(poll)
    return last


def held_by_http_connections(log_text: str) -> bool:
    """Whether a SIGTERM's shutdown waited on open HTTP connections that did not close by themselves.

    tritonserver logs "Timeout N: Found M HTTP service connections" once a second while any is open, up to
    its exit timeout (15 s here). A client that has just closed its connection can still be counted at
    the first check, and is gone by the next (seen once in a clean `make test`: one line,
    then none); a connection held by a request that is never answered is counted to the end (15 lines,
    then "Exit timeout expired", which callers that expect a clean exit check on their own)."""
    return log_text.count("HTTP service connections") > 2


def repository_api(server, model: str, action: str, config: dict | None = None, timeout: float = 300):
    """POST the repository API's `load` or `unload` of `model`, with the header its restriction asks for
    (every server the project starts restricts it); `config` (load only) replaces the model's
    config.pbtxt. Returns the response."""
    import json

    import requests

    body = {} if config is None else {"parameters": {"config": json.dumps(config)}}
    return requests.post(f"http://{server.http_url}/v2/repository/models/{model}/{action}", json=body,
                         headers=server.admin_headers, timeout=timeout)


def reload_from_repository(server, model: str) -> None:
    """Back to the repository's config.pbtxt after a load with a config override. A load alone would not
    do it: Triton sees the model's files unchanged and keeps the override."""
    r = repository_api(server, model, "unload", timeout=60)
    assert r.status_code == 200, r.text
    r = repository_api(server, model, "load")
    assert r.status_code == 200, r.text


def processes_naming(marker: str) -> list[str]:
    """Command lines of live processes that name `marker` (a folder a test's servers and stubs run from),
    pytest's own aside: what a test that stopped its servers must not leave behind."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_text().replace("\0", " ")
        except OSError:
            continue
        if marker in text and "pytest" not in text:
            found.append(text[:120])
    return found


def csv_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def locust_events(prefix: Path) -> dict[str, dict]:
    """`<Type> <Name>` -> row of a Locust run's stats CSV (`--csv prefix`), the Aggregated row left out."""
    return {f"{r['Type']} {r['Name']}": r for r in csv_rows(Path(f"{prefix}_stats.csv")) if r["Type"]}


@contextlib.contextmanager
def default_model_serving(log_dir: Path, extra_args: tuple[str, ...] = ()):
    """tritonserver and the OpenAI frontend serving the default model itself (the tests' tiny-model
    override lifted for their start): yields (server, frontend URL); stops both, and fails if any process
    they started outlives them."""
    from batchlm.launcher.frontend_process import FrontendProcess
    from batchlm.launcher.ports import free_port
    from batchlm.launcher.triton_server import TritonServer
    from batchlm.paths import MODEL_ENV

    saved = os.environ.pop(MODEL_ENV, None)
    server = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          log_path=log_dir / "server.log", exit_timeout_s=5, extra_args=extra_args)
    frontend = FrontendProcess(server.grpc_url, port=free_port(), graceful_timeout=2, log_path=log_dir / "frontend.log")
    try:
        server.start(timeout=300)
        frontend.start(timeout=60)
        yield server, frontend.url
    finally:
        tree = server.descendants()
        frontend.stop()
        server.stop()
        if saved is not None:
            os.environ[MODEL_ENV] = saved
    assert not [pid for pid in tree if is_alive(pid)]
