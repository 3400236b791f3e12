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
    family: str                # "triton", "triton-tier", "engine", "llama.cpp" or "openvino": how it is started
                               # and asked
    activations: str = "float32"  # triton-tier and engine: the tier the model runs (EngineConfig.activations)
    default: bool = True       # in --servers' default; the bfloat16 tier's rows are for a file with BF16 weights


SERVERS: dict[str, Server] = {s.name: s for s in (
    Server("triton", "continuous_batching, Triton generate_stream", "triton"),
    Server("openai", "continuous_batching, OpenAI frontend /v1/completions", "triton"),
    Server("triton-int8", "continuous_batching, int8 activations, Triton generate_stream", "triton-tier", "int8"),
    Server("triton-bf16", "continuous_batching, bfloat16 activations, Triton generate_stream", "triton-tier",
           "bfloat16", default=False),
    Server("engine", "LLMEngine in process, no server", "engine"),
    Server("engine-int8", "LLMEngine in process, int8 activations, no server", "engine", "int8"),
    Server("engine-bf16", "LLMEngine in process, bfloat16 activations, no server", "engine", "bfloat16",
           default=False),
    Server("llama-q4_1", "llama-server, shipped Q4_1 file", "llama.cpp"),
    Server("llama-q8_0", "llama-server, Q8_0 file (llama-quantize)", "llama.cpp"),
    Server("openvino-ir-f32", "OpenVINO GenAI in process, float32 IR, f32 hint", "openvino"),
    Server("openvino-ir", "OpenVINO GenAI in process, float32 IR, default precision", "openvino"),
    Server("openvino-gguf", "OpenVINO GenAI in process, the GGUF file read directly, f32 hint", "openvino"),
)}
SUBJECT = "triton"  # the ratio columns divide this server's tok/s by each other's
FAST_SUBJECTS = ("triton-int8", "triton-bf16")  # and, where they ran, these ones' (the fast tiers)


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
