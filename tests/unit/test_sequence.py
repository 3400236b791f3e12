"""Sequence: counters, finish reasons, and stop strings that span tokens (with a fake detokenizer)."""

from batchlm.engine.sampling import SamplingParams
from batchlm.engine.sequence import FinishReason, Sequence, SequenceStatus

EOS = 0
PIECES = {1: "he", 2: "ll", 3: "o wo", 4: "rld", 5: "!", 6: "nder", 7: " "}


class FakeDetokenizer:
    """Token id -> fixed text piece; nothing held back."""

    def add(self, token_id: int) -> str:
        return PIECES[token_id]

    def flush(self) -> str:
        return ""


def make(max_tokens=16, stop=(), ignore_eos=False) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos)
    return Sequence("r", [5, 5, 5], params, frozenset({EOS}), FakeDetokenizer())


def feed(seq: Sequence, tokens: list[int]) -> list[str]:
    """Append tokens one by one; returns the text handed out after each one."""
    pieces = []
    for t in tokens:
        assert not seq.is_finished
        seq.append_token(t)
        pieces.append(seq.take_new_text())
    return pieces


def test_counters_and_token_slices():
    seq = make()
    assert (seq.num_prompt_tokens, seq.num_output_tokens, seq.num_tokens) == (3, 0, 3)
    assert seq.status is SequenceStatus.WAITING and not seq.is_prefill_done
    seq.num_computed_tokens = 3
    seq.append_token(1)
    assert seq.is_prefill_done and seq.num_uncomputed_tokens == 1
    assert seq.token_ids(2, 4) == [5, 1] and seq.token_ids(3, 4) == [1] and seq.token_ids(0, 2) == [5, 5]


def test_max_tokens_gives_length():
    seq = make(max_tokens=3)
    feed(seq, [1, 2, 7])
    assert seq.is_finished and seq.finish_reason is FinishReason.LENGTH
    assert seq.text == "hell " and seq.num_output_tokens == 3


def test_eos_gives_stop_without_its_text_unless_ignored():
    seq = make()
    feed(seq, [1, EOS])
    assert seq.finish_reason is FinishReason.STOP and seq.output_ids == [1, EOS]
    PIECES[EOS] = "<eos>"
    try:
        seq = make(max_tokens=3, ignore_eos=True)
        feed(seq, [1, EOS, EOS])
        assert seq.finish_reason is FinishReason.LENGTH and seq.text == "he<eos><eos>"
    finally:
        del PIECES[EOS]


def test_stop_string_across_tokens_truncates_and_never_leaks():
    seq = make(stop=("world",))
    pieces = feed(seq, [1, 2, 3, 4, 5][:4])  # "he" "ll" "o wo" "rld" -> "hello world"
    assert seq.finish_reason is FinishReason.STOP
    assert seq.text == "hello "
    assert "".join(pieces) == "hello "
    assert all("w" not in p for p in pieces[:3])  # "wo" was held back until it could be judged


def test_held_back_text_is_released_when_stop_does_not_complete():
    seq = make(stop=("world",))
    pieces = feed(seq, [1, 2, 3, 6])  # "hello wonder"
    assert not seq.is_finished
    assert "".join(pieces) == "hello wonder"[: len("hello wonder") - 4]
    seq.finish(FinishReason.LENGTH)
    assert "".join(pieces) + seq.take_new_text() == "hello wonder"


def test_earliest_of_several_stop_strings_wins():
    seq = make(stop=("rld", "o w"))
    feed(seq, [1, 2, 3])
    assert seq.text == "hell" and seq.finish_reason is FinishReason.STOP


def test_token_ids_are_handed_out_once():
    seq = make()
    seq.append_token(1)
    seq.append_token(2)
    assert seq.take_new_tokens() == ([1, 2], None)
    assert seq.take_new_tokens() == ([], None)


def test_a_stop_string_before_min_tokens_does_not_end_the_text():
    params = SamplingParams(max_tokens=16, stop=("o",), min_tokens=4)
    seq = Sequence("r", [5, 5, 5], params, frozenset({EOS}), FakeDetokenizer())
    feed(seq, [1, 2, 3])  # "hello wo": two "o"s, both before the 4th token
    assert not seq.is_finished
    seq.append_token(6)  # "nder": the 4th token; the stop string must come after it
    assert not seq.is_finished
    seq.append_token(3)  # "o wo"
    assert seq.is_finished and seq.finish_reason is FinishReason.STOP and seq.text == "hello wonder"
