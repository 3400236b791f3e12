"""The prefix-caching benchmark's report: figures per workload with the cache on and off, their ratios,
the issue's goals, and whether every answer was the same on both sides.

Input: `runs[side]` ("on", "off"), a list with one entry per round, each a dict workload ->
WorkloadRun.as_dict() (batchlm.bench.served.prefix_driver). Latency percentiles pool every round's
requests; throughput is all rounds' output tokens over all rounds' time; "each round" pairs round k on
with round k off, which ran back to back.
"""

from __future__ import annotations

import statistics

from batchlm.bench.served.request_record import distribution

SIDES = ("on", "off")
# (workload, figure key, what the goal asks, bound, "max": on / off at most bound, "near": within bound of 1)
GOALS = (
    ("chat", "ttft_p50_later", "TTFT p50 of turns >= 2, on / off", 0.3, "max"),
    ("system", "tok_s", "output tok/s, on / off", 1.5, "min"),
    ("control", "tok_s", "output tok/s, on / off", 0.03, "near"),
)


def figures(rounds: list[dict], workload: str) -> dict:
    """One side's figures for `workload`, over its rounds."""
    runs = [r[workload] for r in rounds if workload in r]
    answers = [a for run in runs for a in run["answers"]]
    ok = [a for a in answers if a["error"] is None]
    duration = sum(run["duration_s"] for run in runs)
    prompt, cached = sum(a["prompt_tokens"] for a in ok), sum(a["cached_tokens"] for a in ok)
    queries = sum(run["counters"].get("queries", 0.0) for run in runs)
    hits = sum(run["counters"].get("hits", 0.0) for run in runs)
    fig = {
        "requests": len(answers), "ok": len(ok),
        "tok_s": sum(a["output_tokens"] for a in ok) / duration if duration else None,
        "tok_s_each": [_tok_s(run) for run in runs],
        "ttft_p50": distribution([a["ttft"] for a in ok])["p50"],
        "ttft_p99": distribution([a["ttft"] for a in ok])["p99"],
        "ttft_p50_each": [distribution([a["ttft"] for a in run["answers"] if a["error"] is None])["p50"]
                          for run in runs],
        "e2e_p50": distribution([a["latency"] for a in ok])["p50"],
        "tpot_p50": distribution([(a["latency"] - a["ttft"]) / (a["output_tokens"] - 1) for a in ok
                                  if a["output_tokens"] > 1 and a["latency"] > a["ttft"]])["p50"],
        "prompt_tokens": prompt, "computed_prompt_tokens": prompt - cached,
        "output_tokens": sum(a["output_tokens"] for a in ok),
        "hit_rate": cached / prompt if prompt else None,
        "hit_rate_metrics": hits / queries if queries else None,
        "evictions": sum(run["counters"].get("evictions", 0.0) for run in runs),
    }
    if workload == "chat":
        for name, keep in (("later", lambda t: t >= 2), ("first", lambda t: t == 1)):
            ttfts = [a["ttft"] for a in ok if keep(a["turn"])]
            fig[f"ttft_p50_{name}"] = distribution(ttfts)["p50"]
            fig[f"ttft_p99_{name}"] = distribution(ttfts)["p99"]
            fig[f"ttft_p50_{name}_each"] = [
                distribution([a["ttft"] for a in run["answers"] if a["error"] is None and keep(a["turn"])])["p50"]
                for run in runs]
    return fig


def _tok_s(run: dict) -> float | None:
    tokens = sum(a["output_tokens"] for a in run["answers"] if a["error"] is None)
    return tokens / run["duration_s"] if run["duration_s"] else None


def identical_answers(runs: dict[str, list[dict]], workload: str) -> tuple[int, int]:
    """(answers equal to the reference, answers compared): every answer of every round on both sides
    against the first round with the cache off, by its key; token ids where the model returns them."""
    reference = {a["key"]: _tokens(a) for a in runs["off"][0][workload]["answers"] if a["error"] is None}
    same = total = 0
    for side in SIDES:
        for k, rounds in enumerate(runs[side]):
            if side == "off" and k == 0:
                continue
            for a in rounds[workload]["answers"]:
                total += 1
                same += a["error"] is None and reference.get(a["key"]) == _tokens(a)
    return same, total


def _tokens(answer: dict):
    return answer["token_ids"] if answer["token_ids"] is not None else answer["text"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _num(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def rows(runs: dict[str, list[dict]], workloads: list[str]) -> list[dict]:
    """One row per (workload, figure): the value on, off, their ratio, and the ratio in each round."""
    table = []
    for workload in workloads:
        on, off = figures(runs["on"], workload), figures(runs["off"], workload)
        shown = [("output tok/s", "tok_s", ".1f")]
        if workload == "chat":
            shown += [(f"TTFT {q} s, {turns}", f"ttft_{q}_{name}", ".3f")
                      for name, turns in (("later", "turns >= 2"), ("first", "first turns")) for q in ("p50", "p99")]
        else:
            shown += [("TTFT p50 s", "ttft_p50", ".3f"), ("TTFT p99 s", "ttft_p99", ".3f")]
        shown += [("time per output token p50 s", "tpot_p50", ".4f"),
                  ("prompt tokens computed", "computed_prompt_tokens", "d")]
        for label, key, spec in shown:
            each = [_ratio(a, b) for a, b in zip(on.get(f"{key}_each", []), off.get(f"{key}_each", []))]
            table.append({"workload": workload, "figure": label, "on": _num(on[key], spec),
                          "off": _num(off[key], spec), "ratio": _num(_ratio(on[key], off[key]), ".2f"),
                          "each round": " / ".join(_num(r, ".2f") for r in each) or "-"})
        table.append({"workload": workload, "figure": "prompt tokens from cache (answers; metrics)",
                      "on": f"{_pct(on['hit_rate'])}; {_pct(on['hit_rate_metrics'])}",
                      "off": f"{_pct(off['hit_rate'])}; {_pct(off['hit_rate_metrics'])}", "ratio": "-",
                      "each round": "-"})
    return table


def goals(runs: dict[str, list[dict]], workloads: list[str]) -> list[dict]:
    """The goals whose workload ran: what each asks, the measured ratio (pooled rounds), whether it holds,
    and the ratio's median and range over the rounds, each round on over the off round beside it."""
    found = []
    for workload, key, what, bound, kind in GOALS:
        if workload not in workloads:
            continue
        on, off = figures(runs["on"], workload), figures(runs["off"], workload)
        value = _ratio(on[key], off[key])
        each = [r for r in (_ratio(a, b) for a, b in zip(on[f"{key}_each"], off[f"{key}_each"])) if r is not None]
        asked = {"max": f"<= {bound}", "min": f">= {bound}", "near": f"within {bound:.0%} of 1"}[kind]
        held = value is not None and {"max": lambda v: v <= bound, "min": lambda v: v >= bound,
                                      "near": lambda v: abs(v - 1) <= bound}[kind](value)
        found.append({"workload": workload, "goal": f"{what} {asked}", "measured": value, "met": held,
                      "rounds": {"median": statistics.median(each), "min": min(each), "max": max(each)}
                      if each else None})
    return found


def markdown(runs: dict[str, list[dict]], workloads: list[str], header: str, bookkeeping: dict | None = None) -> str:
    """The report: `header` (what ran, the command, the machine), the table, the goals, the answers, and
    the scheduler's bookkeeping cost (batchlm.bench.prefix_bookkeeping.BookkeepingCost.as_dict()) if given."""
    lines = [header, "", "| workload | figure | cache on | cache off | on / off | on / off, each round |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['figure']} | {r['on']} | {r['off']} | {r['ratio']} | {r['each round']} |"
              for r in rows(runs, workloads)]
    lines += ["", "| goal | measured | met | rounds: median [min, max] |", "|---|---|---|---|"]
    lines += [f"| {g['workload']}: {g['goal']} | {_num(g['measured'], '.2f')} | {'yes' if g['met'] else 'no'} | "
              f"{_spread(g['rounds'])} |" for g in goals(runs, workloads)]
    lines.append("")
    for workload in workloads:
        same, total = identical_answers(runs, workload)
        failed = sum(figures(runs[s], workload)["requests"] - figures(runs[s], workload)["ok"] for s in SIDES)
        lines.append(f"- {workload}: {same}/{total} answers identical to the first round with the cache off "
                     f"(greedy){f'; {failed} requests failed' if failed else ''}.")
    if bookkeeping is not None:
        lines.append(bookkeeping_line(bookkeeping, figures(runs["off"], "control")["tpot_p50"]))
    return "\n".join(lines) + "\n"


def _spread(rounds: dict | None) -> str:
    return "-" if rounds is None else f"{rounds['median']:.2f} [{rounds['min']:.2f}, {rounds['max']:.2f}]"


def bookkeeping_line(cost: dict, step_s: float | None) -> str:
    """The scheduler's prefix bookkeeping per step, beside the served control's step (time per output token)."""
    share = f", {100 * cost['extra_us'] / (step_s * 1e6):.2g}% of the served control's time per output token " \
            f"({step_s * 1e3:.1f} ms, cache off)" if step_s else ""
    return (f"- Bookkeeping, in process (batchlm.bench.prefix_bookkeeping; the scheduler with no model, through "
            f"the control after a fill, evicting {cost['evictions']} cached blocks): "
            f"{cost['on_us']:.0f} us per step with the cache on, {cost['off_us']:.0f} us off, "
            f"{cost['extra_us']:+.0f} us{share}; median of {cost['repeats']} passes of {cost['steps']} steps.")


def summary(runs: dict[str, list[dict]], workloads: list[str]) -> dict:
    """The report's figures, JSON-ready."""
    return {
        "figures": {side: {w: figures(runs[side], w) for w in workloads} for side in SIDES},
        "goals": goals(runs, workloads),
        "identical": {w: dict(zip(("same", "compared"), identical_answers(runs, w))) for w in workloads},
    }
