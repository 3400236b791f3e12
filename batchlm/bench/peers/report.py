"""One table row per engine from its raw result, agreement with the reference, and the markdown table."""

from __future__ import annotations

import statistics

from batchlm.bench.peers.peer import PEERS
from batchlm.bench.peers.workload import PeerRequest

REFERENCE = "hf-static"  # the engine every other's tokens are compared with
SUBJECT = "batchlm"  # the engine the ratio column divides by


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(fraction of requests equal to the reference, fraction of the reference's tokens matched before
    each request's first difference)."""
    if len(tokens) != len(reference):
        raise ValueError(f"{len(tokens)} outputs for {len(reference)} reference outputs")
    equal = sum(a == b for a, b in zip(tokens, reference))
    total = sum(map(len, reference))
    matched = sum(common_prefix(a, b) for a, b in zip(tokens, reference))
    return equal / len(reference), (matched / total if total else 1.0)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(result: dict, requests: list[PeerRequest], reference: list[list[int]] | None,
              max_num_seqs: int = 8) -> dict:
    """One table row from a case's raw result (tokens, times), or its skip/failure reason."""
    row = {"engine": result["engine"], "batching": PEERS[result["engine"]].batching.format(n=max_num_seqs),
           "versions": result.get("versions", {})}
    if "tokens" not in result:
        row["status"] = result.get("skipped") or result.get("failed") or "no result"
        return row
    tokens = result["tokens"]
    wrong = [r.index for r, t in zip(requests, tokens) if len(t) != r.max_tokens]
    output_tokens = sum(map(len, tokens))
    row.update(status="ok", output_tokens=output_tokens, wall_s=result["wall_s"],
               output_tok_per_s=output_tokens / result["wall_s"],
               p50_e2e_s=median(result["e2e_s"]), p50_ttft_s=median(result["ttft_s"]),
               wrong_lengths=wrong, notes=result.get("notes", ""))
    if reference is not None:
        row["requests_equal"], row["tokens_equal"] = agreement(tokens, reference)
    return row


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    """The markdown table; the ratio column is the project's engine's tok/s over each row's."""
    subject = next((r for r in rows if r["engine"] == SUBJECT and r.get("status") == "ok"), None)
    lines = ["| engine | batching | output tok/s | batchlm / this | p50 E2E s | p50 TTFT s "
             f"| requests = {REFERENCE} | tokens = {REFERENCE} |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = r["engine"] + "".join(f" ({d} {v})" for d, v in list(r.get("versions", {}).items())[:1])
        if r.get("status") != "ok":
            lines.append(f"| {label} | {r['batching']} | {r['status']} | | | | | |")
            continue
        ratio = (f"{subject['output_tok_per_s'] / r['output_tok_per_s']:.2f}x"
                 if subject is not None else "n/a")
        lines.append(f"| {label} | {r['batching']} | {r['output_tok_per_s']:.1f} | {ratio} "
                     f"| {_fmt(r['p50_e2e_s'], '.2f')} | {_fmt(r['p50_ttft_s'], '.2f')} "
                     f"| {_fmt(r.get('requests_equal'), '.1%')} | {_fmt(r.get('tokens_equal'), '.1%')} |")
    return "\n".join(lines)
