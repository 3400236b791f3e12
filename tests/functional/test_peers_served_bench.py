"""`batchlm-bench peers-served` end to end against the project's own server only, on the tiny model: one
concurrency, a few short requests through Triton's generate_stream and the OpenAI frontend, the server
stopped with its stubs, every figure and the agreement with transformers written."""

import json
import subprocess
import sys

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from batchlm import kernels
from batchlm.paths import DEFAULT_MODEL, PROJECT_ROOT, TINY_MODEL_DIR
from tests.functional.conftest import processes_naming

SIZES = ["--servers", "triton,openai", "--concurrency", "2", "--num-requests", "3", "--max-tokens", "4",
         "--prompt-tokens-min", "1", "--prompt-tokens-max", "4000", "--agreement-prompts", "2",
         "--agreement-tokens", "4"]


def test_peers_served_measures_both_paths_of_the_project_server_and_stops_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "peers-served", *SIZES, "--model",
                           str(TINY_MODEL_DIR), "--out", str(tmp_path)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not processes_naming(str(tmp_path / "repository-2"))
    doc = json.loads((tmp_path / "peers_served.json").read_text())
    assert [(r["server"], r["streams"], r["status"]) for r in doc["rows"]] == [("triton", 2, "ok"), ("openai", 2, "ok")]
    for row in doc["rows"]:
        stats = row["stats"]
        assert stats["requests"] == 3 and stats["output_tokens"] == 12 and stats["output_tok_per_s"] > 0, row
        assert 0 < stats["ttft_p50_s"] <= stats["ttft_p99_s"] and 0 < stats["tpot_p50_s"] <= stats["tpot_p99_s"]
        assert row["peak_rss_mib"] > 0 and row["agreement"] == [2, 2], row
    table = (tmp_path / "peers_served.md").read_text()
    assert "| continuous_batching, OpenAI frontend /v1/completions | " in table and "x |" in table


@pytest.mark.skipif(not kernels.linear_q8_is_native(), reason="batchlm::linear_q8 needs AVX2")
def test_the_int8_tier_serves_the_default_model_through_triton(tmp_path):
    """triton-int8: a server of its own whose config sets activations int8, on the default model's GGUF file
    (whose Q4_1 and Q8_0 blocks linear_q8 multiplies), answering every request in full. (Its agreement
    and ratio table are the same code as the other servers', tested above and in the unit tests.)"""
    sizes = [a if a != "triton,openai" else "triton-int8" for a in SIZES]
    sizes[sizes.index("--agreement-prompts") + 1] = "0"
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "peers-served", *sizes, "--model",
                           str(DEFAULT_MODEL), "--out", str(tmp_path)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not processes_naming(str(tmp_path / "repository-2"))
    config = text_format.Parse((tmp_path / "repository-2-int8" / "continuous_batching" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    assert config.parameters["activations"].string_value == "int8"
    doc = json.loads((tmp_path / "peers_served.json").read_text())
    [row] = doc["rows"]
    assert (row["server"], row["streams"], row["status"]) == ("triton-int8", 2, "ok")
    assert row["stats"]["requests"] == 3 and row["stats"]["output_tokens"] == 12 and row["peak_rss_mib"] > 0


def test_the_in_process_engine_rows_run_the_same_workload_without_a_server(tmp_path):
    """engine, engine-int8: the project's LLMEngine in a process of its own, driven as OpenVINO's rows are,
    every request answered in full; the exact tier's greedy tokens are transformers'. (On the tiny model's
    Hugging Face folder int8 has no kept blocks and runs float32: its kernel is tested elsewhere.)"""
    sizes = [a if a != "triton,openai" else "engine,engine-int8" for a in SIZES]
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "peers-served", *sizes, "--model",
                           str(TINY_MODEL_DIR), "--out", str(tmp_path)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "peers_served.json").read_text())
    assert [(r["server"], r["streams"], r["status"]) for r in doc["rows"]] == [("engine", 2, "ok"),
                                                                              ("engine-int8", 2, "ok")]
    for row in doc["rows"]:
        stats = row["stats"]
        assert stats["requests"] == 3 and stats["output_tokens"] == 12 and stats["output_tok_per_s"] > 0, row
        assert 0 < stats["ttft_p50_s"] <= stats["ttft_p99_s"] and row["peak_rss_mib"] > 0, row
    assert doc["rows"][0]["agreement"] == [2, 2]
    assert "| LLMEngine in process, no server | 2 |" in (tmp_path / "peers_served.md").read_text()
