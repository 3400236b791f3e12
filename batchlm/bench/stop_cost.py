"""What stop strings cost a token: `Sequence.append_token` timed against the length of the stop list.

    batchlm-bench stop-cost [--counts 0,16,1000,100000] [--tokens 200]

Every new token's text is searched for every stop string of its request on the engine thread that all
requests share, which is why a request may carry at most `MAX_STOP_STRINGS`. The lists here are set
past that limit on purpose, to show what it guards against. The detokenizer is a stand-in that gives
each token one short word, so the time is the stop search and the bookkeeping, not a real tokenizer.
"""

from __future__ import annotations

import argparse
import time

from batchlm.engine.sampling import SamplingParams
from batchlm.request_schema import MAX_STOP_STRINGS
from batchlm.engine.sequence import Sequence


class _Words:
    """A detokenizer that turns token id N into the text " wN"."""

    def add(self, token_id: int) -> str:
        return f" w{token_id}"

    def flush(self) -> str:
        return ""


def ms_per_token(count: int, tokens: int) -> float:
    """Mean ms of append_token over `tokens` tokens with `count` stop strings that never match."""
    params = SamplingParams(max_tokens=tokens + 1)
    object.__setattr__(params, "stop", tuple(f"zq{i}x" for i in range(count)))  # NOTE: past the limit
    seq = Sequence("r", [1, 2, 3], params, detokenizer=_Words())
    start = time.perf_counter()
    for t in range(tokens):
        seq.append_token(100 + t)
    return (time.perf_counter() - start) / tokens * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="0,16,1000,100000", help="stop-list lengths, comma-separated")
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    print(f"(a request may carry at most {MAX_STOP_STRINGS} stop strings)")
    for count in (int(c) for c in args.counts.split(",")):
        print(f"{count:>7} stop strings: {ms_per_token(count, args.tokens):.3f} ms a token")


if __name__ == "__main__":
    main()
