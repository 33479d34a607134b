"""Tokenizer of the demo engine: UTF-8 bytes are ids 0-255, then BOS and EOS, then 256 English words.

Text is encoded byte by byte (a prompt of n bytes is n tokens after BOS, whatever it says); the words are
what the engine generates (`GENERATED_FIRST`: it samples only EOS and the words), so the output of the
demo's random-weight model reads as words rather than random bytes. A word decodes as a space and the word.

Also owns the minimal chat template that turns an OpenAI `messages` list into a prompt string, and an
incremental decoder for streaming (a multi-byte character may arrive over several tokens).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvconnect.core.errors import InvalidRequestError

BYTE_VOCAB_SIZE = 256
BOS_ID = 256
EOS_ID = 257
WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "an",
    "be",
    "it",
    "are",
    "this",
    "which",
    "or",
    "had",
    "not",
    "but",
    "they",
    "have",
    "one",
    "you",
    "were",
    "their",
    "all",
    "there",
    "she",
    "we",
    "been",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "if",
    "out",
    "up",
    "what",
    "about",
    "into",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "sky",
    "river",
    "stone",
    "light",
    "wind",
    "cloud",
    "tree",
    "leaf",
    "bird",
    "song",
    "road",
    "city",
    "sea",
    "rain",
    "snow",
    "fire",
    "star",
    "moon",
    "sun",
    "garden",
    "field",
    "morning",
    "evening",
    "night",
    "quiet",
    "gentle",
    "bright",
    "green",
    "blue",
    "red",
    "golden",
    "silver",
    "warm",
    "cold",
    "soft",
    "slow",
    "swift",
    "open",
    "small",
    "large",
    "near",
    "far",
    "above",
    "below",
    "across",
    "along",
    "around",
    "beyond",
    "inside",
    "outside",
    "again",
    "always",
    "often",
    "sometimes",
    "together",
    "alone",
    "home",
    "door",
    "window",
    "table",
    "book",
    "letter",
    "story",
    "word",
    "voice",
    "dream",
    "hope",
    "heart",
    "mind",
    "hand",
    "eye",
    "face",
    "name",
    "friend",
    "child",
    "mother",
    "father",
    "house",
    "room",
    "bridge",
    "hill",
    "valley",
    "forest",
    "island",
    "shore",
    "harbor",
    "lamp",
    "candle",
    "paper",
    "music",
    "bell",
    "clock",
    "path",
    "stream",
    "lake",
    "meadow",
    "mountain",
    "winter",
    "summer",
    "spring",
    "autumn",
    "ship",
    "wave",
    "grass",
    "flower",
    "seed",
    "root",
    "branch",
    "shadow",
    "whisper",
    "laughter",
    "silence",
    "journey",
    "promise",
    "memory",
)
WORD_BASE = 258  # the id of WORDS[0]
VOCAB_SIZE = WORD_BASE + len(WORDS)
GENERATED_FIRST = EOS_ID  # the engine generates ids in [GENERATED_FIRST, VOCAB_SIZE): EOS and the words

_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces; incomplete UTF-8 sequences wait for their bytes."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if not 0 <= token_id < VOCAB_SIZE:
            raise InvalidRequestError("token_ids", f"id {token_id} is outside [0, {VOCAB_SIZE})")
        if token_id >= WORD_BASE:
            return self._utf8.decode(b"", final=True) + " " + WORDS[token_id - WORD_BASE]
        if token_id >= BYTE_VOCAB_SIZE:
            return ""
        return self._utf8.decode(bytes((token_id,)))

    def flush(self) -> str:
        """Whatever is still buffered (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


class ByteTokenizer:
    bos_id = BOS_ID
    eos_id = EOS_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, token_ids: Iterable[int], *, skip_special: bool = True) -> str:
        raw = bytearray()
        parts: list[str] = []
        for t in token_ids:
            if not 0 <= t < VOCAB_SIZE:
                raise InvalidRequestError("token_ids", f"id {t} is outside [0, {VOCAB_SIZE})")
            if t < BYTE_VOCAB_SIZE:
                raw.append(t)
            elif t >= WORD_BASE:
                raw.extend(b" " + WORDS[t - WORD_BASE].encode())
            elif not skip_special:
                parts.append(raw.decode("utf-8", errors="replace"))
                raw.clear()
                parts.append("<bos>" if t == BOS_ID else "<eos>")
        parts.append(raw.decode("utf-8", errors="replace"))
        return "".join(parts)

    def is_special(self, token_id: int) -> bool:
        return BYTE_VOCAB_SIZE <= token_id < WORD_BASE

    def incremental_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder()

    def apply_chat_template(
        self, messages: Sequence[ChatMessage | Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """`<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n` for the reply."""
        if not messages:
            raise InvalidRequestError("messages", "must contain at least one message")
        lines: list[str] = []
        for i, m in enumerate(messages):
            if isinstance(m, ChatMessage):
                role, content = m.role, m.content
            else:
                role, content = m.get("role"), m.get("content")  # type: ignore[assignment]
            if role not in _ROLES:
                raise InvalidRequestError(f"messages[{i}].role", f"must be one of {_ROLES}, got {role!r}")
            if not isinstance(content, str):
                raise InvalidRequestError(f"messages[{i}].content", "must be a string")
            lines.append(f"<|{role}|>\n{content}\n")
        if add_generation_prompt:
            lines.append("<|assistant|>\n")
        return "".join(lines)
