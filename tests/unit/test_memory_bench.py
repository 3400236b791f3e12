"""`batchlm-bench memory`'s reading of /proc and its table."""

import os

from batchlm.bench.served.memory import process_memory, table


def test_a_process_memory_is_read_from_proc():
    m = process_memory(os.getpid())
    assert 0 < m["pss"] <= m["rss"] <= m["hwm"] + 1  # MiB; this process's peak is at least what it holds


def test_the_table_has_a_row_per_process_and_their_total():
    rows = {"a stub": {"rss": 100.0, "hwm": 120.0, "pss": 90.0},
            "tritonserver": {"rss": 40.0, "hwm": 41.0, "pss": 36.0}}
    lines = table(rows).splitlines()
    assert lines[2] == "| a stub | 100 MiB | 120 MiB | 90 MiB |"
    assert lines[-1] == "| total | 140 MiB | 161 MiB | 126 MiB |"
