"""What a server the project starts exposes: its three ports on loopback only, inference open, and the
administrative APIs (model repository, shared memory, logging, trace) refused to a client without the
header only the starter holds, over HTTP and gRPC. The header's value is on tritonserver's command line
by default, and on no command line where the server is asked to hide it (argv_secret)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from batchlm.launcher import admin_key, argv_secret
from batchlm.launcher.ports import free_port
from batchlm.launcher.triton_server import TritonServer
from batchlm_client.triton_llm import LLMClient

ADMIN_ROUTES = [  # (method, path) of each restricted HTTP API
    ("POST", "/v2/repository/index"),
    ("POST", "/v2/repository/models/static_batching/unload"),
    ("POST", "/v2/repository/models/static_batching/load"),
    ("GET", "/v2/systemsharedmemory/status"),
    ("GET", "/v2/logging"),
    ("GET", "/v2/trace/setting"),
]


def _other_addresses() -> list[str]:
    """This machine's IPv4 addresses that are not loopback."""
    found = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # NOTE: connect() on UDP sends nothing; it only picks the interface a route would use
            s.connect(("192.0.2.1", 9))
            found.add(s.getsockname()[0])
        except OSError:
            pass
    for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
        found.add(info[4][0])
    return sorted(a for a in found if not a.startswith("127."))


def test_no_port_listens_beyond_loopback(server):
    others = _other_addresses()
    if not others:
        pytest.skip("this machine has no address besides loopback to try")
    for address in others:
        for port in (server.http_port, server.grpc_port, server.metrics_port):
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex((address, port)) != 0, f"port {port} answers on {address}"
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=2):
        pass  # and loopback does


@pytest.mark.parametrize("method, path", ADMIN_ROUTES)
def test_administrative_http_apis_refuse_a_client_without_the_header(server, method, path):
    url = f"http://{server.http_url}{path}"
    refused = requests.request(method, url, json={}, timeout=30)
    assert refused.status_code == 403 and "restricted" in refused.text, (refused.status_code, refused.text)
    assert requests.get(f"http://{server.http_url}/v2/models/static_batching/ready", timeout=30).status_code == 200
    if path.endswith(("/index", "/status", "/logging", "/setting")):  # the starter's header opens them
        assert requests.request(method, url, json={}, headers=server.admin_headers, timeout=30).status_code == 200


def test_administrative_grpc_apis_refuse_a_client_without_the_header(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for call in (client.get_model_repository_index, lambda: client.unload_model("static_batching"),
                     client.get_system_shared_memory_status, client.get_log_settings):
            with pytest.raises(InferenceServerException) as refused:
                call()
            # NOTE: tritonserver 2.51 refuses with UNAVAILABLE over gRPC; the message tells it from overload
            assert "This protocol is restricted" in str(refused.value), str(refused.value)
        assert client.is_model_ready("static_batching")
        index = client.get_model_repository_index(headers=server.grpc_admin_headers)
        assert {m.name for m in index.models} >= {"static_batching", "dynamic_batching", "continuous_batching"}
    finally:
        client.close()


def test_inference_stays_open_to_every_client(server):
    llm = LLMClient(server.http_url, server.grpc_url, timeout=120)
    try:
        assert llm.generate("continuous_batching", "Still open", 3, ignore_eos=True).num_output_tokens == 3
    finally:
        llm.close()


def test_by_default_the_key_is_tritonservers_argument_and_nothing_is_preloaded(server):
    """The default: the key reaches tritonserver as its argument (where other users of the machine can
    read it in /proc), no library is preloaded, and the restricted APIs above answer the key."""
    assert not server.token_hidden
    assert server.admin_token.encode() in Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    environ = Path(f"/proc/{server.process.pid}/environ").read_bytes()
    assert b"BATCHLM_ARGV_" not in environ and b"argv_secret" not in environ


@pytest.fixture(scope="module")
def hidden_key_server(tmp_path_factory):
    """A server asked to keep its key off the command line, serving one model (for its stub)."""
    log = tmp_path_factory.mktemp("hidden-key") / "server.log"
    srv = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_path=log,
                       extra_args=("--model-control-mode=explicit", "--load-model=dynamic_batching"),
                       exit_timeout_s=5, hide_admin_key=True)
    with srv:
        yield srv


def test_the_administrative_key_is_on_no_command_line_and_in_no_log(hidden_key_server):
    """Other users of the machine read every process's command line in /proc; asked to (hide_admin_key,
    `batchlm-serve --hide-admin-key`), the key that opens the administrative APIs is on none of the
    server's: tritonserver's holds a placeholder (the key reached it through its environment, which it
    blanked), and the stubs it started inherited neither the key nor the library that put it in place.
    The restricted APIs answer the key all the same."""
    server = hidden_key_server
    token = server.admin_token.encode()
    assert server.token_hidden
    assert server.stubs()  # the stubs are checked too
    for pid in [server.process.pid, *server.stubs()]:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert token not in cmdline and token not in environ, pid
        if pid != server.process.pid:
            assert b"BATCHLM_ARGV_" not in environ and b"argv_secret" not in environ, pid
    assert server.token_placeholder.encode() in Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    assert token not in Path(server.log_path).read_bytes()
    r = requests.post(f"http://{server.http_url}/v2/repository/index", json={}, headers=server.admin_headers,
                      timeout=30)
    assert r.status_code == 200 and token.decode() not in r.text


def test_a_server_that_did_not_take_its_key_refuses_to_serve(tmp_path, monkeypatch):
    """Were the library not preloaded (a loader that ignores LD_PRELOAD), tritonserver's key would be the
    placeholder, which every local user can read: the start fails, saying why, and leaves no server
    running."""
    preloaded = argv_secret.environment

    def without_preload(*args):
        return {k: v for k, v in preloaded(*args).items() if k != "LD_PRELOAD"}

    monkeypatch.setattr(argv_secret, "environment", without_preload)
    srv = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                       log_path=tmp_path / "server.log", extra_args=("--model-control-mode=explicit",),
                       hide_admin_key=True)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the argv_secret library did not run in tritonserver"):
        srv.start(timeout=120)
    # told from the loaded libraries at once, not at the end of TOKEN_TAKEN_TIMEOUT_S
    assert time.monotonic() - started < admin_key.TOKEN_TAKEN_TIMEOUT_S / 2
    assert srv.process is None  # stopped
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", srv.http_port)) != 0, "the server still listens"
