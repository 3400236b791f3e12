"""ThreadGovernor: the thread count it picks for the cores other processes leave, the /proc/stat reading,
and, end to end, an engine that drops to one thread while another process holds one of its two cores and
goes back to two once it leaves."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from batchlm.engine.thread_governor import BAND, PERIOD_S, STALE_S, ThreadGovernor, read_busy_seconds
from batchlm.paths import PROJECT_ROOT


class Clocks:
    """Fake wall clock, all-process busy seconds and own CPU seconds, advanced by the test."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.busy = 0.0
        self.own = 0.0

    def advance(self, wall: float, others: float, own: float) -> None:
        """`wall` seconds pass while other processes use `others` cores and this one `own` cores."""
        self.wall += wall
        self.busy += (others + own) * wall
        self.own += own * wall

    def governor(self, max_threads: int, cores: int) -> ThreadGovernor:
        return ThreadGovernor(max_threads, cpus=frozenset(range(cores)), busy_seconds=lambda: self.busy,
                              own_seconds=lambda: self.own, clock=lambda: self.wall)


@pytest.mark.parametrize("current, free, expected", [
    (2, 2.0, 2), (2, 1.5, 2), (2, 2 - BAND + 0.05, 2),   # a neighbour under BAND of a core: keep both
    (2, 2 - BAND - 0.05, 1), (2, 1.0, 1), (2, 0.1, 1),    # over it: one thread, never fewer
    (1, 1.0, 1), (1, 1 + BAND - 0.05, 1),                  # hysteresis: the count stays inside the band
    (1, 1 + BAND + 0.05, 2), (1, 2.0, 2),
    (4, 2.2, 2), (4, 3.3, 3), (2, 3.7, 4), (3, 8.0, 4),   # never more than the configured count
])
def test_choose_follows_free_cores_with_a_band_of_hysteresis(current, free, expected):
    assert ThreadGovernor(4, cpus=frozenset(range(8)), busy_seconds=lambda: 0.0).choose(current, free) == expected


def test_a_busy_neighbour_takes_a_thread_away_and_gives_it_back_when_it_leaves():
    clocks = Clocks()
    governor = clocks.governor(2, cores=2)
    assert governor.enabled and governor.threads() == 2
    clocks.advance(PERIOD_S / 2, others=1.0, own=1.0)
    assert governor.threads() == 2, "judged before a period passed"
    clocks.advance(PERIOD_S, others=1.0, own=1.0)
    assert governor.threads() == 1
    assert governor.others == pytest.approx(1.0)
    clocks.advance(PERIOD_S, others=0.5, own=1.0)  # inside the band: stays
    assert governor.threads() == 1
    clocks.advance(PERIOD_S, others=0.1, own=1.9)  # its own CPU time is not counted as others'
    assert governor.threads() == 2
    assert governor.others == pytest.approx(0.1)


def test_a_window_that_spans_an_idle_engine_is_not_judged():
    clocks = Clocks()
    governor = clocks.governor(2, cores=2)
    clocks.advance(STALE_S + 1, others=2.0, own=0.0)  # the engine had nothing to step
    assert governor.threads() == 2
    clocks.advance(PERIOD_S, others=0.0, own=2.0)  # a new window starts where the stale one ended
    assert governor.threads() == 2


def test_it_keeps_the_configured_count_where_it_cannot_judge():
    assert not ThreadGovernor(1, cpus=frozenset({0, 1})).enabled

    def unreadable() -> float:
        raise OSError("no /proc/stat")

    governor = ThreadGovernor(2, cpus=frozenset({0, 1}), busy_seconds=unreadable)
    assert not governor.enabled and governor.threads() == 2
    with pytest.raises(ValueError):
        ThreadGovernor(0)


def test_read_busy_seconds_sums_the_busy_fields_of_the_given_cpus(tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    #       user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(textwrap.dedent("""\
        cpu  999 999 999 999 999 999 999 999 0 0
        cpu0 100 1 10 5000 70 2 3 4 0 0
        cpu1 200 0 20 6000 80 0 0 0 0 0
        cpu12 1000 0 0 0 0 0 0 0 0 0
        intr 12345 1 2 3
        ctxt 99
        """))
    assert read_busy_seconds(frozenset({0}), str(stat)) == pytest.approx(120 / tick)
    assert read_busy_seconds(frozenset({0, 1}), str(stat)) == pytest.approx(340 / tick)
    assert read_busy_seconds(frozenset({12}), str(stat)) == pytest.approx(1000 / tick)
    assert read_busy_seconds(frozenset({0}), "/proc/stat") > 0


ENGINE_UNDER_A_NEIGHBOUR = r"""
import json, os, subprocess, sys, time
os.sched_setaffinity(0, {CPUS})
from batchlm.engine.engine import LLMEngine
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.paths import TINY_MODEL_DIR

engine = LLMEngine(TINY_MODEL_DIR, EngineConfig(num_threads=2, max_num_seqs=4))
ids = iter(range(10**6))

def step_until(want, limit_s):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < 4:
            engine.add_request(str(next(ids)), "a b c d e f g h", SamplingParams(max_tokens=64, ignore_eos=True))
        engine.step()
        if engine._governor.current == want:
            return True
    return False

seen = {"idle": step_until(2, 1.0) and engine._governor.current}
hog = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                       preexec_fn=lambda: os.sched_setaffinity(0, {HOG_CPU}))
try:
    seen["dropped"] = step_until(1, 8.0)
    seen["others_busy"] = engine._governor.others
finally:
    hog.kill()
    hog.wait()
seen["restored"] = step_until(2, 8.0)
seen["others_after"] = engine._governor.others
print(json.dumps(seen))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_engine_steps_with_one_thread_while_another_process_holds_one_of_its_two_cores():
    cpus = sorted(os.sched_getaffinity(0))[:2]
    script = ENGINE_UNDER_A_NEIGHBOUR.replace("{CPUS}", repr(set(cpus))).replace("{HOG_CPU}", repr({cpus[0]}))
    proc = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["idle"] == 2, seen
    assert seen["dropped"], f"still two threads with a core held: {seen}"
    assert seen["others_busy"] > 1 - BAND, seen
    assert seen["restored"], f"no second thread once the core was free: {seen}"


def test_a_sequence_gets_the_same_tokens_whatever_the_thread_count_of_each_step():
    """The governor changes the thread count between steps, mid-sequence; the kernels split work across
    threads without changing any sum's order, so the tokens cannot depend on it."""
    script = r"""
import json
from batchlm.engine.engine import LLMEngine
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.paths import TINY_MODEL_DIR
tokens = {}
for threads in (1, 2):
    engine = LLMEngine(TINY_MODEL_DIR, EngineConfig(num_threads=threads, adaptive_threads=False))
    outputs = engine.generate(["word " * (9 + 41 * i) for i in range(4)],
                              SamplingParams(max_tokens=48, ignore_eos=True))
    tokens[threads] = [list(out.token_ids) for out in outputs]
print(json.dumps(tokens))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tokens = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(tokens["1"]) == 4 and all(len(ids) == 48 for ids in tokens["1"])
    assert tokens["1"] == tokens["2"]
