"""static_batching holds requests until a full batch of 8 is waiting, then answers all of them."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from batchlm.triton_server import TritonServer, free_port
from client.triton_llm import LLMClient, RequestFailed

BATCH = 8


def _send(server, i, protocol="http"):
    client = LLMClient(server.http_url, server.grpc_url, timeout=300)
    try:
        call = client.generate if protocol == "http" else client.infer_grpc
        result = call("static_batching", f"Request number {i} asks", max_tokens=4 + i, ignore_eos=True)
        return time.monotonic(), result
    finally:
        client.close()


def test_nth_request_releases_the_batch(server):
    with ThreadPoolExecutor(BATCH) as pool:
        first = [pool.submit(_send, server, i, "http" if i % 2 else "grpc") for i in range(BATCH - 1)]
        time.sleep(3.0)
        assert not any(f.done() for f in first), "a request finished before the batch was full"
        released_at = time.monotonic()
        last = pool.submit(_send, server, BATCH - 1)
        results = [f.result(timeout=120) for f in first + [last]]
    for i, (done_at, result) in enumerate(results):
        assert done_at > released_at
        assert result.num_output_tokens == 4 + i and result.finish_reason == "length"
    # Everyone waits for the slowest: the answers arrive together.
    finish_times = [t for t, _ in results]
    assert max(finish_times) - min(finish_times) < 1.0


def test_stream_is_refused_with_field_named(llm):
    with pytest.raises(RequestFailed) as info:
        llm.generate("static_batching", "hi", max_tokens=4, stream=True)
    assert info.value.status == "400" and "stream" in info.value.message


def test_unload_fails_parked_requests_with_unavailable(server):
    with ThreadPoolExecutor(3) as pool:
        parked = [pool.submit(_send, server, i) for i in range(3)]
        time.sleep(2.0)
        r = requests.post(f"http://{server.http_url}/v2/repository/models/static_batching/unload", timeout=60)
        assert r.status_code == 200
        errors = []
        for f in parked:
            with pytest.raises(RequestFailed) as info:
                f.result(timeout=60)
            errors.append(info.value)
    try:
        for e in errors:
            assert e.status in ("503", "400", "500") and "unloaded" in e.message, e
    finally:
        r = requests.post(f"http://{server.http_url}/v2/repository/models/static_batching/load", timeout=300)
        assert r.status_code == 200


def test_sigterm_right_after_load_exits_cleanly(tmp_path):
    """The watchdog's readiness checks are calls to the server. One that overlapped the instance's
    finalize made tritonserver abort (SIGABRT, boost lock_exception) whenever the server was stopped
    within 0.5 s of loading static_batching; it now asks nothing while no request is parked."""
    log = tmp_path / "server.log"
    srv = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_path=log,
                       extra_args=("--model-control-mode=explicit", "--load-model=static_batching"))
    srv.start(timeout=300)
    process = srv.process
    srv.stop()
    text = log.read_text()
    assert process.returncode == 0 and "lock_exception" not in text, text[-3000:]
    assert "successfully unloaded 'static_batching'" in text
