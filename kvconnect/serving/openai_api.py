"""OpenAI request bodies and responses (completions and chat), as typed structs and plain builders.

Parsing is strict about types and names the offending field; unknown fields are ignored, as OpenAI
clients send many. `kv_transfer_params` is kept raw here and validated by `protocol.py`.
"""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec

from kvconnect.core.errors import InvalidRequestError

DEFAULT_MAX_TOKENS = 16
_PATH = re.compile(r"at `\$\.?([^`]*)`")


class Message(msgspec.Struct):
    role: str
    content: str


class GenerateBody(msgspec.Struct):
    """The union of /v1/completions and /v1/chat/completions fields we honour."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[Message] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 0.0  # greedy unless asked (the demo model has no generation config)
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stream: bool = False
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM extension: include token ids in each choice
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def limit(self) -> int:
        value = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return DEFAULT_MAX_TOKENS if value is None else value


def parse_body(raw: bytes, chat: bool) -> GenerateBody:
    try:
        body = msgspec.json.decode(raw, type=GenerateBody)
    except msgspec.ValidationError as e:
        m = _PATH.search(str(e))
        raise InvalidRequestError(m.group(1) if m and m.group(1) else "body", str(e).split(" - at ")[0]) from e
    except msgspec.DecodeError as e:
        raise InvalidRequestError("body", f"not valid JSON: {e}") from e
    except RecursionError as e:
        raise InvalidRequestError("body", "JSON nested too deeply") from e
    if chat and not body.messages:
        raise InvalidRequestError("messages", "required and non-empty for chat completions")
    if not chat and (body.prompt is None or body.prompt == "" or body.prompt == []):
        raise InvalidRequestError("prompt", "required and non-empty")
    if body.n != 1:
        raise InvalidRequestError("n", "only n=1 is supported")
    if body.limit < 1:
        raise InvalidRequestError("max_tokens", f"must be >= 1, got {body.limit}")
    return body


def _choice(
    text: str, token_ids: list[int], finish: str | None, with_ids: bool, chat_part: dict[str, Any] | None
) -> dict[str, Any]:
    """One choice: chat answers carry `chat_part` (message or delta), completions carry `text`."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    choice.update(chat_part if chat_part is not None else {"text": text})
    if with_ids:
        choice["token_ids"] = token_ids
    return choice


def completion_response(
    request_id: str,
    model: str,
    text: str,
    token_ids: list[int],
    finish: str | None,
    num_prompt: int,
    chat: bool,
    kv_transfer_params: dict[str, Any] | None,
    with_ids: bool,
) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    choice = _choice(text, token_ids, finish, with_ids, {"message": message} if chat else None)
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": num_prompt,
            "completion_tokens": len(token_ids),
            "total_tokens": num_prompt + len(token_ids),
        },
        "kv_transfer_params": kv_transfer_params,
    }


def stream_chunk(
    request_id: str,
    model: str,
    text: str,
    token_ids: list[int],
    finish: str | None,
    chat: bool,
    with_ids: bool,
    first: bool = False,
) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
    choice = _choice(text, token_ids, finish, with_ids, {"delta": delta} if chat else None)
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def error_body(status: int, message: str, field: str | None = None, kind: str = "") -> dict[str, Any]:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": field, "code": status}}
