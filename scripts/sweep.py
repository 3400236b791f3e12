"""Tune one knob: serve a model at several values of one config.pbtxt field, the same load each time.

    python scripts/sweep.py dynamic_batching \\
        --vary dynamic_batching.max_queue_delay_microseconds=0,50000,500000,2000000 \\
        [--rounds 2] [--out results/sweep] -- --rate 1.0 --num-requests 48

    python scripts/sweep.py continuous_batching --vary parameters.max_num_seqs=2,4,8,16 -- --concurrency 32

    python scripts/sweep.py dynamic_batching --vary instance_group.0.count=1,2 \
        --vary parameters.num_threads=2,1 -- --rate 3.0 --num-requests 96

Several --vary flags move their fields together: each needs as many values as the first, and the k-th
run of a round sets every field to its k-th value (above: 1 instance of 2 threads, then 2 of 1).

Everything after `--` goes to `scripts/benchmark.py` as it is (the load, the workload flags, --protocol,
--set for fields that stay fixed, --model-repository). For each round, and in each round for each value in
turn (so a slow phase of the machine falls on every value alike), the model is served from a copy of
its folder with `--set PATH=VALUE` (one per --vary) by its own tritonserver and measured once. Writes each run's JSON
and markdown under --out/<value>/round-<k>/, and the sweep's own `sweep.md`, `sweep.json` and `sweep.png`:
per value, the medians over the rounds of the batch Triton formed, sequences per forward pass,
throughput and latency.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchlm.triton_server import DEFAULT_REPOSITORY  # noqa: E402
from client import plots  # noqa: E402
from client.config_override import ConfigOverride, overridden_config  # noqa: E402
from client.sweep import sweep_markdown, sweep_rows  # noqa: E402

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
    p.epilog = "after --: scripts/benchmark.py's flags (load, workload, protocol, --set for fixed fields)"
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
    """One `scripts/benchmark.py` run with each PATH=value of `setting` on its own server; its run document."""
    sets = [arg for path, value in setting.items() for arg in ("--set", f"{path}={value}")]
    command = [sys.executable, str(ROOT / "scripts" / "benchmark.py"), args.model, "--start-server",
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
    command = shlex.join(["python", "scripts/sweep.py", *(a for a in sys.argv[1:] if a != "--report-only")])
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
