"""The servers the command measures: each one's label for the table, and why one cannot run here."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

from batchlm.bench.peers_served.llama_server import BUILD_HINT, LLAMA_CPP_DIR, binary

EXTRA_HINT = "pip install -e '.[peers-served]' (make bench-peers-served installs it)"


@dataclass(frozen=True)
class Server:
    name: str                  # the --servers key
    label: str                 # the table's
    family: str                # "triton", "triton-int8", "engine", "llama.cpp" or "openvino": how it is started
                               # and asked


SERVERS: dict[str, Server] = {s.name: s for s in (
    Server("triton", "continuous_batching, Triton generate_stream", "triton"),
    Server("openai", "continuous_batching, OpenAI frontend /v1/completions", "triton"),
    Server("triton-int8", "continuous_batching, int8 activations, Triton generate_stream", "triton-int8"),
    Server("engine", "LLMEngine in process, no server", "engine"),
    Server("engine-int8", "LLMEngine in process, int8 activations, no server", "engine"),
    Server("llama-q4_1", "llama-server, shipped Q4_1 file", "llama.cpp"),
    Server("llama-q8_0", "llama-server, Q8_0 file (llama-quantize)", "llama.cpp"),
    Server("openvino-ir-f32", "OpenVINO GenAI in process, float32 IR, f32 hint", "openvino"),
    Server("openvino-ir", "OpenVINO GenAI in process, float32 IR, default precision", "openvino"),
    Server("openvino-gguf", "OpenVINO GenAI in process, the GGUF file read directly, f32 hint", "openvino"),
)}
SUBJECT = "triton"  # the ratio columns divide this server's tok/s by each other's
FAST_SUBJECT = "triton-int8"  # and, where it ran, this one's (the fast tier)


def missing(server: Server) -> str | None:
    """Why `server` cannot run on this machine (the command or extra that provides it), or None."""
    if server.family == "llama.cpp" and binary("llama-server") is None:
        return f"skipped: llama-server is not built ({BUILD_HINT})"
    if server.name == "llama-q8_0" and binary("llama-quantize") is None:
        return f"skipped: llama-quantize is not built ({BUILD_HINT})"
    if server.family == "openvino" and importlib.util.find_spec("openvino_genai") is None:
        return f"skipped: openvino_genai is not installed ({EXTRA_HINT})"
    return None


def versions() -> dict[str, str]:
    """The peers' versions found here: the llama.cpp sources llama-server was built from, and packages."""
    found = {}
    stamp = LLAMA_CPP_DIR / "bin" / ".built-from"
    if binary("llama-server") is not None and stamp.is_file():
        found["llama-server"] = f"llama.cpp of {stamp.read_text().strip()}"
    for dist in ("openvino-genai", "openvino", "transformers"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found
