"""Tokenizer round trips and IncrementalDetokenizer streaming, on the default checkpoint's tokenizer."""

import json
import shutil

import pytest

from batchlm.model.checkpoint import write_default_checkpoint
from batchlm.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["The quick brown fox, said Alice.", "héllo wörld 日本語 🙂",
         "naïve café — Привет мир! 你好，世界 🚀🚀", "  leading spaces and\nnew lines\t tabs  "]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_default_checkpoint(tmp_path_factory.mktemp("tok"), seed=0, hidden_size=32,
                                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=16, intermediate_size=64)


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


def byte_token_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One token per byte (GPT-2 byte-to-unicode alphabet), to split a character across tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [tok.hf.token_to_id(mapping[b]) for b in data]


def test_special_ids_and_vocab(tok):
    assert tok.vocab_size == 8192 and tok.bos_token_id == 1 and tok.eos_token_ids == frozenset({2})
    assert [tok.hf.token_to_id(t) for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert tok.decode(ids) == text  # decode skips the BOS


def test_english_like_text_compresses(tok):
    text = "The water was cold and the people said that the mountain was far."
    assert len(tok.encode(text)) < len(text.split()) + 4  # common words are whole tokens


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_never_emits_broken_characters(tok, text):
    prompt = tok.encode("Once upon a time")
    ids = tok.encode(text)[1:]
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == detok.text == tok.decode(ids)


def test_a_character_split_over_byte_tokens_is_held_back_until_complete(tok):
    ids = byte_token_ids(tok, "a日🙂".encode())
    assert None not in ids and len(ids) == 8
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id])
    pieces = [detok.add(i) for i in ids]
    assert pieces == ["a", "", "", "日", "", "", "", "🙂"]
    assert detok.flush() == "" and detok.text == "a日🙂"


def test_invalid_bytes_are_not_held_forever(tok):
    detok = IncrementalDetokenizer(tok, [])
    lone = byte_token_ids(tok, b"\x80")[0]  # a continuation byte with no lead byte: never valid
    pieces = [detok.add(lone) for _ in range(12)] + [detok.flush()]
    assert "".join(pieces) == detok.text == tok.decode([lone] * 12)
    assert any(pieces[:12])
    long = IncrementalDetokenizer(tok, [])
    pieces = [long.add(lone) for _ in range(70)]  # at the bound on held tokens all of it goes out
    assert "".join(pieces) == tok.decode([lone] * 64)
    assert "".join(pieces) + long.flush() == long.text == tok.decode([lone] * 70)


@pytest.mark.parametrize("before", [b"\x80", b"\x80\x80\x80", b"\xc3"])
def test_a_character_split_after_invalid_bytes_comes_out_whole(tok, before):
    # Were the invalid bytes counted toward the held tokens, the split emoji would go out as U+FFFD when
    # its third byte came, and its last byte would then add no text, so the emoji would be lost: "\ufffd\ufffdx".
    ids = byte_token_ids(tok, before + "😀".encode()) + tok.encode("x")[1:]
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id])
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == detok.text == tok.decode(ids)
    assert detok.text.endswith("😀x") and "😀" in "".join(pieces)


def test_bos_follows_the_post_processor_when_config_is_silent(model_dir, tmp_path):
    plain = shutil.copytree(model_dir, tmp_path / "plain")
    (plain / "tokenizer_config.json").write_text("{}")
    assert Tokenizer.from_dir(plain).encode("hi")[0] == 1  # TemplateProcessing adds <s>
    spec = json.loads((plain / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (plain / "tokenizer.json").write_text(json.dumps(spec))
    assert 1 not in Tokenizer.from_dir(plain).encode("hi")


def test_eos_ids_merge_config_and_generation_config(model_dir, tmp_path):
    d = shutil.copytree(model_dir, tmp_path / "eos")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert Tokenizer.from_dir(d).eos_token_ids == frozenset({2, 5})


def test_max_bytes_per_token_bounds_the_token_count_from_below(tok):
    """No text has fewer tokens than its bytes over `max_bytes_per_token`: the bound the engine refuses
    a far too long prompt by, before tokenizing it. Checked on the tokens' own texts repeated (the
    longest tokens, the worst case) and on mixed scripts."""
    per_token = tok.max_bytes_per_token
    assert per_token is not None and per_token > 1
    longest = sorted(range(tok.vocab_size), key=lambda i: -len(tok.hf.decode([i], skip_special_tokens=False).encode()))
    texts = [*TEXTS, "".join(tok.hf.decode([i], skip_special_tokens=False) for i in longest[:200]) * 5]
    for text in texts:
        ids = tok.encode(text)[1 if tok.add_bos else 0:]
        assert len(ids) >= len(text.encode()) / per_token, text[:80]
        assert ids == tok.hf.encode(text, add_special_tokens=False).ids  # encode_batch gives encode's ids
