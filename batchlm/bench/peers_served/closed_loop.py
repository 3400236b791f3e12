"""Closed-loop clients: `concurrency` streams, each sending the next request when its answer has arrived."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from batchlm.bench.peers_served.stats import StreamRecord
from batchlm.bench.peers_served.workload import ServedRequest

# (request, t0) -> its record; one such callable per stream (each holds its own connection)
Sender = Callable[[ServedRequest, float], StreamRecord]


def run_closed_loop(requests: list[ServedRequest], concurrency: int,
                    make_sender: Callable[[], Sender]) -> list[StreamRecord]:
    """Every request answered, `concurrency` at a time, in workload order; records in workload order.
    The first failure stops the other streams from taking more requests and is raised once all end."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    lock = threading.Lock()
    pending = list(reversed(requests))
    records: dict[int, StreamRecord] = {}
    failures: list[BaseException] = []
    t0 = time.perf_counter()

    def stream(send: Sender) -> None:
        while True:
            with lock:
                if not pending or failures:
                    return
                request = pending.pop()
            try:
                record = send(request, t0)
            except BaseException as exc:  # NOTE: raised in the caller's thread below
                with lock:
                    failures.append(exc)
                return
            with lock:
                records[request.index] = record

    senders = [make_sender() for _ in range(min(concurrency, len(requests)))]
    threads = [threading.Thread(target=stream, args=(s,), name=f"stream-{i}", daemon=True)
               for i, s in enumerate(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return [records[r.index] for r in requests]
