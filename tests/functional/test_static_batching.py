"""static_batching holds requests until a full batch of 8 is waiting, then answers all of them."""

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from batchlm.backend.instance_claim import InstanceClaim
from batchlm.launcher.ports import free_port
from batchlm.launcher.processes import process_tree, stub_instances
from batchlm.launcher.triton_server import TritonServer
from batchlm_client.triton_llm import LLMClient, RequestFailed
from tests.functional.conftest import (held_by_http_connections, metric_reaches, metric_value, reload_from_repository,
                                       repository_api)

BATCH = 8
PROTOCOLS = ("http", "infer", "grpc")
# Triton's status for UNAVAILABLE per protocol. HTTP /generate on tritonserver 2.51 answers every error
# that a model returns with 400 (it reads the error's code after freeing it; see docs/operations.md), so only
# /infer and gRPC carry the code, and only the message tells /generate's clients what happened.
UNAVAILABLE = {"http": ("400", "503"), "infer": ("503",), "grpc": ("StatusCode.UNAVAILABLE",)}


def _send(server, i, protocol="http", max_tokens=None, timeout=300.0):
    """One request over `protocol`: "http" (/generate), "infer" (HTTP /infer) or "grpc" (ModelInfer)."""
    client = LLMClient(server.http_url, server.grpc_url, timeout=timeout)
    try:
        call = {"http": client.generate, "infer": client.infer_http, "grpc": client.infer_grpc}[protocol]
        result = call("static_batching", f"Request number {i} asks",
                      max_tokens=4 + i if max_tokens is None else max_tokens, ignore_eos=True)
        return time.monotonic(), result
    finally:
        client.close()


def _send_and_count(server, i, max_tokens):
    """_send, then the server's generated-token counter for static_batching as soon as the answer came."""
    answer = _send(server, i, PROTOCOLS[i % 3], max_tokens=max_tokens)
    return answer, metric_value(server, "batchlm_generated_tokens_total", "static_batching")


def test_nth_request_releases_the_batch(server):
    lengths = [4 + i for i in range(BATCH - 1)] + [100]  # the last row runs far longer than the others
    before = metric_value(server, "batchlm_generated_tokens_total", "static_batching") or 0.0
    with ThreadPoolExecutor(BATCH) as pool:
        first = [pool.submit(_send_and_count, server, i, lengths[i]) for i in range(BATCH - 1)]
        # The gauge reads every parked request within a watchdog interval of the last one parked
        # (not just the first of a burst, until the next record)
        assert metric_reaches(server, "batchlm_waiting_requests", "static_batching", BATCH - 1, timeout=60) == BATCH - 1
        assert not any(f.done() for f in first), "a request finished before the batch was full"
        last = pool.submit(_send_and_count, server, BATCH - 1, lengths[-1])
        results = [f.result(timeout=120) for f in first + [last]]
    for i, ((_, result), _) in enumerate(results):
        assert result.num_output_tokens == lengths[i] and result.finish_reason == "length"
    # Everyone waits for the slowest: when even the shortest row's answer came, the batch had generated
    # every row's tokens (its counter is pushed before the answers are sent). A row answered as it
    # finished would see the 100-token row's tokens still to come.
    after = metric_value(server, "batchlm_generated_tokens_total", "static_batching")
    assert [counted for _, counted in results] == [after] * BATCH
    assert after - before >= sum(lengths)
    # The gauges were pushed before the answers: they read nothing running now, not 8 until the next request
    for name in ("batchlm_running_requests", "batchlm_waiting_requests", "batchlm_kv_blocks_used"):
        assert metric_value(server, name, "static_batching") == 0, name


def test_stream_is_refused_with_field_named(llm):
    with pytest.raises(RequestFailed) as info:
        llm.generate("static_batching", "hi", max_tokens=4, stream=True)
    assert info.value.status == "400" and "stream" in info.value.message


def test_unload_fails_parked_requests_with_unavailable(server):
    executions = _executions(server)
    with ThreadPoolExecutor(3) as pool:
        parked = {protocol: pool.submit(_send, server, i, protocol) for i, protocol in enumerate(PROTOCOLS)}
        _wait_parked(server, executions + 3)
        r = repository_api(server, "static_batching", "unload", timeout=60)
        assert r.status_code == 200
        errors = {}
        for protocol, f in parked.items():
            with pytest.raises(RequestFailed) as info:
                f.result(timeout=60)
            errors[protocol] = info.value
    try:
        for protocol, e in errors.items():
            assert e.status in UNAVAILABLE[protocol] and "unloaded" in e.message, (protocol, e)
    finally:
        _load(server)


def test_an_unload_right_after_the_first_requests_park_fails_them(server):
    """A fresh instance whose first requests are parked and then, within the watchdog's interval, the
    model is unloaded: the parked requests get UNAVAILABLE and the unload ends. A watchdog that counted
    a not-ready model only after one of its checks had seen it ready would, as it checks only while
    requests are parked, leave these requests parked and the unload never ending (their clients give
    up after 30 s)."""
    _load(server)  # a reload: a new instance, whose watchdog has made no check yet
    executions = _executions(server)
    try:
        with ThreadPoolExecutor(3) as pool:
            parked = {protocol: pool.submit(_send, server, i, protocol, timeout=30)
                      for i, protocol in enumerate(PROTOCOLS)}
            _wait_parked(server, executions + 3)
            r = repository_api(server, "static_batching", "unload", timeout=60)
            assert r.status_code == 200
            answers = {protocol: _failure(f) for protocol, f in parked.items()}
        for protocol, (status, message) in answers.items():
            assert status in UNAVAILABLE[protocol] and "unloaded before a full batch" in message, (protocol, message)
    finally:
        _load(server)


def _executions(server) -> int:
    r = requests.get(f"http://{server.http_url}/v2/models/static_batching/stats", timeout=10)
    return int(r.json()["model_stats"][0]["execution_count"])


def _wait_parked(server, executions: int, timeout: float = 30.0) -> None:
    """Until static_batching's execution count reads `executions`: execute() parks a request and returns."""
    deadline = time.monotonic() + timeout
    while _executions(server) < executions:
        assert time.monotonic() < deadline, "the requests were not parked"
        time.sleep(0.01)


def _load(server, config: dict | None = None) -> None:
    """(Re)load static_batching from the repository, or with `config` (JSON) instead of its config.pbtxt."""
    r = repository_api(server, "static_batching", "load", config)
    assert r.status_code == 200, r.text


def test_overload_is_refused_with_unavailable_and_503(server):
    """Beyond `max_waiting` waiting requests (parked, or in full batches behind the running one), a
    request is refused at once: gRPC status UNAVAILABLE, HTTP /infer 503, and the others are untouched.
    Here batches of 2 and max_waiting 2: one batch runs, one full batch waits."""
    config = requests.get(f"http://{server.http_url}/v2/models/static_batching/config", timeout=30).json()
    config["parameters"]["batch_size"]["string_value"] = "2"
    config["parameters"]["max_waiting"]["string_value"] = "2"
    _load(server, config)
    try:
        with ThreadPoolExecutor(4) as pool:
            running = [pool.submit(_send, server, i, max_tokens=300) for i in range(2)]
            assert metric_reaches(server, "batchlm_running_requests", "static_batching", 2, timeout=30) == 2
            waiting = [pool.submit(_send, server, i) for i in range(2, 4)]
            assert metric_reaches(server, "batchlm_waiting_requests", "static_batching", 2, timeout=30) == 2
            for protocol in ("infer", "grpc", "http"):
                started = time.monotonic()
                with pytest.raises(RequestFailed) as info:
                    _send(server, 9, protocol)
                assert time.monotonic() - started < 5.0
                assert info.value.status in UNAVAILABLE[protocol], (protocol, info.value)
                assert "static_batching is overloaded: 2 requests already waiting" in info.value.message
            assert not any(f.done() for f in running + waiting)
            results = [f.result(timeout=120)[1] for f in running + waiting]
        assert [r.num_output_tokens for r in results] == [300, 300, 6, 7]
    finally:
        _reload_from_repository(server)


def test_a_reload_fails_the_old_instances_parked_requests(server):
    """A reload (the loaded model loaded again, here with another max_waiting) sends new requests to the
    new instance, and Triton unloads the old one once the requests it holds are done, without telling
    it; to the old instance the model still reads ready. Its parked requests get UNAVAILABLE
    ("reloaded") once the successor holds the instance's name (InstanceClaim), and the old stub exits,
    rather than they and the old stub waiting for as long as the server runs."""
    config = requests.get(f"http://{server.http_url}/v2/models/static_batching/config", timeout=30).json()
    config["parameters"]["max_waiting"]["string_value"] = "32"
    # the instance that will hold the parked requests: the claim's holder (not every static_batching stub:
    # an instance that a test before this one asked to unload may still be running)
    old = {InstanceClaim("static_batching_0_0", server_pid=server.process.pid).holder()}
    assert server.stubs().get(next(iter(old))) == "static_batching"
    executions = _executions(server)
    try:
        with ThreadPoolExecutor(3) as pool:
            parked = {protocol: pool.submit(_send, server, i, protocol) for i, protocol in enumerate(PROTOCOLS)}
            _wait_parked(server, executions + 3)
            _load(server, config)
            for protocol, f in parked.items():
                with pytest.raises(RequestFailed) as info:
                    f.result(timeout=30)
                assert info.value.status in UNAVAILABLE[protocol], (protocol, info.value)
                assert "static_batching was reloaded before a full batch" in info.value.message
        deadline = time.monotonic() + 30
        while old & set(server.stubs()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not old & set(server.stubs()), "the old instance's stub is still running"
    finally:
        _reload_from_repository(server)


def _reload_from_repository(server) -> None:
    reload_from_repository(server, "static_batching")
    config = requests.get(f"http://{server.http_url}/v2/models/static_batching/config", timeout=30).json()
    assert config["parameters"]["max_waiting"]["string_value"] == "64"


def test_sigterm_right_after_load_exits_cleanly(tmp_path):
    """The watchdog's readiness checks are calls to the server. One that overlaps the instance's
    finalize makes tritonserver abort (SIGABRT, boost lock_exception) whenever the server is stopped
    within 0.5 s of loading static_batching, so the watchdog asks nothing while no request is parked."""
    log = tmp_path / "server.log"
    srv = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_path=log,
                       extra_args=("--model-control-mode=explicit", "--load-model=static_batching"))
    srv.start(timeout=300)
    process = srv.process
    srv.stop()
    text = log.read_text()
    assert process.returncode == 0 and "lock_exception" not in text, text[-3000:]
    assert "successfully unloaded 'static_batching'" in text


def test_drain_answers_parked_http_requests_so_sigterm_exits_at_once(tmp_path):
    """On SIGTERM tritonserver first waits, up to its exit timeout, for every open HTTP connection to
    close. A request parked in static_batching keeps its connection open, even when its client has
    died, until the model answers it, which it does only at unload: without drain() the server waited
    out its 15 s exit timeout, exited 1 with the model still loaded, and the parked clients got their
    connection closed with no answer. drain() unloads first: every parked client is answered
    UNAVAILABLE, and the SIGTERM after it finds nothing to wait for."""
    log = tmp_path / "server.log"
    srv = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_path=log,
                       extra_args=("--model-control-mode=explicit", "--load-model=static_batching"))
    srv.start(timeout=300)
    try:
        url = f"http://{srv.http_url}/v2/models/static_batching/generate"
        body = json.dumps({"text_input": "parked", "max_tokens": 4})
        dead = subprocess.Popen([sys.executable, "-c", "import sys, urllib.request; urllib.request.urlopen("
                                 "urllib.request.Request(sys.argv[1], data=sys.argv[2].encode()))", url, body],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with ThreadPoolExecutor(2) as pool:
            parked = [pool.submit(_send, srv, i, protocol) for i, protocol in enumerate(("infer", "http"))]
            _wait_parked(srv, 3)  # the dead client's and these two
            dead.kill()  # a client that died with its request parked
            dead.wait(timeout=10)
            assert not any(f.done() for f in parked)
            assert srv.drain() == ["static_batching"]
            answers = [_failure(f) for f in parked]
        # NOTE: only plain values are kept: a failed request's exception holds its client's socket
        # open, and an open HTTP connection is what a SIGTERM waits for
        del parked
        for protocol, (status, message) in zip(("infer", "http"), answers):
            assert status in UNAVAILABLE[protocol] and "unloaded" in message, (protocol, status, message)
        process = srv.process
        srv.stop()
    finally:
        srv.stop()
    text = log.read_text()
    # the SIGTERM found no connection to wait for (none that stayed open), no expiry, a clean exit
    assert not held_by_http_connections(text) and "Exit timeout expired" not in text, text[-3000:]
    assert process.returncode == 0, text[-3000:]


def test_sigterm_with_parked_grpc_requests_waits_for_no_http_connection(tmp_path):
    """gRPC requests parked in static_batching hold no HTTP connection, so a SIGTERM finds none to wait
    for: the model unloads, every parked client gets its answer, UNAVAILABLE "...was unloaded...", and the
    server exits 0. A client that read the model's config over HTTP for a gRPC request and kept that
    connection open while it waited would make the SIGTERM wait out the exit timeout for it, exit 1 and
    unload nothing.

    NOTE: now and then tritonserver 2.51's stub dies of SIGSEGV in pb_utils.is_model_ready during such a
    shutdown; the unload then hangs to the end of the exit timeout, and the kill that follows ends the
    calls with a gRPC GOAWAY (docs/operations.md, "Why drain before the SIGTERM"). That is Triton's
    defect, not this contract, so a stop that stalls is run again on a fresh server, up to 3 times; the
    contract must hold on a stop that did not stall, and a GOAWAY never passes. Where all 3 stall, the
    test is an expected failure that says whether the stub was seen dead during each stall."""
    stalls = []
    for attempt in range(3):
        text, answers, returncode, stub_died = _sigterm_with_parked_grpc_requests(tmp_path / f"attempt-{attempt}")
        assert not held_by_http_connections(text), text[-3000:]
        if "Exit timeout expired" not in text:
            break
        stalls.append(f"stub {'dead' if stub_died else 'alive'} 5 s into the stall; {answers[0][1][:80]}")
    else:
        pytest.xfail(f"each of {len(stalls)} bare SIGTERMs stalled on Triton's side: {stalls}")
    for status, message in answers:
        assert status in UNAVAILABLE["grpc"] and "unloaded" in message, (status, message)
    assert returncode == 0, text[-3000:]


def _sigterm_with_parked_grpc_requests(work) -> tuple[str, list[tuple[str, str]], int, bool]:
    """Park 3 gRPC requests in static_batching and SIGTERM the server: its log, the 3 failures, its exit
    status, and whether its stub was gone while the server still counted the model live."""
    work.mkdir(parents=True)
    log = work / "server.log"
    # NOTE: an exit timeout of 10 s: room for the unload on a busy machine, and a connection held open is
    # still logged (and counted) within it. A stop that stalls on Triton's side is killed 14 s after the
    # SIGTERM, not 30
    srv = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_path=log,
                       extra_args=("--model-control-mode=explicit", "--load-model=static_batching"),
                       exit_timeout_s=10)
    srv.start(timeout=300)
    stub_died = threading.Event()
    try:
        stubs = list(stub_instances(process_tree(srv.process.pid)))
        with ThreadPoolExecutor(4) as pool:
            parked = [pool.submit(_send, srv, i, "grpc") for i in range(3)]
            # NOTE: 2 s, not until the gauge reads them: a SIGTERM within a fraction of a second of the
            # parking makes the stub's SIGSEGV likely, which stalls the stop
            time.sleep(2.0)
            assert not any(f.done() for f in parked)
            process = srv.process
            pool.submit(_watch_stub, log, stubs, stub_died)
            srv.stop(grace=14)
            answers = [_failure(f) for f in parked]
        del parked
    finally:
        srv.stop()
    return log.read_text(), answers, process.returncode, stub_died.is_set()


def _watch_stub(log, stubs: list[int], died: threading.Event, timeout: float = 30.0) -> None:
    """Set `died` if no pid of `stubs` is alive while the server's log still counts a live model 5 s
    into its exit timeout (the stall of a crashed stub)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        if "Timeout 5: Found 1 live models" in text:
            if not any(_alive(pid) for pid in stubs):
                died.set()
            return
        if "Exit timeout expired" in text or "successfully unloaded" in text:
            return
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _failure(future) -> tuple[str, str]:
    """The status and message of the RequestFailed that `future` ended with."""
    with pytest.raises(RequestFailed) as info:
        future.result(timeout=60)
    return info.value.status, info.value.message


@pytest.mark.parametrize("model, path, value, said", [
    ("static_batching", ("parameters", "batch_size", "string_value"), "16",
     "batch_size: 16 rows exceed max_num_seqs=8"),
    ("dynamic_batching", ("max_batch_size",), 16, "max_batch_size: 16 rows exceed max_num_seqs=8"),
    ("static_batching", ("parameters", "max_waiting", "string_value"), "4", "max_waiting: 4 is below batch_size=8"),
])
def test_a_config_that_could_not_run_is_refused_at_load(server, model, path, value, said):
    """16 rows of up to 1024 tokens do not fit 8 sequence slots and 512 KV blocks, and with fewer
    requests allowed to wait than a batch holds no batch could fill: the load fails naming the key, and
    the model loaded before keeps serving with its config. Loaded, such a config would fail every full
    batch as a whole (INVALID_ARG "batch: 16 rows exceed max_num_seqs=8" to all 16 clients), or park
    max_waiting requests for ever and refuse the rest."""
    url = f"http://{server.http_url}/v2/models/{model}/config"
    original = requests.get(url, timeout=30).json()
    config = json.loads(json.dumps(original))
    target = config
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    r = repository_api(server, model, "load", config)
    try:
        assert r.status_code == 400 and said in r.json()["error"], r.text
        assert requests.get(url, timeout=30).json() == original
        assert requests.get(f"http://{server.http_url}/v2/models/{model}/ready", timeout=30).status_code == 200
        if model == "dynamic_batching":
            llm = LLMClient(server.http_url, server.grpc_url, timeout=120)
            try:
                assert llm.generate(model, "Still serving", 3, ignore_eos=True).num_output_tokens == 3
            finally:
                llm.close()
    finally:  # only if the override loaded after all: back to the repository's config.pbtxt
        if requests.get(url, timeout=30).json() != original:
            repository_api(server, model, "unload", timeout=120)
            assert repository_api(server, model, "load", timeout=300).status_code == 200
