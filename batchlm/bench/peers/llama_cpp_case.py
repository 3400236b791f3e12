"""llama.cpp's case: llama-cpp-python's batch API driven as llama.cpp's server drives its slots."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from batchlm.bench.peers.checkpoint import CACHE_DIR, checkpoint_digest
from batchlm.bench.peers.groups import now_since
from batchlm.bench.peers.workload import PeerRequest
from batchlm.model.gguf_file import is_gguf

# llama.cpp's flash_attn_type. Its CPU flash attention rounds to F16 inside (logits off by up to ~6e-3 against
# transformers' float32 on the default checkpoint, ~2e-5 without it), so "off" is the float32 run.
LLAMA_FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


def gguf_model_path(model_dir: str | Path) -> Path:
    """The checkpoint as a GGUF file for llama.cpp: itself where it is one, else an F32 GGUF written once
    per digest (batchlm.model.gguf_export.write_gguf)."""
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
            now = now_since(t0)
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
    wall = now_since(t0)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return {"tokens": tokens, "ttft_s": ttft, "e2e_s": e2e, "wall_s": wall,
            "notes": f"F32 GGUF and KV, flash attention {args.llama_flash_attn}, {args.max_num_seqs} slots, "
                     f"n_batch={args.max_batch_tokens}, n_threads={args.threads}"}
