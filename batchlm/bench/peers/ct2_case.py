"""CTranslate2's case: `Generator.generate_batch`, request-level, on the checkpoint converted once."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from batchlm.bench.peers.checkpoint import CACHE_DIR, checkpoint_digest
from batchlm.bench.peers.groups import run_groups, truncate
from batchlm.bench.peers.workload import PeerRequest

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
