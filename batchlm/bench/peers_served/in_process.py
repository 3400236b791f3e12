"""The frame of an engine measured without a server, in a process of its own (openvino_case, engine_case):
its command line, the runs read from the requests file, the engine built once for the largest
concurrency, a warm-up, every concurrency in turn with the process's peak RSS, and the result file
(measure.measure_in_process reads it). A case gives how to build its engine and how to drive one
closed-loop run on it."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

from batchlm.bench.peers_served.rss import PeakRss
from batchlm.bench.peers_served.stats import StreamRecord
from batchlm.bench.peers_served.workload import ServedRequest

# build(config, model, threads, max_num_seqs) -> the engine
Build = Callable[[str, Path, int, int], object]
# closed_loop(engine, requests, concurrency, id_base) -> a record per request, in the requests' order
ClosedLoop = Callable[[object, list[ServedRequest], int, int], list[StreamRecord]]


def run_case(argv: list[str] | None, description: str, configs: Iterable[str], model_help: str, build: Build,
             closed_loop: ClosedLoop) -> int:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", choices=sorted(configs), required=True)
    p.add_argument("--model", type=Path, required=True, help=model_help)
    p.add_argument("--requests-file", type=Path, required=True, help="JSON: {concurrency: [request, ...]}")
    p.add_argument("--result-file", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    runs = {int(c): [ServedRequest(**{**r, "prompt_ids": tuple(r["prompt_ids"])}) for r in reqs]
            for c, reqs in json.loads(args.requests_file.read_text()).items()}
    start = time.perf_counter()
    engine = build(args.config, args.model, args.threads, max(runs))
    load_s = time.perf_counter() - start
    warm = next(iter(runs.values()))[0]
    closed_loop(engine, [ServedRequest(0, warm.prompt_ids, warm.text, 8)], 1, 0)
    results = {}
    for run, (concurrency, requests) in enumerate(runs.items(), start=1):
        with PeakRss([os.getpid()]) as rss:
            records = closed_loop(engine, requests, concurrency, run * 1_000_000)  # ids unique per engine
        results[concurrency] = {"records": [asdict(r) for r in records], "peak_rss_mib": rss.peak_mib}
    args.result_file.write_text(json.dumps({"load_s": load_s, "runs": results}))
    return 0
