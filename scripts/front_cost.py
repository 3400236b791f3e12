#!/usr/bin/env python
"""What the TensorRT-LLM front (`continuous_batching_trtllm`) costs, measured on the CPU.

    python scripts/front_cost.py [--rounds 2] [--num-requests 96] [--concurrency 32] [--lock-file F]

The front sends every engine response through Triton twice (engine -> front over BLS, front -> client),
in a Python process of its own. On a GPU, that per-token work caps what the front can pass on, whatever
the engine makes. Here the engine behind the front is the functional tests' stand-in
(`tests/functional/trtllm_standin/`: TensorRT-LLM's tensor contract over batchlm's engine, with
`continuous_batching`'s settings), so the front's cost can be read against `continuous_batching`, the same
engine without a front:
- direct: `continuous_batching` alone on a tritonserver;
- front: `continuous_batching_trtllm` + the stand-in on another.
Each runs the seeded workload closed loop at --concurrency, streamed (a response per token) and not,
alternated over --rounds. Reported per run: output tok/s over the whole run (the front cannot tell how
many requests wait inside the engine, so there is no saturated window to read), and the CPU seconds per
1,000 output tokens of each Python stub (read from /proc), so the front's own CPU per token is a figure
a GPU machine can be sized with. Writes --out/front_cost.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchlm.triton_server import TritonServer, free_port  # noqa: E402
from client.arrivals import ArrivalSpec  # noqa: E402
from client.benchmark import BenchmarkConfig  # noqa: E402
from client.report import measure  # noqa: E402
from client.workload import WorkloadSpec, build_requests  # noqa: E402
from tests.functional.trtllm_standin import FRONT, standin_repository  # noqa: E402

DIRECT = "continuous_batching"
TICKS = os.sysconf("SC_CLK_TCK")


def stub_cpu(server: TritonServer) -> dict[str, float]:
    """CPU seconds (user + system) of each Python stub of `server`, by the model it serves."""
    seconds = {}
    for pid, model in server.stubs().items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[model] = (int(stat[11]) + int(stat[12])) / TICKS
    return seconds


def run(server: TritonServer, model: str, stream: bool, requests: list, spec: WorkloadSpec, concurrency: int,
        timeout: float) -> dict:
    config = BenchmarkConfig(model, server.http_url, server.grpc_url, server.metrics_url,
                             ArrivalSpec.closed_loop(concurrency), stream=stream, timeout=timeout)
    before = stub_cpu(server)
    doc = measure(config, requests, spec.as_dict())
    after = stub_cpu(server)
    summary = doc["summary"]
    tokens = sum(r["num_output_tokens"] for r in doc["requests"] if r.get("ok", True))
    assert summary["failures"] == {}, summary["failures"]
    return {"model": model, "stream": stream, "tok_s": summary["output_token_throughput"], "output_tokens": tokens,
            "cpu_s_per_1k_tokens": {m: round(1000 * (after[m] - before.get(m, 0.0)) / tokens, 3) for m in after}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("results/front_cost"))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    ap.add_argument("--lock-file", type=Path, help="hold this flock while the servers run")
    args = ap.parse_args()

    spec = WorkloadSpec(num_requests=args.num_requests)
    requests = build_requests(spec)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "repository"
    shutil.rmtree(work, ignore_errors=True)
    repository = standin_repository(work / "front")
    results = []
    with contextlib.ExitStack() as stack:
        if args.lock_file:
            lock = stack.enter_context(open(args.lock_file, "w"))
            fcntl.flock(lock, fcntl.LOCK_EX)
        for round_ in range(args.rounds):
            for model in ((DIRECT, FRONT) if round_ % 2 == 0 else (FRONT, DIRECT)):
                kwargs = {"extra_args": ("--model-control-mode=explicit", f"--load-model={DIRECT}")} \
                    if model == DIRECT else {"model_repository": repository}
                server = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                      log_path=args.out / f"server-{model}-{round_}.log", **kwargs)
                with server:
                    run(server, model, False, requests[:8], spec, 8, args.timeout)  # warm-up
                    for stream in (False, True):
                        results.append({"round": round_ + 1, **run(server, model, stream, requests, spec,
                                                                   args.concurrency, args.timeout)})
                        print(json.dumps(results[-1]), flush=True)
    (args.out / "front_cost.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n| round | model | stream | out tok/s | CPU s / 1k tokens per stub |\n|---|---|---|---|---|")
    for r in results:
        cpu = ", ".join(f"{m} {v}" for m, v in sorted(r["cpu_s_per_1k_tokens"].items()))
        print(f"| {r['round']} | {r['model']} | {r['stream']} | {r['tok_s']:.1f} | {cpu} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
