"""`activations` "bfloat16" served: `continuous_batching` through a real tritonserver on a GGUF file of BF16
weights (the tiny model's, written here), its answers those of the engine in process on the same tier, token
for token and log-probability for log-probability, and not the exact tier's."""

from __future__ import annotations

import pytest
import torch

from batchlm import kernels
from batchlm.bench.peers_served import triton_target
from batchlm.engine.engine import LLMEngine
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.model.gguf_export import write_gguf
from batchlm.paths import MODEL_ENV, TINY_MODEL_DIR
from batchlm_client.triton_llm import LLMClient
from tests.functional.conftest import processes_naming

PROMPTS = ([1, 2, 3, 4, 5], [300, 17, 4000, 42], [77] * 12)
TOKENS = 8


@pytest.mark.skipif(not kernels.linear_is_native(torch.bfloat16), reason="batchlm::linear_bf16 needs AVX-512 BF16")
def test_the_bfloat16_tier_serves_a_bf16_file_through_triton(tmp_path, monkeypatch):
    path = write_gguf(TINY_MODEL_DIR, tmp_path / "tiny.BF16.gguf", lambda name: "BF16")
    monkeypatch.setenv(MODEL_ENV, str(path))  # the checkpoint every served model loads here
    with triton_target.serving(tmp_path, 2, path, "bfloat16") as target:
        client = LLMClient(target.http_url.removeprefix("http://"), timeout=300)
        try:
            served = [client.generate(triton_target.MODEL, ids, TOKENS, ignore_eos=True, logprobs=1) for ids in PROMPTS]
        finally:
            client.close()
    assert not processes_naming(str(tmp_path / "repository-2-bfloat16"))
    params = [SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=1)] * len(PROMPTS)
    tiers = {a: LLMEngine(path, EngineConfig(activations=a)).generate([list(p) for p in PROMPTS], params)
             for a in ("bfloat16", "float32")}
    for got, want in zip(served, tiers["bfloat16"]):
        assert got.token_ids == want.token_ids
        assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-6)
    gaps = [abs(a.logprob - b.logprob) for x, y in zip(tiers["bfloat16"], tiers["float32"])
            for a, b in zip(x.logprobs, y.logprobs)]
    assert max(gaps) > 1e-4  # the exact tier answers otherwise: the served one ran bfloat16
