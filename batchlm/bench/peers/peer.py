"""The engines the command compares: what each imports, how it batches, and the message of a missing one."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

EXTRA_HINT = "pip install -e '.[peers]'"


@dataclass(frozen=True)
class Peer:
    name: str                    # the --engines key
    batching: str                # how it batches, for the table ({n}: --max-num-seqs)
    modules: tuple[str, ...]     # what it imports
    distributions: tuple[str, ...]  # the pip packages that provide them, for versions and skip messages


PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer("batchlm", "continuous, {n} in flight", (), ()),
    Peer("hf-cb", "continuous (ContinuousBatchingManager), {n} in flight", ("transformers",), ("transformers",)),
    Peer("hf-static", "request-level: `generate`, groups of {n}", ("transformers",), ("transformers",)),
    Peer("ct2", "request-level: `generate_batch`, groups of {n}", ("ctranslate2", "transformers"),
         ("ctranslate2", "transformers")),
    Peer("llama.cpp", "continuous (server-style slots), {n} in flight", ("llama_cpp", "gguf"),
         ("llama-cpp-python", "gguf")),
)}


def missing_modules(peer: Peer) -> list[str]:
    return [m for m in peer.modules if importlib.util.find_spec(m) is None]


def skip_message(peer: Peer, missing: list[str]) -> str:
    return (f"skipped: {', '.join(missing)} not installed (the optional `peers` extra: "
            f"`{EXTRA_HINT}`, or `make bench-peers`)")


def versions(peer: Peer) -> dict[str, str]:
    found = {}
    for dist in peer.distributions:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found
