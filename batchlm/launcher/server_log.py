"""What a tritonserver's log says: its last lines, why models did not load, and crashes."""

from __future__ import annotations

import re
from pathlib import Path

_CRASH = re.compile(r"corrupt|double free|malloc|free\(\)|Segmentation|Aborted")
# NOTE: tritonserver 2.51's words for a model it would not load: a config it refused while reading the
# repository ("Poll failed for model directory 'm': ...") or a load that failed ("failed to load 'm' version 1: ...")
_LOAD_FAILURE = re.compile(r"\] \"(Poll failed for model directory '[^']*': .*|failed to load '[^']*' version .*)\"$")


def log_tail(log_path: Path | None, lines: int = 40) -> str:
    """The log's last `lines` lines under a heading, for an error message; "" where there is no log."""
    if log_path is None or not Path(log_path).exists():
        return ""
    tail = Path(log_path).read_text(errors="replace").splitlines()[-lines:]
    return "\n--- tritonserver log tail ---\n" + "\n".join(tail)


def load_failures(log_path: Path | None, start: int = 0) -> list[str]:
    """Why models did not load, in tritonserver's words, from byte `start` of the log on."""
    if log_path is None or not Path(log_path).exists():
        return []
    with open(log_path, "rb") as log:
        log.seek(start)
        lines = log.read().decode(errors="replace").splitlines()
    return [m.group(1) for m in map(_LOAD_FAILURE.search, lines) if m]


def crash_lines(log_path: Path | None) -> list[str]:
    """Lines of the log that show a process crashing (heap corruption, a fatal signal)."""
    if log_path is None or not Path(log_path).exists():
        return []
    return [line for line in Path(log_path).read_text(errors="replace").splitlines() if _CRASH.search(line)]
