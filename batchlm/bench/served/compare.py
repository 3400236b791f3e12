"""The measured comparison of static, dynamic and continuous batching: `make compare`.

    batchlm-bench compare [--out results/compare] [--lock-file /tmp/batchlm-cpu.lock] [--publish docs/results]
                          [--protocol http|grpc|openai]

`--protocol` is the benchmark client's door: Triton's HTTP (default) or gRPC, or `openai`, through an
OpenAI-compatible frontend started next to every run's server.

Every run gets its own tritonserver (free ports, only that model loaded, so strategies never share the
CPU), warmed up, and the same seeded workload (batchlm.bench.workload defaults):
1. saturation, in --repeats (3) interleaved rounds: each round runs dynamic, static and continuous
   batching closed loop at --concurrency (32) on --num-requests (64), then the engine in process (no
   Triton) on the same requests, then continuous batching with the same KV memory (512 blocks x 16
   tokens) but --same-kv-seqs (64) sequences in flight, closed loop at 64 on --same-kv-requests (twice
   --num-requests: each of its slots serves two requests or more). The median run of each counts.
   A virtual machine's speed can drift over tens of minutes, and not on every strategy alike
   (docs/benchmarking.md, "Noise on small machines"); interleaved, a slow phase falls on every strategy
   instead of on whichever ran in it. Every strategy answers each request once (stream=false), so all
   send the same responses and the throughput compares scheduling alone;
2. per strategy, on one server: continuous batching also streamed at saturation (a response per token,
   what per-token responses cost on this machine), and an open-loop Poisson sweep at the same absolute
   rates for every strategy: 0.5x and 0.9x dynamic batching's saturation rate, plus 0.9x continuous
   batching's own, --num-open (24) requests each, and --num-reference (32) at 0.5x, the point the
   latency targets read (the more requests there, the steadier the p50: raise it where time allows);
3. variants written into the results folder (never into model_repository/): static and dynamic with
   pad_finished_rows=false, one saturation run each.
Throughput at saturation is read while the server had requests waiting (the timeline's
`saturated` window): the drain at the end of a closed loop, when fewer requests are left than slots, is
not saturation; the whole run's figures are reported beside it.
Writes runs/*.json|md, comparison.md|json and plots/*.png under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import shutil
import sys
import time
from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from batchlm.backend.serving_config import ServingConfig
from batchlm.bench.served import comparison, plots
from batchlm.bench.served.arrivals import ArrivalSpec
from batchlm.bench.served.benchmark import Benchmark, BenchmarkConfig, unfillable_batches
from batchlm.bench.served.report import markdown_table, measure, summary_row, write_run
from batchlm.bench.workload import OutputLengths, WorkloadRequest, make_spec, requests_of
from batchlm.engine.engine_config import EngineConfig
from batchlm.launcher.frontend_process import FrontendProcess, ServerWithFrontend
from batchlm.launcher.ports import free_port
from batchlm.launcher.processes import exit_cleanly_on_sigterm
from batchlm.launcher.triton_server import TritonServer
from batchlm.paths import DEFAULT_REPOSITORY, served_model
from batchlm_client.openai_client import OPENAI_PROTOCOL
from batchlm_client.triton_llm import STREAMING_PROTOCOLS

STATIC, DYNAMIC, CONT = comparison.STRATEGIES
REFERENCE = "half-dynamic"  # the open-loop point the latency targets read


def _median(results: list[dict]) -> dict:
    """The median result by output tok/s while saturated (the lower middle one of an even count)."""
    return sorted(results, key=comparison.saturated_tok)[(len(results) - 1) // 2]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("results/compare"))
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=64, help="per saturation run (multiple of 8)")
    p.add_argument("--num-open", type=int, default=24, help="per open-loop point (multiple of 8)")
    p.add_argument("--num-reference", type=int, default=32,
                   help="at the open-loop point of the latency targets (0.5x dynamic's saturation rate; "
                        "multiple of 8)")
    p.add_argument("--repeats", type=int, default=3, help="saturation runs per strategy; the median counts")
    p.add_argument("--same-kv-seqs", type=int, default=64)
    p.add_argument("--workload", choices=("chat", "synthetic"), default="chat",
                   help="chat: the project's prompt set through the chat template, lengths decided by the model "
                        "(default); synthetic: exponential lengths with EOS ignored (batchlm.bench.workload)")
    p.add_argument("--same-kv-requests", type=int,
                   help="saturation requests of the same-KV run (default: twice --num-requests)")
    p.add_argument("--protocol", choices=(*STREAMING_PROTOCOLS, OPENAI_PROTOCOL), default="http",
                   help="the benchmark client's transport (bench/served/benchmark.py; default: http); openai: every "
                        "run through an OpenAI-compatible frontend started next to its server")
    p.add_argument("--lock-file", type=Path, help="hold this flock while a server or a measurement runs")
    p.add_argument("--publish", type=Path, help="also copy comparison.md and plots/ here")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild comparison.md, .json and plots from --out's runs/ without measuring")
    return p.parse_args()


class Comparison:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.spec = make_spec(args.workload, args.num_requests)
        self.requests = requests_of(self.spec)
        self.open_requests = requests_of(make_spec(args.workload, args.num_open))
        self.reference_requests = requests_of(make_spec(args.workload, args.num_reference))
        same_kv = args.same_kv_requests or args.num_requests * 2
        self.same_kv_requests = requests_of(make_spec(args.workload, same_kv))
        self.docs: dict[str, dict] = {}

    @contextlib.contextmanager
    def _cpu(self):
        if self.args.lock_file is None:
            yield
            return
        with open(self.args.lock_file, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _server(self, model: str, repository: Path = DEFAULT_REPOSITORY):
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        frontend = FrontendProcess("", port=free_port(), log_path=self.out / "logs" / f"{model}-frontend.log") \
            if self.args.protocol == OPENAI_PROTOCOL else None
        server = ServerWithFrontend(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                                    metrics_port=free_port(), log_path=self.out / "logs" / f"{model}.log",
                                    extra_args=("--model-control-mode=explicit", f"--load-model={model}"),
                                    frontend=frontend)
        with self._cpu():
            server.start(timeout=300)
            try:
                self._warm_up(server, model)
                yield server
            finally:
                server.stop()

    def _warm_up(self, server: TritonServer, model: str) -> None:
        warm = [WorkloadRequest(i, "warm up the model", 4, 4) for i in range(8)]
        Benchmark(self._config(server, model, ArrivalSpec.closed_loop(8), metrics=False)).run(warm)

    def _config(self, server, model, arrival, metrics=True, stream: bool | None = None) -> BenchmarkConfig:
        openai = {"openai_url": f"{server.frontend.url}/v1"} if server.frontend is not None else {}
        return BenchmarkConfig(model, server.http_url, server.grpc_url,
                               server.metrics_url if metrics else None, arrival, stream=stream,
                               protocol=self.args.protocol, **openai)

    def _measure(self, role: str, server, model: str, arrival: ArrivalSpec, requests,
                 stream: bool | None = None) -> dict:
        started = time.monotonic()
        doc = measure(self._config(server, model, arrival, stream=stream), requests, self.spec.as_dict())
        doc["role"] = role
        self.docs[role] = doc
        write_run(doc, self.out / "runs", role.replace("/", "__"))
        s = doc["summary"]
        print(f"[{time.monotonic() - started:5.0f}s] {role:45s} {doc['arrival']['label']:32s} "
              f"{s['output_token_throughput']:7.1f} tok/s ({comparison.saturated_tok(doc):7.1f} while saturated)  "
              f"{s['request_throughput']:.2f} req/s  "
              f"E2E p50 {s['e2e']['p50']}  TTFT p50 {s['ttft']['p50']}  failures {s['failures']}",
              flush=True)
        return doc

    def saturation_rounds(self) -> tuple[dict[str, dict], dict]:
        """--repeats rounds; each round runs every saturation target once, one after the other (a fresh
        server per run), and the engine in process once. Interleaved, a drift of the machine's speed
        over tens of minutes falls on every strategy alike instead of on whichever ran in the
        slow phase. Returns the median run per role (renamed `<role>/saturation`) and the median
        in-process result."""
        args = self.args
        same_kv = comparison.write_variant(self.out / "variants" / "same_kv", CONT,
                                           {"max_num_seqs": str(args.same_kv_seqs)})
        targets = [  # role, model, repository, concurrency, requests
            (DYNAMIC, DYNAMIC, DEFAULT_REPOSITORY, args.concurrency, self.requests),
            (STATIC, STATIC, DEFAULT_REPOSITORY, args.concurrency, self.requests),
            (CONT, CONT, DEFAULT_REPOSITORY, args.concurrency, self.requests),
            (f"{CONT}_same_kv", CONT, same_kv, max(args.concurrency, args.same_kv_seqs), self.same_kv_requests),
        ]
        runs: dict[str, list[dict]] = {role: [] for role, *_ in targets}
        engines: list[dict] = []
        for i in range(args.repeats):
            for role, model, repository, concurrency, requests in targets:
                with self._server(model, repository) as server:
                    runs[role].append(self._measure(f"{role}/saturation-repeat-{i + 1}", server, model,
                                                    ArrivalSpec.closed_loop(concurrency), requests, stream=False))
                if role == CONT:
                    from batchlm.bench.engine_baseline import engine_throughput  # NOTE: here: torch takes seconds

                    with self._cpu():
                        params = runs[CONT][0]["model_config"].get("parameters", {})
                        engine = engine_throughput(served_model(params["model_dir"]["string_value"]),
                                                   self._engine_config(runs[CONT][0]), self.requests)
                    engines.append(engine)
                    print(f"engine in process, round {i + 1}: {engine['output_token_throughput']:.1f} tok/s "
                          f"({comparison.saturated_tok(engine):.1f} while saturated)", flush=True)
        medians = {role: self._keep_median(role, role_runs) for role, role_runs in runs.items()}
        engine = _median(engines)
        engine["rounds"] = [round(comparison.saturated_tok(e), 1) for e in engines]
        engine["rounds_whole_run"] = [round(e["output_token_throughput"], 1) for e in engines]
        print(f"engine in process: median of {engine['rounds']} output tok/s", flush=True)
        return medians, engine

    def strategy(self, name: str, rates: dict[str, float], role_name: str | None = None,
                 repository: Path = DEFAULT_REPOSITORY, streamed_saturation: bool = False,
                 saturation_runs: int = 0) -> None:
        """On one server: `saturation_runs` closed-loop runs, not streamed (the median one becomes
        `<role>/saturation`); one streamed saturation run if asked; then the open-loop points of `rates`
        (streamed where the model can)."""
        role_name = role_name or name
        closed = ArrivalSpec.closed_loop(self.args.concurrency)
        with self._server(name, repository) as server:
            runs = [self._measure(f"{role_name}/saturation-repeat-{i + 1}", server, name, closed, self.requests,
                                  stream=False) for i in range(saturation_runs)]
            if runs:
                self._keep_median(role_name, runs)
            if streamed_saturation:
                self._measure(f"{role_name}_streamed/saturation", server, name, closed, self.requests,
                              stream=True)
            for role, rate in rates.items():
                requests = self.reference_requests if role == REFERENCE else self.open_requests
                self._measure(f"{role_name}/{role}", server, name, ArrivalSpec.open_loop(rate), requests)

    def _keep_median(self, role_name: str, runs: list[dict]) -> dict:
        """Rename the median run (by output tok/s while saturated) to `<role>/saturation`; the others keep
        their names."""
        median = _median(runs)
        old = median["role"]
        median["role"] = f"{role_name}/saturation"
        del self.docs[old]
        self.docs[median["role"]] = median
        (self.out / "runs" / f"{old.replace('/', '__')}.json").unlink()
        (self.out / "runs" / f"{old.replace('/', '__')}.md").unlink()
        write_run(median, self.out / "runs", median["role"].replace("/", "__"))
        spread = [round(comparison.saturated_tok(d), 1) for d in runs]
        print(f"{role_name}/saturation: median of {spread} output tok/s while saturated", flush=True)
        return median

    def bound(self, engine: dict) -> tuple[float, str]:
        """The step-count bound of continuous over request-level batching at 8, and where it comes from:
        the synthetic spec's distribution, or the output lengths the engine produced for the chat workload
        (greedy and batch-invariant, so every strategy produces the same lengths)."""
        if self.spec.as_dict().get("kind") != "chat":
            return self.spec.static_speedup_bound(8), "from the spec's distribution"
        lengths = OutputLengths(tuple(engine["output_lengths"])).summary(8)
        return lengths["step_bound_8"], (
            f"from the output lengths the model produced ({lengths['requests']} requests: mean {lengths['mean']}, "
            f"p50 {lengths['p50']}, p90 {lengths['p90']}, p99 {lengths['p99']}, max {lengths['max']} tokens)")

    def run(self) -> None:
        if self.spec.as_dict().get("kind") != "chat":
            print(f"workload {self.spec.as_dict()}; step-count bound at 8: "
                  f"{self.spec.static_speedup_bound(8):.2f}x", flush=True)
        saturation, engine = self.saturation_rounds()
        r_d = saturation[DYNAMIC]["summary"]["request_throughput"]
        common = {REFERENCE: 0.5 * r_d, "near-dynamic": 0.9 * r_d}
        self.strategy(DYNAMIC, common)
        self.strategy(STATIC, common)
        self.strategy(CONT, {**common, "near-own": 0.9 * saturation[CONT]["summary"]["request_throughput"]},
                      streamed_saturation=True)
        variants = self.out / "variants"
        for name in (STATIC, DYNAMIC):
            repo = comparison.write_variant(variants / f"{name}_unpadded", name, {"pad_finished_rows": "false"})
            self.strategy(name, {}, role_name=f"{name}_unpadded", repository=repo, saturation_runs=1)
        self.report(engine)

    def _engine_config(self, doc: dict) -> EngineConfig:
        """The continuous model's EngineConfig, as the server reported its config.pbtxt in `doc`'s run."""
        config = doc["model_config"]
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        return ServingConfig.from_parameters(params).engine

    def reload(self) -> None:
        """Rebuild the report from a finished run's files."""
        for path in sorted((self.out / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime):
            doc = json.loads(path.read_text())
            self.docs[doc["role"]] = doc
        self.report(json.loads((self.out / "comparison.json").read_text())["engine"])

    def _protocols(self) -> str:
        """The transports the runs used (runs measured before the option existed used gRPC)."""
        names = {"http": "HTTP (/generate, and /generate_stream server-sent events when streamed)",
                 "grpc": "gRPC (infer, and a stream for decoupled models)",
                 "openai": "the OpenAI-compatible frontend (/v1/completions, streamed where the model streams)"}
        used = sorted({d.get("protocol", "grpc") for d in self.docs.values()})
        return "; ".join(names[u] for u in used)

    def _caching(self) -> str:
        """Whether each strategy's engine had prefix caching on, as its config (or the engine's default) says."""
        states = {}
        for role, doc in self.docs.items():
            params = {k: v["string_value"] for k, v in doc["model_config"].get("parameters", {}).items()}
            states.setdefault(role.split("/")[0], ServingConfig.from_parameters(params).engine.enable_prefix_caching)
        return ", ".join(f"{'on' if on else 'off'} in {name}" for name, on in sorted(states.items()))

    def report(self, engine: dict) -> None:
        bound, bound_source = self.bound(engine)
        targets = comparison.targets(self.docs, REFERENCE, bound, engine)
        rows = [summary_row(d) for d in self.docs.values()]
        text = ("# Measured comparison: static vs dynamic vs continuous batching\n\n"
                f"Workload: {self.spec.as_dict()} (saturation runs; the same-KV run takes the first "
                f"{len(self.same_kv_requests)} requests of this seeded spec), "
                f"first {self.args.num_open} requests of it for open-loop points ({self.args.num_reference} "
                f"at 0.5x dynamic batching's saturation rate). Step-count bound at 8 sequences: {bound:.2f}x, "
                f"{bound_source}. "
                "Throughput at saturation is measured while requests were waiting (the server's generated-"
                "token counter, up to the last timeline sample with a request waiting); the whole closed-"
                "loop run, drain included, is given beside it. Client transport: "
                f"{self._protocols()}. Prefix caching: {self._caching()}.\n\n"
                "## The seed's table, measured\n\n" + comparison.seed_table(self.docs, REFERENCE) +
                "\n## Targets\n\n" + comparison.targets_table(targets) +
                f"\nEngine in process (no Triton, same EngineConfig, same {len(self.requests)} requests "
                f"queued at once): {comparison.saturated_tok(engine):.1f} output tok/s until the last "
                f"request is admitted, {engine['output_token_throughput']:.1f} to the end (median of the rounds:"
                f" {engine.get('rounds')} and {engine.get('rounds_whole_run')}).\n\n"
                f"## Load at {self.docs['dynamic_batching/' + REFERENCE]['arrival']['label']} (the latency "
                "targets' point, from the models' metrics timeline)\n\n" +
                comparison.load_table(self.docs, REFERENCE) +
                "\n## Every run (times in seconds)\n\n" + markdown_table([{"role": d["role"], **r}
                                                                       for d, r in zip(self.docs.values(), rows)]))
        (self.out / "comparison.md").write_text(text)
        (self.out / "comparison.json").write_text(json.dumps(
            {"targets": targets, "engine": engine, "bound": bound,
             "summaries": {k: d["summary"] for k, d in self.docs.items()}}, indent=1))
        self.plot()
        print(text)
        if self.args.publish:
            self.args.publish.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.out / "comparison.md", self.args.publish / "comparison.md")
            for png in (self.out / "plots").glob("*.png"):
                shutil.copy(png, self.args.publish / png.name)

    def plot(self) -> None:
        folder = self.out / "plots"
        series = {name: [d for role, d in self.docs.items()
                         if role.split("/")[0] == name and "-repeat-" not in role]
                  for name in comparison.STRATEGIES}
        plots.throughput_latency(series, folder / "throughput_latency.png")
        plots.ttft_cdf({n: self.docs[f"{n}/{REFERENCE}"] for n in comparison.STRATEGIES},
                       folder / "ttft_cdf.png")
        for role, doc in self.docs.items():
            if role.endswith("/saturation"):
                plots.timeline(doc, folder / f"timeline_{role.split('/')[0]}.png")


def unrunnable(args: argparse.Namespace, repository: Path = DEFAULT_REPOSITORY) -> str | None:
    """Why static batching could not answer every request of some run of this compare, or None. Asked
    before anything runs: the benchmark would refuse the run (`unfillable_batches`) only when it reaches
    static batching, after the other strategies' runs, with no comparison.json for --report-only yet."""
    config = json_format.MessageToDict(
        text_format.Parse((repository / STATIC / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()),
        preserving_proto_field_name=True)
    runs = [("--num-requests / --concurrency", args.num_requests, ArrivalSpec.closed_loop(args.concurrency)),
            ("--num-open", args.num_open, ArrivalSpec.open_loop(1.0)),
            ("--num-reference", args.num_reference, ArrivalSpec.open_loop(1.0))]
    for option, count, arrival in runs:
        problem = unfillable_batches(config, count, arrival)
        if problem is not None:
            return f"{option}: {problem}"
    return None


def main() -> None:
    args = parse_args()
    exit_cleanly_on_sigterm()
    if not args.report_only and (problem := unrunnable(args)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    args.out.mkdir(parents=True, exist_ok=True)
    comparison_run = Comparison(args)
    if args.report_only:
        comparison_run.reload()
    else:
        comparison_run.run()


if __name__ == "__main__":
    main()
