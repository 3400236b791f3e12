"""One schema for all three models: malformed input is refused naming the field, the server keeps
serving, and greedy decoding gives the same text everywhere, whatever shares the batch."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from batchlm.engine import LLMEngine
from batchlm.engine_config import EngineConfig
from batchlm.sampling import SamplingParams
from client.triton_llm import LLMClient

MODELS = ("static_batching", "dynamic_batching", "continuous_batching")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["dynamic_batching", "continuous_batching", "static_batching"])
@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 4}, "text_input"),
    ({"text_input": "hi"}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "max_tokens": 4, "top_p": 2.0}, "top_p"),
    ({"text_input": "hi", "max_tokens": 4, "top_k": -1}, "top_k"),
    ({"text_input": "hi", "max_tokens": 100000}, "max_tokens"),
    # a field that matches no input arrives as a request parameter; before, it was dropped in silence
    ({"text_input": "hi", "max_tokens": 4, "temprature": 0.7}, "temprature: unknown field"),
    ({"text_input": "hi", "max_tokens": 4, "stop": ["x"] * 17}, "stop: at most 16 stop strings"),
])
def test_malformed_request_names_field(server, name, body, field):
    r = requests.post(f"http://{server.http_url}/v2/models/{name}/generate", json=body, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text)
    assert field in r.json()["error"]


PROMPTS = [
    "The history of the city", "Numbers: one two three", "A recipe for bread", "Dear diary, today",
    "In the beginning", "Weather report:", "Questions and answers", "The last line",
]


def _generate(server, model, prompt, max_tokens, infer=False):
    """Over /generate, or over HTTP /infer (models that are not decoupled)."""
    client = LLMClient(server.http_url, server.grpc_url, timeout=300)
    try:
        ask = client.infer_http if infer else client.generate
        return ask(model, prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True).text
    finally:
        client.close()


def test_greedy_text_is_the_same_everywhere(server):
    lengths = [6 + 5 * i for i in range(len(PROMPTS))]  # different lengths share each batch
    engine = LLMEngine(ROOT / "models" / "default", EngineConfig(num_threads=1))
    alone = [engine.generate([p], SamplingParams(max_tokens=n, ignore_eos=True))[0].text
             for p, n in zip(PROMPTS, lengths)]
    for model in MODELS:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            # static and dynamic batching also answer /infer: every other request of a batch goes there
            infer = [i % 2 == 1 and model != "continuous_batching" for i in range(len(PROMPTS))]
            texts = list(pool.map(lambda a: _generate(server, model, *a), zip(PROMPTS, lengths, infer)))
        assert texts == alone, model
