"""OpenVINO GenAI's continuous-batching pipeline on CPU, in process (it has no HTTP server): the same
closed-loop streams, driven from one loop that steps the pipeline and reads each request's new tokens.

Run in a process of its own by the command (`python -m batchlm.bench.peers_served.openvino_case ...`): one
pipeline per configuration, every concurrency on it in turn, after a warm-up; its result is a JSON file.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from batchlm.bench.peers_served.in_process import run_case
from batchlm.bench.peers_served.stats import StreamRecord
from batchlm.bench.peers_served.workload import ServedRequest


@dataclass(frozen=True)
class OpenVinoConfig:
    name: str         # the row's label
    source: str       # "gguf": the checkpoint's GGUF file, read by GenAI itself; "ir": the float32 IR
    f32_hint: bool    # INFERENCE_PRECISION_HINT f32; False: the plugin's default (bf16 where the CPU has it)


OPENVINO_CONFIGS = {c.name: c for c in (
    OpenVinoConfig("openvino-ir-f32", "ir", True),
    OpenVinoConfig("openvino-ir", "ir", False),
    OpenVinoConfig("openvino-gguf", "gguf", True),
)}


def pipeline(model: Path, config: OpenVinoConfig, threads: int, max_num_seqs: int):
    import openvino_genai

    scheduler = openvino_genai.SchedulerConfig()
    scheduler.max_num_seqs = max_num_seqs
    scheduler.max_num_batched_tokens = 512
    scheduler.cache_size = 1  # GB of KV cache: 32 sequences of 170 tokens need ~0.25 in float32
    properties = {"INFERENCE_NUM_THREADS": threads}
    if config.f32_hint:
        properties["INFERENCE_PRECISION_HINT"] = "f32"
    return openvino_genai.ContinuousBatchingPipeline(str(model), scheduler, "CPU", properties)


def run_closed_loop(pipe, requests: list[ServedRequest], concurrency: int, id_base: int = 0) -> list[StreamRecord]:
    """`concurrency` requests in flight; a finished one's stream adds its next request before the next step.
    The pipeline's request ids are `id_base` + each request's index (unique within one pipeline)."""
    import numpy as np
    import openvino
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.do_sample = False
    config.ignore_eos = True
    pending = deque(requests)
    in_flight: dict[int, dict] = {}
    records: dict[int, StreamRecord] = {}
    t0 = time.perf_counter()

    def admit() -> None:
        request = pending.popleft()
        config.max_new_tokens = request.max_tokens
        ids = openvino.Tensor(np.array([request.prompt_ids], dtype=np.int64))
        handle = pipe.add_request(id_base + request.index, ids, config)
        in_flight[request.index] = {"handle": handle, "sent": time.perf_counter() - t0, "first": None, "ids": []}

    while pending and len(in_flight) < concurrency:
        admit()
    while in_flight:
        pipe.step()
        now = time.perf_counter() - t0
        for index, state in list(in_flight.items()):
            handle = state["handle"]
            while handle.can_read():
                for output in handle.read().values():
                    state["ids"] += list(output.generated_ids)
            if state["ids"] and state["first"] is None:
                state["first"] = now
            status = handle.get_status()
            if status == openvino_genai.GenerationStatus.RUNNING:
                continue
            if status != openvino_genai.GenerationStatus.FINISHED:
                raise RuntimeError(f"request {index} ended with {status}")
            del in_flight[index]
            records[index] = StreamRecord(index, state["sent"], state["first"] or now, now, len(state["ids"]),
                                          tuple(state["ids"]))
            if pending:
                admit()
    return [records[r.index] for r in requests]


def main(argv: list[str] | None = None) -> int:
    return run_case(argv, __doc__, OPENVINO_CONFIGS, "the GGUF file, or the IR's folder",
                    lambda config, model, threads, seqs: pipeline(model, OPENVINO_CONFIGS[config], threads, seqs),
                    run_closed_loop)


if __name__ == "__main__":
    raise SystemExit(main())
