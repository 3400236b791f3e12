"""BatchingService, the lifecycle every serving strategy shares, without a server: a stand-in for
`triton_python_backend_utils` records what would be sent and logged."""

from __future__ import annotations

import importlib
import sys
import time
import types

import pytest

import batchlm.backend
from batchlm.backend.fault_injection import FaultInjector

_STUBBED = ("batchlm.backend.triton_io", "batchlm.backend.metrics", "batchlm.backend.batching_service")


class _Error:
    INVALID_ARG, UNAVAILABLE, INTERNAL, CANCELLED = "INVALID_ARG", "UNAVAILABLE", "INTERNAL", "CANCELLED"

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        self.message, self.code = message, code


class _Response:
    def __init__(self, output_tensors=(), error: _Error | None = None) -> None:
        self.error = error


class _Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[object, int]] = []

    def send(self, response=None, flags: int = 0) -> None:
        self.sent.append((response, flags))


class _Metrics:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def record_stopped(self) -> None:
        self.calls.append(("stopped",))

    def record_idle(self) -> None:
        self.calls.append(("idle",))

    def set_queue(self, *snapshot) -> None:
        self.calls.append(("queue", *snapshot))

    def flush_if_due(self) -> None:
        pass


@pytest.fixture
def pb(monkeypatch):
    """The stand-in module, and batchlm's backend modules imported against it (and forgotten after)."""
    fake = types.ModuleType("triton_python_backend_utils")
    fake.TritonError, fake.InferenceResponse = _Error, _Response
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    fake.errors = []
    fake.Logger = types.SimpleNamespace(log_error=fake.errors.append, log_verbose=lambda message: None)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    for name in _STUBBED:  # as module and as the package's attribute: `from batchlm.backend import x` reads both
        monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.delattr(batchlm.backend, name.rpartition(".")[2], raising=False)
    fake.service = importlib.import_module("batchlm.backend.batching_service")
    yield fake
    for name in _STUBBED:
        sys.modules.pop(name, None)
        vars(batchlm.backend).pop(name.rpartition(".")[2], None)


def _service(pb, faults: FaultInjector | None = None, waiting=(), snapshot=(0, 0, 0, 8)):
    class Service(pb.service.BatchingService):
        drained: float | None = None

        def _drain(self, deadline: float) -> None:
            self.drained = deadline

        def _take_waiting(self) -> list:
            return list(waiting)

        def _queue_snapshot(self):
            if isinstance(snapshot, Exception):
                raise snapshot
            return snapshot

    return Service("m", _Metrics(), faults)


def test_a_stopped_service_fails_what_waits_and_refuses_every_later_request(pb):
    waiting = [_Sender(), _Sender()]
    service = _service(pb, waiting=waiting)
    assert service.serving and service._refusal() is None
    error = service._stop_serving(RuntimeError("boom"))
    reason = "m: the engine thread stopped (RuntimeError: boom); reload the model"
    assert isinstance(error, pb.service.EngineStopped) and str(error) == reason
    for sender in waiting:
        [(response, flags)] = sender.sent
        assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        assert response.error.code == "INTERNAL" and response.error.message == f"EngineStopped: {reason}"
    assert not service.serving and str(service._refusal()) == reason
    assert service._metrics.calls == [("stopped",)] and pb.errors == [reason]
    other = service._stop_serving(ValueError("x"), "the engine was left mid-batch")
    assert str(other) == "m: the engine was left mid-batch (ValueError: x); reload the model"


def test_close_refuses_new_requests_then_drains_within_the_timeout(pb):
    service = _service(pb)
    before = time.monotonic()
    service.close(5.0)
    assert before + 5.0 <= service.drained <= time.monotonic() + 5.0
    refusal = service._refusal()
    assert type(refusal).__name__ == "Unavailable" and str(refusal) == "UNAVAILABLE: m is unloading; retry later"
    assert service.serving  # closed is not stopped: is_ready stays true while Triton unloads it


def test_a_failed_metrics_update_is_logged_and_fails_nothing(pb):
    service = _service(pb, FaultInjector.parse("metrics@2"))
    service._record_idle()  # passes 1 (the queue) and 2 (idle, which raises)
    assert service._metrics.calls == [("queue", 0, 0, 0, 8)]
    assert pb.errors == ["m: a metrics update failed: InjectedFault('fault injected at metrics, pass 2')"]
    broken = _service(pb, snapshot=RuntimeError("no stats"))
    broken._record_queue()
    assert broken._metrics.calls == [] and pb.errors[-1] == "m: a metrics update failed: RuntimeError('no stats')"
