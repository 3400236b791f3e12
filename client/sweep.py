"""A sweep: one config field of one model served at several values, the same workload and load each
time, summarized as a table (and, by client.plots.sweep, a plot) of what the knob moved.

Input: run documents (client.report.run_document), grouped by the value they ran with, one per round.
Each figure is the median over the rounds, so a slow phase of the machine that fell on one round of
one value does not decide the row.
"""

from __future__ import annotations

import statistics

from client.comparison import seqs_per_forward

FIGURES = ("requests per execution", "seqs per forward", "req/s", "out tok/s", "out tok/s saturated",
           "TTFT p50", "E2E p50", "E2E p90", "E2E p99")


def figures(doc: dict) -> dict[str, float | None]:
    """One run's figures, by FIGURES' names (None where the run has none)."""
    s = doc["summary"]
    return {
        "requests per execution": s.get("requests_per_execution"),
        "seqs per forward": seqs_per_forward(doc),
        "req/s": s["request_throughput"],
        "out tok/s": s["output_token_throughput"],
        "out tok/s saturated": (s.get("saturated") or {}).get("output_token_throughput"),
        "TTFT p50": s["ttft"]["p50"], "E2E p50": s["e2e"]["p50"], "E2E p90": s["e2e"]["p90"],
        "E2E p99": s["e2e"]["p99"],
    }


def sweep_rows(runs: dict[str, list[dict]]) -> list[dict]:
    """A row per value (in the order given): the medians of each figure over its runs, the requests
    answered out of those sent, and the failures by code over all of them."""
    rows = []
    for value, docs in runs.items():
        each = [figures(doc) for doc in docs]
        row: dict = {"value": value, "rounds": len(docs)}
        for name in FIGURES:
            found = [f[name] for f in each if f[name] is not None]
            row[name] = statistics.median(found) if found else None
        row["ok"] = f'{sum(d["summary"]["num_ok"] for d in docs)}/{sum(d["summary"]["num_requests"] for d in docs)}'
        failures: dict[str, int] = {}
        for doc in docs:
            for code, count in doc["summary"]["failures"].items():
                failures[code] = failures.get(code, 0) + count
        row["failures"] = ", ".join(f"{k}: {v}" for k, v in sorted(failures.items())) or "-"
        rows.append(row)
    return rows


def sweep_markdown(model: str, path: str, rows: list[dict], load: str, command: str, env: dict) -> str:
    """The sweep's table with what it ran: the model, the field, the load, the command and the machine
    (`env`: client.report.environment() of a run)."""
    headers = [path, *FIGURES, "ok", "failures"]
    lines = [f"# {model}: {path}", "",
             f"Load: {load}; medians over {rows[0]['rounds'] if rows else 0} round(s) per value. Times in "
             "seconds. `requests per execution` is the batch Triton handed the model (1 where Triton does "
             "not batch); `seqs per forward` the unfinished sequences in the engine's forward passes.", "",
             f"Command: `{command}`", "",
             f"Machine: {env.get('cpu')} x{env.get('cpu_count')}, server {env.get('server')}, "
             f"packages {env.get('packages')}.", "",
             "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = [row["value"], *(_cell(row[name]) for name in FIGURES), row["ok"], row["failures"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
