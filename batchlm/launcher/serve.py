"""Serve the model repository with a real tritonserver until a signal drains and stops it.

    batchlm-serve [--model PATH] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002] [--log FILE]
                  [--drain-timeout 60] [--frontend-port 9000] [--frontend-host 127.0.0.1] [--no-frontend]
                  [--on-model-failure reload|exit|off] [--hide-admin-key] [--api-key KEY]
                  [-- extra tritonserver arguments]

`--model` serves another checkpoint (a llama GGUF file or a Hugging Face Llama folder) in every model of
the repository instead of their `model_dir` (SmolLM2-135M-Instruct); it sets $BATCHLM_MODEL, which the
models and the frontend read.
Ports also come from HTTP_PORT, GRPC_PORT, METRICS_PORT, FRONTEND_PORT. `make serve` runs the set-up
first. The server's log goes to this terminal, or with `--log` to that file.

Once the server is ready, the OpenAI-compatible frontend (batchlm/frontend/) starts next to it on
`--frontend-port` (9000; 0 or `--no-frontend`: none), bound to 127.0.0.1 unless `--frontend-host`
says otherwise, and talks to the server over gRPC. With an API key ($BATCHLM_API_KEY, or `--api-key`,
which puts it on this command's own command line), the frontend asks every request but `/health` and
`/metrics` for `Authorization: Bearer <key>`; the key reaches it in its environment, and tritonserver does not get it.
On a stop it is stopped first: it stops accepting and lets its answers in flight finish (at most 10 s),
then the server is drained.

The server binds 127.0.0.1 unless `--address` says otherwise. It runs in explicit model control with
every model loaded at start (`--model-control-mode=explicit --load-model=*`) unless the extra arguments
choose a mode; its administrative APIs (model repository, shared memory, logging, trace) answer only
this command (a header with a random value, an argument of tritonserver; `--hide-admin-key` keeps it off
the command line, docs/operations.md, "Security"). SIGINT,
SIGTERM or SIGHUP drain it: every model is unloaded through the repository API, so requests parked in
static_batching or waiting in a queue are answered UNAVAILABLE and running ones finish; then the server
gets its SIGTERM. A second signal while draining stops it at once. In another model control mode the
repository API refuses unloads, and the server gets its SIGTERM at once. Then this script removes what
the server's stubs left (shared-memory regions, instance claims) and exits 0; if the server ends by
itself, the script exits with the server's status.

While serving, it watches every model (batchlm/launcher/supervisor.py): when a model's stub process
dies or its serving thread stops, `--on-model-failure reload` (the default) unloads and loads that
model alone; `exit` stops the server at once and exits 3, for an orchestrator to restart it.
"""

import argparse
import os
import sys
from pathlib import Path

from batchlm.api_key import API_KEY_ENV, resolve_api_key
from batchlm.launcher.frontend_process import FrontendProcess, ServerWithFrontend
from batchlm.launcher.model_control import with_model_control
from batchlm.launcher.ports import LOOPBACK
from batchlm.launcher.serve_loop import serve_until_signalled
from batchlm.paths import DEFAULT_REPOSITORY, MODEL_ENV


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="batchlm-serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY)
    ap.add_argument("--model", type=Path, default=None,
                    help="checkpoint every model serves instead of its model_dir: a llama GGUF file or a HF folder")
    ap.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    ap.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    ap.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    ap.add_argument("--address", default=LOOPBACK,
                    help="the address HTTP, gRPC and metrics bind (default: 127.0.0.1, this machine only); "
                         "0.0.0.0 serves every network the machine is on, with no authentication: "
                         "see docs/operations.md, Security")
    ap.add_argument("--log", type=Path, default=None, help="write the server log here (default: terminal)")
    ap.add_argument("--drain-timeout", type=float, default=60.0,
                    help="seconds a signal waits for the models to unload before stopping anyway")
    ap.add_argument("--frontend-port", type=int, default=int(os.environ.get("FRONTEND_PORT", 9000)),
                    help="port of the OpenAI-compatible frontend; 0: no frontend")
    ap.add_argument("--frontend-host", default=LOOPBACK,
                    help="the address the frontend binds (default: 127.0.0.1, this machine only)")
    ap.add_argument("--no-frontend", action="store_true", help="serve Triton alone")
    ap.add_argument("--on-model-failure", choices=("reload", "exit", "off"), default="reload",
                    help="when a model's stub process dies or its serving thread stops: reload that model "
                         "(default; the others are not touched), stop the server at once and exit 3 (every "
                         "request in flight ends), or leave it to Triton (see docs/operations.md)")
    ap.add_argument("--hide-admin-key", action="store_true",
                    help="keep the administrative APIs' key off tritonserver's command line, which every local "
                         "user can read, with a preloaded library built by the C compiler on first use "
                         "(see docs/operations.md, Security)")
    ap.add_argument("--api-key", default=None,
                    help=f"the bearer token the frontend asks for (default: ${API_KEY_ENV}, else none); prefer the "
                         "variable: an option is on this command's command line, which every local user can read")
    ap.add_argument("extra", nargs="*", help="extra tritonserver arguments, after --")
    args = ap.parse_args(argv)
    try:
        api_key = resolve_api_key(args.api_key)
    except ValueError as exc:
        ap.error(str(exc))
    if args.model is not None:
        if not args.model.exists():
            ap.error(f"--model: no checkpoint at {args.model}")
        os.environ[MODEL_ENV] = str(args.model.resolve())  # the server, its stubs and the frontend inherit it
    frontend = None
    if args.frontend_port and not args.no_frontend:
        frontend = FrontendProcess("", host=args.frontend_host, port=args.frontend_port,  # Triton's: at start
                                   api_key=api_key)

    server = ServerWithFrontend(
        model_repository=args.model_repository.resolve(), http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port, log_path=args.log,
        show_output=args.log is None, extra_args=tuple(with_model_control(args.extra)), address=args.address,
        hide_admin_key=args.hide_admin_key, frontend=frontend,
    )
    return serve_until_signalled(server, args.drain_timeout, on_model_failure=args.on_model_failure)


if __name__ == "__main__":
    sys.exit(main())
