"""The text and bytes of single token ids that the OpenAI frontend's log-probabilities show, read from
a checkpoint's tokenizer with no server."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders
from tokenizers.models import BPE

from batchlm.frontend.token_text import TokenTexts
from batchlm.frontend.tokenize import load_tokenizer
from batchlm.model.tokenizer import Tokenizer
from batchlm.paths import TINY_MODEL_DIR

# The tiny checkpoint's BOS, " world", and " 日本" as byte-level BPE splits it: b" \xe6", b"\x97\xa5\xe6",
# b"\x9c", b"\xac" (each character's bytes over two tokens)
BOS, WORLD, JA = 1, 1844, (677, 948, 253, 108)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("m", TINY_MODEL_DIR)


def test_a_tokens_bytes_are_exact_and_its_text_is_vllms_decode_of_it_alone(tokenizer):
    texts, hf = TokenTexts(tokenizer), tokenizer.hf
    assert [texts.bytes_of(i) for i in JA] == [b" \xe6", b"\x97\xa5\xe6", b"\x9c", b"\xac"]
    assert b"".join(texts.bytes_of(i) for i in JA).decode() == " 日本"
    assert texts.text_of(JA[0]) == " \ufffd" and texts.text_of(WORLD) == " world"
    assert texts.text_of(BOS) == "<s>" and texts.is_special(BOS) and not texts.is_special(WORLD)
    assert all(texts.text_of(i) == hf.decode([i], skip_special_tokens=False) for i in range(hf.get_vocab_size()))


def test_sentencepiece_pieces_give_their_bytes_with_the_space_mark_as_a_space():
    vocab = {"<unk>": 0, "<0xE6>": 1, "\u2581Hi": 2, "there": 3}
    hf = HFTokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    texts = TokenTexts(Tokenizer(hf, add_bos=False, bos_token_id=None, eos_token_ids=frozenset()))
    assert [texts.bytes_of(i) for i in (1, 2, 3)] == [b"\xe6", b" Hi", b"there"]
