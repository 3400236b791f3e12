"""The comparison's PNGs (matplotlib, Agg backend): throughput against latency, TTFT CDF, timelines.

Each function takes run documents (batchlm.bench.served.report.run_document) and writes one file.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

COLORS = {"static_batching": "tab:red", "dynamic_batching": "tab:orange",
          "continuous_batching": "tab:green"}


def _color(name: str) -> str:
    return COLORS.get(name, "tab:blue")


def throughput_latency(series: dict[str, list[dict]], path: Path) -> None:
    """Output tokens/s (x) against p50 and p99 E2E latency (y), per strategy: a line through its open-loop
    points and a cross for each closed-loop run (saturation, where latency is queueing at the client's
    concurrency, not a point of the same curve). Runs without a successful request are left out."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key in zip(axes, ("p50", "p99")):
        for name, docs in series.items():
            docs = sorted((d for d in docs if d["summary"]["e2e"][key] is not None),
                          key=lambda d: d["summary"]["output_token_throughput"])
            for closed in (False, True):
                chosen = [d for d in docs if (d["arrival"]["mode"] == "closed") == closed]
                x = [d["summary"]["output_token_throughput"] for d in chosen]
                y = [d["summary"]["e2e"][key] for d in chosen]
                if chosen:
                    ax.plot(x, y, "x" if closed else "o-", color=_color(name), markersize=9 if closed else 6,
                            label=f"{name} (closed loop)" if closed else name)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{key} end-to-end latency (s)")
        ax.set_title(f"throughput vs {key} latency (open-loop Poisson points; x: closed loop)")
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, path)


def ttft_cdf(docs: dict[str, dict], path: Path) -> None:
    """CDF of time to first token, one curve per strategy (runs at the same arrival rate)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, doc in docs.items():
        values = np.sort([r["ttft"] for r in doc["requests"] if r["error"] is None])
        if values.size:
            ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                    label=f"{name} ({doc['arrival']['label']})", color=_color(name))
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def timeline(doc: dict, path: Path) -> None:
    """Sequences per forward pass and waiting requests over one run (from the model's metrics)."""
    samples = doc["timeline"]
    fig, ax = plt.subplots(figsize=(10, 3.5))
    if samples:
        t = [s["t"] for s in samples]
        ax.step(t, [s["seqs_per_forward"] for s in samples], where="post", label="sequences per forward",
                color=_color(doc["model"]))
        ax.step(t, [s["waiting"] for s in samples], where="post", label="waiting requests",
                color="tab:gray", alpha=0.7)
        limit = _seq_limit(doc)
        if limit:
            ax.axhline(limit, color="k", ls="--", lw=0.8, label=f"limit {limit}")
    ax.set_xlabel("time (s)")
    ax.set_title(f"{doc['model']}: {doc['arrival']['label']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    _save(fig, path)


def sweep(rows: list[dict], path_name: str, title: str, path: Path) -> None:
    """One config field's values (x, in the order run) against latency (left), and throughput with the
    batch Triton formed and the engine's sequences per forward pass (right), from sweep.sweep_rows."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    x = list(range(len(rows)))
    labels = [row["value"] for row in rows]
    for key, style in (("TTFT p50", "s--"), ("E2E p50", "o-"), ("E2E p99", "^-")):
        left.plot(x, [row[key] if row[key] is not None else np.nan for row in rows], style, label=key)
    left.set_ylabel("seconds")
    left.set_ylim(bottom=0)
    left.set_title("latency")
    right.plot(x, [row["out tok/s"] for row in rows], "o-", color="tab:green", label="output tok/s")
    right.set_ylabel("output tokens/s")
    right.set_title("throughput and batch size")
    batch = right.twinx()
    for key, style, color in (("requests per execution", "s--", "tab:purple"), ("seqs per forward", "d:", "tab:brown")):
        batch.plot(x, [row[key] if row[key] is not None else np.nan for row in rows], style, color=color, label=key)
    batch.set_ylabel("batch: requests per execution, sequences per forward")
    right.set_ylim(bottom=0)  # NOTE: from 0, so a 2% change does not fill the panel
    batch.set_ylim(bottom=0)
    lines = right.get_legend_handles_labels()
    more = batch.get_legend_handles_labels()
    right.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper center",
                 bbox_to_anchor=(0.5, -0.16), ncol=3)
    for ax in (left, right):
        ax.set_xticks(x, labels)
        ax.set_xlabel(path_name)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(title)
    _save(fig, path)


def _seq_limit(doc: dict) -> int | None:
    config = doc.get("model_config", {})
    params = {k: v.get("string_value") for k, v in config.get("parameters", {}).items()}
    value = params.get("max_num_seqs") or params.get("batch_size") or config.get("max_batch_size")
    return int(value) if value else None


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
