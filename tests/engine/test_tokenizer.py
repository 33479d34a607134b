"""Byte tokenizer: round trips, specials, streaming decode, chat template."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconnect.core.errors import InvalidRequestError
from kvconnect.engine import BOS_ID, EOS_ID, ByteTokenizer, ChatMessage
from kvconnect.engine.tokenizer import GENERATED_FIRST, VOCAB_SIZE, WORD_BASE, WORDS

tok = ByteTokenizer()


@given(st.text())
def test_round_trip(text: str) -> None:
    ids = tok.encode(text)
    assert ids[0] == BOS_ID
    assert all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_multibyte_characters_are_several_tokens() -> None:
    assert tok.encode("é€😀", add_bos=False) == list("é€😀".encode())
    assert len(tok.encode("😀", add_bos=False)) == 4


def test_specials_skipped_or_shown() -> None:
    ids = [BOS_ID, *tok.encode("hi", add_bos=False), EOS_ID]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special=False) == "<bos>hi<eos>"
    assert tok.is_special(EOS_ID) and not tok.is_special(ord("a"))
    assert tok.vocab_size == 258 + 256


def test_generated_words_decode_as_words_whole_and_streamed() -> None:
    """What the engine generates (EOS and the words) reads as text; bytes before a word end cleanly."""
    ids = [*tok.encode("hi", add_bos=False), WORD_BASE, WORD_BASE + len(WORDS) - 1, EOS_ID]
    assert tok.decode(ids) == f"hi {WORDS[0]} {WORDS[-1]}"
    dec = tok.incremental_decoder()
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == tok.decode(ids)
    assert not tok.is_special(WORD_BASE) and GENERATED_FIRST == EOS_ID and len(set(WORDS)) == len(WORDS)


def test_out_of_range_ids_are_refused() -> None:
    with pytest.raises(InvalidRequestError):
        tok.decode([VOCAB_SIZE])
    with pytest.raises(InvalidRequestError):
        tok.incremental_decoder().feed(-1)


@given(st.text())
def test_incremental_decode_matches_decode(text: str) -> None:
    dec = tok.incremental_decoder()
    ids = [*tok.encode(text), EOS_ID]
    pieces = [dec.feed(i) for i in ids]
    assert "".join(pieces) + dec.flush() == text


def test_incremental_decoder_waits_for_whole_characters() -> None:
    dec = tok.incremental_decoder()
    raw = "€".encode()
    assert [dec.feed(b) for b in raw] == ["", "", "€"]
    dec.feed(raw[0])
    assert dec.flush() == "\ufffd"


def test_invalid_utf8_is_replaced() -> None:
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"


def test_chat_template() -> None:
    messages: list[ChatMessage | dict[str, str]] = [
        ChatMessage("system", "Be brief."),
        {"role": "user", "content": "Hi"},
    ]
    assert tok.apply_chat_template(messages) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|user|>\nHi\n")


@pytest.mark.parametrize(
    "messages, field",
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": "ok"}, {"role": "user", "content": 3}], "messages[1].content"),
    ],
)
def test_chat_template_rejects_bad_messages(messages: list, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template(messages)
    assert info.value.field == field
