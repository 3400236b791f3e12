"""The API key check: with a key configured, every request but health and metrics must carry
`Authorization: Bearer <key>`, or is answered 401 in OpenAI's error shape with `WWW-Authenticate: Bearer`.

    app.add_middleware(RequireApiKey, key="...")     # create_app does it where it is given a key

It is plain ASGI middleware in front of the router, so it guards every path, those with no route too,
before a request body is read. `/health` stays open for probes and the launcher's readiness wait, and
`/metrics` for Prometheus, as vLLM's and TGI's servers leave them.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from batchlm.frontend import errors

OPEN_PATHS = frozenset({"/health", "/metrics"})


class RequireApiKey:
    """ASGI middleware: HTTP requests outside OPEN_PATHS need the bearer token `key`."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            refused = self._refusal(scope["headers"])
            if refused is not None:
                response = JSONResponse(refused.body(), status_code=refused.status,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, headers: list[tuple[bytes, bytes]]) -> errors.ApiError | None:
        """None where `headers` carry the key; else the 401 that says what is wrong."""
        values = [value for name, value in headers if name == b"authorization"]
        if not values:
            return errors.unauthorized("no API key: send the header `Authorization: Bearer <key>`")
        scheme, _, token = values[0].strip().partition(b" ")
        if len(values) > 1 or scheme.lower() != b"bearer" or not token.strip():
            return errors.unauthorized("the Authorization header must be one `Bearer <key>`")
        # NOTE: constant time in the token's bytes; only the key's length could show in the timing
        if not hmac.compare_digest(token.strip(), self._key):
            return errors.unauthorized("incorrect API key")
        return None
