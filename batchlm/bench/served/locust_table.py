"""Locust stats as one markdown table: a row per request event of each `<prefix>_stats.csv` of headless runs.

    .venv/bin/batchlm-bench locust-table results/locust/static_batching_stats.csv ...

One row per request event (TTFT, E2E) of each file, the Aggregated row left out; times in ms as Locust
writes them (rounded to two significant digits for percentiles), mean output tokens from the events'
response length, and requests/s over the whole run.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

HEADER = ("| strategy | protocol | event | requests | failures | median | mean | p95 | p99 | max "
          "| mean output tokens | req/s |")


def rows(path: Path) -> list[str]:
    """Markdown rows of one stats file; ValueError naming the file if it is not Locust's stats CSV."""
    with open(path, newline="") as f:
        records = [r for r in csv.DictReader(f) if r.get("Type") in ("TTFT", "E2E")]
    if not records:
        raise ValueError(f"{path}: no TTFT or E2E rows; expected a Locust <prefix>_stats.csv of locustfiles/")
    lines = []
    for r in sorted(records, key=lambda r: (r["Name"], r["Type"])):
        protocol, model = r["Name"].split(" ", 1)
        lines.append(
            f"| `{model}` | {protocol} | {r['Type']} | {int(r['Request Count'])} | {int(r['Failure Count'])} "
            f"| {float(r['Median Response Time']):.0f} | {float(r['Average Response Time']):.0f} "
            f"| {float(r['95%']):.0f} | {float(r['99%']):.0f} | {float(r['Max Response Time']):.0f} "
            f"| {float(r['Average Content Size']):.1f} | {float(r['Requests/s']):.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stats", nargs="+", type=Path, help="Locust <prefix>_stats.csv files, in table order")
    args = parser.parse_args(argv)
    out = [HEADER, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    try:
        for path in args.stats:
            out.extend(rows(path))
    except (OSError, ValueError, KeyError) as e:
        print(f"locust_table: {e}", file=sys.stderr)
        return 2
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
