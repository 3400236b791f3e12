"""A model repository with the shipped `continuous_batching_trtllm` in front of the stand-in `tensorrt_llm`
(`model.py` here: TensorRT-LLM's tensor contract over batchlm's engine, for machines without a GPU)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from batchlm.backend.serving_config import SERVING_KEYS

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "docker" / "trtllm" / "model_repository"
FRONT = "continuous_batching_trtllm"
# The stand-in's error hook (model.py): a request for FAILING_OUTPUT_LEN tokens fails after FAILING_AFTER
FAILING_OUTPUT_LEN, FAILING_AFTER = 777, 5


def _parse(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def standin_config() -> str:
    """The shipped tensorrt_llm config with the Python backend, continuous_batching's engine parameters and
    the error hook's two."""
    config = _parse(SHIPPED / "tensorrt_llm" / "config.pbtxt")
    config.backend = "python"
    config.parameters.clear()
    for key, value in _parse(ROOT / "model_repository" / "continuous_batching" / "config.pbtxt").parameters.items():
        if key not in SERVING_KEYS or key == "model_dir":
            config.parameters[key].string_value = value.string_value
    config.parameters["failing_output_len"].string_value = str(FAILING_OUTPUT_LEN)
    config.parameters["failing_after"].string_value = str(FAILING_AFTER)
    return text_format.MessageToString(config)


def standin_repository(repository: Path, max_in_flight: int | None = None,
                       engine_silence_timeout_ms: int | None = None) -> Path:
    """Write the two models into `repository` (the front's max_in_flight and engine_silence_timeout_ms
    replaced where given)."""
    (repository / "tensorrt_llm" / "1").mkdir(parents=True)
    (repository / "tensorrt_llm" / "config.pbtxt").write_text(standin_config())
    shutil.copy(Path(__file__).parent / "model.py", repository / "tensorrt_llm" / "1")
    shutil.copytree(SHIPPED / FRONT, repository / FRONT, ignore=shutil.ignore_patterns("__pycache__"))
    front = repository / FRONT / "config.pbtxt"
    for key, value in (("max_in_flight", max_in_flight), ("engine_silence_timeout_ms", engine_silence_timeout_ms)):
        if value is not None:
            text, count = re.subn(rf'(key: "{key}" value: \{{ string_value: )"\d+"', rf'\1"{value}"',
                                  front.read_text())
            assert count == 1, key
            front.write_text(text)
    return repository
