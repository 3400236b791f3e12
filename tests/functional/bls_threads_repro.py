"""A minimal reproducer of the Python backend defect behind continuous_batching_trtllm's crash, and of its
remedy: finished decoupled BLS calls freed by the stub without the GIL. No batchlm code: two tiny models.

    .venv/bin/python -m tests.functional.bls_threads_repro [--concurrency 16] [--requests 1600] [--responses 100]
                     [--noise] [--remedy] [--fail-at K] [--work DIR] [-- TRITON_ARGS]

Not collected by pytest (no `test_` prefix): `tests/functional/test_bls_cleanup.py` runs it with
`--noise --remedy`; the other modes are for running by hand.

`callee` (decoupled) answers N responses, one per 2 ms step, from its own thread. `caller` (decoupled)
starts a thread per request that makes one decoupled BLS call to `callee`, iterates its responses and
answers the client once. Clients: --concurrency gRPC streams, one request at a time each. A request
unanswered for 30 s counts as stalled. Prints what was answered, which stubs are alive at the end, and
any heap-corruption line tritonserver logged; exits 1 if a request stalled or a stub died.
Without --remedy, tritonserver 2.51's caller stub can die with more than one call in flight, logging
`corrupted size vs. prev_size in fastbins`, `malloc_consolidate(): unaligned fastbin chunk detected`,
`malloc(): unaligned fastbin chunk detected`, or nothing. The race is timing-dependent: on some machines
plain runs answer every request, which is what --noise is for.
The cause (python_backend r24.10 source): a finished call's response iterator is shared by Python and
the stub's routing map, and the map lets go on the stub's message thread, without the GIL. When Python
lets go first (here: as soon as `sum` returns), the iterator and its responses' numpy arrays are freed
on that thread while Python threads run.
--noise makes Python let go first every time: a caller thread logs without pause, and each call's
cleanup waits behind those log round trips in the stub's one queue, so the caller's stub dies within a
run of the defaults.
--remedy makes each caller thread ask `is_cancelled()` (a round trip through the same queue) before it
lets go, so the stub has let go already and every request is answered, --noise or not. The front does the
same with a `BlsReaper` (batchlm/backend/trtllm/bls_reaper.py).
"""

from __future__ import annotations

import argparse
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from batchlm.launcher.ports import free_port
from batchlm.launcher.triton_server import TritonServer

CALLEE_CONFIG = """name: "callee"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
CALLEE = '''import queue, threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

FAIL_AT = -1  # set by write_repository: answer an error (final) instead of response number FAIL_AT (0-based)


class TritonPythonModel:
    def initialize(self, args):
        self.inbox = queue.Queue()
        threading.Thread(target=self.run, daemon=True).start()

    def execute(self, requests):
        for r in requests:
            self.inbox.put([r.get_response_sender(), int(pb_utils.get_input_tensor_by_name(r, "N").as_numpy()[0]), 0])
        return None

    def run(self):
        active = []
        while True:
            try:
                while True:
                    active.append(self.inbox.get(block=not active))
            except queue.Empty:
                pass
            time.sleep(0.002)  # one step
            for item in list(active):
                if item[2] == FAIL_AT:
                    item[0].send(pb_utils.InferenceResponse(error=pb_utils.TritonError("callee failed")),
                                 flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    active.remove(item)
                    continue
                item[1] -= 1
                item[2] += 1
                response = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([item[1]], np.int32))])
                if item[1] <= 0:
                    item[0].send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    active.remove(item)
                else:
                    item[0].send(response)
'''
CALLER_CONFIG = CALLEE_CONFIG.replace('"callee"', '"caller"').replace('name: "OUT" data_type: TYPE_INT32 dims: [ -1 ]',
                                                                      'name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ]')
CALLER = '''import threading
import numpy as np
import triton_python_backend_utils as pb_utils

NOISE, REMEDY = False, False  # set by write_repository


class TritonPythonModel:
    def initialize(self, args):
        self.quiet = threading.Event()
        if NOISE:  # log round trips queued ahead of each call's cleanup: Python lets go of its iterator first
            threading.Thread(target=self.noise, daemon=True).start()

    def finalize(self):
        self.quiet.set()

    def noise(self):
        while not self.quiet.is_set():
            pb_utils.Logger.log_verbose("noise")

    def execute(self, requests):
        for r in requests:
            n = pb_utils.get_input_tensor_by_name(r, "N").as_numpy().copy()
            threading.Thread(target=self.serve, args=(r.get_response_sender(), n), daemon=True).start()
        return None

    def serve(self, sender, n):
        call = pb_utils.InferenceRequest(model_name="callee", inputs=[pb_utils.Tensor("N", n)],
                                         requested_output_names=["OUT"])
        responses = call.exec(decoupled=True)
        count = sum(1 for response in responses if pb_utils.get_output_tensor_by_name(response, "OUT") is not None)
        if REMEDY:  # a round trip queued behind the call's cleanup: the stub has let go once it is answered
            sender.is_cancelled()
        del responses  # Python's share of the iterator
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("COUNT", np.array([count], np.int32))]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


def write_repository(root: Path, noise: bool, remedy: bool, fail_at: int) -> Path:
    caller = CALLER.replace("NOISE, REMEDY = False, False", f"NOISE, REMEDY = {noise}, {remedy}")
    callee = CALLEE.replace("FAIL_AT = -1", f"FAIL_AT = {fail_at}")
    for name, config, code in (("callee", CALLEE_CONFIG, callee), ("caller", CALLER_CONFIG, caller)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
        (root / name / "1" / "model.py").write_text(code)
    return root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=1600)
    ap.add_argument("--responses", type=int, default=100, help="responses per BLS call")
    ap.add_argument("--noise", action="store_true",
                    help="a caller thread logging without pause, so each call's cleanup waits in the stub's queue")
    ap.add_argument("--remedy", action="store_true",
                    help="after each call, one is_cancelled() round trip before Python lets go of its iterator")
    ap.add_argument("--fail-at", type=int, default=-1,
                    help="the callee answers an error (final) instead of its response number K (0-based)")
    ap.add_argument("--work", type=Path,
                    help="an empty folder for the repository and the log (default: a new temp one)")
    ap.add_argument("extra", nargs="*", help="extra tritonserver arguments, after --")
    args = ap.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="bls_threads_"))
    server = TritonServer(model_repository=write_repository(work / "repository", args.noise, args.remedy, args.fail_at),
                          http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          log_path=work / "server.log", extra_args=tuple(args.extra))
    answered, stalled, lock = [0], [0], threading.Lock()

    def client(count: int) -> None:
        c = grpcclient.InferenceServerClient(server.grpc_url)
        responses: queue.Queue = queue.Queue()
        c.start_stream(callback=lambda result, error: responses.put(error))
        try:
            for _ in range(count):
                n = grpcclient.InferInput("N", [1], "INT32")
                n.set_data_from_numpy(np.array([args.responses], np.int32))
                c.async_stream_infer("caller", [n])
                try:
                    responses.get(timeout=30)
                except queue.Empty:
                    with lock:
                        stalled[0] += 1
                    return
                with lock:
                    answered[0] += 1
        finally:
            c.stop_stream(cancel_requests=True)
            c.close()

    with server:
        start = time.monotonic()
        threads = [threading.Thread(target=client, args=(args.requests // args.concurrency,))
                   for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        alive = sorted(server.stubs().values())
        elapsed = time.monotonic() - start
    heap = server.crash_lines()
    print(f"answered {answered[0]} of {args.requests}, stalled {stalled[0]}, in {elapsed:.1f}s; "
          f"stubs alive at the end: {alive}; heap errors logged: {heap or 'none'}; log: {work / 'server.log'}")
    return 1 if stalled[0] or alive != ["callee", "caller"] else 0


if __name__ == "__main__":
    sys.exit(main())
