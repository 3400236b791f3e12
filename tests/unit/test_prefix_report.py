"""The prefix-caching benchmark's report and flags (batchlm.bench.served.prefix_report, .prefix), on made-up runs."""

import pytest

from batchlm.bench.served import prefix, prefix_report


def answer(key, ttft, prompt=100, cached=0, tokens=(1, 2), turn=None, error=None):
    return {"key": key, "turn": turn, "sent_at": 0.0, "ttft": ttft, "latency": ttft + 1.0, "prompt_tokens": prompt,
            "cached_tokens": cached, "output_tokens": len(tokens), "token_ids": list(tokens), "text": "",
            "error": error}


def run(workload, answers, duration, queries=0.0, hits=0.0):
    return {workload: {"workload": workload, "duration_s": duration, "answers": answers,
                       "counters": {"queries": queries, "hits": hits, "evictions": 0.0, "cached_blocks": 3.0}}}


def chat_round(ttft_later, cached, duration, tokens=(1, 2)):
    answers = [answer("c0.t1", 1.0, turn=1, tokens=tokens), answer("c0.t2", ttft_later, cached=cached, turn=2),
               answer("c0.t3", ttft_later, cached=cached, turn=3)]
    return run("chat", answers, duration, queries=300.0, hits=2.0 * cached)


RUNS = {"on": [chat_round(0.1, 80, 2.0), chat_round(0.3, 80, 2.0)],
        "off": [chat_round(1.0, 0, 4.0), chat_round(1.0, 0, 4.0, tokens=(1, 3))]}


def test_figures_pool_the_rounds_and_split_chat_turns():
    on = prefix_report.figures(RUNS["on"], "chat")
    assert on["requests"] == on["ok"] == 6
    assert on["tok_s"] == pytest.approx(12 / 4.0) and on["tok_s_each"] == [3.0, 3.0]
    assert on["ttft_p50_first"] == 1.0 and on["ttft_p50_later"] == pytest.approx(0.2)
    assert on["ttft_p50_later_each"] == [0.1, 0.3]
    assert on["hit_rate"] == pytest.approx(320 / 600) and on["hit_rate_metrics"] == pytest.approx(320 / 600)
    assert on["computed_prompt_tokens"] == 600 - 320 and on["tpot_p50"] == 1.0
    off = prefix_report.figures(RUNS["off"], "chat")
    assert off["hit_rate"] == 0 and off["hit_rate_metrics"] == 0 and off["tok_s"] == pytest.approx(12 / 8.0)


def test_answers_are_compared_with_the_first_round_off_by_key():
    # the first answer of round 2 off differs; every other one matches
    assert prefix_report.identical_answers(RUNS, "chat") == (8, 9)
    failed = {"on": [run("system", [answer("r0", 0.1, error="[400] no")], 1.0)],
              "off": [run("system", [answer("r0", 0.1)], 1.0)]}
    assert prefix_report.identical_answers(failed, "system") == (0, 1)


def test_goals_read_the_ratios_and_say_whether_they_hold():
    (goal,) = prefix_report.goals(RUNS, ["chat"])
    assert goal["measured"] == pytest.approx(0.2) and goal["met"] and "<= 0.3" in goal["goal"]
    assert goal["rounds"] == pytest.approx({"median": 0.2, "min": 0.1, "max": 0.3})
    near = {"on": [run("control", [answer("r0", 0.1)], 1.02)], "off": [run("control", [answer("r0", 0.1)], 1.0)]}
    (goal,) = prefix_report.goals(near, ["control"])
    assert goal["met"] and goal["measured"] == pytest.approx(1 / 1.02)
    far = {"on": [run("control", [answer("r0", 0.1)], 1.1)], "off": near["off"]}
    assert not prefix_report.goals(far, ["control"])[0]["met"]


def test_the_markdown_has_a_row_per_figure_the_goals_and_the_answers_check():
    text = prefix_report.markdown(RUNS, ["chat"], "# header")
    assert text.startswith("# header\n")
    assert "| chat | TTFT p50 s, turns >= 2 | 0.200 | 1.000 | 0.20 | 0.10 / 0.30 |" in text
    assert "| chat | prompt tokens from cache (answers; metrics) | 53%; 53% | 0%; 0% | - | - |" in text
    assert "| chat: TTFT p50 of turns >= 2, on / off <= 0.3 | 0.20 | yes | 0.20 [0.10, 0.30] |" in text
    assert "- chat: 8/9 answers identical to the first round with the cache off (greedy)." in text
    summary = prefix_report.summary(RUNS, ["chat"])
    assert summary["identical"] == {"chat": {"same": 8, "compared": 9}} and set(summary["figures"]) == {"on", "off"}


@pytest.mark.parametrize("argv, said", [
    (["--model", "static_batching", "--workloads", "chat"], "chat needs --turns-min equal to --turns-max"),
    (["--model", "static_batching", "--workloads", "chat", "--turns-min", "6", "--turns-max", "6",
      "--conversations", "12"], "a multiple of 8"),
    (["--model", "static_batching", "--workloads", "system", "--concurrency", "4"], "closed loop at 4"),
    (["--model", "static_batching", "--workloads", "control", "--control-requests", "12"], "the last 4 of 12"),
    (["--turns-min", "6", "--turns-max", "5"], "--turns-max must be >= --turns-min"),
    (["--rounds", "0"], "--rounds and --concurrency must be >= 1"),
])
def test_flags_that_cannot_work_are_refused_before_any_server_starts(argv, said, capsys):
    with pytest.raises(SystemExit):
        prefix.parse_args(argv)
    assert said in capsys.readouterr().err


def test_static_batching_runs_every_workload_with_full_batches():
    args = prefix.parse_args(["--model", "static_batching", "--turns-min", "5", "--turns-max", "5"])
    assert args.spec.turns_min == 5 and args.workloads == ["chat", "system", "control"]


def test_the_bookkeeping_line_sets_the_extra_time_beside_a_served_step():
    cost = {"on_us": 110.0, "off_us": 90.0, "extra_us": 20.0, "steps": 68, "repeats": 7, "evictions": 100}
    line = prefix_report.bookkeeping_line(cost, 0.04)
    assert "110 us per step with the cache on, 90 us off, +20 us, 0.05% of the served control's time per " \
           "output token (40.0 ms, cache off); median of 7 passes of 68 steps." in line
    assert "evicting 100 cached blocks" in line and "%" not in prefix_report.bookkeeping_line(cost, None)
    control = {"on": [run("control", [answer("r0", 0.1)], 1.0)], "off": [run("control", [answer("r0", 0.1)], 1.0)]}
    assert prefix_report.markdown(control, ["control"], "# h", cost).rstrip().endswith("68 steps.")
