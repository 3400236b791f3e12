"""The project's engine next to the CPU engines a user would otherwise pick: one workload, one checkpoint.

    batchlm-bench peers [--num-requests 64] [--seed 0] [--engines batchlm,hf-cb,hf-static,ct2,llama.cpp]
                        [--workload FILE] [--out results/peers]
    make bench-peers    (installs the `peers` extra into .venv first)

The workload is seeded (batchlm.bench.workload): by default 64 requests, prompts of 32-256 tokens, output
lengths exponential with mean 128 capped at 512, all arriving at t=0, greedy, EOS ignored (every request
produces exactly its length). `--workload FILE` replaces it with a JSON list of
{"prompt_ids": [...], "max_tokens": N}. Every engine gets the same prompts as token ids (BOS included, as
the project's tokenizer encodes them), the same per-request output lengths, float32 weights from the same
checkpoint (the default model's GGUF file, dequantized: `--model-dir`) and 2 intra-op threads
(`--threads`), at most 8 sequences at a time (`--max-num-seqs`):
- batchlm:   the project's LLMEngine, EngineConfig(max_num_seqs=8) otherwise default (adaptive threads
             included), built and stepped on one thread (batchlm.engine.owner_thread); continuous batching.
- hf-cb:     transformers' ContinuousBatchingManager (what `model.generate_batch` runs), paged KV cache,
             max_requests_per_batch=8, max_batch_tokens=512 and room for 8 x 1024 tokens of KV (the
             engine's budgets), attention `--hf-attention` (sdpa; "paged|eager" also runs, ~13% slower
             here). Its loop runs on a thread of its own, as transformers starts it.
- hf-static: transformers' `model.generate`: groups of 8 in arrival order, left-padded, each group run to
             completion with max_new_tokens = its longest request; each output cut to its own length.
- ct2:       CTranslate2 `Generator.generate_batch`, the same groups of 8 run to completion (max_length =
             the group's longest, outputs cut, include_prompt_in_result=False: the prompts are forwarded
             at once up to the group's shortest, the rest of each prompt a token a step, as CTranslate2
             does), intra_threads=2, the checkpoint converted once with its TransformersConverter
             (float32) into .cache/peers/, keyed on the checkpoint's digest.
- llama.cpp: llama-cpp-python's low-level batch API driven as llama.cpp's server drives it: 8 slots,
             continuous batching, prompts chunked into the 512-token batch, greedy; the checkpoint written
             once as an F32 GGUF (the `gguf` package's writer; llama.cpp's convert script is not on PyPI)
             into .cache/peers/, the KV cache F32 and flash attention off (`--llama-flash-attn`: on CPU
             it rounds through F16, and ~22% of requests' greedy tokens then differ from transformers').
Each engine runs in a fresh subprocess (OpenMP and thread state do not leak between them), one after
another, after a short warm-up in that process. A peer whose package is missing is skipped with the
extra to install; the other rows still print.

What is measured, per engine, from the first submission (t=0):
- output tok/s: all requests' output tokens / the time until the last request completed;
- p50 E2E: when each request's output was complete. Request-level peers return a group's outputs when
  the group's call returns, so every request of a group ends then;
- p50 TTFT: when each request's first output token was produced. batchlm: the step that returned it;
  hf-cb: the first of transformers' per-token timestamps (record_timestamps=True); hf-static: a streamer's
  second put() of the group (the first is the prompt), i.e. the earlier groups' run time plus this group's
  prefill; ct2: the request's first per-token callback (it changes no token; it costs CTranslate2 ~3%
  of its throughput, less than this machine's run-to-run noise); llama.cpp: when the llama_decode that
  produced its first token returned;
- agreement: the fraction of requests whose token ids equal hf-static's exactly (the transformers
  reference), and the fraction of the reference's tokens each engine matches before its first difference
  (n/a when hf-static did not run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from batchlm.bench.peers.batchlm_case import run_batchlm
from batchlm.bench.peers.checkpoint import CACHE_DIR
from batchlm.bench.peers.ct2_case import run_ct2
from batchlm.bench.peers.llama_cpp_case import LLAMA_FLASH_ATTN, run_llama_cpp
from batchlm.bench.peers.peer import PEERS, missing_modules, skip_message, versions
from batchlm.bench.peers.report import REFERENCE, format_table, summarize
from batchlm.bench.peers.transformers_case import run_hf_cb, run_hf_static
from batchlm.bench.peers.workload import PeerRequest, load_workload, seeded_workload, workload_spec
from batchlm.model.gguf_export import export_hf
from batchlm.model.gguf_file import is_gguf
from batchlm.paths import DEFAULT_MODEL, PROJECT_ROOT

CASES = {"batchlm": run_batchlm, "hf-cb": run_hf_cb, "hf-static": run_hf_static, "ct2": run_ct2,
         "llama.cpp": run_llama_cpp}


def run_case_subprocess(name: str, requests_file: Path, args: argparse.Namespace) -> dict:
    """Run one engine in a fresh process; its result, or why there is none."""
    peer = PEERS[name]
    missing = missing_modules(peer)
    if missing:
        return {"engine": name, "skipped": skip_message(peer, missing)}
    if name not in CASES:
        return {"engine": name, "skipped": "skipped: no case for this engine"}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_file = Path(f.name)
    cmd = [sys.executable, "-m", "batchlm.bench.peers.cli", "--case", name, "--requests-file", str(requests_file),
           "--result-file", str(result_file), "--model-dir", str(args.model_dir), "--threads", str(args.threads),
           "--max-num-seqs", str(args.max_num_seqs), "--max-batch-tokens", str(args.max_batch_tokens),
           "--hf-attention", args.hf_attention, "--llama-flash-attn", args.llama_flash_attn]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(cmd, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=args.case_timeout)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            return {"engine": name, "failed": f"failed (exit {proc.returncode}): {tail}", "stderr": proc.stderr[-4000:]}
        result = json.loads(result_file.read_text())
    except subprocess.TimeoutExpired:
        return {"engine": name, "failed": f"failed: no result within {args.case_timeout} s"}
    finally:
        result_file.unlink(missing_ok=True)
    result["engine"] = name
    result["versions"] = versions(peer)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(PEERS),
                   help=f"comma-separated, run in this order (default: all of {', '.join(PEERS)})")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-tokens-min", type=int, default=32)
    p.add_argument("--prompt-tokens-max", type=int, default=256)
    p.add_argument("--output-mean", type=float, default=128.0)
    p.add_argument("--output-cap", type=int, default=512)
    p.add_argument("--workload", type=Path, default=None,
                   help='a JSON list of {"prompt_ids": [...], "max_tokens": N} instead of the seeded workload')
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences at a time: in flight, or per group")
    p.add_argument("--max-batch-tokens", type=int, default=512,
                   help="per-step token budget of the continuous engines (the engine's max_num_batched_tokens)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of every engine")
    p.add_argument("--hf-attention", default="sdpa", help="hf-cb's attention: sdpa or paged|eager")
    p.add_argument("--llama-flash-attn", choices=sorted(LLAMA_FLASH_ATTN), default="off",
                   help="llama.cpp's flash attention (its default is auto, i.e. on; on CPU it computes in F16)")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL,
                   help="a Hugging Face Llama folder, or a llama GGUF file (default: the default model's), which is "
                        "written once as a Hugging Face folder (float32) into .cache/peers/ for the peers to read")
    p.add_argument("--out", type=Path, default=Path("results/peers"), help="where peers.json and peers.md go")
    p.add_argument("--case-timeout", type=int, default=3600, help="seconds one engine may take")
    p.add_argument("--case", choices=sorted(PEERS), help=argparse.SUPPRESS)  # one engine, in this process
    p.add_argument("--requests-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in args.engines if e not in PEERS]
    if unknown:
        p.error(f"unknown engines {unknown}; known: {', '.join(PEERS)}")
    for name in ("num_requests", "max_num_seqs", "max_batch_tokens", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def run_one_case(args: argparse.Namespace) -> None:
    requests = [PeerRequest(**r) for r in json.loads(args.requests_file.read_text())]
    result = CASES[args.case](requests, args)
    args.result_file.write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case:
        run_one_case(args)
        return 0
    if is_gguf(args.model_dir):  # NOTE: transformers and CTranslate2 read a folder; every engine gets this one
        args.model_dir = export_hf(args.model_dir, CACHE_DIR / f"hf-{args.model_dir.stem}")
    requests = load_workload(args.workload) if args.workload else seeded_workload(args)
    workload = ({"file": str(args.workload)} if args.workload else {"spec": workload_spec(args).as_dict()})
    workload.update(num_requests=len(requests), prompt_tokens=sum(len(r.prompt_ids) for r in requests),
                    output_tokens=sum(r.max_tokens for r in requests))
    print(f"{len(requests)} requests, {workload['prompt_tokens']} prompt and {workload['output_tokens']} output "
          f"tokens, all at t=0; {args.max_num_seqs} sequences at a time, {args.threads} threads", flush=True)
    # NOTE: the reference runs first when asked for, so the others' agreement can be printed as they end
    order = sorted(args.engines, key=lambda e: e != REFERENCE) if REFERENCE in args.engines else args.engines
    results: dict[str, dict] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([asdict(r) for r in requests], f)
        requests_file = Path(f.name)
    try:
        for name in order:
            start = time.perf_counter()
            results[name] = run_case_subprocess(name, requests_file, args)
            status = results[name].get("skipped") or results[name].get("failed") or "done"
            print(f"{name}: {status} ({time.perf_counter() - start:.0f} s)", flush=True)
            if "stderr" in results[name]:
                print(results[name]["stderr"], file=sys.stderr)
    finally:
        requests_file.unlink(missing_ok=True)
    reference = results.get(REFERENCE, {}).get("tokens")
    rows = [summarize(results[name], requests, reference, args.max_num_seqs) for name in args.engines]
    table = format_table(rows)
    print(table)
    for row in rows:
        if row.get("wrong_lengths"):
            print(f"{row['engine']}: requests {row['wrong_lengths']} did not get their length", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps(
        {"workload": workload, "max_num_seqs": args.max_num_seqs, "threads": args.threads, "reference": REFERENCE,
         "rows": rows, "outputs": {n: r.get("tokens") for n, r in results.items()}}, indent=1) + "\n")
    (args.out / "peers.md").write_text(table + "\n")
    print(f"wrote {args.out / 'peers.json'} and {args.out / 'peers.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
