"""BatchingService: the lifecycle, fault reporting and metrics export every serving strategy shares.

A service (static, dynamic and continuous batching, and the TensorRT-LLM front) is in one of three states:
- serving: it takes requests;
- closed: `close()` (from `finalize`) was called. New requests are refused UNAVAILABLE "M is unloading;
  retry later" (`_refusal`); the strategy's `_drain` answers or finishes what it holds and stops its
  threads before `close` returns;
- stopped: the thread that runs the engine cannot go on (dynamic batching: its engine was left
  mid-batch). `_stop_serving` fails every request that waits with INTERNAL `EngineStopped`, and returns
  the error for the strategy to fail what its thread held; every later request is refused with it,
  `serving` reads False (what a model's `is_ready` says) and `batchlm_serving_up` reads 0 (what the
  serve command's supervisor watches). Only a reload ends it.

Metrics: every update goes through `_record`, which passes the `metrics` fault point first
(batchlm.backend.fault_injection); a failed update is logged and fails no request. `_record_queue`
publishes the strategy's `_queue_snapshot` (waiting, running, KV blocks used and in total) as one update.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from batchlm.errors import Unavailable
from batchlm.backend import triton_io
from batchlm.backend.fault_injection import FaultInjector
from batchlm.backend.metrics import ModelMetrics


class EngineStopped(RuntimeError):
    """The service has stopped (its engine thread died, or its engine was left mid-batch): the model
    answers INTERNAL until it is reloaded."""

    def __str__(self) -> str:
        return self.args[0]


class BatchingService:
    """The base of every service; a subclass adds how its strategy takes, runs and answers requests.

    `_lock` guards `_closed`, `_stopped` and whatever the subclass declares guarded by it; any thread
    may call `serving`, `close` (once) and the `_record*` methods."""

    _close_timeout = 10.0  # seconds `close()` may take when not told

    def __init__(self, model_name: str, metrics: ModelMetrics, faults: FaultInjector | None = None) -> None:
        self._name = model_name  # in errors: a copy of the model under another name says its own
        self._metrics = metrics
        self._faults = faults if faults is not None else FaultInjector()
        self._lock = threading.Lock()
        self._closed = False  # guarded by _lock
        self._stopped: str | None = None  # why the service stopped, if it did; guarded by _lock

    @property
    def serving(self) -> bool:
        """False once the service has stopped: every request then fails until a reload."""
        with self._lock:
            return self._stopped is None

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests from now on, then answer or finish what the service holds and stop its
        threads, within `timeout` seconds (the strategy's `_close_timeout` when None). From `finalize`."""
        deadline = time.monotonic() + (self._close_timeout if timeout is None else timeout)
        with self._lock:
            self._closed = True
        self._drain(deadline)

    def _drain(self, deadline: float) -> None:
        """The strategy's part of `close`, done by the `time.monotonic()` `deadline`; nothing by default
        (a service with no thread of its own and nothing held between calls)."""

    def _refusal(self) -> Exception | None:
        """Why a new request is refused now, if it is: EngineStopped once stopped, UNAVAILABLE once
        closed. The caller holds `_lock`."""
        if self._stopped is not None:
            return EngineStopped(self._stopped)
        if self._closed:
            return Unavailable(f"{self._name} is unloading; retry later")
        return None

    def _overloaded(self, limit: int, where: str = "waiting") -> Unavailable:
        return Unavailable(f"{self._name} is overloaded: {limit} requests already {where}")

    def _unloaded(self) -> Unavailable:
        """The answer to a request still held when the service closes."""
        return Unavailable(f"{self._name} was unloaded before the request finished")

    # -- faults ---------------------------------------------------------------------------------
    def _stop_serving(self, exc: BaseException, what: str = "the engine thread stopped") -> EngineStopped:
        """The service cannot go on because of `exc`: log it, fail every request `_take_waiting` gives,
        refuse every later one, and publish `batchlm_serving_up` 0. Returns the error the caller answers
        the requests its thread held with."""
        reason = f"{self._name}: {what} ({type(exc).__name__}: {exc}); reload the model"
        triton_io.log_error(reason)
        with self._lock:
            self._stopped = reason
            waiting = self._take_waiting()
        self._record(self._metrics.record_stopped)
        error = EngineStopped(reason)
        fail_quietly(waiting, error)
        return error

    def _take_waiting(self) -> list:
        """The response senders of the requests that wait for the engine thread, taken from the service
        (they are failed by `_stop_serving`); none by default. The caller holds `_lock`."""
        return []

    # -- metrics --------------------------------------------------------------------------------
    def _record(self, record: Callable[..., None], *args) -> None:
        """One metrics update, `record(*args)`, after the `metrics` fault point: one that fails is logged
        and fails no request."""
        try:
            self._faults.hit("metrics")
            record(*args)
        except Exception as exc:  # noqa: BLE001 - metrics are not worth a request
            triton_io.log_error(f"{self._name}: a metrics update failed: {exc!r}")

    def _record_prefix_cache(self, stats) -> None:
        """Publish an engine's prefix-cache totals (an EngineStats), as one metrics update."""
        self._record(self._metrics.record_prefix_cache, stats.prefix_cache_queries, stats.prefix_cache_hits,
                     stats.prefix_cache_evictions, stats.kv_blocks_cached)

    def _record_queue(self) -> None:
        """Publish the waiting and running counts and the KV pool's use, as one metrics update. Several
        threads may call this: the snapshot is taken and set under `_lock`, so a thread that took one
        before another thread's cannot set it after (a submit that read `running` before a batch ended
        would otherwise set it after the worker set 0, reading as a batch running until the next request)."""
        try:
            with self._lock:
                snapshot = self._queue_snapshot()
                self._faults.hit("metrics")
                self._metrics.set_queue(*snapshot)
            self._metrics.flush_if_due()
        except Exception as exc:  # noqa: BLE001 - metrics are not worth a request
            triton_io.log_error(f"{self._name}: a metrics update failed: {exc!r}")

    def _queue_snapshot(self) -> tuple[int, int, int, int]:
        """(waiting, running, KV blocks used, KV blocks in total), read under `_lock`."""
        raise NotImplementedError

    def _record_idle(self) -> None:
        """Nothing runs now: publish the queue, drop the last-forward gauge to 0, push everything."""
        self._record_queue()
        self._record(self._metrics.record_idle)  # NOTE: after the gauges' update, which this flush pushes


def fail_quietly(senders: Iterable, exc: BaseException) -> None:
    """Answer every one of `senders` with `exc` as its final response; a client gone is logged."""
    for sender in senders:
        triton_io.send_final_quietly(sender, triton_io.error_response(exc))
