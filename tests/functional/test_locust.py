"""The Locust files against a real server: clean short runs, overload past capacity, distributed mode.

Every Locust process runs headless with a run-time limit, under a subprocess timeout, in its own process
group that is killed whatever happens, and talks to 127.0.0.1 only. Outputs are kept short (mean 16,
cap 32 tokens) so each run is seconds on a 2-core CPU.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from batchlm.launcher.ports import free_port
from batchlm.launcher.triton_server import TritonServer
from batchlm.paths import PROJECT_ROOT
from tests.functional.conftest import csv_rows, is_alive, locust_events

LOCUST = str(Path(sys.executable).parent / "locust")
GRPC_USER = "locustfiles/grpc_stream_user.py"
HTTP_USER = "locustfiles/http_user.py"
STEP_LOAD = "locustfiles/step_load.py"
SHORT_OUTPUTS = ("--output-mean", "16", "--output-cap", "32")


def _host(server, locustfile: str) -> str:
    return server.grpc_url if locustfile.startswith(GRPC_USER) else f"http://{server.http_url}"


def _start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([LOCUST, *args], cwd=PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _end(process: subprocess.Popen) -> None:
    """Kill the process group if anything is left of it (a finished run leaves nothing)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10)


def _run(args: list[str], log: Path, timeout: float) -> int:
    process = _start(args, log)
    try:
        return process.wait(timeout=timeout)
    finally:
        _end(process)


def _protocol(locustfile: str, extra: tuple[str, ...] = ()) -> str:
    """The first word of the users' event names."""
    if locustfile.startswith(GRPC_USER):
        return "grpc"
    return "infer" if "infer" in extra else "http"


@pytest.mark.parametrize("locustfile, model, users, extra", [
    # NOTE: gRPC streams to continuous_batching, HTTP /generate to static_batching and HTTP /infer to
    # dynamic_batching run for a minute in tests/functional/test_soak.py, which checks the same rows
    # a full batch. `--stop-timeout`: at the end of the 3 s every request sent is answered before Locust
    # stops, however slow the CPU, so each run has rows to check
    (GRPC_USER, "static_batching", 8, ()),
    (GRPC_USER, "dynamic_batching", 4, ()),
    (HTTP_USER, "continuous_batching", 4, ()),  # /generate_stream
    (HTTP_USER, "dynamic_batching", 4, ()),  # /generate
])
def test_headless_run_reports_ttft_and_e2e(server, tmp_path, locustfile, model, users, extra):
    prefix = tmp_path / "run"
    rc = _run(["-f", locustfile, "--headless", "--host", _host(server, locustfile), "--model", model,
               "-u", str(users), "-r", str(users), "-t", "3s", "--stop-timeout", "60", "--csv", str(prefix),
               *SHORT_OUTPUTS, *extra],
              tmp_path / "locust.log", timeout=90)
    log = (tmp_path / "locust.log").read_text()
    assert rc == 0, log[-3000:]
    assert csv_rows(Path(f"{prefix}_failures.csv")) == []
    protocol = _protocol(locustfile, extra)
    rows = locust_events(prefix)
    assert set(rows) == {f"TTFT {protocol} {model}", f"E2E {protocol} {model}"}, rows
    # the Locust table from this run's CSV: one row per event, its request count as Locust wrote it
    table = subprocess.run([sys.executable, "-m", "batchlm.bench", "locust-table", f"{prefix}_stats.csv"],
                           cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    for kind in ("E2E", "TTFT"):
        assert f"| `{model}` | {protocol} | {kind} | {int(rows[f'{kind} {protocol} {model}']['Request Count'])} | 0 |" \
            in table.stdout, table.stdout
    for row in rows.values():
        assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, row
        assert float(row["Average Content Size"]) > 0  # output tokens
    if model == "continuous_batching":  # streamed: the first token comes well before the last
        assert float(rows[f"TTFT {protocol} {model}"]["Average Response Time"]) < \
            float(rows[f"E2E {protocol} {model}"]["Average Response Time"])


def test_locust_table_refuses_a_file_that_is_not_locusts_stats(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "locust-table", str(path)], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"locust_table: {path}: no TTFT or E2E rows; expected a Locust <prefix>_stats.csv of locustfiles/"), proc


def test_grpc_user_exits_when_the_server_is_unreachable(tmp_path):
    """A user whose on_start fails (nothing listens on the port) must not keep Locust from exiting:
    an open gRPC channel would hang the process after the run, past any run-time limit."""
    rc = _run(["-f", GRPC_USER, "--headless", "--host", f"127.0.0.1:{free_port()}", "--model",
               "continuous_batching", "-u", "1", "-r", "1", "-t", "2s", *SHORT_OUTPUTS],
              tmp_path / "locust.log", timeout=30)
    log = (tmp_path / "locust.log").read_text()
    assert rc == 1 and "UNAVAILABLE" in log, log[-3000:]


@pytest.mark.parametrize("args, status, message", [
    # refused at start, before any user runs: /infer answers once, and continuous_batching streams by default
    (("--model", "continuous_batching"), 2,
     "locust: error: --http-endpoint infer answers once and cannot stream continuous_batching"),
    # not streamed, but decoupled: each user refuses to start, naming the model
    (("--model", "continuous_batching", "--stream", "off"), 1,
     "continuous_batching is decoupled, and HTTP /infer cannot serve a decoupled model"),
])
def test_http_user_refuses_infer_for_a_decoupled_model(server, tmp_path, args, status, message):
    rc = _run(["-f", HTTP_USER, "--headless", "--host", f"http://{server.http_url}", *args,
               "--http-endpoint", "infer", "-u", "1", "-r", "1", "-t", "3s", *SHORT_OUTPUTS],
              tmp_path / "locust.log", timeout=60)
    log = (tmp_path / "locust.log").read_text()
    assert rc == status and message in log, log[-3000:]


class _BrokenStream(BaseHTTPRequestHandler):
    """`/generate_stream` that sends one event, then a line that is not JSON ("malformed"), or closes
    the connection before the response that ends the request ("truncated")."""

    mode = "malformed"

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(b'data: {"text_output": "a", "num_output_tokens": 1, "finish_reason": ""}\n\n')
        if self.mode == "malformed":
            self.wfile.write(b"data: {not json\n\n")
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("mode, message", [
    ("malformed", "[client] JSONDecodeError: "),
    ("truncated", "[stream] ended after 1 tokens without its final response"),
])
def test_a_stream_that_breaks_is_a_failed_request(tmp_path, mode, message):
    """A stream that cannot be read to its end is an E2E failure with its reason: a malformed event does
    not raise out of the user's task (which Locust would count as an exception, with no E2E event and
    no failure wait), and a stream cut before its final response does not count as a success."""
    _BrokenStream.mode = mode
    broken = ThreadingHTTPServer(("127.0.0.1", 0), _BrokenStream)
    threading.Thread(target=broken.serve_forever, daemon=True).start()
    prefix = tmp_path / "run"
    try:
        rc = _run(["-f", HTTP_USER, "--headless", "--host", f"http://127.0.0.1:{broken.server_port}",
                   "--model", "continuous_batching", "-u", "1", "-r", "1", "-t", "3s", "--failure-wait", "0.2",
                   "--csv", str(prefix), *SHORT_OUTPUTS], tmp_path / "locust.log", timeout=60)
    finally:
        broken.shutdown()
        broken.server_close()
    log = (tmp_path / "locust.log").read_text()
    assert rc == 1, log[-3000:]  # requests failed
    failures = csv_rows(Path(f"{prefix}_failures.csv"))
    assert failures and all(r["Method"] == "E2E" and message in r["Error"] for r in failures), failures
    assert csv_rows(Path(f"{prefix}_exceptions.csv")) == [], log[-3000:]
    e2e = locust_events(prefix)["E2E http continuous_batching"]
    assert int(e2e["Failure Count"]) == int(e2e["Request Count"]) > 0


def overload_repository(path: Path) -> Path:
    """A copy of the model repository that overloads at a few users: static and continuous admit 8
    and 4 waiting requests, dynamic batching queues 4. model_dir is made absolute."""
    shutil.copytree(PROJECT_ROOT / "model_repository", path, ignore=shutil.ignore_patterns("__pycache__"))
    checkpoint = PROJECT_ROOT / "models" / "tiny-random"
    for config in path.glob("*/config.pbtxt"):
        waiting = "8" if config.parent.name == "static_batching" else "4"
        text = config.read_text().replace('"models/tiny-random"', f'"{checkpoint}"')
        text = re.sub(r'(key: "max_waiting" value: \{ string_value: )"\d+"', rf'\1"{waiting}"', text)
        config.write_text(re.sub(r"max_queue_size: \d+", "max_queue_size: 4", text))
    return path


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("overload")
    srv = TritonServer(model_repository=overload_repository(base / "model_repository"),
                       http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                       log_path=base / "server.log",
                       extra_args=("--model-control-mode=explicit", "--load-model=*"))
    srv.start(timeout=300)
    yield srv
    tree = srv.descendants()
    # NOTE: the /infer step load leaves requests of killed Locust users parked in static_batching, whose
    # HTTP connections a SIGTERM would wait for until its exit timeout (15 s here); unload first.
    try:
        srv.drain()
    finally:
        srv.stop()
    time.sleep(0.5)
    assert not [pid for pid in tree if is_alive(pid)], "processes left behind"


@pytest.mark.parametrize("locustfile, model, message, extra", [
    # NOTE: one path in make test (/generate's 400 with its UNAVAILABLE prefix); the same refusal through the
    # other transports in make test-slow (tests/functional/test_generate_status.py checks every code in make test)
    pytest.param(GRPC_USER, "static_batching",
                 "[stream] UNAVAILABLE: static_batching is overloaded: 8 requests already waiting", (),
                 marks=pytest.mark.slow),
    pytest.param(HTTP_USER, "dynamic_batching", "[503] [request id: <id_unknown>] Exceeds maximum queue size", (),
                 marks=pytest.mark.slow),
    # /generate answers 400 for every model error: the message's prefix says it is a refusal to retry
    (HTTP_USER, "continuous_batching",
     "[400] UNAVAILABLE: continuous_batching is overloaded: 4 requests already waiting", ()),
    # /infer keeps the model's UNAVAILABLE as 503, where /generate reads 400
    pytest.param(HTTP_USER, "static_batching",
                 "[503] UNAVAILABLE: static_batching is overloaded: 8 requests already waiting",
                 ("--http-endpoint", "infer"), marks=pytest.mark.slow),
])
def test_step_load_past_capacity_fails_with_tritons_message(small_server, tmp_path, locustfile, model, message,
                                                            extra):
    """Steps to 32 users, 2 s a step, twice what static batching admits (8 running, 8 waiting), so some must be
    refused however the timing falls. A last step of 24 (1.5x) saw no refusal in one CI run: refused
    users back off for a second and, with requests in transit on the client side, often found room."""
    prefix = tmp_path / "run"
    rc = _run(["-f", f"{locustfile},{STEP_LOAD}", "--headless", "--host", _host(small_server, locustfile),
               "--model", model, "--step-users", "8", "--step-time", "2", "--steps", "4",
               "--csv", str(prefix), *SHORT_OUTPUTS, *extra],
              tmp_path / "locust.log", timeout=90)
    log = (tmp_path / "locust.log").read_text()
    assert rc == 1, log[-3000:]  # Locust's exit code when requests failed
    failures = csv_rows(Path(f"{prefix}_failures.csv"))
    assert failures, log[-3000:]
    for row in failures:  # every failure is a rejection carrying Triton's message: no timeouts, no others
        assert row["Method"] == "E2E" and row["Error"] == f"Overloaded({message!r})", row
    e2e = locust_events(prefix)[f"E2E {_protocol(locustfile, extra)} {model}"]
    assert int(e2e["Request Count"]) > int(e2e["Failure Count"]) > 0  # served up to capacity, then refused


@pytest.mark.slow  # NOTE: tooling beside serving; make test-slow runs it (make test stays under 10 min)
def test_distributed_run_aggregates_two_workers(server, tmp_path):
    port = free_port()
    prefix = tmp_path / "run"
    locustfile = ["-f", GRPC_USER]
    master = _start([*locustfile, "--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
                     "--expect-workers", "2", "--headless", "--host", server.grpc_url,
                     "--model", "continuous_batching", "-u", "4", "-r", "4", "-t", "5s", "--csv", str(prefix),
                     *SHORT_OUTPUTS], tmp_path / "master.log")
    # DEBUG: a worker logs the users it spawned only at that level.
    workers = [_start([*locustfile, "--worker", "--master-host", "127.0.0.1", "--master-port", str(port),
                       "--loglevel", "DEBUG"], tmp_path / f"worker{i}.log") for i in range(2)]
    try:
        rc = master.wait(timeout=120)
        for worker in workers:
            worker.wait(timeout=30)  # workers quit when the master does
    finally:
        for process in [master, *workers]:
            _end(process)
    log = (tmp_path / "master.log").read_text()
    assert rc == 0, log[-3000:]
    assert "to 2 ready workers" in log
    for i in range(2):  # each worker ran its share of the 4 users
        worker_log = (tmp_path / f"worker{i}.log").read_text()
        assert re.search(r"\b2 users spawned", worker_log), worker_log[-3000:]
    rows = locust_events(prefix)
    assert set(rows) == {"TTFT grpc continuous_batching", "E2E grpc continuous_batching"}
    for row in rows.values():
        assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, row
