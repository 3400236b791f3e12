"""What streaming granularity costs: continuous batching streamed at several `stream_interval`s.

    batchlm-bench stream-interval [--intervals 1 2 4 8] [--rounds 2] [--concurrency 32]
                                      [--num-requests 128] [--protocol http|grpc] [--out results/stream_interval]

For each round, and in each round for each interval in turn (so a slow phase of the machine falls on
every interval alike), a copy of `continuous_batching` with that `stream_interval` is served by its own
tritonserver and measured with `batchlm/bench/served/run.py ... --stream` at saturation (closed loop), then
once more with `--no-stream` (one answer per request) as the reference. Writes every run's JSON and
markdown under --out and a summary table, `stream_interval.md`: medians over the rounds of output
tok/s while saturated, TTFT, inter-chunk gap and responses per request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from batchlm.paths import PROJECT_ROOT as ROOT
from batchlm.bench.served.comparison import write_variant
from batchlm_client.triton_llm import STREAMING_PROTOCOLS

MODEL = "continuous_batching"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--protocol", choices=STREAMING_PROTOCOLS, default="http",
                   help="the benchmark client's transport (batchlm/bench/served/run.py --protocol)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "stream_interval")
    args = p.parse_args()
    if any(i < 1 for i in args.intervals) or args.rounds < 1:
        p.error("--intervals must be >= 1 and --rounds >= 1")
    return args


def run_once(args: argparse.Namespace, repository: Path, stream: bool, out: Path) -> dict:
    """One `batchlm-bench run` on its own server; its run document."""
    command = [sys.executable, "-m", "batchlm.bench", "run", MODEL, "--start-server",
               "--model-repository", str(repository), "--concurrency", str(args.concurrency),
               "--num-requests", str(args.num_requests), "--stream" if stream else "--no-stream",
               "--protocol", args.protocol, "--out", str(out)]
    subprocess.run(command, check=True, cwd=ROOT)
    (document,) = [json.loads(p.read_text()) for p in out.glob(f"{MODEL}-*.json")]
    return document


def figures(doc: dict) -> dict:
    """The figures the summary shows for one run."""
    s = doc["summary"]
    ok = [r for r in doc["requests"] if r["error"] is None]
    return {
        "tok_s": (s.get("saturated") or s)["output_token_throughput"],
        "ttft_p50": s["ttft"]["p50"],
        "itl_p50": s["itl"]["p50"], "itl_p99": s["itl"]["p99"],
        "responses": (statistics.mean(len(r["chunk_times"]) for r in ok) if ok else None)
                     if doc["streamed"] else 1.0,
        "failures": sum(s["failures"].values()) if s["failures"] else 0,
    }


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: dict[str, list[dict]]) -> str:
    reference = median_of(results["not streamed"], "tok_s")
    lines = ["| stream_interval | output tok/s while saturated (each round) | / not streamed | TTFT p50 s "
             "| gap between responses p50 / p99 s | responses per request | failures |",
             "|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        tok = median_of(runs, "tok_s")
        each = " / ".join(f"{r['tok_s']:.1f}" for r in runs)
        lines.append(f"| {name} | {tok:.1f} ({each}) | {tok / reference:.2f} | {_fmt(median_of(runs, 'ttft_p50'))} "
                     f"| {_fmt(median_of(runs, 'itl_p50'))} / {_fmt(median_of(runs, 'itl_p99'))} "
                     f"| {_fmt(median_of(runs, 'responses'), 1)} | {sum(r['failures'] for r in runs)} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    repositories = {i: write_variant(args.out / "variants" / f"interval_{i}", MODEL, {"stream_interval": str(i)})
                    for i in args.intervals}
    results: dict[str, list[dict]] = {str(i): [] for i in args.intervals}
    results["not streamed"] = []
    for k in range(1, args.rounds + 1):
        for i in args.intervals:
            doc = run_once(args, repositories[i], True, args.out / "runs" / f"interval_{i}_round_{k}")
            results[str(i)].append(figures(doc))
        doc = run_once(args, repositories[args.intervals[0]], False, args.out / "runs" / f"not_streamed_round_{k}")
        results["not streamed"].append(figures(doc))
    text = (f"# {MODEL} streamed at several stream_interval values\n\nClosed loop at {args.concurrency}, "
            f"{args.num_requests} requests of the default workload, {args.rounds} rounds; medians over the "
            f"rounds. `not streamed`: one answer per request (`--no-stream`).\n\n{table(results)}\n")
    (args.out / "stream_interval.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
