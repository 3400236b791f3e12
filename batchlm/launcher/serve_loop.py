"""Serve a started `TritonServer` until a signal, watching its models, then drain and stop it: the loop
of the serve commands (batchlm-serve, scripts/serve_trtllm.py)."""

from __future__ import annotations

import signal
import sys
import time

from batchlm.launcher.deferred_signals import STOP_SIGNALS
from batchlm.launcher.processes import exit_cleanly_on_sigterm
from batchlm.launcher.supervisor import ModelSupervisor
from batchlm.launcher.triton_server import TritonServer

# The serve command's status when it stopped the server because a model failed (--on-model-failure exit)
EXIT_MODEL_FAILED = 3


def serve_until_signalled(server: TritonServer, drain_timeout: float = 60.0, start_timeout: float = 900.0,
                          on_model_failure: str = "reload") -> int:
    """Start `server`, print a ready line, and serve until SIGINT, SIGTERM or SIGHUP; then drain it where
    it runs in explicit model control (`TritonServer.drainable`; at most `drain_timeout` s; a second
    signal skips the rest) and stop it. Return 0; the server's status if it ended by itself; 1 if it
    exited or was not ready within `start_timeout` s at start (said in one line); EXIT_MODEL_FAILED
    where a model failed under `on_model_failure="exit"`. Progress goes to stderr, prefixed `serve:`.

    While it serves, a `ModelSupervisor` looks every 0.5 s for a model whose stub died or whose serving
    thread stopped: "reload" reloads that model alone, "exit" stops the server at once (every request
    in flight ends with its connection) and returns EXIT_MODEL_FAILED, "off" leaves it to Triton.

    Draining first matters: on SIGTERM tritonserver waits, up to its exit timeout, for every open HTTP
    connection to close before it unloads anything, and a request parked in static_batching keeps its
    connection open until its model is unloaded (see `TritonServer.drain`)."""
    exit_cleanly_on_sigterm()  # NOTE: SIGTERM's default action would end this process before server.stop()
    # NOTE: the signals that stop the server must reach this process even when its parent handed it
    # SIGINT ignored (a job started in the background by a shell without job control) or blocked. The
    # server runs in a session of its own, so a terminal's Ctrl-C reaches this process only.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))
    status, grace = 0, None
    try:
        try:
            try:
                server.start(timeout=start_timeout)
            except (RuntimeError, TimeoutError) as exc:  # NOTE: the server's own log has said why
                _say(f"not serving: {exc}")
                return 1
            print(f"tritonserver ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}",
                  flush=True)
            # NOTE: not signal.pause(): a signal that lands after Python's last check for pending signals
            # and before pause() is entered leaves pause() waiting for the next one, and the server
            # running. A pending signal's handler runs at the latest when this sleep ends.
            supervisor = None if on_model_failure == "off" else ModelSupervisor(server, on_model_failure, _say).start()
            while server.process.poll() is None:
                time.sleep(0.5)
                if supervisor is not None and supervisor.check() and on_model_failure == "exit":
                    _say("stopping the server at once (--on-model-failure exit): every request in flight ends")
                    status, grace = EXIT_MODEL_FAILED, 0.0
                    break
            else:
                status = server.process.returncode or 1
                _say(f"tritonserver exited by itself with status {server.process.returncode}")
        except (KeyboardInterrupt, SystemExit):
            if server.drainable and server.process is not None and server.process.poll() is None:
                _drain(server, drain_timeout)
    finally:
        for signum in STOP_SIGNALS:  # NOTE: nothing may cut the stop short: it removes the stubs
            signal.signal(signum, signal.SIG_IGN)
        process = server.process
        server.stop(grace=grace)
        if status == 0 and process is not None and process.returncode:
            _say(f"tritonserver exited with status {process.returncode} (its log says why)")
    return status


def _drain(server: TritonServer, timeout: float) -> None:
    _say(f"draining: unloading every model (at most {timeout:.0f} s); signal again to stop at once")
    try:
        unloaded = server.drain(timeout=timeout)
        _say(f"unloaded {', '.join(unloaded) or 'nothing'}; stopping")
    except (KeyboardInterrupt, SystemExit):
        _say("second signal: stopping without waiting for the drain")
    except (TimeoutError, OSError) as exc:  # NOTE: urllib's URLError and HTTPError are OSErrors
        _say(f"drain incomplete ({exc}); stopping")


def _say(message: str) -> None:
    print(f"serve: {message}", file=sys.stderr, flush=True)
