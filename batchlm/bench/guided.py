"""What guided decoding costs: the engine's step with guided requests in the batch and without, and the
two grammar libraries side by side on this tokenizer.

    batchlm-bench guided [--model PATH] [--batch 8] [--tokens 64] [--rounds 3]

1. The engine alone (in process, the default model): a batch of `--batch` requests, greedy, `--tokens`
   tokens each, run with none guided, then half guided, then all guided by a JSON schema that keeps
   them going (an object of `--tokens`-long digit strings), interleaved round by round. Reports the
   median ms per step of each and the ratio to the free batch.
2. The libraries (llguidance, which the engine uses, and xgrammar where `pip install -e '.[grammars]'`
   put it): the tokenizer's set-up, a JSON schema's compile time and the per-step mask time along one
   output of that schema.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from batchlm.paths import DEFAULT_MODEL

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
                                           "address": {"type": "object", "properties": {"city": {"type": "string"}},
                                                       "required": ["city"], "additionalProperties": False}},
          "required": ["name", "age", "tags", "address"], "additionalProperties": False}


def step_ms(engine, prompts: list[str], params: list) -> float:
    steps = []
    engine.generate(prompts, params, on_step=lambda seqs, tokens: steps.append(time.perf_counter()))
    return statistics.median(b - a for a, b in zip(steps, steps[1:])) * 1e3


def engine_cost(model: str, batch: int, tokens: int, rounds: int) -> None:
    from batchlm.engine.engine import LLMEngine
    from batchlm.engine.engine_config import EngineConfig
    from batchlm.engine.sampling import SamplingParams

    engine = LLMEngine(model, EngineConfig(num_threads=2, max_num_seqs=batch))
    long = json.dumps({"type": "object", "properties": {"d": {"type": "string", "pattern": f"^[0-9]{{{tokens * 2}}}$"}},
                       "required": ["d"]})
    free = SamplingParams(max_tokens=tokens, ignore_eos=True)
    held = SamplingParams(max_tokens=tokens, ignore_eos=True, guided_decoding_guide_type="json_schema",
                          guided_decoding_guide=long)
    prompts = [f"Request {i}: write down a long number." for i in range(batch)]
    mixes = {"none guided": [free] * batch, "half guided": [held, free] * (batch // 2) + [free] * (batch % 2),
             "all guided": [held] * batch}
    engine.generate(prompts[:1], [held])  # the llguidance tokenizer is built by the first guided request
    times = {name: [] for name in mixes}
    for _ in range(rounds):
        for name, params in mixes.items():
            times[name].append(step_ms(engine, prompts, params))
    base = statistics.median(times["none guided"])
    print(f"engine step, {batch} requests x {tokens} tokens, median of {rounds} rounds:")
    for name, values in times.items():
        ms = statistics.median(values)
        print(f"  {name:>12}: {ms:7.2f} ms a step  ({ms / base:.3f}x the free batch)")


def library_cost(model: str) -> None:
    import random

    from batchlm.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    schema = json.dumps(SCHEMA)
    vocab, eos = tok.vocab_size, sorted(tok.eos_token_ids)
    import llguidance

    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.hf.to_str(), n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("json_schema", schema), log_level=0)
    compile_s = time.perf_counter() - start
    report("llguidance", setup, compile_s, _walk(matcher.compute_bitmask, matcher.consume_token,
                                                  matcher.is_stopped, vocab, random.Random(0)))
    try:
        import transformers
        import xgrammar
    except ImportError:
        print("xgrammar: not installed (pip install -e '.[grammars]'); skipped")
        return
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf, eos_token=tok.hf.id_to_token(eos[0]))
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(fast, vocab_size=vocab)
    setup = time.perf_counter() - start
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(schema)
    compile_s = time.perf_counter() - start
    xm = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, vocab)

    def fill() -> bytes:
        xm.fill_next_token_bitmask(mask)
        return mask.numpy().tobytes()

    report("xgrammar", setup, compile_s, _walk(fill, xm.accept_token, xm.is_terminated, vocab, random.Random(0)))


def _walk(mask, take, done, vocab: int, rng) -> list[float]:
    """Seconds of each mask along one output: a random allowed token each step, short tokens first."""
    import numpy as np

    times = []
    for _ in range(200):
        if done():
            break
        start = time.perf_counter()
        bits = mask()
        times.append(time.perf_counter() - start)
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(bits, np.uint8), bitorder="little")[:vocab])
        take(int(rng.choice(allowed[:50])))
    return times


def report(name: str, setup: float, compile_s: float, masks: list[float]) -> None:
    print(f"{name}: tokenizer set-up {setup * 1e3:.0f} ms, schema compile {compile_s * 1e3:.1f} ms, mask "
          f"p50 {statistics.median(masks) * 1e6:.0f} us, max {max(masks) * 1e6:.0f} us over {len(masks)} steps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    library_cost(args.model)
    engine_cost(args.model, args.batch, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
