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
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from batchlm.bench.workload import WorkloadSpec, build_requests
from batchlm.model.gguf_export import export_hf
from batchlm.model.gguf_file import is_gguf
from batchlm.paths import DEFAULT_MODEL, PROJECT_ROOT

EXTRA_HINT = "pip install -e '.[peers]'"
CACHE_DIR = PROJECT_ROOT / ".cache" / "peers"
REFERENCE = "hf-static"
SUBJECT = "batchlm"
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
PAD_ID = 0  # left padding for hf-static (masked out; any id would do)
# llama.cpp's flash_attn_type. Its CPU flash attention rounds to F16 inside (logits off by up to ~6e-3 against
# transformers' float32, ~2e-5 without it, measured on the default checkpoint), so "off" is the float32 run.
LLAMA_FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


@dataclass(frozen=True)
class Peer:
    name: str                    # the --engines key
    batching: str                # how it batches, for the table ({n}: --max-num-seqs)
    modules: tuple[str, ...]     # what it imports
    distributions: tuple[str, ...]  # the pip packages that provide them, for versions and skip messages


PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer("batchlm", "continuous, {n} in flight", (), ()),
    Peer("hf-cb", "continuous (ContinuousBatchingManager), {n} in flight", ("transformers",), ("transformers",)),
    Peer("hf-static", "request-level: `generate`, groups of {n}", ("transformers",), ("transformers",)),
    Peer("ct2", "request-level: `generate_batch`, groups of {n}", ("ctranslate2", "transformers"),
         ("ctranslate2", "transformers")),
    Peer("llama.cpp", "continuous (server-style slots), {n} in flight", ("llama_cpp", "gguf"),
         ("llama-cpp-python", "gguf")),
)}


@dataclass(frozen=True)
class PeerRequest:
    index: int
    prompt_ids: list[int]
    max_tokens: int


# --- the pure parts: workload, groups, truncation, agreement, the table ---

def load_workload(path: str | Path) -> list[PeerRequest]:
    """A JSON list of {"prompt_ids": [int, ...], "max_tokens": int}, in arrival order."""
    items = json.loads(Path(path).read_text())
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a non-empty JSON list of requests")
    requests = []
    for i, item in enumerate(items):
        item = item if isinstance(item, dict) else {}
        ids, n = item.get("prompt_ids"), item.get("max_tokens")
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
            raise ValueError(f"{path}: request {i}: prompt_ids must be a non-empty list of token ids")
        if not (isinstance(n, int) and n >= 1):
            raise ValueError(f"{path}: request {i}: max_tokens must be an int >= 1")
        requests.append(PeerRequest(i, list(ids), n))
    return requests


def seeded_workload(args: argparse.Namespace) -> list[PeerRequest]:
    """The seeded spec's requests, prompts encoded as the engine encodes them (BOS first)."""
    from batchlm.model.tokenizer import Tokenizer

    spec = workload_spec(args)
    tokenizer = Tokenizer.from_dir(args.model_dir)
    return [PeerRequest(r.index, tokenizer.encode(r.prompt), r.max_tokens)
            for r in build_requests(spec, args.model_dir)]


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(seed=args.seed, num_requests=args.num_requests, prompt_tokens_min=args.prompt_tokens_min,
                        prompt_tokens_max=args.prompt_tokens_max, output_mean=args.output_mean,
                        output_cap=args.output_cap)


def request_groups(num_requests: int, size: int) -> list[list[int]]:
    """Request-level batches: indices in arrival order, `size` at a time (the last may be smaller)."""
    if size < 1:
        raise ValueError("group size must be >= 1")
    return [list(range(i, min(i + size, num_requests))) for i in range(0, num_requests, size)]


def truncate(rows: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Each row of a group run to the group's longest length, cut to its own request's length."""
    if len(rows) != len(lengths):
        raise ValueError(f"{len(rows)} rows for {len(lengths)} lengths")
    short = [i for i, (row, n) in enumerate(zip(rows, lengths)) if len(row) < n]
    if short:
        raise ValueError(f"rows {short} hold fewer tokens than their requests asked for")
    return [list(row[:n]) for row, n in zip(rows, lengths)]


def missing_modules(peer: Peer) -> list[str]:
    return [m for m in peer.modules if importlib.util.find_spec(m) is None]


def skip_message(peer: Peer, missing: list[str]) -> str:
    return (f"skipped: {', '.join(missing)} not installed (the optional `peers` extra: "
            f"`{EXTRA_HINT}`, or `make bench-peers`)")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(fraction of requests equal to the reference, fraction of the reference's tokens matched before
    each request's first difference)."""
    if len(tokens) != len(reference):
        raise ValueError(f"{len(tokens)} outputs for {len(reference)} reference outputs")
    equal = sum(a == b for a, b in zip(tokens, reference))
    total = sum(map(len, reference))
    matched = sum(common_prefix(a, b) for a, b in zip(tokens, reference))
    return equal / len(reference), (matched / total if total else 1.0)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(result: dict, requests: list[PeerRequest], reference: list[list[int]] | None,
              max_num_seqs: int = 8) -> dict:
    """One table row from a case's raw result (tokens, times), or its skip/failure reason."""
    row = {"engine": result["engine"], "batching": PEERS[result["engine"]].batching.format(n=max_num_seqs),
           "versions": result.get("versions", {})}
    if "tokens" not in result:
        row["status"] = result.get("skipped") or result.get("failed") or "no result"
        return row
    tokens = result["tokens"]
    wrong = [r.index for r, t in zip(requests, tokens) if len(t) != r.max_tokens]
    output_tokens = sum(map(len, tokens))
    row.update(status="ok", output_tokens=output_tokens, wall_s=result["wall_s"],
               output_tok_per_s=output_tokens / result["wall_s"],
               p50_e2e_s=median(result["e2e_s"]), p50_ttft_s=median(result["ttft_s"]),
               wrong_lengths=wrong, notes=result.get("notes", ""))
    if reference is not None:
        row["requests_equal"], row["tokens_equal"] = agreement(tokens, reference)
    return row


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    """The markdown table; the ratio column is the project's engine's tok/s over each row's."""
    subject = next((r for r in rows if r["engine"] == SUBJECT and r.get("status") == "ok"), None)
    lines = ["| engine | batching | output tok/s | batchlm / this | p50 E2E s | p50 TTFT s "
             f"| requests = {REFERENCE} | tokens = {REFERENCE} |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = r["engine"] + "".join(f" ({d} {v})" for d, v in list(r.get("versions", {}).items())[:1])
        if r.get("status") != "ok":
            lines.append(f"| {label} | {r['batching']} | {r['status']} | | | | | |")
            continue
        ratio = (f"{subject['output_tok_per_s'] / r['output_tok_per_s']:.2f}x"
                 if subject is not None else "n/a")
        lines.append(f"| {label} | {r['batching']} | {r['output_tok_per_s']:.1f} | {ratio} "
                     f"| {_fmt(r['p50_e2e_s'], '.2f')} | {_fmt(r['p50_ttft_s'], '.2f')} "
                     f"| {_fmt(r.get('requests_equal'), '.1%')} | {_fmt(r.get('tokens_equal'), '.1%')} |")
    return "\n".join(lines)


def versions(peer: Peer) -> dict[str, str]:
    found = {}
    for dist in peer.distributions:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def checkpoint_digest(model_dir: str | Path) -> str:
    """A short digest of the checkpoint's files (config, tokenizer, weights): the key of converted copies."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    names = [n for n in CHECKPOINT_FILES if (root / n).is_file()]
    names += sorted(p.name for p in root.glob("*.safetensors"))
    for name in names:
        digest.update(name.encode() + b"\0")
        with open(root / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


# --- the cases: each runs in its own process and returns tokens and times ---

def _now_since(t0: float) -> float:
    return time.perf_counter() - t0


def run_batchlm(requests: list[PeerRequest], args: argparse.Namespace) -> dict:
    """The project's engine, built and stepped on one thread (as the services do)."""
    result: dict = {}

    def build():
        from batchlm.engine.engine import LLMEngine
        from batchlm.engine.engine_config import EngineConfig

        return LLMEngine(args.model_dir, EngineConfig(max_num_seqs=args.max_num_seqs, num_threads=args.threads,
                                                      max_num_batched_tokens=args.max_batch_tokens))

    def run(engine) -> None:
        from batchlm.engine.sampling import SamplingParams

        engine.generate([requests[0].prompt_ids], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        tokens: list[list[int]] = [[] for _ in requests]
        ttft = [0.0] * len(requests)
        e2e = [0.0] * len(requests)
        t0 = time.perf_counter()
        for r in requests:
            engine.add_request(f"r{r.index}", r.prompt_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
        while engine.has_unfinished():
            outputs = engine.step()
            now = _now_since(t0)
            for out in outputs:
                i = int(out.request_id[1:])
                if out.token_ids and not tokens[i]:
                    ttft[i] = now
                tokens[i].extend(out.token_ids)
                if out.finished:
                    e2e[i] = now
        result.update(tokens=tokens, ttft_s=ttft, e2e_s=e2e, wall_s=_now_since(t0),
                      notes=f"EngineConfig(max_num_seqs={args.max_num_seqs}, num_threads={args.threads}, "
                            f"max_num_batched_tokens={args.max_batch_tokens})")

    worker = threading.Thread(target=lambda: run(build()), name="batchlm-engine")
    worker.start()
    worker.join()
    if "tokens" not in result:
        raise RuntimeError("the engine thread ended without a result (see its traceback above)")
    return result


def _hf_model(args: argparse.Namespace, attention: str | None = None):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    kwargs = {"attn_implementation": attention} if attention else {}
    return AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, local_files_only=True,
                                                **kwargs).eval()


def run_hf_cb(requests: list[PeerRequest], args: argparse.Namespace) -> dict:
    """transformers' continuous batching: requests added one by one, each with its own max_new_tokens."""
    import math

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = _hf_model(args, args.hf_attention)
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    page = ContinuousBatchingConfig.page_size
    # KV room for max_num_seqs sequences of max(longest request, 1024) tokens, as the engine's 8 x 1024
    num_blocks = max(1, math.ceil(args.max_num_seqs * max(longest, 1024) / page))
    cb_config = ContinuousBatchingConfig(max_requests_per_batch=args.max_num_seqs,
                                         max_batch_tokens=args.max_batch_tokens, num_blocks=num_blocks)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests),
                                  eos_token_id=-1, pad_token_id=PAD_ID)
    tokens: list[list[int]] = [[] for _ in requests]
    ttft = [0.0] * len(requests)
    e2e = [0.0] * len(requests)

    def wait_for(count: int, on_result) -> None:
        done = 0
        while done < count:
            out = manager.get_result(timeout=1.0)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped")
                continue
            if out.error is not None:
                raise RuntimeError(f"transformers' request {out.request_id} failed: {out.error}")
            if out.is_finished():
                on_result(out)
                done += 1

    with model.continuous_batching_context_manager(generation_config=gen_config, continuous_batching_config=cb_config,
                                                   block=True, timeout=30) as manager:
        manager.add_request(requests[0].prompt_ids, request_id="warmup", max_new_tokens=8, eos_token_id=-1)
        wait_for(1, lambda out: None)
        t0 = time.perf_counter()
        for r in requests:
            manager.add_request(r.prompt_ids, request_id=f"r{r.index}", max_new_tokens=r.max_tokens,
                                eos_token_id=-1, record_timestamps=True)

        def record(out) -> None:
            i = int(out.request_id[1:])
            tokens[i] = list(out.generated_tokens)
            ttft[i] = out.timestamps[0] - t0 if out.timestamps else math.nan
            e2e[i] = _now_since(t0)

        wait_for(len(requests), record)
        wall = _now_since(t0)
        resolved = manager.continuous_batching_config
        notes = (f"attn {model.config._attn_implementation}, "
                 f"max_requests_per_batch={resolved.max_requests_per_batch}, "
                 f"max_batch_tokens={resolved.max_batch_tokens}, "
                 f"num_blocks={resolved.num_blocks} x page {resolved.page_size}")
    return {"tokens": tokens, "ttft_s": ttft, "e2e_s": e2e, "wall_s": wall, "notes": notes}


def run_hf_static(requests: list[PeerRequest], args: argparse.Namespace) -> dict:
    """transformers' `generate`, request-level: left-padded groups run to their longest request."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        """Notes when a group's first generated tokens arrive (put #1 is the prompt, put #2 the first token)."""

        def __init__(self) -> None:
            self.puts = 0
            self.first: float | None = None

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    model = _hf_model(args)

    def generate(group: list[PeerRequest], streamer: FirstToken | None = None) -> list[list[int]]:
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.tensor([[PAD_ID] * (width - len(r.prompt_ids)) + r.prompt_ids for r in group])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in group])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r in group),
                                 min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=PAD_ID,
                                 streamer=streamer)
        return truncate(out[:, width:].tolist(), [r.max_tokens for r in group])

    def generate_group(group: list[PeerRequest]) -> tuple[list[list[int]], list[float]]:
        streamer = FirstToken()
        rows = generate(group, streamer)
        return rows, [streamer.first] * len(rows)

    return {**run_groups(requests, args.max_num_seqs, generate_group),
            "notes": f"attn {model.config._attn_implementation}, left padding, groups of {args.max_num_seqs}"}


def run_groups(requests: list[PeerRequest], group_size: int,
               generate_group: Callable[[list[PeerRequest]], tuple[list[list[int]], list[float]]]) -> dict:
    """A request-level engine's run: groups of `group_size` in arrival order, each run to completion by
    `generate_group(group)`, which returns the group's token rows and when (time.perf_counter) each row's
    first token came; every request of a group ends when the call returns. After one small warm-up call."""
    generate_group([PeerRequest(0, requests[0].prompt_ids, 8)])
    tokens: list[list[int]] = [[] for _ in requests]
    ttft = [0.0] * len(requests)
    e2e = [0.0] * len(requests)
    t0 = time.perf_counter()
    for group in request_groups(len(requests), group_size):
        rows, firsts = generate_group([requests[i] for i in group])
        done = _now_since(t0)
        for i, row, first in zip(group, rows, firsts):
            tokens[i], ttft[i], e2e[i] = row, first - t0, done
    return {"tokens": tokens, "ttft_s": ttft, "e2e_s": e2e, "wall_s": _now_since(t0)}


def ct2_model_dir(model_dir: str | Path) -> Path:
    """The checkpoint converted to CTranslate2 (float32), converted once per checkpoint digest."""
    import ctranslate2.converters

    out = CACHE_DIR / f"ct2-{checkpoint_digest(model_dir)}-float32"
    if not (out / "model.bin").is_file():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=CACHE_DIR, prefix=".ct2-"))
        converter = ctranslate2.converters.TransformersConverter(str(model_dir))
        converter.convert(str(tmp), quantization="float32", force=True)
        os.replace(tmp, out)
    return out


def run_ct2(requests: list[PeerRequest], args: argparse.Namespace) -> dict:
    """CTranslate2, request-level: each group generated to its longest request, outputs cut."""
    import ctranslate2

    path = ct2_model_dir(args.model_dir)
    vocabulary = json.loads((path / "vocabulary.json").read_text())
    generator = ctranslate2.Generator(str(path), device="cpu", compute_type="float32",
                                      intra_threads=args.threads, inter_threads=1)
    first: dict[int, float] = {}

    def on_token(step) -> bool:
        first.setdefault(step.batch_id, time.perf_counter())
        return False  # never stops a row: the group runs to its longest request

    def generate(group: list[PeerRequest], callback=None) -> list[list[int]]:
        results = generator.generate_batch(  # noqa: F821 (bound above; deleted only after the last call)
            [[vocabulary[t] for t in r.prompt_ids] for r in group], max_length=max(r.max_tokens for r in group),
            include_prompt_in_result=False, end_token=[], return_end_token=True, sampling_topk=1, beam_size=1,
            callback=callback)
        return truncate([res.sequences_ids[0] for res in results], [r.max_tokens for r in group])

    def generate_group(group: list[PeerRequest]) -> tuple[list[list[int]], list[float]]:
        first.clear()
        rows = generate(group, on_token)
        return rows, [first[j] for j in range(len(rows))]

    result = run_groups(requests, args.max_num_seqs, generate_group)
    del generator  # NOTE: before the interpreter's teardown, which has aborted with a callback registered
    return {**result, "notes": f"float32, intra_threads={args.threads}, groups of {args.max_num_seqs}, {path.name}"}


def gguf_model_path(model_dir: str | Path) -> Path:
    """The checkpoint as a GGUF file for llama.cpp: itself where it is one, else an F32 GGUF written once
    per digest (batchlm.model.gguf_file.write_gguf)."""
    from batchlm.model.gguf_export import write_gguf

    if is_gguf(model_dir):
        return Path(model_dir)
    out = CACHE_DIR / f"gguf-{checkpoint_digest(model_dir)}-f32.gguf"
    if not out.is_file():
        write_gguf(model_dir, out)
    return out


def run_llama_cpp(requests: list[PeerRequest], args: argparse.Namespace) -> dict:
    """llama.cpp through llama-cpp-python's low-level API, scheduled as llama-server schedules its slots:
    each llama_decode carries one token of every decoding slot, then prompt tokens of newly admitted
    requests up to the batch size (a longer prompt continues in the next batch); greedy on the logits."""
    import llama_cpp
    import numpy as np

    path = gguf_model_path(args.model_dir)
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    per_slot = max(longest, 1024)
    ctx_params = llama_cpp.llama_context_default_params()
    ctx_params.n_ctx = per_slot * args.max_num_seqs
    ctx_params.n_batch = args.max_batch_tokens
    ctx_params.n_ubatch = args.max_batch_tokens
    ctx_params.n_seq_max = args.max_num_seqs
    ctx_params.n_threads = args.threads
    ctx_params.n_threads_batch = args.threads
    ctx_params.type_k = ctx_params.type_v = 0  # GGML_TYPE_F32: the KV cache in float32 too (llama.cpp's default is F16)
    ctx_params.flash_attn_type = LLAMA_FLASH_ATTN[args.llama_flash_attn]
    ctx = llama_cpp.llama_init_from_model(model, ctx_params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    memory = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(args.max_batch_tokens + args.max_num_seqs, 0, 1)

    def serve(reqs: list[PeerRequest], t0: float):
        tokens: list[list[int]] = [[] for _ in reqs]
        ttft = [0.0] * len(reqs)
        e2e = [0.0] * len(reqs)
        waiting = list(range(len(reqs)))
        free = list(range(args.max_num_seqs))
        slots: dict[int, dict] = {}   # seq id -> {"req": i, "pos": next position, "fed": prompt tokens fed}
        while waiting or slots:
            n = 0
            rows: list[tuple[int, int]] = []  # (batch row with logits, seq id)

            def add(token: int, pos: int, seq: int, logits: bool) -> None:
                nonlocal n
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
                batch.seq_id[n][0], batch.logits[n] = seq, logits
                if logits:
                    rows.append((n, seq))
                n += 1

            for seq, slot in slots.items():  # decodes first, one token each
                if slot["fed"] == len(reqs[slot["req"]].prompt_ids):
                    add(tokens[slot["req"]][-1], slot["pos"], seq, True)
                    slot["pos"] += 1
            while waiting and free and n < args.max_batch_tokens:
                seq = free.pop(0)
                slots[seq] = {"req": waiting.pop(0), "pos": 0, "fed": 0}
            for seq, slot in slots.items():  # then prompt chunks, in admission order
                prompt = reqs[slot["req"]].prompt_ids
                while slot["fed"] < len(prompt) and n < args.max_batch_tokens:
                    last = slot["fed"] == len(prompt) - 1
                    add(prompt[slot["fed"]], slot["pos"], seq, last)
                    slot["fed"] += 1
                    slot["pos"] += 1
            batch.n_tokens = n
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            now = _now_since(t0)
            for row, seq in rows:
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, row), shape=(vocab_size,))
                i = slots[seq]["req"]
                if not tokens[i]:
                    ttft[i] = now
                tokens[i].append(int(logits.argmax()))
                if len(tokens[i]) == reqs[i].max_tokens:
                    e2e[i] = now
                    llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
                    del slots[seq]
                    free.append(seq)
        return tokens, ttft, e2e

    serve([PeerRequest(0, requests[0].prompt_ids, 8)], time.perf_counter())  # warm-up
    llama_cpp.llama_memory_clear(memory, True)
    t0 = time.perf_counter()
    tokens, ttft, e2e = serve(requests, t0)
    wall = _now_since(t0)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return {"tokens": tokens, "ttft_s": ttft, "e2e_s": e2e, "wall_s": wall,
            "notes": f"F32 GGUF and KV, flash attention {args.llama_flash_attn}, {args.max_num_seqs} slots, "
                     f"n_batch={args.max_batch_tokens}, n_threads={args.threads}"}


CASES = {"batchlm": run_batchlm, "hf-cb": run_hf_cb, "hf-static": run_hf_static, "ct2": run_ct2,
         "llama.cpp": run_llama_cpp}


# --- the driver ---

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
    cmd = [sys.executable, "-m", "batchlm.bench.peers", "--case", name, "--requests-file", str(requests_file),
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
