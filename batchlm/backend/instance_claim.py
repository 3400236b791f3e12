"""InstanceClaim: lets a model instance learn that Triton has loaded its successor.

Why: when a loaded model is loaded again (a reload, for instance with a new config), Triton starts new
instances, routes new requests to them, and unloads the old ones once every request they hold is done.
It does not tell the old instances, and to them `pb_utils.is_model_ready` still answers true (the model,
by then the new one, is ready). `static_batching`'s parked requests wait for a batch that no new request
will join, so they, and the old instance's stub, would wait for as long as the server runs
(`tests/functional/test_static_batching.py::test_a_reload_fails_the_old_instances_parked_requests`).

How: an instance's name (`model_instance_name`, e.g. `static_batching_0_0`) is the same in every load,
and its stub is a child of the server. So each instance, once initialized, claims
`<temp dir>/batchlm-instances/<server pid>-<instance name>` by writing its own process id there; a
successor overwrites the claim. An instance is superseded when the claim names another process that is
alive (a successor whose load failed has exited, so its claim does not count).

Contract: `claim()` at the end of a successful initialize, `superseded()` from any thread (a file read,
no call to the server), `release()` in finalize (removes the claim only if it is still this process's).
`clear_claims(server_pid)` once the server has stopped (`TritonServer.stop()` does).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def default_folder() -> Path:
    return Path(tempfile.gettempdir()) / "batchlm-instances"


def clear_claims(server_pid: int, folder: Path | None = None) -> None:
    """Remove every claim of a server that has stopped: an instance that never reached finalize (the
    server exited on its exit timeout, or was killed) leaves its claim behind."""
    for path in (default_folder() if folder is None else folder).glob(f"{server_pid}-*"):
        path.unlink(missing_ok=True)


class InstanceClaim:
    def __init__(self, instance_name: str, folder: Path | None = None, server_pid: int | None = None,
                 pid: int | None = None) -> None:
        folder = default_folder() if folder is None else folder
        server_pid = os.getppid() if server_pid is None else server_pid
        self.path = folder / f"{server_pid}-{instance_name}"
        self.pid = os.getpid() if pid is None else pid

    def claim(self) -> None:
        """Make this process the instance's current holder (atomically: write aside, then rename)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        aside = self.path.with_name(f"{self.path.name}.{self.pid}")
        aside.write_text(str(self.pid))
        os.replace(aside, self.path)

    def holder(self) -> int | None:
        try:
            return int(self.path.read_text())
        except (OSError, ValueError):
            return None

    def superseded(self) -> bool:
        """True once another live process holds the claim: a successor instance has been loaded."""
        holder = self.holder()
        return holder is not None and holder != self.pid and process_alive(holder)

    def release(self) -> None:
        if self.holder() == self.pid:
            self.path.unlink(missing_ok=True)


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a stub that exited and was not reaped yet)."""
    if Path("/proc").is_dir():
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True
