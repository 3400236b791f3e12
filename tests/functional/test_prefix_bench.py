"""`batchlm-bench prefix` end to end on the tiny model: one round of every workload, a server with the cache on
and one with it off, each stopped with its stubs; the same answers on both, hits only where the cache is on."""

import json
import subprocess
import sys

from batchlm.paths import PROJECT_ROOT
from tests.functional.conftest import processes_naming

SIZES = ["--rounds", "1", "--conversations", "2", "--turns-min", "2", "--turns-max", "3", "--system-requests", "4",
         "--control-requests", "3", "--control-prompt-tokens-min", "20", "--control-prompt-tokens-max", "40",
         "--max-tokens", "4", "--concurrency", "2", "--stagger-ms", "50", "--think-ms", "50"]


def test_prefix_bench_serves_the_cache_on_and_off_with_the_same_answers(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "prefix", *SIZES, "--out", str(tmp_path)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not processes_naming(str(tmp_path / "variants"))
    doc = json.loads((tmp_path / "prefix_cache.json").read_text())
    assert doc["parameters"]["on"]["enable_prefix_caching"] == "true"
    assert doc["parameters"]["off"]["enable_prefix_caching"] == "false"
    assert doc["streamed"] and doc["workloads"] == ["chat", "system", "control"]
    assert doc["spec"]["think_ms"] == 50 and doc["bookkeeping"]["steps"] > 0 and doc["bookkeeping"]["on_us"] > 0
    figures = doc["summary"]["figures"]
    for side in ("on", "off"):
        (round_,) = doc["runs"][side]
        chat = round_["chat"]["answers"]
        assert sorted(a["turn"] for a in chat) == [1, 1, 2, 2, 3]  # 2 conversations of 2 and 3 turns (seed 0)
        for workload, count in (("chat", 5), ("system", 4), ("control", 3)):
            fig = figures[side][workload]
            assert fig["requests"] == fig["ok"] == count, (side, workload)
            assert fig["output_tokens"] == 4 * count and fig["tok_s"] > 0 and fig["ttft_p50"] > 0
    assert figures["on"]["chat"]["ttft_p50_later"] > 0 and figures["on"]["chat"]["ttft_p50_first"] > 0
    for workload in ("chat", "system"):
        on, off = figures["on"][workload], figures["off"][workload]
        assert on["hit_rate"] > 0 and on["hit_rate_metrics"] == on["hit_rate"], workload
        assert off["hit_rate"] == 0 and off["hit_rate_metrics"] == 0, workload
        assert on["computed_prompt_tokens"] < off["computed_prompt_tokens"] == off["prompt_tokens"]
    assert figures["on"]["control"]["hit_rate"] == figures["off"]["control"]["hit_rate"] == 0
    assert doc["summary"]["identical"] == {"chat": {"same": 5, "compared": 5}, "system": {"same": 4, "compared": 4},
                                           "control": {"same": 3, "compared": 3}}
    text = (tmp_path / "prefix_cache.md").read_text()
    assert "| workload | figure | cache on | cache off | on / off | on / off, each round |" in text
    assert "| system: output tok/s, on / off >= 1.5 |" in text
    assert "- chat: 5/5 answers identical to the first round with the cache off (greedy)." in text
    assert "- Bookkeeping, in process" in text
    assert {p.name for p in (tmp_path / "logs").iterdir()} == {"on-round-1.log", "off-round-1.log"}
