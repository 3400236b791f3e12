"""The engine's greedy tokens equal Hugging Face transformers' LlamaForCausalLM's, token for token.

The reference is transformers' own Llama (pinned in the `test` extra; missing, this module fails to
import, it does not skip), loaded from local folders only, run one prompt at a time with no padding:
a plain greedy loop over `model(...)` with its KV cache, taking the argmax of every step's logits, so
no logits processor (min_new_tokens, repetition penalties) touches them and EOS is just another token.
Two checkpoints: the default one, and a small one of another shape written by the project's own writer
(6 query heads over 2 KV heads, tied embeddings, llama3 RoPE scaling). The engine runs each prompt alone
and all prompts in one generate call (their prefills and decodes share forward passes), with its
default backends (the native kernels where they are built) and with torch's.

Exact equality, in float32: the two sum in different orders (fused QKV and gate/up matmuls, other
attention code), so their logits differ, by up to ~6e-5 over these sequences, while the
checkpoints' logits have a std of 4 (LM_HEAD_LOGIT_STD in batchlm/model/checkpoint.py) and the smallest
gap between the reference's top two logits at any step here is ~9e-4; a failure names that gap.
"""

import random

import pytest
import torch
import transformers

from batchlm.engine.engine import LLMEngine
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.engine.sequence import FinishReason
from batchlm.model.checkpoint import SafetensorsCheckpoint, write_default_checkpoint
from batchlm.model.model_config import ModelConfig
from batchlm.paths import TINY_MODEL_DIR
from tests.unit.torch_threads import intra_op_threads

PROMPT_LENGTHS = (5, 37, 120, 300)
NEW_TOKENS = 64
THREADS = 1  # the engine's and the reference's intra-op threads alike
# Another shape than the default's (8 heads over 2 KV heads, untied, no RoPE scaling): GQA 3:1, an
# output matrix that is the embedding, and llama3 scaling whose three bands (kept, blended, slowed) all
# hold some of the 16 frequencies with head_dim 32 and an original length of 256 (< the longest prompt).
OTHER_SHAPE = dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
                   head_dim=32, intermediate_size=512)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256}
BACKENDS = {"default": {}, "torch": dict(attention="torch", linear="onednn", pointwise="torch")}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)  # temperature 0: argmax


@pytest.fixture(scope="module")
def threads():
    with intra_op_threads(THREADS):
        yield


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    """Written once (~1 s): the writer trains a small tokenizer too, which the engine loads."""
    return write_default_checkpoint(tmp_path_factory.mktemp("gqa3_tied_llama3"), seed=5, tie_word_embeddings=True,
                                    rope_scaling=LLAMA3_SCALING, **OTHER_SHAPE)


@pytest.fixture(scope="module", params=["default", "gqa3_tied_llama3"])
def checkpoint(request):
    if request.param == "default":
        return TINY_MODEL_DIR  # written by set-up (`make test` runs it first)
    return request.getfixturevalue("other_checkpoint")


@pytest.fixture(scope="module")
def prompts(checkpoint):
    """Token-id prompts of PROMPT_LENGTHS, BOS first, drawn from the checkpoint's vocabulary."""
    vocab = ModelConfig.from_dir(checkpoint).vocab_size
    rng = random.Random(len(PROMPT_LENGTHS))
    return [[1] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in PROMPT_LENGTHS]


_REFERENCE: dict = {}  # checkpoint -> reference: pytest sets a module fixture up again when the params change


@pytest.fixture(scope="module")
def reference(checkpoint, prompts, threads):
    """transformers' greedy tokens for each prompt alone, and each step's gap between its top two logits."""
    if checkpoint not in _REFERENCE:
        _REFERENCE[checkpoint] = hf_reference(checkpoint, prompts)
    return _REFERENCE[checkpoint]


def hf_reference(checkpoint, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    # NOTE: local_files_only: the folder is the model, nothing is looked up or downloaded
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, local_files_only=True, dtype=torch.float32,
                                                          attn_implementation="eager")
    config = ModelConfig.from_dir(checkpoint)
    # The reference reads the checkpoint as the engine does, or equal tokens would prove less than they seem.
    assert model.model.rotary_emb.rope_type == (dict(config.rope_scaling)["rope_type"] if config.rope_scaling
                                                else "default")
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == config.tie_word_embeddings == ("lm_head.weight" not in SafetensorsCheckpoint(checkpoint))
    greedy = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    # Varied tokens, or equality would prove little (a model that repeats one token for ever agrees easily).
    assert all(len(set(tokens)) >= NEW_TOKENS // 4 for tokens, _ in greedy), [len(set(t)) for t, _ in greedy]
    return greedy


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    tokens, gaps = [], []
    while True:
        top2 = out.logits[0, -1].float().topk(2)
        tokens.append(int(out.logits[0, -1].argmax()))
        gaps.append(float(top2.values[0] - top2.values[1]))
        if len(tokens) == n:
            return tokens, gaps
        out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)


# NOTE: the torch fallbacks in `make test-slow`: make test checks the shipped path (the kernels) and stays
# under its 10 minutes
@pytest.fixture(scope="module", params=["default", pytest.param("torch", marks=pytest.mark.slow)])
def engine(request, checkpoint, threads):
    engine = LLMEngine(checkpoint, EngineConfig(num_threads=THREADS, **BACKENDS[request.param]))
    if request.param == "torch":
        assert engine.model.linear_backend == "onednn" and not engine.model.attention_kernel
    return engine


def assert_equal_to_reference(outputs, reference, prompts):
    for output, (expected, gaps), prompt in zip(outputs, reference, prompts, strict=True):
        got = list(output.token_ids)
        assert len(got) == NEW_TOKENS and output.finish_reason is FinishReason.LENGTH, (len(got), output)
        if got != expected:
            at = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
            pytest.fail(f"{len(prompt)}-token prompt: first difference at new token {at}: engine {got[at]}, "
                        f"transformers {expected[at]} (the reference's top-2 logit gap there: {gaps[at]:.3g})")



def test_each_prompt_alone_equals_transformers(engine, reference, prompts):
    outputs = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert_equal_to_reference(outputs, reference, prompts)


def test_all_prompts_in_one_batch_equal_transformers(engine, reference, prompts):
    steps = []
    outputs = engine.generate(prompts, GREEDY, on_step=lambda seqs, tokens: steps.append(seqs))
    assert max(steps) == len(prompts)  # they did share forward passes
    assert_equal_to_reference(outputs, reference, prompts)
