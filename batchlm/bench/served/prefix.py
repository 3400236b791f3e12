"""Prefix caching, served: the cache on and off in one run, on workloads that repeat their beginning.

    batchlm-bench prefix [--model continuous_batching] [--rounds 4] [--out results/prefix_cache]
                         [--workloads chat system control] [--concurrency 8] [--conversations 8]
                         [--turns-min 5] [--turns-max 10] [--stagger-ms 500] [--think-ms 1000]
                         [--system-requests 16] [--control-requests 16] [--max-tokens 32] [--seed 0]

The workloads (batchlm.bench.prefix_workload; the project's own text, seeded): multi-turn chat (the
conversations started --stagger-ms apart, each turn sent a seeded think time, mean --think-ms, after the
previous answer arrives: users interleave, they do not move in lockstep), one system prompt of
at least 500 tokens before short questions (closed loop at --concurrency), and a control of prompts that
share no prefix (closed loop at --concurrency), whose throughput shows what the cache's bookkeeping
costs. The model is served from two copies of its folder under --out (model_repository/ is never
edited), one with `enable_prefix_caching` "true", one "false", each by its own tritonserver with only
that model loaded, one server at a time. Each round serves both, the order swapped every round (on,
off; then off, on), so a slow phase of the machine falls on both. A server is warmed up, then runs the
workloads in turn on one start: the control finds the cache full of the others' blocks, as a server
that has been serving would. Greedy, EOS ignored and a fixed --max-tokens: both sides do the same work,
and the report says whether every answer was the same.
With the control, the scheduler's prefix bookkeeping is also timed in process, with no model
(batchlm.bench.prefix_bookkeeping). Writes prefix_cache.md (the table of on / off ratios, the goals with
the rounds' median and range, the bookkeeping) and prefix_cache.json (every answer of every run) under
--out, and each server's log under --out/logs.
static_batching answers only full batches of 8: its chat needs --turns-min equal to --turns-max and
--conversations a multiple of 8; its other workloads a --concurrency of 8 or more and request counts
that are multiples of 8.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from batchlm.bench import prefix_bookkeeping, prefix_workload
from batchlm.bench.prefix_workload import THINK_CAP, WORKLOADS, Conversation, PrefixWorkloadSpec
from batchlm.bench.served import prefix_report
from batchlm.bench.served.arrivals import ArrivalSpec
from batchlm.bench.served.benchmark import Benchmark, BenchmarkConfig, unfillable_batches
from batchlm.bench.served.comparison import STRATEGIES, write_variant
from batchlm.bench.served.prefix_driver import Driver, Target
from batchlm.bench.served.report import environment, model_config
from batchlm.bench.workload import WorkloadRequest
from batchlm.engine.engine_config import EngineConfig
from batchlm.launcher.ports import free_port
from batchlm.launcher.processes import exit_cleanly_on_sigterm
from batchlm.launcher.triton_server import TritonServer
from batchlm.model.chat_template import ChatTemplate, load_chat_template
from batchlm.model.tokenizer import Tokenizer
from batchlm.paths import DEFAULT_REPOSITORY, served_model

SPEC_HELP = {
    "seed": "the same seed gives the same workloads",
    "conversations": "chat: conversations, one turn each in flight at a time",
    "turns_min": "chat: user turns per conversation, uniform in [min, max]",
    "stagger_ms": "chat: a conversation starts this long after the one before it",
    "think_ms": f"chat: mean think time between an answer and the next turn (exponential, at most {THINK_CAP}x)",
    "system_requests": "system: requests, the system prompt and one short question each",
    "system_prompt_tokens": "system: the shared system prompt's length, at least",
    "control_requests": "control: prompts that share no prefix",
    "control_prompt_tokens_min": "control: prompt length, uniform in [min, max] tokens",
    "max_tokens": "every answer's length in tokens (greedy, EOS ignored)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=STRATEGIES, default="continuous_batching")
    p.add_argument("--rounds", type=int, default=4, help="on and off once each per round, the order swapped each round")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--concurrency", type=int, default=8, help="system and control: requests in flight")
    p.add_argument("--out", type=Path, default=Path("results/prefix_cache"))
    group = p.add_argument_group("workload (batchlm.bench.prefix_workload.PrefixWorkloadSpec)")
    defaults = PrefixWorkloadSpec()
    for field in fields(PrefixWorkloadSpec):
        group.add_argument("--" + field.name.replace("_", "-"), type=int, default=getattr(defaults, field.name),
                           help=SPEC_HELP.get(field.name))
    args = p.parse_args(argv)
    if args.rounds < 1 or args.concurrency < 1:
        p.error("--rounds and --concurrency must be >= 1")
    try:
        args.spec = PrefixWorkloadSpec(**{f.name: getattr(args, f.name) for f in fields(PrefixWorkloadSpec)})
    except ValueError as exc:
        p.error(_as_flags(str(exc)))
    problem = batch_problem(_config(args.model), args)
    if problem is not None:
        p.error(problem)
    return args


def _as_flags(message: str) -> str:
    """A spec's error in the flags' words (`PrefixWorkloadSpec.turns_max` reads `--turns-max`)."""
    for f in fields(PrefixWorkloadSpec):
        flag = "--" + f.name.replace("_", "-")
        message = message.replace(f"PrefixWorkloadSpec.{f.name}", flag).replace(f"= {f.name}", f"= {flag}")
    return message


def _config(model: str) -> dict:
    """The model's config.pbtxt as Triton's JSON of it."""
    config = text_format.Parse((DEFAULT_REPOSITORY / model / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def batch_problem(config: dict, args: argparse.Namespace) -> str | None:
    """Why a workload would leave requests waiting for ever on a model that answers only full batches,
    or None. Chat keeps as many requests in flight as conversations that are not over, so on such a
    model every conversation must last equally long, and their number fill whole batches."""
    spec, closed = args.spec, ArrivalSpec.closed_loop(args.concurrency)
    counts = {"system": spec.system_requests, "control": spec.control_requests}
    batch = int(config.get("parameters", {}).get("batch_size", {}).get("string_value", "1"))
    for workload in args.workloads:
        problem = None
        if workload != "chat":
            problem = unfillable_batches(config, counts[workload], closed)
        elif batch > 1 and (spec.turns_min != spec.turns_max or spec.conversations % batch):
            problem = (f"{config.get('name')} answers only full batches of {batch}: chat needs --turns-min "
                       f"equal to --turns-max and --conversations a multiple of {batch}")
        if problem is not None:
            return f"{workload}: {problem}"
    return None


@dataclass(frozen=True)
class Workloads:
    """What every server is sent: the chat scripts and the other workloads' requests."""

    scripts: list[Conversation]
    template: ChatTemplate
    requests: dict[str, list[WorkloadRequest]]
    tokenizer: Tokenizer
    fill: list[WorkloadRequest]  # bookkeeping: the system workload and a control of the next seed

    @classmethod
    def build(cls, spec: PrefixWorkloadSpec, checkpoint: Path) -> Workloads:
        tokenizer, template = Tokenizer.from_dir(checkpoint), load_chat_template(checkpoint)
        system = prefix_workload.system_requests(spec, tokenizer, template)
        fill = system + prefix_workload.control_requests(replace(spec, seed=spec.seed + 1), checkpoint)
        return cls(prefix_workload.conversations(spec), template,
                   {"system": system, "control": prefix_workload.control_requests(spec, checkpoint)}, tokenizer, fill)

    def bookkeeping(self, parameters: dict[str, str], max_tokens: int, concurrency: int) -> dict:
        """The scheduler's prefix bookkeeping per control step, in process, under the served engine config."""
        ids = [[self.tokenizer.encode(r.prompt) for r in group] for group in (self.fill, self.requests["control"])]
        return prefix_bookkeeping.measure(EngineConfig.from_parameters(parameters), *ids, max_tokens,
                                          concurrency).as_dict()


def measure_side(args: argparse.Namespace, repository: Path, log: Path, work: Workloads) -> dict:
    """Serve the model from `repository`, warm it up, and run every workload once; a dict with each
    workload's run, the served parameters and the environment."""
    server = TritonServer(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), log_path=log,
                          extra_args=("--model-control-mode=explicit", f"--load-model={args.model}"))
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        server.start(timeout=300)  # NOTE: a failed start stops what it started
    except (RuntimeError, TimeoutError) as exc:
        failures = server.load_failures()
        raise SystemExit(f"error: tritonserver did not serve {args.model}: {failures[0] if failures else exc} "
                         f"(log: {log})") from None
    try:
        warm = [WorkloadRequest(i, "warm up the model", 4, 4) for i in range(8)]
        streamed = Benchmark(BenchmarkConfig(args.model, server.http_url, server.grpc_url, None,
                                             ArrivalSpec.closed_loop(8))).run(warm).streamed
        driver = Driver(Target(args.model, server.http_url, server.metrics_url, streamed))
        try:
            runs = {}
            for workload in args.workloads:
                if workload == "chat":
                    run = driver.chat(work.scripts, work.template, args.spec.max_tokens)
                else:
                    run = driver.closed_loop(workload, work.requests[workload], args.concurrency)
                runs[workload] = run.as_dict()
                fig = prefix_report.figures([runs], workload)
                print(f"    {workload:8s} {fig['tok_s'] or 0:7.1f} out tok/s  TTFT p50 {fig['ttft_p50'] or 0:.3f} s  "
                      f"prompt tokens from cache {fig['hit_rate'] or 0:.0%}  {fig['ok']}/{fig['requests']} ok",
                      flush=True)
        finally:
            driver.close()
        served = model_config(server.http_url, args.model)["parameters"]
        return {"runs": runs, "streamed": streamed, "environment": environment(server.http_url),
                "parameters": {k: v["string_value"] for k, v in served.items()}}
    finally:
        server.stop()


def header(args: argparse.Namespace, sides: dict[str, list[dict]], work: Workloads, command: str) -> str:
    spec, env = args.spec, sides["on"][0]["environment"]
    system = work.requests["system"][0].prompt_tokens if work.requests["system"] else 0
    streamed = sides["on"][0]["streamed"]
    return "\n".join([
        f"# {args.model}: prefix caching on / off", "",
        f"{args.rounds} round(s), on and off served once each per round by their own tritonserver, the "
        "order swapped each round; figures pool the rounds. Every answer "
        f"{spec.max_tokens} tokens, greedy, EOS ignored. Workloads (seed {spec.seed}): chat, "
        f"{spec.conversations} conversations of {spec.turns_min}-{spec.turns_max} turns, one started every "
        f"{spec.stagger_ms} ms, each turn sent a think time (seeded, exponential, mean {spec.think_ms} ms, at "
        f"most {THINK_CAP * spec.think_ms} ms) after the previous answer arrives; system, {spec.system_requests} "
        f"requests of a "
        f"{system}-token prompt (system prompt, template and one short question), closed loop at "
        f"{args.concurrency}; control, {spec.control_requests} prompts of {spec.control_prompt_tokens_min}-"
        f"{spec.control_prompt_tokens_max} tokens sharing no prefix, closed loop at {args.concurrency}. "
        + ("TTFT: the first streamed text." if streamed else "TTFT: the whole answer (the model does not stream)."),
        "", f"Command: `{command}`", "",
        f"Machine: {env.get('cpu')} x{env.get('cpu_count')}, server {env.get('server')}, "
        f"packages {env.get('packages')}.",
    ])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    command = shlex.join(["batchlm-bench", "prefix", *(sys.argv[1:] if argv is None else argv)])
    checkpoint = served_model(_config(args.model)["parameters"]["model_dir"]["string_value"])
    work = Workloads.build(args.spec, checkpoint)
    variants = {side: write_variant(args.out / "variants" / side, args.model,
                                    {"enable_prefix_caching": "true" if side == "on" else "false"})
                for side in prefix_report.SIDES}
    sides: dict[str, list[dict]] = {side: [] for side in prefix_report.SIDES}
    for k in range(1, args.rounds + 1):
        for side in prefix_report.SIDES if k % 2 else reversed(prefix_report.SIDES):
            print(f"== round {k}/{args.rounds}: cache {side}", flush=True)
            measured = measure_side(args, variants[side], args.out / "logs" / f"{side}-round-{k}.log", work)
            expected = "true" if side == "on" else "false"
            if measured["parameters"].get("enable_prefix_caching") != expected:
                raise SystemExit(f"error: the {side} server has enable_prefix_caching "
                                 f"{measured['parameters'].get('enable_prefix_caching')!r}, not {expected!r}")
            sides[side].append(measured)
    runs = {side: [m["runs"] for m in sides[side]] for side in prefix_report.SIDES}
    bookkeeping = (work.bookkeeping(sides["on"][0]["parameters"], args.spec.max_tokens, args.concurrency)
                   if "control" in args.workloads else None)
    text = prefix_report.markdown(runs, args.workloads, header(args, sides, work, command), bookkeeping)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_cache.md").write_text(text)
    (args.out / "prefix_cache.json").write_text(json.dumps({
        "command": command, "model": args.model, "checkpoint": str(checkpoint), "rounds": args.rounds,
        "concurrency": args.concurrency, "workloads": args.workloads, "spec": args.spec.as_dict(),
        "streamed": sides["on"][0]["streamed"], "environment": sides["on"][0]["environment"],
        "parameters": {side: sides[side][0]["parameters"] for side in prefix_report.SIDES},
        "summary": prefix_report.summary(runs, args.workloads), "bookkeeping": bookkeeping, "runs": runs,
    }, indent=1))
    print(text)
    print(f"wrote {args.out / 'prefix_cache.md'} and prefix_cache.json")


if __name__ == "__main__":
    main()
