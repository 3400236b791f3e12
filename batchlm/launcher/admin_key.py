"""The key of tritonserver's administrative APIs: which APIs it restricts, the arguments that restrict
them, and, where the key is kept off the command line (argv_secret, opt-in), the checks that it reached
the server.

Every server the project starts restricts the administrative APIs (Triton's names in RESTRICTED_APIS)
to requests carrying the header ADMIN_HEADER with a random value made for that server. Inference,
health, metadata, model configuration and statistics stay open to every client that reaches the port.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from batchlm.launcher import argv_secret

ADMIN_HEADER = "batchlm-admin"  # the header the restricted APIs ask for
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
# A route of each restricted API that changes nothing, to check that the server took its key
_RESTRICTED_PROBES = {"model-repository": ("POST", "/v2/repository/index"), "logging": ("GET", "/v2/logging"),
                      "trace": ("GET", "/v2/trace/setting"),
                      "shared-memory": ("GET", "/v2/systemsharedmemory/status")}
_WARNED_TOKEN_SHOWN = False  # the warning that a key asked to be hidden is on a command line: once per process
# The most seconds from tritonserver's exec to its preloaded library blanking the key (milliseconds seen)
TOKEN_TAKEN_TIMEOUT_S = 10.0


def restricts(restricted_apis: tuple[str, ...], extra_args: tuple[str, ...]) -> bool:
    """Whether a server restricts `restricted_apis` with its own key: some are named, and the caller's
    `extra_args` restrict none themselves (tritonserver takes one key per API, so theirs replace these)."""
    return bool(restricted_apis) and not any(
        a.startswith(("--http-restricted-api", "--grpc-restricted-protocol")) for a in extra_args)


def restriction_args(restricted_apis: tuple[str, ...], value: str) -> list[str]:
    """tritonserver arguments that restrict `restricted_apis` over HTTP and gRPC to ADMIN_HEADER=`value`."""
    apis = ",".join(restricted_apis)
    return [f"--http-restricted-api={apis}:{ADMIN_HEADER}={value}",
            f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={value}"]


def warn_key_shown() -> None:
    """Say, once per process, that the key was to be hidden but is on tritonserver's command line."""
    global _WARNED_TOKEN_SHOWN
    if _WARNED_TOKEN_SHOWN:
        return
    _WARNED_TOKEN_SHOWN = True
    print("batchlm: WARNING: batchlm/launcher/argv_secret.c could not be built or used (no C compiler?), "
          "so the key of the administrative APIs is on tritonserver's command line, which every "
          "local user can read (docs/operations.md, \"Security\")", file=sys.stderr, flush=True)


def await_taken(process: subprocess.Popen, token: str, preload: Path) -> None:
    """That the argv_secret library ran in tritonserver `process` (it blanks `token` in the process's
    environment before main()), or RuntimeError at once: without it the key would be the placeholder,
    which every local user can read. Returns without a word where the process has exited (the caller's
    readiness wait says why, with the log's tail)."""
    deadline = time.monotonic() + TOKEN_TAKEN_TIMEOUT_S
    while not argv_secret.taken(process.pid, token):
        if process.poll() is not None:
            return
        if time.monotonic() > deadline or argv_secret.missing(process.pid, preload):
            raise RuntimeError("the argv_secret library did not run in tritonserver (not preloaded), so its "
                               "key would be the placeholder on its command line; not serving")
        time.sleep(0.005)


def check_taken(http_url: str, restricted_apis: tuple[str, ...], headers: dict[str, str]) -> None:
    """That the server at `http_url` took its key: a restricted API answers `headers`. Else RuntimeError:
    its key would be the placeholder."""
    api = next((a for a in _RESTRICTED_PROBES if a in restricted_apis), None)
    if api is None:
        return
    method, route = _RESTRICTED_PROBES[api]
    request = urllib.request.Request(f"http://{http_url}{route}", headers=headers, method=method,
                                     data=b"{}" if method == "POST" else None)
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"tritonserver refused its own key on the {api} API (HTTP {exc.code}): the key "
                           "did not take the placeholder's place in its arguments; not serving") from None
