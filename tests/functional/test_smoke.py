"""Issue 2's smoke test: the repository loads in a real tritonserver and every model answers over
HTTP generate and gRPC."""

import pytest
import requests

MODELS = ("static_batching", "dynamic_batching", "continuous_batching")


def test_server_and_models_ready(server):
    for name in MODELS:
        r = requests.get(f"http://{server.http_url}/v2/models/{name}/ready", timeout=10)
        assert r.status_code == 200, name


@pytest.mark.parametrize("name", ["dynamic_batching", "continuous_batching"])
def test_answers_over_http_and_grpc(llm, name):
    http = llm.generate(name, "The quick brown fox", max_tokens=6, ignore_eos=True)
    grpc = llm.infer_grpc(name, "The quick brown fox", max_tokens=6, ignore_eos=True)
    assert http.num_output_tokens == grpc.num_output_tokens == 6
    assert http.finish_reason == grpc.finish_reason == "length"
    assert http.num_input_tokens == grpc.num_input_tokens > 0
    assert http.text == grpc.text and http.text
