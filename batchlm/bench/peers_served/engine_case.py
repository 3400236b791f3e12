"""This project's LLMEngine in process, with no server: the same closed-loop streams, driven from one loop
that steps the engine, as OpenVINO GenAI's rows are (openvino_case). Beside OpenVINO's rows it compares the
two engines on equal terms; beside `continuous_batching`'s served rows it shows what serving costs (the
Python backend, tritonserver's HTTP stream, the clients on the same cores).

Run in a process of its own by the command (`python -m batchlm.bench.peers_served.engine_case ...`): one
engine per configuration, with `continuous_batching`'s defaults (EngineConfig's) but max_num_seqs = the
largest concurrency and --threads threads, every concurrency on it in turn after a warm-up; its result is a
JSON file of openvino_case's form.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from batchlm.bench.peers_served.in_process import run_case
from batchlm.bench.peers_served.server import SERVERS
from batchlm.bench.peers_served.stats import StreamRecord
from batchlm.bench.peers_served.workload import ServedRequest

# --config: the tier it runs
ENGINE_ACTIVATIONS = {name: s.activations for name, s in SERVERS.items() if s.family == "engine"}


def run_closed_loop(engine, requests: list[ServedRequest], concurrency: int, id_base: int = 0) -> list[StreamRecord]:
    """`concurrency` requests in flight; a finished one's stream adds its next request before the next step.
    The engine's request ids are `id_base` + each request's index (unique within one engine)."""
    from batchlm.engine.sampling import SamplingParams

    pending = deque(requests)
    in_flight: dict[str, dict] = {}
    records: dict[int, StreamRecord] = {}
    t0 = time.perf_counter()

    def admit() -> None:
        request = pending.popleft()
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)  # temperature 0: greedy
        engine.add_request(str(id_base + request.index), list(request.prompt_ids), params)
        in_flight[str(id_base + request.index)] = {"index": request.index, "sent": time.perf_counter() - t0,
                                                    "first": None, "ids": []}

    while pending and len(in_flight) < concurrency:
        admit()
    while in_flight:
        outputs = engine.step()
        now = time.perf_counter() - t0
        for out in outputs:
            state = in_flight[out.request_id]
            state["ids"] += out.token_ids
            if state["ids"] and state["first"] is None:
                state["first"] = now
            if not out.finished:
                continue
            del in_flight[out.request_id]
            records[state["index"]] = StreamRecord(state["index"], state["sent"], state["first"] or now, now,
                                                   len(state["ids"]), tuple(state["ids"]))
            if pending:
                admit()
    return [records[r.index] for r in requests]


def build(config: str, model: Path, threads: int, max_num_seqs: int):
    from batchlm.engine.engine import LLMEngine
    from batchlm.engine.engine_config import EngineConfig

    return LLMEngine(model, EngineConfig(activations=ENGINE_ACTIVATIONS[config], max_num_seqs=max_num_seqs,
                                         num_threads=threads))


def main(argv: list[str] | None = None) -> int:
    return run_case(argv, __doc__, ENGINE_ACTIVATIONS, "the checkpoint: a GGUF file or a Hugging Face folder", build,
                    run_closed_loop)


if __name__ == "__main__":
    raise SystemExit(main())
