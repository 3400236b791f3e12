"""`batchlm-bench contention`'s bookkeeping: the order it measures in, its medians and ratios, its table,
and the busy process it measures beside."""

import itertools
import os
import time

from batchlm.bench.served.contention import busy_process, interleaved, parse_args, table


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_busy_process_holds_a_core_while_the_block_runs_and_is_gone_after():
    with busy_process(nice=0) as proc:
        start = cpu_seconds(proc.pid)
        time.sleep(0.5)
        used = cpu_seconds(proc.pid) - start
        assert proc.poll() is None
    assert used > 0.1, f"the busy process used {used:.2f} s of CPU in 0.5 s"
    assert proc.poll() is not None


def test_policies_take_turns_within_each_half_each_run_after_its_settle_run():
    calls: list[str] = []
    rates = {"adaptive": itertools.count(100, 10), "fixed": itertools.count(200, 10)}

    def measure(policy: str):
        def run() -> dict:
            calls.append(f"{policy}")
            return {"output_tokens_per_s": float(next(rates[policy]))}
        return run

    def settle(policy: str):
        return lambda: calls.append(f"settle {policy}")

    rows = interleaved({p: measure(p) for p in rates}, repeats=2, nice=0,
                       settles={"adaptive": settle("adaptive")})
    one_half = ["settle adaptive", "adaptive", "fixed"]
    assert calls == one_half * 4  # idle, busy, idle, busy
    # the fake adaptive runs give 100 (idle), 110 (busy), 120 (idle), 130 (busy): medians of two
    assert rows["adaptive"]["idle"] == 110 and rows["adaptive"]["busy"] == 120
    assert rows["fixed"]["idle"] == 210 and rows["fixed"]["busy"] == 220
    assert rows["fixed"]["busy_over_idle"] == 220 / 210
    assert len(rows["adaptive"]["runs"]["idle"]) == 2
    assert all(run["steal_cores"] >= 0 for run in rows["adaptive"]["runs"]["busy"])


def test_the_table_gives_busy_over_idle_and_adaptive_over_fixed_when_idle():
    where = "engine, in process"
    rows = [{"where": where, "policy": "adaptive", "idle": 990.0, "busy": 600.0, "busy_over_idle": 600 / 990},
            {"where": where, "policy": "fixed", "idle": 1000.0, "busy": 250.0, "busy_over_idle": 0.25}]
    text = table(rows).splitlines()
    assert text[2] == "| engine, in process | adaptive | 990 | 600 | 61% | 0.99 |"
    assert text[3] == "| engine, in process | fixed | 1000 | 250 | 25% |  |"


def test_arguments_are_checked():
    args = parse_args(["--models", "--repeats", "2"])
    assert args.models == [] and args.repeats == 2 and args.policies == ["adaptive", "fixed"]
    for bad in (["--repeats", "0"], ["--concurrency", "0"], ["--models", "nonsense"]):
        try:
            parse_args(bad)
        except SystemExit as exit_:
            assert exit_.code == 2
        else:
            raise AssertionError(f"{bad} accepted")
