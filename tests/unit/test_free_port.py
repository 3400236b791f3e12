"""free_port(): never the same port twice in one process (the kernel may hand a freed port out again;
one test server once got the same HTTP and metrics port, and tritonserver refused to start)."""

import socket

from batchlm.launcher.ports import free_port


def test_a_thousand_ports_are_all_different_and_free():
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)  # plain bind(0) gave 956 to 969 different ones of 1000
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
