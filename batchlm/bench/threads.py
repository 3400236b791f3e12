"""Where the engine is built and where it steps: the cost of a second OpenMP team (batchlm.engine.owner_thread).

    batchlm-bench threads [--num-requests 48]

Each case runs in a fresh process (OpenMP state is per process) on the same seeded workload:
- `same-thread`: built and stepped on the main thread;
- `built-elsewhere`: built on the main thread, stepped on another thread (what a worker thread that
  steps a model loaded in `initialize()` does);
- `owner-thread`: built and stepped on the same worker thread (what the services do).
It prints output tokens/s, ms per step and the process's voluntary context switches.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading

from batchlm.paths import TINY_MODEL_DIR

CASES = ("same-thread", "built-elsewhere", "owner-thread")


def run_case(case: str, num_requests: int) -> dict:
    from batchlm.bench.engine_baseline import run_to_completion
    from batchlm.bench.workload import WorkloadSpec, build_requests
    from batchlm.engine.engine import LLMEngine
    from batchlm.engine.engine_config import EngineConfig

    requests = build_requests(WorkloadSpec(num_requests=num_requests))
    result: dict = {}

    def build() -> LLMEngine:
        return LLMEngine(TINY_MODEL_DIR, EngineConfig())

    def step(engine: LLMEngine) -> None:
        import warnings
        warnings.simplefilter("ignore", RuntimeWarning)  # the foreign-thread warning is the point here
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        run = run_to_completion(engine, requests)
        result.update(case=case, output_tokens_per_s=round(run["output_token_throughput"], 1),
                      ms_per_step=round(run["duration_s"] / run["steps"] * 1000, 2),
                      voluntary_context_switches=resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches)

    if case == "same-thread":
        step(build())
    elif case == "built-elsewhere":
        engine = build()
        worker = threading.Thread(target=step, args=(engine,))
        worker.start()
        worker.join()
    else:
        worker = threading.Thread(target=lambda: step(build()))
        worker.start()
        worker.join()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in this process
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.num_requests)))
        return
    print("| case | output tok/s | ms/step | voluntary context switches |\n|---|---|---|---|")
    for case in CASES:
        out = subprocess.run([sys.executable, "-m", "batchlm.bench.threads", "--case", case,
                              "--num-requests", str(args.num_requests)],
                             check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {case} | {r['output_tokens_per_s']} | {r['ms_per_step']} | {r['voluntary_context_switches']} |")


if __name__ == "__main__":
    main()
