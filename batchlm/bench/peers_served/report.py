"""One row per server and concurrency, and the markdown tables: the figures, then the subject's ratios."""

from __future__ import annotations

from dataclasses import dataclass

from batchlm.bench.peers_served.server import FAST_SUBJECTS, SERVERS, SUBJECT
from batchlm.bench.peers_served.stats import RunStats


@dataclass(frozen=True)
class ServedRow:
    server: str                        # a SERVERS key
    streams: int
    status: str = "ok"                 # "ok", or why there are no figures (skipped, failed)
    stats: RunStats | None = None
    peak_rss_mib: float | None = None  # the server's processes summed, sampled while it served this run
    agreement: tuple[int, int] | None = None  # (prompts equal to transformers', prompts compared)

    def as_dict(self) -> dict:
        return {"server": self.server, "label": SERVERS[self.server].label, "streams": self.streams,
                "status": self.status, "stats": self.stats.as_dict() if self.stats else None,
                "peak_rss_mib": self.peak_rss_mib,
                "agreement": list(self.agreement) if self.agreement is not None else None}


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f}"


def ratio(rows: list[ServedRow], server: str, streams: int, subject_name: str = SUBJECT) -> float | None:
    """The subject's output tok/s over `server`'s at `streams`, where both ran."""
    found = {(r.server, r.streams): r for r in rows if r.stats is not None and r.stats.output_tok_per_s > 0}
    subject, other = found.get((subject_name, streams)), found.get((server, streams))
    if subject is None or other is None:
        return None
    return subject.stats.output_tok_per_s / other.stats.output_tok_per_s


def format_table(rows: list[ServedRow]) -> str:
    """Every row's figures; TTFT and TPOT in milliseconds, TPOT the time per output token after the first."""
    lines = ["| server | streams | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
             "| peak RSS MiB | greedy = transformers |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        label = SERVERS[r.server].label
        if r.stats is None:
            lines.append(f"| {label} | {r.streams} | {r.status} | | | | | | |")
            continue
        s = r.stats
        agree = f"{r.agreement[0]}/{r.agreement[1]}" if r.agreement is not None else "n/a"
        rss = f"{r.peak_rss_mib:.0f}" if r.peak_rss_mib is not None else "n/a"
        lines.append(f"| {label} | {r.streams} | {s.output_tok_per_s:.1f} | {_ms(s.ttft_p50_s)} | {_ms(s.ttft_p99_s)} "
                     f"| {_ms(s.tpot_p50_s)} | {_ms(s.tpot_p99_s)} | {rss} | {agree} |")
    return "\n".join(lines)


def format_ratios(rows: list[ServedRow]) -> str:
    """`continuous_batching` through Triton over each other server, output tok/s, per concurrency; and the
    same for its fast tiers' runs (int8, bfloat16 activations) where they ran."""
    streams = sorted({r.streams for r in rows})
    tables = []
    for subject in (SUBJECT, *FAST_SUBJECTS):
        if not any(r.server == subject and r.stats is not None for r in rows) and subject != SUBJECT:
            continue
        servers = [s for s in dict.fromkeys(r.server for r in rows) if s != subject]
        lines = [f"| {SERVERS[subject].label} over | " + " | ".join(f"{n} streams" for n in streams) + " |",
                 "|---|" + "---:|" * len(streams)]
        for server in servers:
            cells = [ratio(rows, server, n, subject) for n in streams]
            lines.append(f"| {SERVERS[server].label} | "
                         + " | ".join("n/a" if c is None else f"{c:.2f}x" for c in cells) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)
