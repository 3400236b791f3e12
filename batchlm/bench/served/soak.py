"""Soak: Locust at saturation against every model at once, and the server's resources over time.

    batchlm-bench soak [--duration 600] [--users 8] [--models static_batching dynamic_batching continuous_batching]
                       [--interval 5] [--out results/soak]
    batchlm-bench soak --http 127.0.0.1:8000 --grpc 127.0.0.1:8001 --server-pid PID   (a running server)

One headless Locust process per model, each keeping `--users` requests in flight for `--duration`
seconds (static_batching needs a multiple of its batch size, 8), on three transports: static_batching
over HTTP /generate, dynamic_batching over HTTP /infer, continuous_batching over streamed gRPC. Outputs
are short (mean `--output-mean` tokens), so many requests start and end and a leak per request shows.
Meanwhile, every `--interval` seconds, it reads tritonserver's process tree (the server and its stubs)
from /proc: resident memory, open file descriptors and threads.

It reports, and checks against bounds (exit 1 if one is broken):
- failures: every failed request, by kind; none is expected at this load (bound: `--max-failures`, 0);
- drift: each model's E2E p99 over the last quarter of the run over its p99 over the second quarter
  (the first is warm-up), from Locust's per-second history (bound: `--max-p99-drift`, 1.5);
- growth: memory, descriptors and threads at the end over the end of the first quarter (bounds:
  `--max-rss-growth-mib`, `--max-fd-growth`, `--max-thread-growth`).
Without `--http`, it starts a server with the project's repository on free ports and stops it after.
It writes soak.json, soak.md and Locust's CSV files to `--out`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from batchlm.launcher.model_control import with_model_control
from batchlm.launcher.ports import free_port
from batchlm.launcher.processes import process_tree
from batchlm.launcher.triton_server import TritonServer
from batchlm.paths import PROJECT_ROOT

MODELS = ("static_batching", "dynamic_batching", "continuous_batching")
# model -> (locustfile, extra Locust arguments): one transport each, so the soak crosses all three
TRANSPORTS = {
    "static_batching": ("locustfiles/http_user.py", ()),
    "dynamic_batching": ("locustfiles/http_user.py", ("--http-endpoint", "infer")),
    "continuous_batching": ("locustfiles/grpc_stream_user.py", ()),
}
LOCUST = str(Path(sys.executable).parent / "locust")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="batchlm-bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--users", type=int, default=8, help="requests in flight per model (a multiple of 8)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--interval", type=float, default=5.0, help="seconds between resource samples")
    p.add_argument("--output-mean", type=int, default=32)
    p.add_argument("--output-cap", type=int, default=64)
    p.add_argument("--http", help="a running server's HTTP address (host:port)")
    p.add_argument("--grpc", help="a running server's gRPC address (host:port)")
    p.add_argument("--server-pid", type=int, help="with --http: tritonserver's pid, for its resources")
    p.add_argument("--max-failures", type=int, default=0)
    p.add_argument("--max-p99-drift", type=float, default=1.5,
                   help="bound on the E2E p99 drift; 0: reported, not bounded (a latency ratio that depends on "
                        "the CPU and what else runs on it)")
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    p.add_argument("--max-fd-growth", type=int, default=16)
    p.add_argument("--max-thread-growth", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("results/soak"))
    args = p.parse_args(argv)
    if args.users < 1 or args.users % 8 and "static_batching" in args.models:
        p.error("--users must be a positive multiple of 8 (static_batching answers only full batches)")
    if bool(args.http) != bool(args.grpc) or bool(args.http) != bool(args.server_pid):
        p.error("--http, --grpc and --server-pid go together (or none, to start a server)")
    if args.duration < 4 * args.interval:
        p.error("--duration must be at least 4 x --interval (quarters of the run are compared)")
    return args


# --- resources ---

@dataclass(frozen=True)
class Sample:
    t: float            # seconds since the load started
    processes: int      # tritonserver and its stubs
    rss_mib: float
    fds: int
    threads: int


def sample(root: int, t: float) -> Sample:
    rss_kib = fds = threads = processes = 0
    for pid in [root, *process_tree(root)]:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            count = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue  # gone between the listing and the read
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss_kib += int(fields.get("VmRSS", "0 kB").split()[0])
        threads += int(fields.get("Threads", "0"))
        fds += count
        processes += 1
    return Sample(t, processes, rss_kib / 1024, fds, threads)


class Sampler:
    """Samples the server's tree every `interval` seconds on a thread of its own."""

    def __init__(self, root: int, interval: float) -> None:
        self.samples: list[Sample] = []
        self._root, self._interval = root, interval
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.samples.append(sample(self._root, time.monotonic() - self._start))
            if self._stop.wait(self._interval):
                return

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join()
        self.samples.append(sample(self._root, time.monotonic() - self._start))
        return self.samples


# --- load ---

def start_locust(model: str, args: argparse.Namespace, http: str, grpc: str) -> subprocess.Popen:
    locustfile, extra = TRANSPORTS[model]
    host = grpc if "grpc" in locustfile else f"http://{http}"
    prefix = args.out / model
    command = [LOCUST, "-f", locustfile, "--headless", "--host", host, "--model", model,
               "-u", str(args.users), "-r", str(args.users), "-t", f"{args.duration:.0f}s",
               "--csv", str(prefix), "--csv-full-history", "--only-summary", "--stop-timeout", "120",
               "--output-mean", str(args.output_mean), "--output-cap", str(args.output_cap), *extra]
    log = open(f"{prefix}.log", "wb")  # noqa: SIM115 - closed by the child's exit; the parent keeps no handle use
    try:
        return subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        log.close()


def finish_locust(process: subprocess.Popen, timeout: float) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def model_report(prefix: Path, duration: float) -> dict:
    """Requests, failures by message, and E2E p99 in the second and the last quarter of the run."""
    with open(f"{prefix}_stats.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["Type"] == "E2E"]
    requests = sum(int(r["Request Count"]) for r in rows)
    failures_total = sum(int(r["Failure Count"]) for r in rows)
    failures: dict[str, int] = {}
    with open(f"{prefix}_failures.csv") as f:
        for r in csv.DictReader(f):
            failures[r["Error"]] = failures.get(r["Error"], 0) + int(r["Occurrences"])
    p99: dict[str, list[float]] = {"second": [], "last": []}
    with open(f"{prefix}_stats_history.csv") as f:
        history = [r for r in csv.DictReader(f) if r["Type"] == "E2E" and r["99%"] not in ("N/A", "")]
    if history:
        start = int(history[0]["Timestamp"])
        for r in history:
            t = int(r["Timestamp"]) - start
            if duration / 4 <= t < duration / 2:
                p99["second"].append(float(r["99%"]))
            elif t >= 3 * duration / 4:
                p99["last"].append(float(r["99%"]))
    second = statistics.median(p99["second"]) if p99["second"] else None
    last = statistics.median(p99["last"]) if p99["last"] else None
    return {"requests": requests, "failures": failures_total, "failure_kinds": failures,
            "p99_second_quarter_ms": second, "p99_last_quarter_ms": last,
            "p99_drift": (last / second) if second and last else None}


def growth(samples: list[Sample], duration: float) -> dict:
    """End of the run over the end of its first quarter (the warm-up: the engines' pools, Triton's
    connections and the stubs' threads are all up by then)."""
    base = [s for s in samples if s.t <= duration / 4][-1]
    end = samples[-1]
    return {"rss_mib": end.rss_mib - base.rss_mib, "fds": end.fds - base.fds, "threads": end.threads - base.threads,
            "processes": end.processes - base.processes, "from": base.__dict__, "to": end.__dict__}


def check(report: dict, args: argparse.Namespace) -> list[str]:
    broken = []
    for model, m in report["models"].items():
        if m["failures"] > args.max_failures:
            broken.append(f"{model}: {m['failures']} failed requests {m['failure_kinds']}")
        if m["requests"] == 0:
            broken.append(f"{model}: no request completed")
        if args.max_p99_drift and m["p99_drift"] is not None and m["p99_drift"] > args.max_p99_drift:
            broken.append(f"{model}: E2E p99 drifted x{m['p99_drift']:.2f} (bound x{args.max_p99_drift})")
    g = report["growth"]
    for key, bound in (("rss_mib", args.max_rss_growth_mib), ("fds", args.max_fd_growth),
                       ("threads", args.max_thread_growth)):
        if g[key] > bound:
            broken.append(f"server {key} grew by {g[key]:.1f} (bound {bound})")
    if g["processes"] != 0:
        broken.append(f"the server's process count changed by {g['processes']} (a stub died or was added)")
    return broken


def markdown(report: dict) -> str:
    lines = ["| model | requests | failures | E2E p99, 2nd quarter | E2E p99, last quarter | drift |",
             "|---|---:|---:|---:|---:|---:|"]
    for model, m in report["models"].items():
        def ms(v):
            return f"{v:.0f} ms" if v is not None else "n/a"
        drift = f"x{m['p99_drift']:.2f}" if m["p99_drift"] is not None else "n/a"
        lines.append(f"| {model} | {m['requests']} | {m['failures']} | {ms(m['p99_second_quarter_ms'])} | "
                     f"{ms(m['p99_last_quarter_ms'])} | {drift} |")
    g = report["growth"]
    lines += ["", "| server (tritonserver and stubs) | end of first quarter | end | growth |", "|---|---:|---:|---:|",
              f"| resident memory | {g['from']['rss_mib']:.0f} MiB | {g['to']['rss_mib']:.0f} MiB "
              f"| {g['rss_mib']:+.1f} MiB |",
              f"| open file descriptors | {g['from']['fds']} | {g['to']['fds']} | {g['fds']:+d} |",
              f"| threads | {g['from']['threads']} | {g['to']['threads']} | {g['threads']:+d} |"]
    return "\n".join(lines)


def soak(args: argparse.Namespace, http: str, grpc: str, server_pid: int) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    sampler = Sampler(server_pid, args.interval)
    processes = {model: start_locust(model, args, http, grpc) for model in args.models}
    codes = {model: finish_locust(p, args.duration + 180) for model, p in processes.items()}
    samples = sampler.stop()
    report = {"duration_s": args.duration, "users_per_model": args.users, "locust_exit_codes": codes,
              "models": {model: model_report(args.out / model, args.duration) for model in args.models},
              "growth": growth(samples, args.duration), "samples": [s.__dict__ for s in samples]}
    report["broken"] = check(report, args)
    for model, code in codes.items():
        if code not in (0, 1):  # 1: Locust saw failures, which are counted above
            report["broken"].append(f"{model}: Locust exited with {code} (see {args.out / model}.log)")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.http:
        report = soak(args, args.http, args.grpc, args.server_pid)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        server = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                              log_path=args.out / "server.log", extra_args=tuple(with_model_control([])))
        server.start(timeout=300)
        try:
            report = soak(args, server.http_url, server.grpc_url, server.process.pid)
        finally:
            server.drain()
            server.stop()
    (args.out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (args.out / "soak.md").write_text(text + "\n")
    print(text)
    for line in report["broken"]:
        print(f"BROKEN: {line}", file=sys.stderr)
    return 1 if report["broken"] else 0


if __name__ == "__main__":
    sys.exit(main())
