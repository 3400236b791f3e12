"""The loopback address every server the project starts binds by default, and free ports on it."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"
_HANDED_OUT: set[int] = set()  # ports free_port() returned in this process


def free_port() -> int:
    """A TCP port that is free on loopback right now, and not one this process was given before.

    The kernel may hand out the port it just freed again: two calls in a row could give one server the
    same HTTP and metrics port, and tritonserver would refuse to start."""
    while True:
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
