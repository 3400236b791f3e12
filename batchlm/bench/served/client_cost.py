"""What the benchmark client and tritonserver spend per response, by transport: CPU seconds per token.

    batchlm-bench client-cost [--concurrency 1] [--num-requests 16] [--rounds 2] [--out results/client_cost]

One tritonserver serves `continuous_batching` (the model that streams) alone. In each round the same
seeded requests run closed loop once per way of asking, in turn (so a slow phase of the machine falls on
every way alike): streamed over a gRPC stream, streamed as HTTP server-sent events (`/generate_stream`),
and one answer per request over gRPC. Around each run it reads the CPU time of tritonserver and of its
backend stubs from /proc, and its own (this process is the client) from getrusage. Prints, and writes to
--out as `client_cost.md`, per run: output tok/s, client and tritonserver CPU per output token, the
stubs' CPU seconds, and p50 TTFT, inter-token gap and E2E. On a machine the client shares with the
server, the client's CPU is taken from the engine.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

from batchlm.bench.served.arrivals import ArrivalSpec
from batchlm.bench.served.benchmark import Benchmark, BenchmarkConfig
from batchlm.bench.workload import WorkloadSpec, build_requests
from batchlm.launcher.ports import free_port
from batchlm.launcher.processes import exit_cleanly_on_sigterm
from batchlm.launcher.triton_server import TritonServer
from batchlm.paths import PROJECT_ROOT as ROOT

MODEL = "continuous_batching"
WAYS = {  # name: (stream, protocol)
    "streamed, gRPC": (True, "grpc"),
    "streamed, HTTP SSE": (True, "http"),
    "one answer, gRPC": (False, "grpc"),
}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "client_cost")
    args = p.parse_args()
    if min(args.concurrency, args.num_requests, args.rounds) < 1:
        p.error("--concurrency, --num-requests and --rounds must be >= 1")
    return args


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of one process, all its threads, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_once(server: TritonServer, args: argparse.Namespace, requests: list, stream: bool,
                 protocol: str) -> dict:
    """One closed-loop run; the CPU each side spent during it."""
    stubs = [pid for pid in server.descendants() if pid != server.process.pid]
    config = BenchmarkConfig(MODEL, server.http_url, server.grpc_url, None,
                             ArrivalSpec.closed_loop(args.concurrency), stream=stream, protocol=protocol)
    client0, server0, stubs0 = own_cpu(), process_cpu(server.process.pid), sum(map(process_cpu, stubs))
    start = time.perf_counter()
    run = Benchmark(config).run(requests)
    wall = time.perf_counter() - start
    client1, server1, stubs1 = own_cpu(), process_cpu(server.process.pid), sum(map(process_cpu, stubs))
    summary = run.summary
    tokens = summary["output_tokens"]
    if summary["failures"] or run.streamed != stream or tokens == 0:
        raise RuntimeError(f"run failed: failures {summary['failures']}, streamed {run.streamed}, "
                           f"{tokens} tokens")
    return {"tok_s": tokens / wall, "client_us": (client1 - client0) / tokens * 1e6,
            "server_us": (server1 - server0) / tokens * 1e6, "stub_s": stubs1 - stubs0,
            "ttft_p50": summary["ttft"]["p50"], "itl_p50": summary["itl"]["p50"] if stream else None,
            "e2e_p50": summary["e2e"]["p50"]}


def table(rows: list[tuple[int, str, dict]]) -> str:
    def ms(value):
        return "-" if value is None else f"{value * 1e3:.2f}"

    lines = ["| round | way | output tok/s | client CPU us/token | tritonserver CPU us/token | stub CPU s "
             "| TTFT p50 ms | inter-token p50 ms | E2E p50 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for round_no, way, r in rows:
        lines.append(f"| {round_no} | {way} | {r['tok_s']:.1f} | {r['client_us']:.0f} | {r['server_us']:.0f} "
                     f"| {r['stub_s']:.2f} | {ms(r['ttft_p50'])} | {ms(r['itl_p50'])} | {ms(r['e2e_p50'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    exit_cleanly_on_sigterm()
    requests = build_requests(WorkloadSpec(num_requests=args.num_requests))
    args.out.mkdir(parents=True, exist_ok=True)
    server = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          log_path=args.out / "server.log",
                          extra_args=("--model-control-mode=explicit", f"--load-model={MODEL}"))
    rows = []
    with server.start(timeout=300):
        measure_once(server, args, requests[:2], False, "grpc")  # warm up
        for round_no in range(1, args.rounds + 1):
            for way, (stream, protocol) in WAYS.items():
                rows.append((round_no, way, measure_once(server, args, requests, stream, protocol)))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = (f"# Client and server CPU per response: {MODEL}, closed loop at {args.concurrency}, "
            f"{args.num_requests} requests, {args.rounds} rounds\n\n" + table(rows))
    (args.out / "client_cost.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
