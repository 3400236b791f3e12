"""The project's `continuous_batching` as the subject: a tritonserver with only that model loaded, from a
copy of its config with `max_num_seqs` set to the concurrency, and the OpenAI frontend in front of it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from batchlm.bench.served.comparison import write_variant
from batchlm.launcher.frontend_process import FrontendProcess, ServerWithFrontend
from batchlm.launcher.ports import free_port

MODEL = "continuous_batching"


@dataclass(frozen=True)
class TritonTarget:
    """What a run asks and measures: Triton's HTTP address, the frontend's, and each one's processes."""

    http_url: str              # http://127.0.0.1:PORT of tritonserver
    frontend_url: str          # http://127.0.0.1:PORT of the OpenAI frontend
    server_pid: int            # tritonserver (its tree holds the model's stub)
    frontend_pid: int


@contextlib.contextmanager
def serving(out: Path, concurrency: int, model: Path | None = None,
            activations: str = "float32") -> Iterator[TritonTarget]:
    """tritonserver serving `continuous_batching` with max_num_seqs = `concurrency` and `activations` (and
    `model` as its checkpoint where given), and the frontend; both stopped on leaving, stubs included, also
    on failure. The repository copy and the logs go under `out`."""
    overrides = {"max_num_seqs": str(concurrency), "activations": activations}
    if model is not None:
        overrides["model_dir"] = str(model.resolve())
    repository = out / f"repository-{concurrency}-{activations}"
    write_variant(repository, MODEL, overrides)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    frontend = FrontendProcess("", port=free_port(), graceful_timeout=2,
                               log_path=logs / f"frontend-{concurrency}-{activations}.log")
    server = ServerWithFrontend(model_repository=repository.resolve(), http_port=free_port(), grpc_port=free_port(),
                                metrics_port=free_port(), log_path=logs / f"triton-{concurrency}-{activations}.log",
                                exit_timeout_s=5, frontend=frontend,
                                extra_args=("--model-control-mode=explicit", f"--load-model={MODEL}"))
    try:
        server.start(timeout=600)
        yield TritonTarget(f"http://{server.http_url}", frontend.url, server.process.pid, frontend.process.pid)
    finally:
        server.stop()
