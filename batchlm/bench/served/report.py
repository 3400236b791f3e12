"""Benchmark reports: the run's environment, its JSON and its markdown table.

Every run records the machine, the versions, the model's config as the server reports it, the
workload and the arrival process, so a number can always be traced to what produced it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

import requests

from batchlm.bench.served.benchmark import BenchmarkRun

PACKAGES = ("torch", "numpy", "tritonclient", "tokenizers")


def environment(http_url: str | None = None) -> dict:
    """Machine, versions and (when a server is given) the server's own metadata."""
    env = {
        "machine": platform.machine(), "platform": platform.platform(), "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
        "packages": {name: _version(name) for name in PACKAGES},
        "attention_kernel": _attention_kernel(),
    }
    if http_url is not None:
        r = requests.get(f"http://{http_url}/v2", timeout=10)
        r.raise_for_status()
        server = r.json()
        env["server"] = {"name": server.get("name"), "version": server.get("version")}
    return env


def _attention_kernel() -> str | None:
    """The batchlm attention kernel built on this machine (the engine's `attention: auto` uses it), or None."""
    try:
        from batchlm import kernels
    except ImportError:  # NOTE: a client machine without the engine's dependencies
        return None
    path = kernels.library_path()
    return path.name if path.exists() else None


def model_config(http_url: str, model: str) -> dict:
    r = requests.get(f"http://{http_url}/v2/models/{model}/config", timeout=10)
    r.raise_for_status()
    return r.json()


def run_document(run: BenchmarkRun, workload: dict, env: dict, model_cfg: dict) -> dict:
    """Everything about one run, JSON-ready."""
    return {
        "model": run.config.model,
        "arrival": run.config.arrival.as_dict(),
        "label": f"{run.config.model} {run.config.arrival.label}",
        "streamed": run.streamed,
        "protocol": run.config.protocol,
        "workload": workload,
        "summary": run.summary,
        "environment": env,
        "model_config": model_cfg,
        "requests": [r.as_dict() for r in run.records],
        "timeline": run.timeline,
    }


def write_json(document: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))


def summary_row(document: dict) -> dict:
    """The figures one line of a table shows."""
    s = document["summary"]

    def q(metric: str, key: str) -> float | None:
        return s[metric][key]

    return {
        "model": document["model"], "arrival": document["arrival"]["label"],
        "req/s": s["request_throughput"], "out tok/s": s["output_token_throughput"],
        "out tok/s saturated": (s.get("saturated") or {}).get("output_token_throughput"),
        "goodput req/s": s["goodput"],
        "TTFT p50": q("ttft", "p50"), "TTFT p99": q("ttft", "p99"),
        "E2E mean": q("e2e", "mean"), "E2E p50": q("e2e", "p50"), "E2E p90": q("e2e", "p90"),
        "E2E p99": q("e2e", "p99"), "TPOT p50": q("tpot", "p50"), "ITL p50": q("itl", "p50"),
        "ITL p99": q("itl", "p99"), "ok": f'{s["num_ok"]}/{s["num_requests"]}',
        "failures": ", ".join(f"{k}: {v}" for k, v in s["failures"].items()) or "-",
    }


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    headers = list(rows[0])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[h]) for h in headers) + " |")
    return "\n".join(lines) + "\n"


def run_markdown(document: dict) -> str:
    """One run as markdown: its label, the table line, the SLO and the environment."""
    s, env = document["summary"], document["environment"]
    return (f"## {document['label']}\n\n{markdown_table([summary_row(document)])}\n"
            f"Times in seconds. Goodput SLO: {s['slo']}. Workload: {document['workload']}.\n"
            f"Machine: {env['cpu']} x{env['cpu_count']}, Python {env['python']}, "
            f"{env['packages']}, server {env.get('server')}.\n")


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass  # NOTE: not Linux; platform.processor() is the best we have
    return platform.processor() or "unknown"


def measure(config, requests: list, workload: dict) -> dict:
    """Run one benchmark (batchlm.bench.served.benchmark.BenchmarkConfig) and return its JSON-ready document."""
    from batchlm.bench.served.benchmark import Benchmark

    env = environment(config.http_url)
    cfg = model_config(config.http_url, config.model)
    return run_document(Benchmark(config).run(requests), workload, env, cfg)


def write_run(document: dict, folder: Path, stem: str) -> None:
    """`<stem>.json` and `<stem>.md` in `folder`."""
    write_json(document, folder / f"{stem}.json")
    (folder / f"{stem}.md").write_text(run_markdown(document))
