"""Command line client: send one request to any model by name and print its text and timings.

    batchlm-client generate continuous_batching "What is the capital of France?" --chat
    batchlm-client generate continuous_batching "Once upon a time" --max-tokens 32
    batchlm-client generate dynamic_batching "Hello" --max-tokens 16 --protocol http
    batchlm-client generate dynamic_batching "Hello" --protocol infer
    batchlm-client info static_batching

Decoupled models are read as a stream, a gRPC one or, with `--protocol http`, server-sent events from
`/generate_stream`, and the text is printed as it arrives (models that refuse `stream: true` are asked
again for one answer); others answer once. `--protocol infer` sends HTTP `/infer` (KServe v2), which
only models that are not decoupled serve, and whose error statuses are Triton's (503 for an
overload), where `/generate` on tritonserver 2.51 answers every model error with 400. With `--chat` the
prompt is one user message, sent through the model's chat template (LLMClient.chat_prompt); without it,
the prompt is sent as it is, for the model to continue.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time

import requests

from batchlm_client.triton_llm import PROTOCOLS, LLMClient, RequestFailed, Result, collect, unreachable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="batchlm-client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--http", default="127.0.0.1:8000", help="HTTP host:port")
    p.add_argument("--grpc", default="127.0.0.1:8001", help="gRPC host:port")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for an answer (default 600)")
    sub = p.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="send one request and print the answer")
    gen.add_argument("model")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--protocol", choices=PROTOCOLS, default="grpc",
                     help="grpc (default), http (/generate, /generate_stream) or infer (HTTP /infer)")
    gen.add_argument("--no-stream", action="store_true", help="ask for one answer even if it can stream")
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message, through the chat template")
    info = sub.add_parser("info", help="print the model's inputs, outputs and batching flags")
    info.add_argument("model")
    return p.parse_args(argv)


def options(args: argparse.Namespace) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                stop=args.stop, ignore_eos=args.ignore_eos or None)


def generate(llm: LLMClient, args: argparse.Namespace) -> tuple[Result, bool]:
    """The result, and whether its text was already printed while streaming."""
    opts = options(args)
    prompt = args.prompt
    if args.chat:
        prompt = llm.chat_prompt(args.model, [{"role": "user", "content": prompt}], via=args.protocol)
    ask = (args.protocol, args.model, prompt, args.max_tokens)
    if args.no_stream or not llm.is_decoupled(args.model, args.protocol):
        return llm.answer(*ask, **opts), False
    start = time.perf_counter()
    try:
        return collect(_echo(llm.stream(*ask, stream=True, **opts)), start), True
    except RequestFailed as exc:
        if "stream" not in exc.message:  # NOTE: a decoupled model that refuses `stream: true`
            raise
        return llm.answer(*ask, **opts), False


def _echo(chunks):
    for chunk in chunks:
        print(chunk.text, end="", flush=True)
        yield chunk


def info(llm: LLMClient, model: str) -> dict:
    config = llm.model_config(model)
    return {
        "name": config["name"], "decoupled": llm.is_decoupled(model),
        "max_batch_size": config.get("max_batch_size", 0),
        "inputs": {i["name"]: [i["data_type"], i["dims"], i.get("optional", False)] for i in config["input"]},
        "outputs": {o["name"]: [o["data_type"], o["dims"]] for o in config["output"]},
        "parameters": {k: v["string_value"] for k, v in config.get("parameters", {}).items()},
    }


def _timed_out(args: argparse.Namespace) -> int:
    print(f"error: no answer within --timeout {args.timeout:g} s", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    llm = LLMClient(args.http, args.grpc, timeout=args.timeout)
    try:
        if args.command == "info":
            print(json.dumps(info(llm, args.model), indent=1))
            return 0
        result, printed = generate(llm, args)
        if not printed:
            print(result.text, end="")
        counters = (result.finish_reason, result.num_input_tokens, result.num_output_tokens)
        reason, num_in, num_out = ("-" if c is None else c for c in counters)  # None: the model has no such output
        print(f"\n--\nfinish_reason={reason} input_tokens={num_in} output_tokens={num_out} "
              f"ttft={result.ttft:.3f}s latency={result.latency:.3f}s chunks={len(result.chunk_times)}")
        return 0
    except RequestFailed as exc:
        if exc.status == "StatusCode.DEADLINE_EXCEEDED":  # gRPC's own timeout
            return _timed_out(args)
        message = unreachable(exc, args.http, args.grpc)
        print(message or f"error: {exc}", file=sys.stderr)
        return 2 if message else 1
    except (requests.Timeout, queue.Empty):  # HTTP's timeout, and a gRPC stream's wait
        return _timed_out(args)
    except Exception as exc:
        message = unreachable(exc, args.http, args.grpc)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 2
    finally:
        llm.close()
