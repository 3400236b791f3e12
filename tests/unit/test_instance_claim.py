"""InstanceClaim: a successor's claim supersedes an instance only while the successor is alive."""

import subprocess
import sys

from batchlm.backend.instance_claim import InstanceClaim, clear_claims


def test_a_live_successor_supersedes_and_a_dead_one_does_not(tmp_path):
    old = InstanceClaim("static_batching_0_0", tmp_path, server_pid=1)
    old.claim()
    assert not old.superseded()
    successor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        InstanceClaim("static_batching_0_0", tmp_path, server_pid=1, pid=successor.pid).claim()
        assert old.superseded()
        old.release()  # the claim is the successor's now: left alone
        assert old.holder() == successor.pid
    finally:
        successor.kill()
        successor.wait()
    assert not old.superseded()  # a successor whose load failed has exited


def test_claims_are_per_server_and_instance_name(tmp_path):
    a = InstanceClaim("static_batching_0_0", tmp_path, server_pid=1, pid=10)
    for other in (InstanceClaim("static_batching_0_1", tmp_path, server_pid=1, pid=11),
                  InstanceClaim("static_batching_0_0", tmp_path, server_pid=2, pid=12)):
        other.claim()
    a.claim()
    assert a.holder() == 10 and not a.superseded()
    a.release()
    assert a.holder() is None and not a.superseded()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1-static_batching_0_1", "2-static_batching_0_0"]


def test_a_stopped_servers_claims_are_cleared(tmp_path):
    for server_pid, name in ((1, "static_batching_0_0"), (1, "static_batching_0_1"), (12, "static_batching_0_0")):
        InstanceClaim(name, tmp_path, server_pid=server_pid, pid=100).claim()
    clear_claims(1, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["12-static_batching_0_0"]
