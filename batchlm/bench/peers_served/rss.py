"""Peak resident memory of a server's processes while it serves: their RSS summed, sampled on a thread."""

from __future__ import annotations

import threading
from batchlm.launcher.processes import process_tree


def rss_mib(pid: int) -> float:
    """The resident set of one process in MiB (VmRSS); 0 for one that has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0.0


def tree_of(*roots: int) -> list[int]:
    """Each root and its live descendants (a server and its children, such as Triton's stubs)."""
    return [pid for root in roots for pid in (root, *process_tree(root))]


class PeakRss:
    """While in the `with` block, every `interval_s` the RSS of `pids` summed; `peak_mib` is the largest
    sum seen (the sums at the block's start and end included). The pids are fixed when it is made: a
    server's processes are all there once it is ready."""

    def __init__(self, pids: list[int], interval_s: float = 0.2) -> None:
        self._pids = list(pids)
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_mib = 0.0

    def sample(self) -> None:
        self.peak_mib = max(self.peak_mib, sum(rss_mib(pid) for pid in self._pids))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def __enter__(self) -> "PeakRss":
        self.sample()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
