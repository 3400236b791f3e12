"""batchlm: a small PyTorch LLM engine (paged KV cache, chunked prefill, continuous batching) and the
Triton glue that serves it three ways.

The public API:

    from batchlm import LLMEngine, EngineConfig, SamplingParams

    engine = LLMEngine("models/SmolLM2-135M-Instruct.Q4_1.gguf", EngineConfig(max_num_seqs=8))
    print(engine.generate(["Once upon a time"], SamplingParams(max_tokens=16))[0].text)

Importing the package is cheap and loads no torch (the Triton models import it in a backend stub
that only reads their config): the engine's names are imported when first used.
See docs/architecture.md for the module map and the contracts between modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "InvalidArgument"]

_HOMES = {
    "LLMEngine": "batchlm.engine.engine",
    "EngineConfig": "batchlm.engine.engine_config",
    "SamplingParams": "batchlm.engine.sampling",
    "RequestOutput": "batchlm.engine.request_output",
    "InvalidArgument": "batchlm.errors",
}

if TYPE_CHECKING:
    from batchlm.engine.engine import LLMEngine
    from batchlm.engine.engine_config import EngineConfig
    from batchlm.engine.request_output import RequestOutput
    from batchlm.engine.sampling import SamplingParams
    from batchlm.errors import InvalidArgument


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module 'batchlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
