"""Greedy agreement with transformers: its `generate` on the same checkpoint gives the reference tokens of
the workload's first prompts; a server agrees on a prompt when its first tokens are the same."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

from batchlm.bench.peers_served.stats import StreamRecord
from batchlm.bench.peers_served.workload import ServedRequest


def load_transformers(model: Path, threads: int = 2):
    """transformers' model of the checkpoint on disk alone (a GGUF file through transformers' own reader, or
    a Hugging Face folder): float32, eager attention, in eval mode, EOS ignored by `generate` as the servers
    ignore it (it may be the greedy token, and generation goes on after it; min_new_tokens would instead
    forbid it and take the second best)."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    kwargs = {"dtype": torch.float32, "attn_implementation": "eager", "local_files_only": True}
    if model.is_file():
        with gguf_parsed_once():
            hf = transformers.AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, **kwargs)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, **kwargs)
    hf.eval()
    hf.generation_config.eos_token_id = None
    return hf


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within: one `gguf.GGUFReader` per file and arguments, and one tensor name map per architecture and
    depth. transformers' GGUF loader parses the file twice (for the config, then for the tensors: each
    parse reads the 49k-entry vocabulary field by field in Python) and builds the name map once per module
    of the model; the results are the same each time, and the repeats are most of a load's time."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def read_once(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def reference_tokens(model: Path, requests: list[ServedRequest], new_tokens: int, threads: int = 2) -> list[list[int]]:
    """transformers' greedy tokens (load_transformers) for each request's prompt ids."""
    import torch

    hf = load_transformers(model, threads)
    tokens = []
    with torch.inference_mode():
        for request in requests:
            prompt = torch.tensor([list(request.prompt_ids)])
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)
            tokens.append(out[0, prompt.shape[1]:].tolist())
    return tokens


def agrees(record: StreamRecord, reference: list[int], decode) -> bool:
    """Whether the answer begins with the reference tokens: compared as ids where the API returned them,
    else as text (the reference decoded by `decode`, the project's tokenizer)."""
    if record.token_ids:
        return list(record.token_ids[:len(reference)]) == reference
    return record.text.startswith(decode(reference))


def agreement(records: list[StreamRecord], reference: list[list[int]], decode) -> tuple[int, int]:
    """(prompts that agree, prompts compared): the first len(reference) records of the workload."""
    by_index = {r.index: r for r in records}
    compared = [(by_index[i], ref) for i, ref in enumerate(reference) if i in by_index]
    return sum(agrees(r, ref, decode) for r, ref in compared), len(compared)
