"""Processes of a server: its tree read from /proc, its Python backend stubs, and the signal and
parent-death settings that keep a stopped or dead starter from leaving any of them running."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def process_tree(root: int) -> list[int]:
    """PIDs of every live descendant of `root` (children first), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            found.append(child)
            todo.append(child)
    return found


def stub_instances(pids: list[int]) -> dict[int, tuple[str, str]]:
    """The Python backend stubs among `pids`: pid -> (model, model instance) each serves."""
    found = {}
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue
        # NOTE: a stub's arguments (tritonserver 2.51): <repository>/<model>/<version>/model.py, the
        # shared-memory region, its default and growth sizes, the parent's pid, the backend's folder,
        # the IPC handle, the instance's name ("<model>_0_0"), its device kind
        if argv[0].endswith("triton_python_backend_stub") and len(argv) > 1:
            model = Path(argv[1]).parents[1].name
            # NOTE: a stub of another layout is told apart by its pid, so each one still counts
            found[pid] = (model, argv[8] if len(argv) > 8 and argv[8] else f"{model} (pid {pid})")
    return found


def exit_cleanly_on_sigterm() -> None:
    """Make SIGTERM and SIGHUP raise SystemExit in this (main-thread) process, so `finally` blocks and
    `TritonServer.__exit__` stop the server and its stubs. Without it the default action ends the
    process at once: the server dies with it (PR_SET_PDEATHSIG), but its Python backend stubs, which
    are the server's children, are left running."""
    def _exit(signum, frame):  # noqa: ARG001 - signal handler signature
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit)


def die_with_parent() -> None:
    """Runs in the child before exec: the server gets SIGKILL if the process that started it dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def kill_group(pgid: int) -> None:
    """SIGKILL every process left in process group `pgid` (none left, or none of ours: nothing to do)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
