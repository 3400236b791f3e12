"""Tune one knob: serve a model at several values of one config.pbtxt field, the same load each time.

    batchlm-bench sweep dynamic_batching \\
        --vary dynamic_batching.max_queue_delay_microseconds=0,50000,500000,2000000 \\
        [--rounds 2] [--out results/sweep] -- --rate 1.0 --num-requests 48

    batchlm-bench sweep continuous_batching --vary parameters.max_num_seqs=2,4,8,16 -- --concurrency 32

    batchlm-bench sweep dynamic_batching --vary instance_group.0.count=1,2 \
        --vary parameters.num_threads=2,1 -- --rate 3.0 --num-requests 96

Several --vary flags move their fields together: each needs as many values as the first, and the k-th
run of a round sets every field to its k-th value (above: 1 instance of 2 threads, then 2 of 1).

Everything after `--` goes to `batchlm-bench run` as it is (the load, the workload flags, --protocol,
--set for fields that stay fixed, --model-repository). For each round, and in each round for each value in
turn (so a slow phase of the machine falls on every value alike), the model is served from a copy of
its folder with `--set PATH=VALUE` (one per --vary) by its own tritonserver and measured once. Writes each run's JSON
and markdown under --out/<value>/round-<k>/, and the sweep's own `sweep.md`, `sweep.json` and `sweep.png`:
per value, the medians over the rounds of the batch Triton formed, sequences per forward pass,
throughput and latency.

A sweep: one config field of one model served at several values, the same workload and load each
time, summarized as a table (and, by batchlm.bench.served.plots.sweep, a plot) of what the knob moved.

Input: run documents (batchlm.bench.served.report.run_document), grouped by the value they ran with, one per round.
Each figure is the median over the rounds, so a slow phase of the machine that fell on one round of
one value does not decide the row.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from batchlm.paths import DEFAULT_REPOSITORY
from batchlm.paths import PROJECT_ROOT as ROOT
from batchlm.bench.served import plots
from batchlm.bench.served.comparison import seqs_per_forward
from batchlm.bench.served.config_override import ConfigOverride, overridden_config

FIGURES = ("requests per execution", "seqs per forward", "req/s", "out tok/s", "out tok/s saturated",
           "TTFT p50", "E2E p50", "E2E p90", "E2E p99")


def figures(doc: dict) -> dict[str, float | None]:
    """One run's figures, by FIGURES' names (None where the run has none)."""
    s = doc["summary"]
    return {
        "requests per execution": s.get("requests_per_execution"),
        "seqs per forward": seqs_per_forward(doc),
        "req/s": s["request_throughput"],
        "out tok/s": s["output_token_throughput"],
        "out tok/s saturated": (s.get("saturated") or {}).get("output_token_throughput"),
        "TTFT p50": s["ttft"]["p50"], "E2E p50": s["e2e"]["p50"], "E2E p90": s["e2e"]["p90"],
        "E2E p99": s["e2e"]["p99"],
    }


def sweep_rows(runs: dict[str, list[dict]]) -> list[dict]:
    """A row per value (in the order given): the medians of each figure over its runs, the requests
    answered out of those sent, and the failures by code over all of them."""
    rows = []
    for value, docs in runs.items():
        each = [figures(doc) for doc in docs]
        row: dict = {"value": value, "rounds": len(docs)}
        for name in FIGURES:
            found = [f[name] for f in each if f[name] is not None]
            row[name] = statistics.median(found) if found else None
        row["ok"] = f'{sum(d["summary"]["num_ok"] for d in docs)}/{sum(d["summary"]["num_requests"] for d in docs)}'
        failures: dict[str, int] = {}
        for doc in docs:
            for code, count in doc["summary"]["failures"].items():
                failures[code] = failures.get(code, 0) + count
        row["failures"] = ", ".join(f"{k}: {v}" for k, v in sorted(failures.items())) or "-"
        rows.append(row)
    return rows


def sweep_markdown(model: str, path: str, rows: list[dict], load: str, command: str, env: dict) -> str:
    """The sweep's table with what it ran: the model, the field, the load, the command and the machine
    (`env`: batchlm.bench.served.report.environment() of a run)."""
    headers = [path, *FIGURES, "ok", "failures"]
    lines = [f"# {model}: {path}", "",
             f"Load: {load}; medians over {rows[0]['rounds'] if rows else 0} round(s) per value. Times in "
             "seconds. `requests per execution` is the batch Triton handed the model (1 where Triton does "
             "not batch); `seqs per forward` the unfinished sequences in the engine's forward passes.", "",
             f"Command: `{command}`", "",
             f"Machine: {env.get('cpu')} x{env.get('cpu_count')}, server {env.get('server')}, "
             f"packages {env.get('packages')}.", "",
             "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = [row["value"], *(_cell(row[name]) for name in FIGURES), row["ok"], row["failures"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"


SET_BY_THE_SWEEP = ("--out", "--start-server", "--http", "--grpc", "--metrics")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--vary", required=True, action="append", metavar="PATH=V1,V2,...",
                   help="the config.pbtxt field and its values, in the order to run them; repeat it to "
                        "move several fields together (the k-th values of each go in one run)")
    p.add_argument("--rounds", type=int, default=1, help="runs per value, interleaved; the table shows medians")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "sweep")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild sweep.md, .json and .png from the runs already under --out")
    p.epilog = "after --: batchlm/bench/served/run.py's flags (load, workload, protocol, --set for fixed fields)"
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])
    args.benchmark_args = argv[split + 1:]
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    varied: dict[str, list[str]] = {}
    for vary in args.vary:
        path, sep, values = vary.partition("=")
        path, values = path.strip(), [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not path or not values:
            p.error("--vary: PATH=V1,V2,..., e.g. dynamic_batching.max_queue_delay_microseconds=0,50000")
        if path in varied:
            p.error(f"--vary {path}: given twice")
        first = next(iter(varied.values()), values)
        if len(values) != len(first):
            p.error(f"--vary {path}: {len(values)} values, the first --vary has {len(first)}; the k-th "
                    "values of each --vary go in one run")
        varied[path] = values
    args.paths = list(varied)
    args.path = ", ".join(args.paths)
    args.settings = [dict(zip(args.paths, values)) for values in zip(*varied.values())]
    args.values = [", ".join(setting.values()) for setting in args.settings]
    if len(set(args.values)) != len(args.values):
        p.error(f"--vary: a value is given twice in {' / '.join(args.values)}")
    for flag in args.benchmark_args:
        name = flag.split("=", 1)[0]
        if name in SET_BY_THE_SWEEP:
            p.error(f"{name}: the sweep sets it for each run; leave it out of the benchmark's flags")
    repository = _repository(args.benchmark_args)
    config = repository / args.model / "config.pbtxt"
    if not config.is_file():
        p.error(f"{args.model}: no such model in {repository}")
    fixed = _fixed_overrides(args.benchmark_args)
    for o in fixed:
        if o.partition("=")[0].strip() in args.paths:
            p.error(f"--set {o.partition('=')[0].strip()}: the sweep varies that field; leave it out of "
                    "the benchmark's flags")
    try:
        fixed = [ConfigOverride.parse(o) for o in fixed]
        overridden_config(config.read_text(), fixed)
    except ValueError as exc:
        p.error(f"--set {exc}")
    for setting in args.settings:  # NOTE: every value checked before the first run, not after an hour
        try:
            overridden_config(config.read_text(), [*fixed, *(ConfigOverride(*kv) for kv in setting.items())])
        except ValueError as exc:
            p.error(f"--vary {exc}")
    return args


def _repository(benchmark_args: list[str]) -> Path:
    for i, flag in enumerate(benchmark_args):
        if flag == "--model-repository" and i + 1 < len(benchmark_args):
            return Path(benchmark_args[i + 1])
        if flag.startswith("--model-repository="):
            return Path(flag.split("=", 1)[1])
    return DEFAULT_REPOSITORY


def _fixed_overrides(benchmark_args: list[str]) -> list[str]:
    found = []
    for i, flag in enumerate(benchmark_args):
        if flag == "--set" and i + 1 < len(benchmark_args):
            found.append(benchmark_args[i + 1])
        elif flag.startswith("--set="):
            found.append(flag.split("=", 1)[1])
    return found


def _document(model: str, out: Path) -> dict:
    """The one run document of `model` in `out`."""
    found = sorted(out.glob(f"{model}-*.json"))
    if len(found) != 1:
        raise SystemExit(f"error: {out} holds {len(found)} runs of {model}, not one")
    return json.loads(found[0].read_text())


def run_once(args: argparse.Namespace, setting: dict[str, str], out: Path) -> dict:
    """One `batchlm-bench run` with each PATH=value of `setting` on its own server; its run document."""
    sets = [arg for path, value in setting.items() for arg in ("--set", f"{path}={value}")]
    command = [sys.executable, "-m", "batchlm.bench", "run", args.model, "--start-server",
               *sets, "--out", str(out), *args.benchmark_args]
    result = subprocess.run(command, cwd=ROOT)
    if result.returncode != 0:
        said = " ".join(f"{path}={value}" for path, value in setting.items())
        raise SystemExit(f"error: the run with {said} failed (exit {result.returncode}); "
                         f"see above and {out / 'server.log'}")
    return _document(args.model, out)


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {value: [] for value in args.values}
    for k in range(1, args.rounds + 1):
        for value, setting in zip(args.values, args.settings):
            out = args.out / _slug(value) / f"round-{k}"
            if args.report_only:
                runs[value].append(_document(args.model, out))
                continue
            said = " ".join(f"{path}={v}" for path, v in setting.items())
            print(f"== round {k}/{args.rounds}: {said}", flush=True)
            runs[value].append(run_once(args, setting, out))
    rows = sweep_rows(runs)
    load = runs[args.values[0]][0]["arrival"]["label"]
    command = shlex.join(["batchlm-bench", "sweep", *(a for a in sys.argv[1:] if a != "--report-only")])
    env = runs[args.values[0]][0]["environment"]
    (args.out / "sweep.md").write_text(sweep_markdown(args.model, args.path, rows, load, command, env))
    (args.out / "sweep.json").write_text(json.dumps({
        "model": args.model, "path": args.path, "paths": args.paths, "values": args.values,
        "settings": args.settings, "rounds": args.rounds, "load": load,
        "command": command, "benchmark_args": args.benchmark_args, "rows": rows,
        "workload": runs[args.values[0]][0]["workload"], "environment": env,
    }, indent=1))
    plots.sweep(rows, args.path, f"{args.model}, {load}", args.out / "sweep.png")
    print((args.out / "sweep.md").read_text())
    print(f"wrote {args.out / 'sweep.md'}, sweep.json and sweep.png")


def _slug(value: str) -> str:
    """A folder name for a value ("2, 1" of two --vary flags: 2_1)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in value.replace(", ", "_"))


if __name__ == "__main__":
    main()
