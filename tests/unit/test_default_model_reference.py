"""The default model (SmolLM2-135M-Instruct, the Q4_1 GGUF file in models/) in the engine, which keeps the
file's blocks (batchlm/model/quantized.py), against Hugging Face transformers loading the same file (its
own GGUF reader and dequantization, float32, eager attention).

- Greedy tokens: chat-templated prompts of 37 to 300 tokens, 64 new tokens each (EOS ignored, so every
  step is compared), alone and all in one batch: equal, token for token.
- Log-probabilities of a project-written text, every token given the ones before it (the engine decodes
  it token by token over its paged KV cache, the reference runs it whole): within LOGPROB_ATOL, and the
  perplexity within PERPLEXITY_RTOL. Both sum in different orders (fused QKV and gate/up matmuls, other
  attention code), so float32 rounding differs, by ~1e-5 in a log-probability.

Both sides get the same token ids (the engine's tokenizer's): transformers builds this file's tokenizer
without the digit splitting of its `smollm` pre-tokenizer, so its ids differ on numbers, which is its
tokenizer and not the model (the project's tokenizer does as llama.cpp and the model's own tokenizer.json).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from batchlm.bench.peers_served.reference import load_transformers
from batchlm.engine.engine import LLMEngine
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.model.chat_template import load_chat_template
from batchlm.paths import DEFAULT_MODEL
from tests.unit.test_reference_equality import assert_equal_to_reference, hf_greedy
from tests.unit.torch_threads import intra_op_threads

NEW_TOKENS = 64  # tests.unit.test_reference_equality.NEW_TOKENS: its assert_equal_to_reference checks it
QUESTIONS = [
    "What is the capital of France?",
    "Explain in a few sentences why the sea tastes salty.",
    "List five things to pack for a weekend of camping in the mountains.",
    "Summarize the following paragraph in one sentence.\n\n" + " ".join([
        "The library on the corner of our street reopened last week after a long renovation.",
        "It now has a quiet reading room on the top floor, a small cafe near the entrance and a corner",
        "where children can listen to stories every Saturday morning. The old wooden shelves were kept,",
        "but the lights, the heating and the windows are new, and the building finally has a lift.",
        "Many neighbours came to the opening, and the librarians handed out free cards to everyone who",
        "asked. The mayor said the town had waited ten years for this day, and that the library would",
        "stay open later on weekdays so that people who work could visit in the evening.",
    ] * 2),
]
TEXT = ("The river ran slowly through the valley, past fields of wheat and a mill that had not turned "
        "for many years. In the spring the water rose and covered the lower meadows, and the farmers "
        "moved their sheep to the hills until it fell again. Children from the village liked to throw "
        "sticks from the old stone bridge and race to the other side to see which one came out first. "
        "Nobody remembered who had built the bridge, but everyone agreed it was older than the church.")
LOGPROB_ATOL = 1e-3
PERPLEXITY_RTOL = 1e-4
THREADS = 2
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def threads():
    with intra_op_threads(THREADS):
        yield


@pytest.fixture(scope="module")
def reference(threads):
    # NOTE: loaded from the file on disk alone: nothing is looked up or downloaded
    return load_transformers(DEFAULT_MODEL, THREADS)


@pytest.fixture(scope="module")
def engine(threads):
    return LLMEngine(DEFAULT_MODEL, EngineConfig(num_threads=THREADS, max_num_seqs=8))


@pytest.fixture(scope="module")
def prompts(engine):
    template = load_chat_template(DEFAULT_MODEL)
    ids = [engine.tokenizer.encode(template.render([{"role": "user", "content": q}])) for q in QUESTIONS]
    assert [len(p) for p in ids][0] == 37 and len(ids[-1]) >= 300, [len(p) for p in ids]
    return ids


@pytest.fixture(scope="module")
def expected(reference, prompts):
    greedy = [hf_greedy(reference, p, NEW_TOKENS) for p in prompts]
    assert all(len(set(tokens)) >= NEW_TOKENS // 4 for tokens, _ in greedy)  # real text, not a repeated token
    return greedy


def test_the_reference_reads_the_file_as_the_engine_does(reference, engine):
    cfg = engine.model.config
    hf = reference.config
    assert (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
            hf.intermediate_size, hf.vocab_size) == (cfg.num_layers, cfg.hidden_size, cfg.num_heads,
                                                     cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size)
    assert reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()
    # the engine keeps the file's blocks (Q4_1 linears, a Q8_0 embedding shared with lm_head): the
    # reference's float32 table is what they dequantize to
    assert engine.model.linear_backend == "quantized" and engine.model.lm_head.qtype == "Q8_0"
    table = engine.model.embed_tokens(torch.arange(cfg.vocab_size))  # (V, D)
    assert torch.equal(reference.model.embed_tokens.weight, table)


def test_greedy_tokens_alone_equal_transformers(engine, expected, prompts):
    outputs = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert_equal_to_reference(outputs, expected, prompts)


def test_greedy_tokens_in_one_batch_equal_transformers(engine, expected, prompts):
    steps = []
    outputs = engine.generate(prompts, GREEDY, on_step=lambda seqs, tokens: steps.append(seqs))
    assert max(steps) == len(prompts)
    assert_equal_to_reference(outputs, expected, prompts)


def test_the_first_answer_is_the_right_one(engine, prompts):
    """The model's own stop: EOS (`<|im_end|>`) ends the answer, and the answer is right."""
    out = engine.generate([prompts[0]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))[0]
    assert (out.text, out.finish_reason.value) == ("The capital of France is Paris.", "stop")


@torch.inference_mode()
def engine_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, the engine's model over its paged KV cache, a token a step."""
    from batchlm.model.kv_cache import KVCache
    from tests.unit.test_model import Seq, forward

    model = engine.model
    cache = KVCache(model.config, num_blocks=-(-len(ids) // 16), block_size=16, device="cpu", dtype=torch.float32)
    seq = Seq(ids, list(range(cache.num_blocks))[::-1], 16)
    out = []
    for t in range(len(ids) - 1):
        logits = forward(model, cache, [seq.schedule(1)])[0]
        out.append(torch.log_softmax(logits.double(), -1)[ids[t + 1]])
    return torch.stack(out)


@torch.inference_mode()
def reference_logprobs(reference, ids: list[int]) -> torch.Tensor:
    logits = reference(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def test_log_probabilities_and_perplexity_of_a_text_equal_transformers(engine, reference):
    ids = engine.tokenizer.encode(TEXT)
    assert len(ids) > 80
    ours, theirs = engine_logprobs(engine, ids), reference_logprobs(reference, ids)
    diff = (ours - theirs).abs()
    print(f"{len(ids) - 1} tokens: max |dlogprob| {diff.max():.2e}, mean {diff.mean():.2e}")
    assert diff.max() <= LOGPROB_ATOL, (diff.max().item(), int(diff.argmax()))
    ppl_ours, ppl_theirs = math.exp(-ours.mean()), math.exp(-theirs.mean())
    print(f"perplexity {ppl_ours:.4f} vs transformers {ppl_theirs:.4f}")
    assert ppl_ours == pytest.approx(ppl_theirs, rel=PERPLEXITY_RTOL)
    assert ppl_ours < 100  # a real model reads real text: random weights give thousands


@torch.inference_mode()
def test_returned_log_probabilities_equal_transformers(engine, reference):
    """What a request with `prompt_logprobs` and `logprobs` gets back: every prompt token after the first
    and every generated one, with its 5 most likely alternatives, scored as transformers scores them."""
    ids = engine.tokenizer.encode(TEXT)
    out = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                logprobs=5, prompt_logprobs=5))[0]
    scored = out.prompt_logprobs + out.logprobs
    full = ids + out.token_ids
    assert [t.token_id for t in scored] == full[1:]
    theirs = torch.log_softmax(reference(input_ids=torch.tensor([full])).logits[0, :-1].double(), -1)  # (n-1, V)
    worst = 0.0
    for position, token in enumerate(scored):
        worst = max(worst, abs(token.logprob - theirs[position, token.token_id].item()),
                    *(abs(p - theirs[position, i].item()) for i, p in token.top))
        top2 = theirs[position].topk(2).values
        if top2[0] - top2[1] > 2 * LOGPROB_ATOL:  # no near-tie: the most likely token is the same one
            assert token.top[0][0] == int(theirs[position].argmax()), position
    print(f"{len(scored)} tokens, 5 alternatives each: max |dlogprob| {worst:.2e}")
    assert worst <= LOGPROB_ATOL


def test_a_json_schema_request_gets_an_object_that_validates(engine):
    """Guided decoding on the real model: the answer parses and has what the schema requires, and its
    values come from the question (the model still chooses them, within the guide)."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    prompt = load_chat_template(DEFAULT_MODEL).render([{"role": "user", "content": (
        "Give me a JSON object describing a person named Ada who is 36 years old.")}])
    out = engine.generate([prompt], SamplingParams(max_tokens=64, guided_decoding_guide_type="json_schema",
                                                   guided_decoding_guide=json.dumps(schema)))[0]
    assert out.finish_reason.value == "stop"
    assert json.loads(out.text) == {"name": "Ada", "age": 36}
