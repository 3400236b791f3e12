"""`batchlm-bench peers-served` end to end against the project's own server only, on the tiny model: one
concurrency, a few short requests through Triton's generate_stream and the OpenAI frontend, the server
stopped with its stubs, every figure and the agreement with transformers written."""

import json
import subprocess
import sys

from batchlm.paths import PROJECT_ROOT, TINY_MODEL_DIR
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
