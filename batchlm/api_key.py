"""The OpenAI-compatible frontend's API key: the environment variable that carries it and the rule that
picks it, shared by the frontend, the launcher that starts it and the clients that call it.

A key comes from an option (`--api-key`) or, where the option is not given, from $BATCHLM_API_KEY, so a
Kubernetes Secret or an `.env` file can carry it and it stays off every command line. Neither: no key,
and the frontend answers every client. Imports nothing beyond the standard library.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

API_KEY_ENV = "BATCHLM_API_KEY"
# Printable ASCII without spaces: what an `Authorization: Bearer <key>` header carries unchanged. A key
# read from a file with its trailing newline would otherwise be one no client can ever send.
_SENDABLE = re.compile(r"[\x21-\x7e]+")


def resolve_api_key(option: str | None, environ: Mapping[str, str] = os.environ,
                    option_name: str = "--api-key") -> str | None:
    """The key: `option` where given (not None), else `environ[API_KEY_ENV]` where set; None where neither.

    ValueError, naming `option_name` and the variable, for an empty key or one with characters a header
    cannot carry: a server started with such a key would refuse every client, or answer them all."""
    source = option_name if option is not None else API_KEY_ENV
    key = option if option is not None else environ.get(API_KEY_ENV)
    if key is None:
        return None
    if not key:
        raise ValueError(f"{source}: the API key is empty; give a key, or leave {option_name} out and "
                         f"{API_KEY_ENV} unset to serve without one")
    if not _SENDABLE.fullmatch(key):
        raise ValueError(f"{source}: the API key must be printable ASCII without spaces or line breaks "
                         "(it travels in an Authorization header); a key read from a file may end with a newline")
    return key


def client_api_key(option: str | None = None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key a client sends: `option` where given, else $BATCHLM_API_KEY; None or empty: none."""
    key = option if option is not None else environ.get(API_KEY_ENV)
    return key or None


def bearer_headers(key: str | None) -> dict[str, str]:
    """The headers that carry `key` (`Authorization: Bearer <key>`); none for no key."""
    return {"Authorization": f"Bearer {key}"} if key else {}
