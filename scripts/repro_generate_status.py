#!/usr/bin/env python
"""What HTTP status an error that a Python model returns gets, per endpoint: a reproducer of the
tritonserver defect that turns every such error into 400 on /generate. No batchlm code: two tiny models.

    python scripts/repro_generate_status.py [--work DIR] [--rounds 3]

`refuse` (not decoupled) and `refuse_decoupled` answer every request with an error whose Triton code is
the request's `text_input` (INVALID_ARG, UNAVAILABLE, INTERNAL, NOT_FOUND, UNSUPPORTED). Each code is
sent --rounds times over HTTP /generate and /generate_stream to both models, over HTTP /infer and gRPC
ModelInfer to `refuse`; the script prints one row per code with every status seen, and exits 1 if a
Python model's UNAVAILABLE reached /infer or gRPC as anything but 503 / UNAVAILABLE.

On this project's tritonserver 2.51 (session 20): /generate and /generate_stream answered 400 for every
code, /infer 400, 503, 500, 404 and 501, and gRPC the code itself. The cause, read in the server's
source (src/http_server.cc, r24.10, and still so on its main branch in 2026): in
`GenerateRequestClass::InferResponseComplete`, `AddErrorJson(err)` frees the error, and the status of
the first response is then read from it (`HttpCodeFromError(err)`): from freed memory, which matches no
code, so the switch falls to its default, 400. The /infer path reads the code before it frees the error.
Triton's own refusals before the model runs (dynamic batching's full queue) take another path and get
their status (503).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from batchlm.server.triton_server import TritonServer, free_port

CODES = ("INVALID_ARG", "UNAVAILABLE", "INTERNAL", "NOT_FOUND", "UNSUPPORTED")
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


def write_repository(root: Path) -> Path:
    for name, decoupled in (("refuse", False), ("refuse_decoupled", True)):
        folder = root / name / "1"
        folder.mkdir(parents=True, exist_ok=True)
        policy = "model_transaction_policy { decoupled: true }" if decoupled else ""
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, policy=policy))
        (folder / "model.py").write_text(MODEL.format(decoupled=decoupled))
    return root


def http_status(url: str, body: dict) -> str:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return str(r.status)
    except urllib.error.HTTPError as e:
        return str(e.code)


def grpc_status(client: grpcclient.InferenceServerClient, code: str) -> str:
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([code.encode()], dtype=np.object_))
    try:
        client.infer("refuse", [tensor])
        return "OK"
    except InferenceServerException as exc:
        return str(exc.status()).removeprefix("StatusCode.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="folder for the model repository and the server log")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="repro_generate_status_"))
    server = TritonServer(model_repository=write_repository(work / "repository"), http_port=free_port(),
                          grpc_port=free_port(), metrics_port=free_port(), log_path=work / "server.log")
    seen: dict[tuple[str, str], set[str]] = defaultdict(set)
    with server:
        base = f"http://{server.http_url}/v2/models"
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            for _ in range(args.rounds):
                for code in CODES:
                    for model in ("refuse", "refuse_decoupled"):
                        for endpoint in ("generate", "generate_stream"):
                            seen[code, f"{model} /{endpoint}"].add(
                                http_status(f"{base}/{model}/{endpoint}", {"text_input": code}))
                    infer = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [code]}]}
                    seen[code, "refuse /infer"].add(http_status(f"{base}/refuse/infer", infer))
                    seen[code, "refuse gRPC"].add(grpc_status(grpc, code))
        finally:
            grpc.close()
    columns = sorted({column for _, column in seen}, key=lambda c: ("gRPC" in c, "/infer" in c, c))
    print("| code | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for code in CODES:
        print(f"| {code} | " + " | ".join(", ".join(sorted(seen[code, c])) for c in columns) + " |")
    print(f"({args.rounds} requests per cell; work folder {work})")
    mapped = seen["UNAVAILABLE", "refuse /infer"] == {"503"} and seen["UNAVAILABLE", "refuse gRPC"] == {"UNAVAILABLE"}
    return 0 if mapped else 1


if __name__ == "__main__":
    sys.exit(main())
