"""One serving benchmark run against one model; writes JSON and a markdown table.

    batchlm-bench run continuous_batching --concurrency 32 --num-requests 64
    batchlm-bench run dynamic_batching --rate 1.5 [--burstiness 0.5] --out results/one
    batchlm-bench run dynamic_batching --start-server --output-min 128 --output-cap 128
    batchlm-bench run dynamic_batching --start-server \
        --set dynamic_batching.max_queue_delay_microseconds=200000
    batchlm-bench run continuous_batching --protocol openai --start-server --concurrency 32 --num-requests 128

Against a running server (--http/--grpc/--metrics), or `--start-server` to bring one up with only
this model loaded, from the repository or, with --set, from a copy of its folder whose config.pbtxt
has those fields changed. `--protocol openai` sends the requests to an OpenAI-compatible server's
/v1/completions instead (`--openai-url`; with --start-server, a frontend started next to the server),
with the frontend's API key where it asks for one (`--api-key`, else $BATCHLM_API_KEY).
The workload (batchlm.bench.workload) is seeded: `--workload chat` (default) sends the project's prompt set
through the model's chat template and lets the model end each answer (capped at --output-cap), then
prints the output lengths it produced and the step-count bound computed from them; `--workload
synthetic` draws prompt and output lengths (the other workload flags) and ignores EOS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from batchlm.api_key import API_KEY_ENV, client_api_key
from batchlm.bench.served.arrivals import ArrivalSpec
from batchlm.bench.served.benchmark import BenchmarkConfig, UnmeasurableModel
from batchlm.bench.served.config_override import ConfigOverride, overridden_config, overridden_repository
from batchlm.bench.served.metrics_timeline import metrics_problem
from batchlm.bench.served.report import markdown_table, measure, summary_row, write_run
from batchlm.bench.served.request_record import SLO
from batchlm.bench.workload import ChatWorkloadSpec, OutputLengths, WorkloadSpec, requests_of
from batchlm.launcher.frontend_process import FrontendProcess, ServerWithFrontend
from batchlm.launcher.ports import free_port
from batchlm.launcher.processes import exit_cleanly_on_sigterm
from batchlm.paths import DEFAULT_REPOSITORY
from batchlm_client.openai_client import DEFAULT_OPENAI_URL, OPENAI_PROTOCOL
from batchlm_client.triton_llm import PROTOCOLS, STREAMING_PROTOCOLS, LLMClient, RequestFailed, unreachable


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="open loop: mean requests/s (Poisson unless --burstiness)")
    load.add_argument("--concurrency", type=int, default=8, help="closed loop: requests in flight")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--http", default="127.0.0.1:8000")
    p.add_argument("--grpc", default="127.0.0.1:8001")
    p.add_argument("--metrics", default="http://127.0.0.1:8002/metrics")
    p.add_argument("--start-server", action="store_true", help="start a server with only this model")
    p.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY,
                   help="with --start-server: the repository to serve (default: the project's)")
    p.add_argument("--slo-ttft", type=float, default=SLO().ttft)
    p.add_argument("--slo-tpot", type=float, default=SLO().tpot)
    p.add_argument("--out", type=Path, default=Path("results/benchmark"))
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="stream the answer (default: when the model can)")
    p.add_argument("--protocol", choices=(*PROTOCOLS, OPENAI_PROTOCOL), default="http",
                   help="http: /generate and /generate_stream (SSE); grpc: infer and streams; infer: HTTP "
                        "/infer, one answer, models that are not decoupled, with Triton's status codes; "
                        "openai: /v1/completions of the OpenAI-compatible frontend at --openai-url "
                        "(--http and --metrics still name the Triton behind it) (default: http)")
    p.add_argument("--openai-url", default=DEFAULT_OPENAI_URL,
                   help=f"--protocol openai: the frontend's base URL (default: {DEFAULT_OPENAI_URL}; with "
                        "--start-server, one started next to the server on a free port)")
    p.add_argument("--api-key", default=None,
                   help=f"--protocol openai: the key the frontend asks for (default: ${API_KEY_ENV}, where set); "
                        "with --start-server, the frontend started asks for it")
    p.add_argument("--set", dest="overrides", metavar="PATH=VALUE", action="append", default=[],
                   help="with --start-server: serve the model with this config.pbtxt field changed (repeatable), "
                        "e.g. dynamic_batching.max_queue_delay_microseconds=200000, parameters.max_num_seqs=16, "
                        "instance_group.0.count=2 (entry 0 of a list) or "
                        "'dynamic_batching.preferred_batch_size=4 8' (a list, replaced whole)")
    workload = p.add_argument_group("workload (batchlm.bench.workload.WorkloadSpec; --output-min equal to --output-cap "
                                    "gives every request exactly that many tokens)")
    defaults = WorkloadSpec()
    workload.add_argument("--workload", choices=("chat", "synthetic"), default="chat",
                          help="chat: the project's prompts, lengths the model decides (capped at --output-cap); "
                               "synthetic: the flags below")
    workload.add_argument("--prompt-tokens-min", type=int, default=defaults.prompt_tokens_min,
                          help="prompt length, uniform in [min, max] tokens")
    workload.add_argument("--prompt-tokens-max", type=int, default=defaults.prompt_tokens_max)
    workload.add_argument("--output-mean", type=float, default=defaults.output_mean,
                          help="output length ~ Exponential(mean), rounded up, then clipped to [min, cap]")
    workload.add_argument("--output-cap", type=int, default=defaults.output_cap)
    workload.add_argument("--output-min", type=int, default=defaults.output_min)
    args = p.parse_args()
    if args.overrides and not args.start_server:
        p.error("--set: needs --start-server (a running server's models are not this script's to change)")
    try:
        args.overrides = [ConfigOverride.parse(text) for text in args.overrides]
    except ValueError as exc:
        p.error(f"--set {exc}")
    if args.stream and args.protocol not in (*STREAMING_PROTOCOLS, OPENAI_PROTOCOL):
        p.error(f"--stream: --protocol {args.protocol} cannot stream; use one of "
                f"{', '.join((*STREAMING_PROTOCOLS, OPENAI_PROTOCOL))}")
    try:
        # NOTE: the synthetic flags are checked whichever workload runs, so a bad one never passes unseen
        args.spec = WorkloadSpec(seed=args.seed, num_requests=args.num_requests,
                                 prompt_tokens_min=args.prompt_tokens_min, prompt_tokens_max=args.prompt_tokens_max,
                                 output_mean=args.output_mean, output_cap=args.output_cap,
                                 output_min=args.output_min)
        if args.workload == "chat":
            args.spec = ChatWorkloadSpec(seed=args.seed, num_requests=args.num_requests, max_tokens=args.output_cap)
        args.arrival = ArrivalSpec.open_loop(args.rate, args.burstiness, args.seed) if args.rate is not None \
            else ArrivalSpec.closed_loop(args.concurrency)
    except ValueError as exc:  # the specs' own checks: rate, burstiness, concurrency, the workload's lengths
        p.error(_as_flags(str(exc)))
    if args.start_server and not (args.model_repository / args.model / "config.pbtxt").is_file():
        models = sorted(d.name for d in args.model_repository.iterdir() if (d / "config.pbtxt").is_file())
        p.error(f"{args.model}: no such model in {args.model_repository}; it has {', '.join(models)}")
    if args.overrides:
        try:
            overridden_config((args.model_repository / args.model / "config.pbtxt").read_text(), args.overrides)
        except ValueError as exc:
            p.error(f"--set {exc}")
    return args


def _as_flags(message: str) -> str:
    """A spec's error in the flags' words: `WorkloadSpec.output_min must be <= output_cap` reads
    `--output-min must be <= --output-cap`."""
    for name in WorkloadSpec.__dataclass_fields__:
        flag = "--" + name.replace("_", "-")
        message = message.replace(f"WorkloadSpec.{name}", flag).replace(f"= {name}", f"= {flag}")
    return message


def main() -> None:
    args = parse_args()
    exit_cleanly_on_sigterm()
    spec, arrival = args.spec, args.arrival
    server = None
    scratch = tempfile.TemporaryDirectory(prefix="batchlm-overrides-") if args.overrides else None
    repository = args.model_repository
    if scratch is not None:  # NOTE: parse_args checked the overrides against the config
        repository = overridden_repository(args.model_repository, args.model, args.overrides, Path(scratch.name))
    if args.start_server:
        # NOTE: --protocol openai: the frontend starts once the server is ready, and stops first
        frontend = FrontendProcess("", port=free_port(), log_path=args.out / "frontend.log",
                                   api_key=client_api_key(args.api_key)) if args.protocol == OPENAI_PROTOCOL else None
        server = ServerWithFrontend(model_repository=repository,
                                    http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                    log_path=args.out / "server.log",
                                    extra_args=("--model-control-mode=explicit", f"--load-model={args.model}"),
                                    frontend=frontend)
        args.out.mkdir(parents=True, exist_ok=True)
        try:
            server.start(timeout=300)
        except (RuntimeError, TimeoutError) as exc:  # NOTE: e.g. an override Triton refuses; start() stopped it
            server.stop()  # NOTE: a frontend that did not start leaves the server running
            if scratch is not None:
                scratch.cleanup()
            failures = server.load_failures()
            if failures:
                print(f"error: tritonserver did not load {args.model}: {failures[0]} (log: {server.log_path})",
                      file=sys.stderr)
            else:
                print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
        args.http, args.grpc, args.metrics = server.http_url, server.grpc_url, server.metrics_url
        if frontend is not None:
            args.openai_url = f"{frontend.url}/v1"
    try:
        config = BenchmarkConfig(args.model, args.http, args.grpc, args.metrics, arrival,
                                 slo=SLO(ttft=args.slo_ttft, tpot=args.slo_tpot), stream=args.stream,
                                 protocol=args.protocol, openai_url=args.openai_url,
                                 openai_api_key=client_api_key(args.api_key))
        if isinstance(spec, WorkloadSpec):
            print(f"{args.model}: {arrival.label}, {spec.num_requests} requests; step-count bound of "
                  f"continuous over request-level batching at 8: {spec.static_speedup_bound(8):.2f}x")
        else:
            print(f"{args.model}: {arrival.label}, {spec.num_requests} chat requests (lengths the model's)")
        with contextlib.closing(LLMClient(args.http, args.grpc)) as probe:
            probe.model_config(args.model)  # NOTE: an unreachable server is reported as such, not as no metrics
        problem = metrics_problem(args.metrics, args.model)
        if problem is not None:
            print(f"warning: {problem}: this run has no metrics timeline and no saturated throughput",
                  file=sys.stderr)
        doc = measure(config, requests_of(spec), spec.as_dict())
    except UnmeasurableModel as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:
        message = unreachable(exc, args.http, args.grpc)
        if message is None and isinstance(exc, RequestFailed):  # the server refused before the run (no such model)
            message = f"error: {exc}"
        if message is None:
            raise
        print(message, file=sys.stderr)
        sys.exit(2)
    finally:
        if server is not None:
            server.stop()
        if scratch is not None:
            scratch.cleanup()
    if args.overrides:
        doc["overrides"] = {o.path: o.value for o in args.overrides}
    stem = f"{args.model}-{arrival.label.replace(' ', '_').replace('/', '')}"
    write_run(doc, args.out, stem)
    print(markdown_table([summary_row(doc)]))
    print(json.dumps(doc["summary"]["failures"]) if doc["summary"]["failures"] else "no failures")
    answered = [r["num_output_tokens"] for r in doc["requests"] if not r.get("error")]
    if answered:
        lengths = OutputLengths(tuple(answered)).summary(8)
        print(f"output lengths: mean {lengths['mean']}, p50 {lengths['p50']}, p90 {lengths['p90']}, p99 "
              f"{lengths['p99']}, max {lengths['max']}; step-count bound at 8: {lengths['step_bound_8']:.2f}x")
    print(f"wrote {args.out / stem}.json and .md")


if __name__ == "__main__":
    main()
