"""Run the OpenAI-compatible frontend with uvicorn.

    batchlm-frontend [--triton-grpc 127.0.0.1:8001] [--host 127.0.0.1] [--port 9000]
                     [--models static_batching,dynamic_batching,...] [--request-timeout S] [--access-log]
                     [--api-key KEY]

It binds 127.0.0.1 unless `--host` says otherwise. With an API key (`--api-key`, else $BATCHLM_API_KEY,
which keeps it off the command line that every local user can read), every route but `/health` and
`/metrics` asks for `Authorization: Bearer <key>`. SIGINT or SIGTERM stop it gracefully: it stops
accepting, lets the answers in flight finish for up to `--graceful-timeout` seconds, then exits.
`batchlm-serve` (make serve) starts it next to Triton.
"""

from __future__ import annotations

import argparse
import sys

from batchlm.api_key import API_KEY_ENV, resolve_api_key
from batchlm.frontend.triton_client import SERVABLE_MODELS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="batchlm-frontend", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--triton-grpc", default="127.0.0.1:8001", help="Triton's gRPC endpoint, host:port")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--models", default=",".join(SERVABLE_MODELS),
                    help="comma-separated models to serve, where Triton has them ready")
    ap.add_argument("--request-timeout", type=float, default=None,
                    help="seconds per Triton request (default: none; static_batching waits for a full batch)")
    ap.add_argument("--graceful-timeout", type=float, default=30.0,
                    help="on a stop, seconds the answers in flight may take to finish")
    ap.add_argument("--access-log", action="store_true", help="log every request")
    ap.add_argument("--api-key", default=None,
                    help=f"the bearer token every route but /health and /metrics asks for (default: "
                         f"${API_KEY_ENV}, else "
                         "none); prefer the variable: an option is on the command line, which every local "
                         "user can read")
    args = ap.parse_args(argv)
    try:
        args.api_key = resolve_api_key(args.api_key)
    except ValueError as exc:
        ap.error(str(exc))
    args.models = tuple(m for m in args.models.split(",") if m)
    if not args.models:
        ap.error("--models: give at least one model")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import uvicorn

    from batchlm.frontend.app import create_app

    app = create_app(args.triton_grpc, args.models, args.request_timeout, args.api_key)
    uvicorn.run(app, host=args.host, port=args.port, access_log=args.access_log, log_level="info",
                timeout_graceful_shutdown=int(args.graceful_timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
