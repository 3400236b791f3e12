"""What one busy process beside the server costs it: throughput idle and with a core held, in process and served.

    batchlm-bench contention [--models continuous_batching static_batching dynamic_batching]
                             [--policies adaptive fixed] [--repeats 3] [--num-requests 32]
                             [--concurrency 8] [--output-tokens 48] [--busy-nice 0] [--out results/contention]

Two thread policies, the engine's `adaptive_threads` parameter: `adaptive` (as shipped: the engine steps
with fewer threads while other processes hold cores, batchlm.engine.thread_governor) and `fixed` (always
`num_threads`). For each policy:
- in process: the engine alone (continuous batching), the seeded workload queued at once and stepped to
  the end, in a fresh process each time (OpenMP's state is per process);
- served: each model in a tritonserver of its own per policy (only that model loaded, `adaptive_threads` set in a
  copy of its config), driven over gRPC by the project's benchmark client, closed loop at
  `--concurrency` (static_batching needs it to be a multiple of its batch size to fill batches).
Each measurement is made idle and with a busy process beside it (`while True: pass` in another Python,
at normal priority unless `--busy-nice`, started before the busy half and killed after), `--repeats`
times; within each half the policies take turns (served, both servers stay up, and the one not measured
is idle), so a change in the machine falls on both. Served, a short uncounted run (`--concurrency`
requests) comes before each measured one: the adaptive engine follows a change in the machine within
two of its governor's periods (0.5 s of stepping), and the table is of the steady state. The table
shows medians of output tokens/s and two ratios: busy over idle (what the busy core costs), and
adaptive over fixed when idle (what the policy costs when nothing else runs). Every run records the
cores the hypervisor stole meanwhile (`steal_cores`): on a VM, another guest is contention too.

The client runs on the same machine in both halves of a pair, so it costs both the same share. Run
nothing else meanwhile: any other load is contention too. It writes `contention.json` and
`contention.md` to `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from batchlm.bench.workload import WorkloadSpec
from batchlm.paths import DEFAULT_REPOSITORY, PROJECT_ROOT

MODELS = ("continuous_batching", "static_batching", "dynamic_batching")
POLICIES = ("adaptive", "fixed")
IN_PROCESS = "engine, in process"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="batchlm-bench contention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS,
                   help="served models to measure (none: in process only)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--no-in-process", dest="in_process", action="store_false")
    p.add_argument("--repeats", type=int, default=3, help="idle/busy pairs per row (the median is shown)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="served: closed-loop requests in flight")
    p.add_argument("--output-tokens", type=int, default=48, help="every request's output length (EOS ignored)")
    p.add_argument("--prompt-tokens-max", type=int, default=64)
    p.add_argument("--busy-nice", type=int, default=0, help="nice value of the busy process")
    p.add_argument("--out", type=Path, default=Path("results/contention"))
    p.add_argument("--engine-case", help=argparse.SUPPRESS)  # internal: one in-process run, JSON out
    args = p.parse_args(argv)
    if args.repeats < 1 or args.num_requests < 1 or args.concurrency < 1 or args.output_tokens < 1:
        p.error("--repeats, --num-requests, --concurrency and --output-tokens must be >= 1")
    return args


def workload(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(num_requests=args.num_requests, prompt_tokens_min=min(16, args.prompt_tokens_max),
                        prompt_tokens_max=args.prompt_tokens_max, output_min=args.output_tokens,
                        output_cap=args.output_tokens, output_mean=float(args.output_tokens))


@contextlib.contextmanager
def busy_process(nice: int) -> Iterator[subprocess.Popen]:
    """Another process that keeps one core busy for as long as the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    time.sleep(0.3)  # NOTE: running, and placed by the scheduler, before the measurement starts
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def steal_seconds() -> float:
    """CPU seconds the hypervisor gave other guests while this VM's CPUs wanted them (0 on bare metal)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()  # the aggregate "cpu" line
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def timed(measure: Callable[[], dict]) -> dict:
    """`measure()`, with the cores the hypervisor stole meanwhile (another VM is contention too)."""
    start, steal = time.monotonic(), steal_seconds()
    result = measure()
    result["steal_cores"] = (steal_seconds() - steal) / (time.monotonic() - start)
    return result


def interleaved(measures: dict[str, Callable[[], dict]], repeats: int, nice: int,
                settles: dict[str, Callable[[], object]] | None = None) -> dict[str, dict]:
    """Per policy, `repeats` idle and busy runs of its measure, the policies taking turns within each
    half, so a change in the machine falls on all of them alike; the medians and every run. Where a
    policy has a `settles` entry, it runs, uncounted, right before each of its measured runs: the
    engine follows a change in the machine within two periods of stepping (ThreadGovernor), and the
    table is of the steady state on either side of it."""
    runs = {policy: {"idle": [], "busy": []} for policy in measures}
    settles = settles or {}

    def half(side: str) -> None:
        for policy, measure in measures.items():
            if policy in settles:
                settles[policy]()
            runs[policy][side].append(timed(measure))

    for _ in range(repeats):
        half("idle")
        with busy_process(nice):
            half("busy")
    rows = {}
    for policy, sides in runs.items():
        row = {side: statistics.median(r["output_tokens_per_s"] for r in sides[side]) for side in sides}
        row["busy_over_idle"] = row["busy"] / row["idle"]
        row["runs"] = sides
        rows[policy] = row
    return rows


# --- in process ---

def engine_case(policy: str, spec: dict) -> dict:
    """One run of the engine alone, built and stepped on one worker thread (as the services do)."""
    import threading

    from batchlm.bench.engine_baseline import run_to_completion
    from batchlm.bench.workload import build_requests
    from batchlm.engine.engine import LLMEngine
    from batchlm.engine.engine_config import EngineConfig
    from batchlm.paths import TINY_MODEL_DIR

    requests = build_requests(WorkloadSpec(**spec))
    result: dict = {}

    def run() -> None:
        engine = LLMEngine(TINY_MODEL_DIR, EngineConfig(adaptive_threads=policy == "adaptive"))
        done = run_to_completion(engine, requests)
        result.update(output_tokens_per_s=done["output_token_throughput"], duration_s=done["duration_s"],
                      steps=done["steps"])

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return result


def measure_in_process(policy: str, spec: WorkloadSpec) -> dict:
    out = subprocess.run([sys.executable, "-m", "batchlm.bench.served.contention", "--engine-case",
                          json.dumps({"policy": policy, "spec": spec.as_dict()})],
                         cwd=PROJECT_ROOT, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- served ---

@contextlib.contextmanager
def served(model: str, policy: str, log_dir: Path) -> Iterator[object]:
    """A tritonserver with only `model`, its `adaptive_threads` set by `policy`."""
    from batchlm.bench.served.config_override import ConfigOverride, overridden_repository
    from batchlm.launcher.ports import free_port
    from batchlm.launcher.triton_server import TritonServer

    value = "true" if policy == "adaptive" else "false"
    with tempfile.TemporaryDirectory(prefix="batchlm-contention-") as scratch:
        repository = overridden_repository(DEFAULT_REPOSITORY, model,
                                           [ConfigOverride("parameters.adaptive_threads", value)], Path(scratch))
        server = TritonServer(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                              metrics_port=free_port(), log_path=log_dir / f"server-{model}-{policy}.log",
                              extra_args=("--model-control-mode=explicit", f"--load-model={model}"))
        server.start(timeout=300)
        try:
            yield server
        finally:
            server.stop()


def measure_served(server, model: str, spec: WorkloadSpec, concurrency: int) -> dict:
    from batchlm.bench.served.arrivals import ArrivalSpec
    from batchlm.bench.served.benchmark import Benchmark, BenchmarkConfig
    from batchlm.bench.workload import build_requests

    config = BenchmarkConfig(model, server.http_url, server.grpc_url, None, ArrivalSpec.closed_loop(concurrency),
                             protocol="grpc")
    summary = Benchmark(config).run(build_requests(spec)).summary
    if summary["num_ok"] != summary["num_requests"]:
        raise RuntimeError(f"{model}: {summary['num_requests'] - summary['num_ok']} requests failed: "
                           f"{summary['failures']}")
    return {"output_tokens_per_s": summary["output_token_throughput"], "duration_s": summary["duration_s"],
            "e2e_p50_s": summary["e2e"]["p50"]}


# --- report ---

def table(rows: list[dict]) -> str:
    """Markdown: one line per (where, policy), with the busy/idle ratio and adaptive/fixed when idle."""
    idle = {(r["where"], r["policy"]): r["idle"] for r in rows}
    lines = ["| where | threads | idle tok/s | one core busy tok/s | busy / idle | idle: adaptive / fixed |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        fixed = idle.get((r["where"], "fixed"))
        versus = f"{r['idle'] / fixed:.2f}" if r["policy"] == "adaptive" and fixed else ""
        lines.append(f"| {r['where']} | {r['policy']} | {r['idle']:.0f} | {r['busy']:.0f} | "
                     f"{r['busy_over_idle']:.0%} | {versus} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.engine_case:
        case = json.loads(args.engine_case)
        print(json.dumps(engine_case(case["policy"], case["spec"])))
        return
    spec = workload(args)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def report(row: dict) -> None:
        rows.append(row)
        print(f"{row['where']:<22} {row['policy']:<9} idle {row['idle']:7.1f} tok/s  busy {row['busy']:7.1f} "
              f"tok/s  busy/idle {row['busy_over_idle']:.0%}", flush=True)

    if args.in_process:
        measures = {policy: (lambda policy=policy: measure_in_process(policy, spec)) for policy in args.policies}
        for policy, row in interleaved(measures, args.repeats, args.busy_nice).items():
            report({"where": IN_PROCESS, "policy": policy, **row})
    for model in args.models:
        with contextlib.ExitStack() as stack:
            servers = {policy: stack.enter_context(served(model, policy, args.out)) for policy in args.policies}
            measures = {policy: (lambda server=server: measure_served(server, model, spec, args.concurrency))
                        for policy, server in servers.items()}
            settle_spec = dataclasses.replace(spec, num_requests=args.concurrency)
            settles = {policy: (lambda server=server: measure_served(server, model, settle_spec, args.concurrency))
                       for policy, server in servers.items()}
            for measure in measures.values():
                measure()  # warm-up, not counted
            for policy, row in interleaved(measures, args.repeats, args.busy_nice, settles).items():
                report({"where": f"{model}, served", "policy": policy, **row})
    doc = {"workload": spec.as_dict(), "concurrency": args.concurrency, "repeats": args.repeats,
           "busy_nice": args.busy_nice, "cpus": len(os.sched_getaffinity(0)), "rows": rows}
    (args.out / "contention.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = table(rows)
    (args.out / "contention.md").write_text(text + "\n")
    print()
    print(text)
    print(f"wrote {args.out / 'contention.json'} and .md")


if __name__ == "__main__":
    main()
