"""Two lm-evaluation-harness runs of the same tasks, item by item: the served model against the reference.

    python -m batchlm.eval.compare REFERENCE_DIR SERVED_DIR [--atol 1e-3] [--out comparison.md]

Each folder is an `--output_path` that one or more `lm_eval ... --log_samples` runs wrote to (the results
JSON and the per-task samples JSON lines, in a subfolder named after the model). For every task found in
both: each aggregate metric of both runs, and per item
- log-likelihood tasks (`multiple_choice`, `loglikelihood`): every choice's log-likelihood, whose largest
  difference must stay within `atol`, and each item's metrics (acc, acc_norm), which must be equal;
- generate-until tasks: the generated text and the filtered answer, which must be identical, and each
  item's metrics (exact_match).
It also reports, per log-likelihood task, the smallest gap between an item's two likeliest choices: a gap
under `atol` would let rounding alone change an answer. Exit status 1 where anything differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

# A log-likelihood here is a sum over a continuation of a few tokens; the engine's log-probability of a
# token agrees with transformers' within ~1e-4 (float32, summed in another order), so a sum within 1e-3.
LOGLIKELIHOOD_ATOL = 1e-3


@dataclass(frozen=True)
class Run:
    """What lm-eval wrote to one `--output_path`: aggregate results and logged samples, per task."""

    results: dict[str, dict[str, float]]  # task -> "metric,filter" -> value
    samples: dict[str, list[dict]]  # task -> samples in doc_id order

    @classmethod
    def read(cls, folder: Path) -> "Run":
        """The newest results and samples of every task under `folder` (lm-eval names its files with a
        timestamp, so a later run of a task in the same folder replaces an earlier one)."""
        results: dict[str, dict[str, float]] = {}
        for path in sorted(folder.rglob("results_*.json"), key=lambda p: p.name):
            for task, values in json.loads(path.read_text())["results"].items():
                results[task] = {k: v for k, v in values.items()
                                 if "," in k and "_stderr" not in k and isinstance(v, (int, float))}
        samples: dict[str, list[dict]] = {}
        for path in sorted(folder.rglob("samples_*.jsonl"), key=lambda p: p.name):
            task = path.name[len("samples_"):].rsplit("_", 1)[0]
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            samples[task] = sorted(rows, key=lambda r: r["doc_id"])
        return cls(results, samples)


def _loglikelihoods(sample: dict) -> list[float] | None:
    """Each request's log-likelihood where the sample's requests are log-likelihood ones, else None.
    lm-eval logs each such answer as [log-likelihood, is_greedy], as strings."""
    answers = [resp[0] for resp in sample["resps"]]
    if all(isinstance(a, list) and len(a) == 2 and str(a[1]) in ("True", "False") for a in answers):
        return [float(a[0]) for a in answers]
    return None


@dataclass
class TaskComparison:
    """One task of both runs. `ok` holds where every metric and item agrees as the module says."""

    task: str
    atol: float
    metrics: dict[str, tuple[float, float]] = field(default_factory=dict)  # "metric,filter" -> (ref, served)
    items: int = 0
    loglikelihoods: int = 0  # compared log-likelihoods; 0 for a generate-until task
    max_loglikelihood_diff: float = 0.0
    smallest_choice_gap: float | None = None  # of the reference, over items with two choices or more
    differing_items: list[str] = field(default_factory=list)  # "doc <id>: what differs"

    @property
    def ok(self) -> bool:
        return (not self.differing_items and self.max_loglikelihood_diff <= self.atol
                and all(ref == served for ref, served in self.metrics.values()))

    def summary(self) -> str:
        if self.loglikelihoods:
            line = (f"{self.task}: {self.items} items, {self.loglikelihoods} log-likelihoods, largest difference "
                    f"{self.max_loglikelihood_diff:.2e} (tolerance {self.atol:g})")
            if self.smallest_choice_gap is not None:
                line += f"; smallest gap between an item's two likeliest choices {self.smallest_choice_gap:.3f}"
        else:
            line = f"{self.task}: {self.items} items, generated texts compared"
        return line + f"; {len(self.differing_items)} items differ"


def compare_task(task: str, reference: Run, served: Run, atol: float = LOGLIKELIHOOD_ATOL) -> TaskComparison:
    out = TaskComparison(task, atol)
    ref_results, served_results = reference.results.get(task, {}), served.results.get(task, {})
    for key in sorted(set(ref_results) | set(served_results)):
        out.metrics[key] = (ref_results.get(key, float("nan")), served_results.get(key, float("nan")))
    ref_samples, served_samples = reference.samples.get(task, []), served.samples.get(task, [])
    if [s["doc_id"] for s in ref_samples] != [s["doc_id"] for s in served_samples]:
        out.differing_items.append(f"the runs logged other items: {len(ref_samples)} and {len(served_samples)}")
        return out
    out.items = len(ref_samples)
    for ref, srv in zip(ref_samples, served_samples):
        doc = f"doc {ref['doc_id']}"
        differs = [m for m in ref["metrics"] if ref.get(m) != srv.get(m)]
        ref_ll, srv_ll = _loglikelihoods(ref), _loglikelihoods(srv)
        if ref_ll is not None and srv_ll is not None and len(ref_ll) == len(srv_ll):
            out.loglikelihoods += len(ref_ll)
            diff = max(abs(a - b) for a, b in zip(ref_ll, srv_ll))
            out.max_loglikelihood_diff = max(out.max_loglikelihood_diff, diff)
            if diff > atol:
                differs.append(f"log-likelihood by {diff:.2e}")
            if len(ref_ll) > 1:
                top = sorted(ref_ll)[-2:]
                gap = top[1] - top[0]
                out.smallest_choice_gap = gap if out.smallest_choice_gap is None else min(out.smallest_choice_gap, gap)
        elif (ref_ll is None) != (srv_ll is None):
            differs.append("one run logged log-likelihoods, the other text")
        elif ref["resps"] != srv["resps"] or ref["filtered_resps"] != srv["filtered_resps"]:
            differs.append(f"text {ref['resps']!r} vs {srv['resps']!r}")
        if differs:
            out.differing_items.append(f"{doc}: {', '.join(differs)}")
    return out


def compare_runs(reference: Path, served: Path, atol: float = LOGLIKELIHOOD_ATOL) -> list[TaskComparison]:
    """Every task both folders hold; a task only one of them holds is reported as differing."""
    ref, srv = Run.read(reference), Run.read(served)
    tasks = sorted(set(ref.results) | set(srv.results))
    if not tasks:
        raise FileNotFoundError(f"no lm-eval results under {reference} or {served}")
    comparisons = [compare_task(task, ref, srv, atol) for task in tasks]
    for c in comparisons:
        if c.task not in ref.results or c.task not in srv.results:
            c.differing_items.append("only one run has this task")
    return comparisons


def report(comparisons: list[TaskComparison], names: tuple[str, str] = ("reference", "served")) -> str:
    lines = [f"| task | metric | {names[0]} | {names[1]} | equal |", "|---|---|---:|---:|---|"]
    for c in comparisons:
        for key, (ref, srv) in c.metrics.items():
            lines.append(f"| {c.task} | {key} | {ref:.4f} | {srv:.4f} | {'yes' if ref == srv else 'NO'} |")
    lines.append("")
    for c in comparisons:
        lines.append(("- " if c.ok else "- DIFFERS: ") + c.summary())
        lines += [f"  - {item}" for item in c.differing_items]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m batchlm.eval.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference", type=Path, help="the reference run's --output_path (lm-eval's hf model)")
    p.add_argument("served", type=Path, help="the served run's --output_path (local-completions, ...)")
    p.add_argument("--atol", type=float, default=LOGLIKELIHOOD_ATOL, help="per-item log-likelihood tolerance")
    p.add_argument("--out", type=Path, help="also write the report (markdown) here")
    args = p.parse_args(argv)
    comparisons = compare_runs(args.reference, args.served, args.atol)
    text = report(comparisons)
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)
    return 0 if all(c.ok for c in comparisons) else 1


if __name__ == "__main__":
    sys.exit(main())
