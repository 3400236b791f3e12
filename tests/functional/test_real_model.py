"""The default model served as `make serve` serves it: SmolLM2-135M-Instruct in all three strategies,
answering factual questions through Triton's /generate, tritonclient over gRPC and the official OpenAI
SDK, each answer ended by the model's own EOS.

Its own tritonserver over the project's model repository as it is (the other functional tests serve the
tiny random checkpoint: tests/conftest.py), and the OpenAI-compatible frontend beside it. Greedy, so the
answers are deterministic; the questions are ones transformers, on the same file, answers right (a 135M
model gets others wrong, and that is the model: tests/unit/test_default_model_reference.py holds the
engine to transformers token for token).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from batchlm.paths import DEFAULT_MODEL
from batchlm_client.triton_llm import LLMClient, collect
from tests.functional.conftest import default_model_serving

MODELS = ("static_batching", "dynamic_batching", "continuous_batching")
# Eight, a full batch of static_batching: question -> a word its right answer holds.
QUESTIONS = {
    "What is the capital of France?": "Paris",
    "What is the capital of Japan?": "Tokyo",
    "What is the capital of Germany?": "Berlin",
    "What is the chemical symbol for water?": "H2O",
    "What is the boiling point of water in Celsius?": "100",
    "How many days are in a week?": "7",
    "What is the largest ocean on Earth?": "Pacific",
    "What is the chemical symbol for gold?": "Au",
}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, frontend URL) over the repository's own model_dir, the default model."""
    with default_model_serving(tmp_path_factory.mktemp("real_model")) as serving:
        yield serving


def _ask_all(ask) -> dict[str, tuple[str, str]]:
    """Every question at once (a thread and a client each): question -> (text, finish_reason)."""
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return dict(zip(QUESTIONS, pool.map(ask, QUESTIONS)))


def _check(answers: dict[str, tuple[str, str]]) -> None:
    for question, (text, finish_reason) in answers.items():
        assert QUESTIONS[question] in text, (question, text)
        assert finish_reason == "stop", (question, text, finish_reason)  # the model's EOS, not the cap
    print(answers["What is the capital of France?"][0])


def test_the_served_models_run_the_default_model(served):
    server, _ = served
    with LLMClient(server.http_url, server.grpc_url) as llm:
        for model in MODELS:
            params = llm.model_config(model)["parameters"]
            assert params["model_dir"]["string_value"] == f"models/{DEFAULT_MODEL.name}"


@pytest.mark.parametrize("model", MODELS)
def test_generate_over_http_answers_through_the_chat_template(served, model):
    server, _ = served

    def ask(question: str):
        with LLMClient(server.http_url, server.grpc_url, timeout=120) as llm:
            prompt = llm.chat_prompt(model, [{"role": "user", "content": question}])
            assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
            result = llm.generate(model, prompt, MAX_TOKENS, temperature=0.0)
            return result.text, result.finish_reason

    _check(_ask_all(ask))


@pytest.mark.parametrize("model", MODELS)
def test_tritonclient_over_grpc_answers(served, model):
    """tritonclient's gRPC client: a stream from continuous_batching, one answer from the others."""
    server, _ = served

    def ask(question: str):
        with LLMClient(server.http_url, server.grpc_url, timeout=120) as llm:
            prompt = llm.chat_prompt(model, [{"role": "user", "content": question}], via="grpc")
            if llm.is_decoupled(model, "grpc"):
                result = collect(llm.stream_grpc(model, prompt, MAX_TOKENS, temperature=0.0, stream=True))
            else:
                result = llm.infer_grpc(model, prompt, MAX_TOKENS, temperature=0.0)
            return result.text, result.finish_reason

    _check(_ask_all(ask))


@pytest.mark.parametrize("model", MODELS)
def test_the_openai_sdk_chat_answers(served, model):
    _, url = served

    def ask(question: str):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
            answer = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                 max_tokens=MAX_TOKENS, temperature=0.0)
            return answer.choices[0].message.content, answer.choices[0].finish_reason

    _check(_ask_all(ask))


def test_generate_without_a_template_continues_the_text(served):
    """/generate is raw completion: the prompt is continued as it is, no template around it."""
    server, _ = served
    with LLMClient(server.http_url, server.grpc_url, timeout=120) as llm:
        result = llm.generate("continuous_batching", "The capital of France is", 8, temperature=0.0)
    assert result.text.startswith(" Paris") and result.num_input_tokens == 5, result
