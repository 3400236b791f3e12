"""What status an error that a Python model returns gets, per endpoint, on this project's tritonserver 2.51:
HTTP /generate and /generate_stream answer 400 whatever the error's code; /infer and gRPC ModelInfer
carry the code. No batchlm code: two ten-line models.

`refuse` (not decoupled) and `refuse_decoupled` answer every request with an error whose Triton code is
the request's `text_input`. The cause of the 400s, read in the server's source (src/http_server.cc,
r24.10, and still so on its main branch in 2026): `GenerateRequestClass::InferResponseComplete` frees
the error in `AddErrorJson(err)` and then reads the first response's status from it
(`HttpCodeFromError(err)`): freed memory matches no code, so the switch falls to its default, 400. The
/infer path reads the code before it frees the error.

This pins the defect, not a contract of the project: the client reads /generate errors by their message
and sends requests that need a machine-readable overload over /infer or gRPC (docs/operations.md,
"Status codes, per endpoint"). If a newer tritonserver fixes /generate, this test fails: update that
section and `UNAVAILABLE` in tests/functional/test_static_batching.py with it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from batchlm.launcher.ports import free_port
from batchlm.launcher.triton_server import TritonServer
from tests.functional.conftest import is_alive

# the model's code -> (HTTP /infer status, gRPC status)
EXPECTED = {
    "INVALID_ARG": ("400", "INVALID_ARGUMENT"),
    "UNAVAILABLE": ("503", "UNAVAILABLE"),
    "INTERNAL": ("500", "INTERNAL"),
    "NOT_FOUND": ("404", "NOT_FOUND"),
    "UNSUPPORTED": ("501", "UNIMPLEMENTED"),
}
CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
{policy}
input [ {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""
MODEL = '''import triton_python_backend_utils as pb_utils

DECOUPLED = {decoupled}


def refusal(request):
    code = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0].decode()
    error = pb_utils.TritonError(f"refused with {{code}}", getattr(pb_utils.TritonError, code))
    return pb_utils.InferenceResponse(error=error)


class TritonPythonModel:
    def execute(self, requests):
        if not DECOUPLED:
            return [refusal(r) for r in requests]
        for r in requests:
            r.get_response_sender().send(refusal(r), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def _write_repository(root):
    for name, decoupled in (("refuse", False), ("refuse_decoupled", True)):
        (root / name / "1").mkdir(parents=True)
        policy = "model_transaction_policy { decoupled: true }" if decoupled else ""
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, policy=policy))
        (root / name / "1" / "model.py").write_text(MODEL.format(decoupled=decoupled))
    return root


def _http_status(url: str, body: dict) -> str:
    # NOTE: Connection: close, so no connection is left for the server's SIGTERM to wait for
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Connection": "close"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return str(r.status)
    except urllib.error.HTTPError as e:
        e.close()
        return str(e.code)


def _grpc_status(client: grpcclient.InferenceServerClient, code: str) -> str:
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([code.encode()], dtype=np.object_))
    try:
        client.infer("refuse", [tensor], client_timeout=30)
        return "OK"
    except InferenceServerException as exc:
        return str(exc.status()).removeprefix("StatusCode.")


def test_generate_answers_400_for_every_model_error_where_infer_and_grpc_carry_the_code(tmp_path):
    server = TritonServer(model_repository=_write_repository(tmp_path / "repository"), http_port=free_port(),
                          grpc_port=free_port(), metrics_port=free_port(), log_path=tmp_path / "server.log",
                          exit_timeout_s=5)
    server.start(timeout=300)
    tree = server.descendants()
    try:
        base = f"http://{server.http_url}/v2/models"
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        seen, expected = {}, {}
        try:
            for code, (infer_status, grpc_status) in EXPECTED.items():
                for model in ("refuse", "refuse_decoupled"):
                    for endpoint in ("generate", "generate_stream"):
                        seen[code, f"{model} /{endpoint}"] = _http_status(f"{base}/{model}/{endpoint}",
                                                                          {"text_input": code})
                        expected[code, f"{model} /{endpoint}"] = "400"
                infer = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [code]}]}
                seen[code, "refuse /infer"] = _http_status(f"{base}/refuse/infer", infer)
                expected[code, "refuse /infer"] = infer_status
                seen[code, "refuse gRPC"] = _grpc_status(grpc, code)
                expected[code, "refuse gRPC"] = grpc_status
        finally:
            grpc.close()
        assert seen == expected
    finally:
        server.stop()
    time.sleep(0.5)
    assert not [pid for pid in tree if is_alive(pid)], "processes left behind by tritonserver"
