"""Served vs served: the project's `continuous_batching` next to llama.cpp's server and OpenVINO GenAI, each
through its own API, on one workload, at 1, 8 and 32 concurrent streams, one server at a time.

    batchlm-bench peers-served [--servers triton,openai,triton-int8,engine,engine-int8,llama-q4_1,llama-q8_0,
                                openvino-ir-f32,openvino-ir,openvino-gguf (triton-bf16, engine-bf16)]
                               [--concurrency 1,8,32]
                               [--num-requests 8,32,64] [--max-tokens 128] [--out results/peers_served]
    make bench-peers-served    (installs the `peers-served` extra, builds llama-server once; ~15 min on 2 cores)

The workload (batchlm.bench.peers_served.workload): the prompts of batchlm/bench/chat_prompts.jsonl whose
chat-templated length is 34-42 tokens, in a seeded order, `--max-tokens` new tokens each with EOS ignored,
greedy, streamed, the prompts sent as token ids (every API here takes them). Closed loop: each of the
`--concurrency` streams sends its next request when its answer has arrived; `--num-requests` per
concurrency (one value for all, or one per concurrency). Each concurrency's requests are a prefix of the
same sequence. Every server gets a warm-up request before each run. The servers:
- triton:     `continuous_batching` through tritonserver's HTTP `/v2/models/continuous_batching/generate_stream`,
              a copy of its config with max_num_seqs = the concurrency (the rest as shipped), only that
              model loaded, on free loopback ports; one server start per concurrency.
- openai:     the same server through the project's OpenAI frontend, `/v1/completions` streamed
              (`ignore_eos`), on the same start as triton's run.
- triton-int8: as triton, on a server of its own whose copy of the config also sets `activations` "int8"
              (the fast tier of Q4_0/Q4_1/Q8_0 weights: batchlm::linear_q8).
- triton-bf16: the same with `activations` "bfloat16" (the fast tier of BF16 weights: batchlm::linear_bf16);
              not in the default list: it is for a --model whose weights are BF16.
- engine, engine-int8, engine-bf16: this project's LLMEngine in process, no server
              (batchlm.bench.peers_served.engine_case), float32, int8 or bfloat16 activations (engine-bf16
              not in the default list), `continuous_batching`'s defaults with max_num_seqs = the largest
              concurrency and --threads threads, driven as OpenVINO's rows are (below): what the engine
              does without serving, and the row to set beside OpenVINO's.
- llama-q4_1: llama.cpp's own `llama-server` (scripts/build_llama_server.sh builds it from the llama.cpp
              that llama-cpp-python 0.3.36 vendors) on the checkpoint's GGUF file, its native `/completion`
              (`ignore_eos`, `top_k` 1, `return_tokens`), `-t`/`-tb` --threads, `--parallel` = the
              concurrency, `-c` = parallel x room for the longest request, `--llama-args` (default
              `--no-repack`: without it llama.cpp crashes at warm-up on CPUs with AMX); other flags at its
              defaults (flash attention auto, prompt cache on).
- llama-q8_0: the same on the checkpoint as Q8_0, quantized by llama-quantize from an F32 GGUF the
              project writes (batchlm.model.gguf_export) into .cache/peers/.
- openvino-*: OpenVINO GenAI's ContinuousBatchingPipeline on CPU, --threads inference threads. It has no
              HTTP server, so it runs in a process of its own with the same closed-loop streams driven
              from its step loop (no HTTP in its figures). openvino-gguf: the GGUF file read by GenAI
              itself, INFERENCE_PRECISION_HINT f32; openvino-ir-f32: a float32 IR exported by optimum-intel
              (scripts/install_optimum_intel.sh) from the checkpoint's float32 Hugging Face folder, f32 hint;
              openvino-ir: that IR at the plugin's default precision (bf16 where the CPU has AMX-BF16).
A server that is not installed or not built is skipped with the command that provides it; the others
still run.

Per server and concurrency: output tok/s (all output tokens / first request sent to last answer done),
TTFT p50/p99 (request sent to its first streamed output), TPOT p50/p99 (per request: (done - first
output) / (tokens - 1)), peak RSS (the server's processes summed, sampled every 0.2 s during the run:
tritonserver and the model's stub, plus the frontend for openai; llama-server; the in-process engines'
processes, the clients included) and greedy agreement with transformers: `generate` (float32, EOS ignored) on the same
checkpoint gives the first --agreement-tokens tokens of the first --agreement-prompts prompts; a prompt
agrees when the server's answer to it in that run begins with them (token ids where the API returns them,
else the text). Then the ratios: `continuous_batching` through Triton over each server, output tok/s, per
concurrency, and where triton-int8 or triton-bf16 ran, the same over each. Writes peers_served.json and
peers_served.md under --out, the servers' logs under --out/logs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from batchlm.bench.peers_served import measure
from batchlm.bench.peers_served.report import ServedRow, format_ratios, format_table
from batchlm.bench.peers_served.server import SERVERS, missing, versions
from batchlm.bench.peers_served.workload import ServedWorkloadSpec, build_workload
from batchlm.paths import DEFAULT_MODEL, MODEL_ENV


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(s for s in SERVERS if SERVERS[s].default),
                   help=f"comma-separated, of {', '.join(SERVERS)}")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="closed-loop streams, one run each")
    p.add_argument("--num-requests", type=_ints, default=[8, 32, 64],
                   help="requests per concurrency: one value for all, or one per --concurrency")
    p.add_argument("--max-tokens", type=int, default=128, help="every answer's length (EOS ignored)")
    p.add_argument("--prompt-tokens-min", type=int, default=34)
    p.add_argument("--prompt-tokens-max", type=int, default=42)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="llama-server's and OpenVINO's threads")
    p.add_argument("--agreement-prompts", type=int, default=8, help="0: no transformers reference")
    p.add_argument("--agreement-tokens", type=int, default=32)
    p.add_argument("--llama-args", default="--no-repack", help="more llama-server flags, one string")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="the checkpoint: a llama GGUF file (default: the default model's), or a Hugging Face Llama "
                        "folder (llama-q4_1 then serves it as an F32 GGUF file)")
    p.add_argument("--out", type=Path, default=Path("results/peers_served"))
    args = p.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in args.servers if s not in SERVERS]
    if unknown:
        p.error(f"unknown servers {unknown}; known: {', '.join(SERVERS)}")
    if len(args.num_requests) == 1:
        args.num_requests *= len(args.concurrency)
    if len(args.num_requests) != len(args.concurrency):
        p.error("--num-requests: one value, or one per --concurrency")
    if args.max_tokens < 1 or args.threads < 1 or args.agreement_prompts < 0 or args.agreement_tokens < 1:
        p.error("--max-tokens, --threads and --agreement-tokens must be >= 1, --agreement-prompts >= 0")
    if args.agreement_tokens > args.max_tokens:
        p.error("--agreement-tokens must be <= --max-tokens")
    if not args.model.exists():
        p.error(f"--model {args.model}: no such file or folder")
    return args


def converted(model: Path) -> tuple[Path, Path]:
    """(the checkpoint as a float32 Hugging Face folder, as an F32 GGUF file), written once into .cache/peers/
    where it is not one already."""
    from batchlm.bench.peers.checkpoint import CACHE_DIR
    from batchlm.bench.peers.llama_cpp_case import gguf_model_path
    from batchlm.model.gguf_export import export_hf

    hf_dir = model if model.is_dir() else export_hf(model, CACHE_DIR / f"hf-{model.stem}")
    return hf_dir, gguf_model_path(hf_dir)


def run_server(name: str, args: argparse.Namespace, plan: measure.Plan) -> list[ServedRow]:
    """The rows of one server other than Triton's two (which share a start: measure.measure_triton)."""
    from batchlm.bench.peers_served.llama_server import q8_0_file
    from batchlm.bench.peers_served.openvino_ir import IrUnavailable, float32_ir

    if SERVERS[name].family == "engine":  # the checkpoint as it is: no conversion
        return measure.measure_in_process(name, "engine", args.model, plan)
    try:
        if name == "llama-q4_1":
            gguf = args.model if args.model.is_file() else converted(args.model)[1]
            return measure.measure_llama(name, gguf, plan, args.prompt_tokens_max, tuple(args.llama_args.split()))
        if name == "llama-q8_0":
            gguf = q8_0_file(converted(args.model)[1])
            return measure.measure_llama(name, gguf, plan, args.prompt_tokens_max, tuple(args.llama_args.split()))
        if name == "openvino-gguf":
            source = args.model if args.model.is_file() else converted(args.model)[1]
        else:
            source = float32_ir(converted(args.model)[0])
        return measure.measure_in_process(name, "openvino", source, plan)
    except IrUnavailable as exc:
        return [ServedRow(name, c, status=f"skipped: {exc}") for c in plan.runs]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from batchlm.model.tokenizer import Tokenizer

    # NOTE: the served model reads $BATCHLM_MODEL before its config's model_dir: both name --model
    os.environ[MODEL_ENV] = str(args.model.resolve())
    spec = ServedWorkloadSpec(args.seed, args.prompt_tokens_min, args.prompt_tokens_max, args.max_tokens)
    sequence = build_workload(spec, max(args.num_requests), args.model)
    runs = {c: sequence[:n] for c, n in zip(args.concurrency, args.num_requests)}
    print(f"{', '.join(f'{len(r)} requests at {c} streams' for c, r in runs.items())}; prompts "
          f"{spec.prompt_tokens_min}-{spec.prompt_tokens_max} tokens, {spec.max_tokens} new tokens each", flush=True)
    reference = None
    if args.agreement_prompts:
        from batchlm.bench.peers_served.reference import reference_tokens

        reference = reference_tokens(args.model, sequence[:args.agreement_prompts], args.agreement_tokens, args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    plan = measure.Plan(runs, reference, Tokenizer.from_dir(args.model).decode, args.out, args.threads)
    rows: list[ServedRow] = []
    triton = [s for s in args.servers if SERVERS[s].family == "triton"]
    for name in args.servers:
        start = time.perf_counter()
        if name in triton and name != triton[0]:
            continue
        reason = missing(SERVERS[name])
        if reason is not None:
            rows += [ServedRow(name, c, status=reason) for c in runs]
            print(f"{name}: {reason}", flush=True)
            continue
        if name in triton:
            rows += measure.measure_triton(triton, plan, args.model)
        elif SERVERS[name].family == "triton-tier":
            rows += measure.measure_triton([name], plan, args.model, activations=SERVERS[name].activations)
        else:
            rows += run_server(name, args, plan)
        print(f"{'/'.join(triton) if name in triton else name}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    rows.sort(key=lambda r: (args.servers.index(r.server), r.streams))
    text = f"{format_table(rows)}\n\n{format_ratios(rows)}"
    print(text)
    (args.out / "peers_served.md").write_text(text + "\n")
    (args.out / "peers_served.json").write_text(json.dumps(
        {"workload": {**spec.as_dict(), "requests": dict(zip(map(str, args.concurrency), args.num_requests))},
         "model": str(args.model), "threads": args.threads, "llama_args": args.llama_args, "versions": versions(),
         "agreement": {"prompts": args.agreement_prompts, "tokens": args.agreement_tokens},
         "rows": [r.as_dict() for r in rows]}, indent=1) + "\n")
    print(f"wrote {args.out / 'peers_served.md'} and {args.out / 'peers_served.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
