"""The measured comparison of the three strategies: variant repositories, the seed's table, targets.

Input: run documents (batchlm.bench.served.report.run_document) keyed by a role ("static_batching/saturation",
"continuous_batching/rate-1.10", ...). Output: markdown with the seed's comparison table filled with
measured numbers and the performance targets with their measured values.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from batchlm.paths import DEFAULT_REPOSITORY, PROJECT_ROOT
from batchlm.bench.served.config_override import ConfigOverride, overridden_repository

STRATEGIES = ("static_batching", "dynamic_batching", "continuous_batching")
SEED_ROWS = {
    "static_batching": ("the whole batch (8 requests, no timer)",
                        "offline jobs with no latency requirement"),
    "dynamic_batching": ("a whole batch (<= 8 requests or a 50 ms timer)",
                         "fixed-length outputs (e.g. image generation)"),
    "continuous_batching": ("one decode step", "production autoregressive LLM serving"),
}


def write_variant(destination: Path, model: str, overrides: dict[str, str]) -> Path:
    """A one-model repository at `destination` whose config.pbtxt has these parameter values
    (model_dir made absolute, so the variant reads the same checkpoint wherever it is served from)."""
    target = destination / model
    if target.exists():
        shutil.rmtree(target)
    model_dir = text_format.Parse((DEFAULT_REPOSITORY / model / "config.pbtxt").read_text(),
                                  model_config_pb2.ModelConfig()).parameters["model_dir"].string_value
    values = {"model_dir": str((PROJECT_ROOT / model_dir).resolve()), **overrides}
    return overridden_repository(DEFAULT_REPOSITORY, model,
                                 [ConfigOverride(f"parameters.{key}", value) for key, value in values.items()],
                                 destination)


def idle_fraction(doc: dict, limit: int) -> float | None:
    """Share of the `limit` sequence slots of the forward passes that did no useful work
    (empty slots and padding rows), over the run's timeline."""
    seqs = seqs_per_forward(doc)
    return None if seqs is None else 1.0 - seqs / limit


def no_forward_fraction(doc: dict) -> float | None:
    """Share of the timeline's samples in which no forward pass ran at all."""
    samples = doc["timeline"]
    return sum(s["forward_passes"] == 0 for s in samples) / len(samples) if samples else None


def seqs_per_forward(doc: dict) -> float | None:
    """Mean unfinished sequences per forward pass over the run's timeline (a padding row of a finished
    request is not counted)."""
    passes = sum(s["forward_passes"] for s in doc["timeline"])
    return sum(s["seqs_per_forward"] * s["forward_passes"] for s in doc["timeline"]) / passes if passes else None


def load_table(docs: dict[str, dict], reference: str) -> str:
    """How loaded each strategy was at the open-loop point the latency targets read: a request-level
    batcher that runs small batches back to back keeps the engine busy, and a request waits behind the
    batch in service."""
    lines = ["| strategy | unfinished sequences per forward pass | samples with a forward pass | E2E p50 s "
             "| TTFT p50 s |",
             "|---|---|---|---|---|"]
    for name in STRATEGIES:
        doc = docs[f"{name}/{reference}"]
        seqs, idle = seqs_per_forward(doc), no_forward_fraction(doc)
        cells = ["-" if seqs is None else f"{seqs:.2f}", "-" if idle is None else f"{1 - idle:.0%}"]
        lines.append(f"| {name} | {' | '.join(cells)} | {_fmt(_q(doc, 'e2e', 'p50'), '.3f')} | "
                     f"{_fmt(_q(doc, 'ttft', 'p50'), '.3f')} |")
    return "\n".join(lines) + "\n"


def _tok(doc: dict) -> float:
    return doc["summary"]["output_token_throughput"]


def saturated_tok(result: dict) -> float:
    """Output tok/s while the server was saturated (requests waiting), for a run document or an
    in-process result; the whole run's figure where the window is unknown (no timeline)."""
    figures = result.get("summary", result)
    window = figures.get("saturated")
    return window["output_token_throughput"] if window else figures["output_token_throughput"]


def _q(doc: dict, metric: str, key: str) -> float | None:
    """A latency statistic of a run; None where no request of it succeeded."""
    return doc["summary"][metric][key]


def _fmt(value: float | None, spec: str) -> str:
    """`value` formatted, or "-" where there is none (no metrics samples, no request that succeeded)."""
    return "-" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is 0 (a strategy with no successful request)."""
    return None if a is None or b is None or b == 0 else a / b


def seed_table(docs: dict[str, dict], reference: str) -> str:
    """The article's table, measured. `reference` names the common-rate role suffix."""
    lines = ["| strategy | unit of scheduling | idle slots at saturation | latency at "
             f"{docs['dynamic_batching/' + reference]['arrival']['label']} | throughput at saturation "
             "| best for |", "|---|---|---|---|---|---|"]
    for name in STRATEGIES:
        sat, ref = docs[f"{name}/saturation"], docs[f"{name}/{reference}"]
        idle, empty = idle_fraction(sat, 8), no_forward_fraction(sat)
        idle_text = (f"{_fmt(idle, '.0%')} of slots empty or padding; no forward in {_fmt(empty, '.0%')} "
                     "of samples")
        latency = (f"E2E p50 {_fmt(_q(ref, 'e2e', 'p50'), '.1f')} s / p99 {_fmt(_q(ref, 'e2e', 'p99'), '.1f')} s; "
                   f"TTFT p50 {_fmt(_q(ref, 'ttft', 'p50'), '.2f')} s")
        throughput = (f"{saturated_tok(sat):.0f} output tok/s while saturated ({_tok(sat):.0f} over the whole "
                      f"run, {sat['summary']['request_throughput']:.2f} req/s)")
        unit, best = SEED_ROWS[name]
        lines.append(f"| {name} | {unit} | {idle_text} | {latency} | {throughput} | {best} |")
    return "\n".join(lines) + "\n"


BOUND_SHARE = 0.9  # of the step-count bound, the throughput ratios' target


def targets(docs: dict[str, dict], reference: str, bound: float, engine: dict) -> list[dict]:
    """Each performance target: what it asks, the measured value, and whether it holds."""
    static, dyn, cont = (docs[f"{n}/saturation"] for n in STRATEGIES)
    same_kv = docs["continuous_batching_same_kv/saturation"]
    streamed = docs.get("continuous_batching_streamed/saturation")
    ref_c, ref_d = docs[f"continuous_batching/{reference}"], docs[f"dynamic_batching/{reference}"]
    sat, r = saturated_tok, _ratio
    # NOTE: the step-count bound is the most continuous batching can gain when every step costs the same;
    # on a CPU a wider step costs more, so the target is a share of the bound, whatever the workload
    share = round(BOUND_SHARE * bound, 2)
    rows = [  # what, measured (while saturated), whole run, limit, op
        (f"continuous / static output tok/s at saturation, 8 seqs each, one response per request "
         f"({BOUND_SHARE} x the bound)", r(sat(cont), sat(static)), r(_tok(cont), _tok(static)), share, ">="),
        (f"continuous / dynamic output tok/s at saturation, 8 seqs each, one response per request "
         f"({BOUND_SHARE} x the bound)", r(sat(cont), sat(dyn)), r(_tok(cont), _tok(dyn)), share, ">="),
        ("step-count bound E[longest of 8] / E[mean] of the workload", bound, None, None, ""),
        ("continuous (same KV memory) / static output tok/s at saturation", r(sat(same_kv), sat(static)),
         r(_tok(same_kv), _tok(static)), 5.0, ">="),
        (f"continuous / dynamic p50 E2E at {ref_d['arrival']['label']}",
         r(_q(ref_c, "e2e", "p50"), _q(ref_d, "e2e", "p50")), None, 0.5, "<="),
        (f"continuous / dynamic p50 TTFT at {ref_d['arrival']['label']}",
         r(_q(ref_c, "ttft", "p50"), _q(ref_d, "ttft", "p50")), None, 0.25, "<="),
        ("continuous through Triton / engine in process, output tok/s at saturation",
         r(sat(cont), sat(engine)), r(_tok(cont), engine["output_token_throughput"]), 0.85, ">="),
    ]
    if streamed is not None:  # informative: what a response per token costs on this machine
        rows += [("continuous streamed / not streamed, output tok/s at saturation",
                  r(sat(streamed), sat(cont)), r(_tok(streamed), _tok(cont)), None, ""),
                 ("continuous streamed / static output tok/s at saturation", r(sat(streamed), sat(static)),
                  r(_tok(streamed), _tok(static)), None, "")]
    out = []
    for what, value, whole_run, limit, op in rows:
        # NOTE: a figure that could not be measured (a strategy with no successful request) does not hold
        holds = None if limit is None else (
            value is not None and (value >= limit if op == ">=" else value <= limit))
        out.append({"target": what, "measured": value, "whole_run": whole_run,
                    "required": f"{op} {limit}" if limit else "-", "holds": holds})
    return out


def targets_table(rows: list[dict]) -> str:
    """Throughput ratios are measured while saturated; `whole run` gives them over the whole closed loop."""
    lines = ["| target | measured | whole run | required | holds |", "|---|---|---|---|---|"]
    for r in rows:
        holds = "-" if r["holds"] is None else ("yes" if r["holds"] else "NO")
        whole = "-" if r.get("whole_run") is None else f"{r['whole_run']:.2f}"
        measured = "-" if r["measured"] is None else f"{r['measured']:.2f}"
        if r["holds"] is not None and measured == f"{float(r['required'].split()[-1]):.2f}":
            measured = f"{r['measured']:.3f}"  # NOTE: on the line at 2 digits: show which side it fell on
        lines.append(f"| {r['target']} | {measured} | {whole} | {r['required']} | {holds} |")
    return "\n".join(lines) + "\n"
