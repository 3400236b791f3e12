"""Watch a running tritonserver's models and act when one can no longer serve.

Two things end a Python model's ability to serve while tritonserver 2.51 still reports it ready:
- **its stub process dies** (killed, out of memory, a crash in native code). Requests it held are never
  answered, later ones fail after a second each with "Stub process ... is not healthy", and Triton
  neither restarts the stub nor marks the model not ready (its Python backend has no restart for
  models that answer through response senders);
- **its serving thread stops** (batchlm.backend: an engine or worker thread that cannot go on). The
  model fails every request at once and sets its `batchlm_serving_up` gauge to 0.

`ModelSupervisor.check()` finds both: the stubs of each model (from /proc, against the instances seen
at start) and the gauge (from the metrics endpoint). For a dead stub it also reports the requests it
held: its instance's last `batchlm_waiting_requests` and `batchlm_running_requests`, which outlive the
stub in tritonserver until a new instance of the same name sets them. Then, by `policy`:
- "reload": unload the model and load it again through the repository API (the serve command holds
  its key). The other models are not touched; the model is refused at once while it reloads and
  serves again once its new instance is ready. Requests a dead stub held stay unanswered until their
  client gives up or the server exits: nothing in Triton 2.51 can answer them.
- "exit": report it; the caller stops the server at once, which ends every request in flight on every
  model (their connections close), and exits non-zero for an orchestrator to start it again.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchlm.launcher.triton_server import TritonServer

POLICIES = ("reload", "exit")
UP_GAUGE = "batchlm_serving_up"
HELD_GAUGES = ("batchlm_waiting_requests", "batchlm_running_requests")
# A model that fails again after this many reloads within the window is left failed (its failure is
# then not transient, and reloading it for ever would only hide that).
MAX_RELOADS_PER_WINDOW = 3
RELOAD_WINDOW_S = 300.0


@dataclass(frozen=True)
class Failure:
    """A model that cannot serve, and why (in words for the log)."""

    model: str
    reason: str


@dataclass
class ModelSupervisor:
    server: TritonServer
    policy: str = "reload"
    say: Callable[[str], None] = print
    expected: dict[str, set[str]] = field(default_factory=dict, init=False)  # model -> its healthy instances
    reloads: Counter = field(default_factory=Counter, init=False)  # model -> reloads done
    _reload_times: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list), init=False, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"on-stub-death: {self.policy!r} is not one of {list(POLICIES)}")

    def start(self) -> "ModelSupervisor":
        """Take the stubs of the ready server as the healthy ones."""
        self.expected = self._instances()
        return self

    def failures(self) -> list[Failure]:
        """Models with an instance whose stub is gone, or whose serving thread says it stopped."""
        alive = self._instances()
        metrics = self._metrics()
        found = {}
        for model, instances in self.expected.items():
            dead = instances - alive.get(model, set())
            if dead:
                held = ("an unknown number of" if metrics is None else
                        f"{sum(_gauge(metrics, name, i) for name in HELD_GAUGES for i in dead):.0f}")
                found[model] = f"{len(dead)} of its {len(instances)} stub process(es) died, holding {held} request(s)"
        for model in _stopped_models(metrics or []):
            found.setdefault(model, "its serving thread stopped")
        return [Failure(model, reason) for model, reason in sorted(found.items())]

    def check(self) -> list[Failure]:
        """Find failed models; under "reload", reload each. Returns the failures found (the caller
        stops the server under "exit")."""
        failed = self.failures()
        for failure in failed:
            self.say(f"{failure.model}: {failure.reason}")
            if self.policy == "reload":
                self._reload(failure.model)
        return failed

    def _reload(self, model: str) -> None:
        recent = [t for t in self._reload_times[model] if t > time.monotonic() - RELOAD_WINDOW_S]
        if len(recent) >= MAX_RELOADS_PER_WINDOW:
            self.say(f"{model}: failed again after {len(recent)} reloads within {RELOAD_WINDOW_S:.0f} s; "
                     "no more reloads: fix the cause and restart the server")
            self.expected.pop(model, None)
            return
        self._reload_times[model] = [*recent, time.monotonic()]
        self.say(f"{model}: reloading it")
        try:
            # NOTE: an unload returns at once. A dead stub's held requests keep the old version
            # unloading for ever, and the load does not wait for it: it starts a new instance.
            self._repository(f"models/{model}/unload")
            self._repository(f"models/{model}/load")
        except OSError as exc:  # NOTE: urllib's URLError and HTTPError are OSErrors
            self.say(f"{model}: reload failed ({exc}); not trying again")
            self.expected.pop(model, None)
            return
        self.reloads[model] += 1
        self.expected[model] = self._instances().get(model, set())
        self.say(f"{model}: reloaded, serving again ({len(self.expected[model])} stub process(es))")

    def _repository(self, path: str, timeout: float = 300.0) -> bytes:
        request = urllib.request.Request(f"http://{self.server.http_url}/v2/repository/{path}", data=b"{}",
                                         method="POST", headers=self.server.admin_headers)
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.read()

    def _instances(self) -> dict[str, set[str]]:
        """model -> the instances whose stubs run now."""
        found: dict[str, set[str]] = defaultdict(set)
        for model, instance in self.server.stub_instances().values():
            found[model].add(instance)
        return dict(found)

    def _metrics(self) -> list[str] | None:
        """The lines of the metrics endpoint's `batchlm_` series; None when it cannot be read."""
        try:
            with urllib.request.urlopen(self.server.metrics_url, timeout=5) as r:
                text = r.read().decode()
        except (urllib.error.URLError, OSError):
            return None
        return [line for line in text.splitlines() if line.startswith("batchlm_")]


def _stopped_models(metrics: list[str]) -> list[str]:
    """Models with a `batchlm_serving_up` series at 0."""
    return sorted({_label(line, "model") for line in metrics
                   if line.startswith(UP_GAUGE + "{") and float(line.rsplit(" ", 1)[1]) == 0.0})


def _gauge(metrics: list[str], name: str, instance: str) -> float:
    """The value of `name` for `instance`; 0 when it has no such series."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics
               if line.startswith(name + "{") and _label(line, "instance") == instance)


def _label(line: str, name: str) -> str:
    labels = line[line.index("{") + 1:line.index("}")]
    for part in labels.split(","):
        key, _, value = part.partition("=")
        if key == name:
            return json.loads(value)
    return ""
