"""Byte-level tokenizer of the demo engine: UTF-8 bytes are ids 0-255, then BOS and EOS.

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
VOCAB_SIZE = 258

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
            elif not skip_special:
                parts.append(raw.decode("utf-8", errors="replace"))
                raw.clear()
                parts.append("<bos>" if t == BOS_ID else "<eos>")
        parts.append(raw.decode("utf-8", errors="replace"))
        return "".join(parts)

    def is_special(self, token_id: int) -> bool:
        return token_id >= BYTE_VOCAB_SIZE

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
