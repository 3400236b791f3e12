"""The OpenAI frontend's prompts, choices and tokenizer routes, with a stand-in for Triton: prompts as
token ids and lists of prompts, `n` choices sharing their prompt's KV, the streams of several choices,
usage with cached tokens, and `/tokenize`, `/detokenize` and `/tokenizer_info` as lm-evaluation-harness'
remote tokenizer asks them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from batchlm.frontend.triton_client import ModelInfo
from batchlm.model.tokenizer import Tokenizer
from batchlm.paths import TINY_MODEL_DIR
from batchlm.response_schema import Chunk
from tests.unit.openai_app import FakeBackend, events, post, request

TOKENIZER = Tokenizer.from_dir(TINY_MODEL_DIR)
MESSAGES = [{"role": "user", "content": "hi"}]


def said(fields: dict, cached: int = 0) -> list[Chunk]:
    """A two-response answer that names the request it answers: its seed, or its prompt."""
    name = str(fields.get("seed", fields.get("text_input", fields.get("input_ids"))))
    prompt = len(fields.get("input_ids", [])) or 4
    return [Chunk(f"<{name}", "", prompt, 1, num_cached_tokens=cached),
            Chunk(">", "length", prompt, 2, num_cached_tokens=cached)]


# -- prompts -----------------------------------------------------------------------------------------

def test_a_prompt_of_token_ids_is_sent_as_input_ids_and_echoed_as_its_text():
    ids = TOKENIZER.encode("Hello there")
    backend = FakeBackend(said)
    status, content = post(backend, "/v1/completions", {"model": "continuous_batching", "prompt": ids,
                                                         "echo": True, "max_tokens": 2})
    assert status == 200, content
    assert backend.sent[0]["input_ids"] == ids and "text_input" not in backend.sent[0]
    choice = Completion.model_validate(json.loads(content)).choices[0]
    assert choice.text == "Hello there" + f"<{ids}>"


@pytest.mark.parametrize("model", ["continuous_batching", "dynamic_batching"])
def test_a_list_of_prompts_is_one_request_and_one_choice_each_in_order(model):
    prompts = [TOKENIZER.encode("one"), TOKENIZER.encode("two words"), TOKENIZER.encode("and three")]
    backend = FakeBackend(said)
    status, content = post(backend, "/v1/completions", {"model": model, "prompt": prompts, "max_tokens": 2})
    answer = Completion.model_validate(json.loads(content))
    assert status == 200 and [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.text for c in answer.choices] == [f"<{p}>" for p in prompts]
    assert sorted(map(str, (f["input_ids"] for f in backend.sent))) == sorted(map(str, prompts))
    assert answer.usage.prompt_tokens == sum(len(p) for p in prompts) and answer.usage.completion_tokens == 6
    texts = ["a", "b"]
    status, content = post(backend, "/v1/completions", {"model": model, "prompt": texts, "max_tokens": 2})
    assert [c["text"] for c in json.loads(content)["choices"]] == ["<a>", "<b>"]


def test_lm_evaluation_harness_batched_scoring_of_token_prompts():
    """local-completions with a remote tokenizer: prompts of ids, echo, logprobs 1, max_tokens 1."""
    from batchlm.response_schema import TokenLogprob

    def scored(fields: dict) -> list[Chunk]:
        ids = tuple(fields["input_ids"])
        return [Chunk("!", "length", len(ids), 1, token_ids=(0,), logprobs=(TokenLogprob(0, -1.0, ((0, -1.0),)),),
                      prompt_ids=ids, prompt_logprobs=tuple(TokenLogprob(i, -0.5, ((i, -0.5),)) for i in ids[1:]))]

    prompts = [TOKENIZER.encode("Paris is"), TOKENIZER.encode("Rome is in Italy")]
    backend = FakeBackend(scored)
    status, content = post(backend, "/v1/completions", {"model": "continuous_batching", "prompt": prompts,
                                                         "echo": True, "logprobs": 1, "max_tokens": 1,
                                                         "temperature": 0, "seed": 1234})
    assert status == 200, content
    choices = sorted(json.loads(content)["choices"], key=lambda c: c["index"])
    for prompt, choice in zip(prompts, choices):
        assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1
        assert choice["logprobs"]["token_logprobs"][0] is None and choice["text"].endswith("!")
        assert all(f["seed"] == 1234 for f in backend.sent)   # each prompt its own request, seeded alike


# -- n -----------------------------------------------------------------------------------------------

def test_n_choices_take_seed_plus_i_and_follow_the_first_choices_first_token():
    backend = FakeBackend(lambda fields: said(fields, cached=0 if fields["seed"] == 5 else 16))
    status, content = post(backend, "/v1/chat/completions", {"model": "continuous_batching", "messages": MESSAGES,
                                                              "n": 3, "seed": 5, "max_tokens": 2})
    answer = ChatCompletion.model_validate(json.loads(content))
    assert status == 200 and [c.message.content for c in answer.choices] == ["<5>", "<6>", "<7>"]
    assert [c.index for c in answer.choices] == [0, 1, 2]
    first, *others = backend.log
    assert backend.log[:2] == [("sent", first[1]), ("first", first[1])]   # the others wait for its first token
    assert {kind for kind, _ in others[1:3]} == {"sent"}
    assert backend.sent[0]["stream"] is True and "stream" not in backend.sent[1]
    # the prompt once, with the first choice's cache hits; every choice's tokens
    usage = answer.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens) == (4, 6, 0)


def test_n_over_a_list_of_prompts_indexes_prompt_by_prompt():
    backend = FakeBackend(said)
    status, content = post(backend, "/v1/completions", {"model": "dynamic_batching", "prompt": ["a", "b"], "n": 2,
                                                         "seed": 0})
    assert [(c["index"], c["text"]) for c in json.loads(content)["choices"]] == [
        (0, "<0>"), (1, "<1>"), (2, "<0>"), (3, "<1>")]
    assert sorted((f["text_input"], f["seed"]) for f in backend.sent) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]


def test_a_stream_of_several_choices_carries_each_ones_index_and_end():
    backend = FakeBackend(said)
    status, content = post(backend, "/v1/chat/completions", {
        "model": "continuous_batching", "messages": MESSAGES, "n": 2, "seed": 1, "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = [ChatCompletionChunk.model_validate(e) for e in events(content)]
    assert status == 200 and all(len(c.choices) == 1 for c in chunks[:-1])
    for index, seed in ((0, 1), (1, 2)):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and "".join(c.delta.content or "" for c in mine) == f"<{seed}>"
        assert [c.finish_reason for c in mine][-1] == "length" and sum(bool(c.finish_reason) for c in mine) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(f["stream"] is True for f in backend.sent)


def test_an_error_of_one_choice_is_the_requests_error_and_cancels_the_others():
    from batchlm.frontend.triton_client import TritonFailure

    class Failing(FakeBackend):
        def stream(self, info, inputs, request_id):
            stream = super().stream(info, inputs, request_id)
            if len(self.sent) == 2:
                async def fail():
                    raise TritonFailure(None, "continuous_batching is overloaded: 1 requests already waiting")
                stream.__anext__ = fail
            self.streams.append(stream)
            return stream

    backend = Failing(said)
    backend.streams = []
    status, content = post(backend, "/v1/completions", {"model": "continuous_batching", "prompt": "x", "n": 2,
                                                         "stream": True})
    assert status == 429 and json.loads(content)["error"]["code"] == "overloaded"
    assert backend.streams[0].cancelled


# -- tokenizer routes --------------------------------------------------------------------------------

def test_tokenizer_info_names_the_special_tokens_and_the_chat_template():
    status, content = request(FakeBackend(said), "GET", "/tokenizer_info")
    info = json.loads(content)
    assert status == 200 and (info["bos_token"], info["eos_token"]) == ("<s>", "</s>")
    assert "add_generation_prompt" in info["chat_template"] and info["model_max_length"] == 1024
    assert "pad_token" in info


def test_tokenizer_info_of_a_gguf_checkpoint():
    from batchlm.paths import PROJECT_ROOT

    gguf = PROJECT_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        pytest.skip("the default GGUF model is not downloaded (make setup)")
    status, content = request(FakeBackend(said, model_dir=gguf), "GET", "/tokenizer_info")
    info = json.loads(content)
    assert status == 200 and info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]


def test_tokenize_and_detokenize_without_a_model_use_the_shared_checkpoint():
    backend = FakeBackend(said)
    status, content = post(backend, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False})
    tokens = json.loads(content)["tokens"]
    assert status == 200 and tokens == TOKENIZER.encode("Hello there")[1:]
    status, content = post(backend, "/detokenize", {"tokens": tokens})
    assert status == 200 and json.loads(content) == {"prompt": "Hello there"}


def test_without_a_model_served_models_of_different_checkpoints_are_a_400_naming_model(tmp_path):
    class TwoCheckpoints(FakeBackend):
        async def info(self, model: str) -> ModelInfo:
            info = await super().info(model)
            return info if model == "continuous_batching" else replace(info, model_dir=tmp_path)

    backend = TwoCheckpoints(said)
    status, content = post(backend, "/tokenize", {"prompt": "Hello"})
    assert status == 400 and json.loads(content)["error"]["param"] == "model"
    status, content = post(backend, "/tokenize", {"prompt": "Hello", "model": "continuous_batching"})
    assert status == 200
