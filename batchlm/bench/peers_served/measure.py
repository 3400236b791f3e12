"""One family of servers measured at every concurrency: each run's records, peak RSS and agreement as rows.

A server is started for its runs and stopped after them, also when a run fails (the failure becomes the
row's status and the next server still runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from batchlm.bench.peers_served import triton_target
from batchlm.bench.peers_served.closed_loop import run_closed_loop
from batchlm.bench.peers_served.http_api import HttpApi
from batchlm.bench.peers_served.llama_server import LlamaServer
from batchlm.bench.peers_served.reference import agreement
from batchlm.bench.peers_served.report import ServedRow
from batchlm.bench.peers_served.rss import PeakRss, tree_of
from batchlm.bench.peers_served.stats import StreamRecord, run_stats
from batchlm.bench.peers_served.workload import ServedRequest
from batchlm.launcher.ports import free_port


@dataclass(frozen=True)
class Plan:
    """What every server is asked: the requests of each concurrency, the reference and how to decode it."""

    runs: dict[int, list[ServedRequest]]   # concurrency -> its requests (prefixes of one sequence)
    reference: list[list[int]] | None      # transformers' first tokens of the first prompts; None: not checked
    decode: Callable[[list[int]], str]     # token ids -> text (the project's tokenizer), for text-only APIs
    out: Path                              # logs and repository copies go under it
    threads: int = 2


def row_of(server: str, streams: int, records: list[StreamRecord], peak_mib: float, plan: Plan) -> ServedRow:
    agree = agreement(records, plan.reference, plan.decode) if plan.reference else None
    return ServedRow(server, streams, stats=run_stats(records), peak_rss_mib=peak_mib, agreement=agree)


def http_run(api: HttpApi, requests_: list[ServedRequest], streams: int,
             pids: list[int]) -> tuple[list[StreamRecord], float]:
    """A warm-up request, then the closed loop, the processes' peak RSS sampled meanwhile."""
    sessions: list[requests.Session] = []

    def make_sender():
        session = requests.Session()
        sessions.append(session)
        return lambda request, t0: api.send(session, request, t0)

    warm = requests_[0]
    with requests.Session() as session:
        api.send(session, ServedRequest(warm.index, warm.prompt_ids, warm.text, 8), time.perf_counter())
    try:
        with PeakRss(pids) as rss:
            records = run_closed_loop(requests_, streams, make_sender)
    finally:
        for session in sessions:
            session.close()
    return records, rss.peak_mib


def _failed(server: str, streams: int, exc: BaseException) -> ServedRow:
    print(f"{server} at {streams} streams failed: {exc}", file=sys.stderr, flush=True)
    return ServedRow(server, streams, status=f"failed: {type(exc).__name__}: {str(exc)[:200]}")


def measure_triton(servers: list[str], plan: Plan, model: Path | None, activations: str = "float32") -> list[ServedRow]:
    """`continuous_batching` at each concurrency on one server start: through Triton's generate_stream
    ("triton", or a fast tier's server with its `activations`) and the OpenAI frontend ("openai"), whichever
    `servers` names, in that order."""
    rows: list[ServedRow] = []
    for streams, requests_ in plan.runs.items():
        try:
            with triton_target.serving(plan.out, streams, model, activations) as target:
                for server in servers:
                    try:
                        if server != "openai":
                            api = HttpApi("triton", target.http_url, triton_target.MODEL)
                            pids = tree_of(target.server_pid)
                        else:
                            api = HttpApi("openai", target.frontend_url, triton_target.MODEL)
                            pids = tree_of(target.server_pid, target.frontend_pid)
                        records, peak = http_run(api, requests_, streams, pids)
                        rows.append(row_of(server, streams, records, peak, plan))
                        print(f"{server} at {streams} streams: {rows[-1].stats.output_tok_per_s:.1f} tok/s", flush=True)
                    except Exception as exc:  # NOTE: a failed run is a row; the server is still stopped
                        rows.append(_failed(server, streams, exc))
        except Exception as exc:
            rows += [_failed(server, streams, exc) for server in servers if (server, streams) not in
                     {(r.server, r.streams) for r in rows}]
    return rows


def measure_llama(server: str, gguf: Path, plan: Plan, max_prompt: int, extra_args: tuple[str, ...]) -> list[ServedRow]:
    """llama-server on `gguf`, started for each concurrency with --parallel = the concurrency."""
    rows: list[ServedRow] = []
    longest = max_prompt + max(r.max_tokens for reqs in plan.runs.values() for r in reqs)
    slot_tokens = -(-(longest + 16) // 64) * 64
    logs = plan.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for streams, requests_ in plan.runs.items():
        llama = LlamaServer(gguf, streams, slot_tokens, plan.threads, extra_args,
                            log_path=logs / f"{server}-{streams}.log", port=free_port())
        try:
            with llama:
                records, peak = http_run(HttpApi("llama.cpp", llama.base_url), requests_, streams,
                                         tree_of(llama.process.pid))
            rows.append(row_of(server, streams, records, peak, plan))
            print(f"{server} at {streams} streams: {rows[-1].stats.output_tok_per_s:.1f} tok/s", flush=True)
        except Exception as exc:
            rows.append(_failed(server, streams, exc))
    return rows


IN_PROCESS_CASES = {"openvino": "batchlm.bench.peers_served.openvino_case",
                    "engine": "batchlm.bench.peers_served.engine_case"}  # by Server.family


def measure_in_process(server: str, family: str, model: Path, plan: Plan, timeout: float = 3600.0) -> list[ServedRow]:
    """An engine without a server in a process of its own (`IN_PROCESS_CASES[family]`: OpenVINO GenAI's
    pipeline, or this project's LLMEngine): one engine, every concurrency in turn; its process's peak RSS
    per run."""
    with tempfile.TemporaryDirectory() as tmp:
        requests_file, result_file = Path(tmp) / "requests.json", Path(tmp) / "result.json"
        requests_file.write_text(json.dumps({str(c): [asdict(r) for r in reqs] for c, reqs in plan.runs.items()}))
        cmd = [sys.executable, "-m", IN_PROCESS_CASES[family], "--config", server,
               "--model", str(model), "--requests-file", str(requests_file), "--result-file", str(result_file),
               "--threads", str(plan.threads)]
        env = {**os.environ, "OMP_NUM_THREADS": str(plan.threads), "TOKENIZERS_PARALLELISM": "false"}
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return [ServedRow(server, c, status=f"failed: no result within {timeout:.0f} s") for c in plan.runs]
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(proc.stderr[-3000:], file=sys.stderr)
            return [ServedRow(server, c, status=f"failed (exit {proc.returncode}): {tail[:200]}") for c in plan.runs]
        result = json.loads(result_file.read_text())
    rows = []
    for streams in plan.runs:
        run = result["runs"][str(streams)]
        records = [StreamRecord(**{**r, "token_ids": tuple(r["token_ids"])}) for r in run["records"]]
        rows.append(row_of(server, streams, records, run["peak_rss_mib"], plan))
        print(f"{server} at {streams} streams: {rows[-1].stats.output_tok_per_s:.1f} tok/s", flush=True)
    return rows
