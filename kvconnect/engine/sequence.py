"""One request inside the engine: its states, its tokens and blocks, and the events it reports.

`TokenEvent` is what `on_event` receives: one per generated token (`token_id` set, `finish_reason`
None), then exactly one final event (`token_id` None, `finish_reason` set, `error` set on "error").
A token that hits a stop id ends the request with "stop" and is not reported as a token event (it is
counted in `num_output_tokens`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvconnect.engine.hooks import KVKeeper, KVLoader, KVLoadHandle
from kvconnect.engine.sampling import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued for blocks
    LOADING = "loading"  # blocks allocated, a KVLoader is filling them
    PREFILL = "prefill"  # needs prompt tokens [0, n-1) computed
    DECODE = "decode"  # one token per step
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int | None  # None on the final event
    logprob: float | None = None  # of token_id under the model distribution
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # tokens sampled so far, this one included

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    on_event: Callable[[TokenEvent], None]
    kv_loader: KVLoader | None
    kv_keeper: KVKeeper | None
    max_new_tokens: int  # sampling.max_tokens clipped to the model's max_position
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    load_handle: KVLoadHandle | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def token_at(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    def num_blocks_needed(self, block_size: int) -> int:
        """Blocks for every token whose K/V may be written: the prompt and all but the last output."""
        return -(-(self.num_prompt_tokens + self.max_new_tokens - 1) // block_size)

    def prompt_block_ids(self, block_size: int) -> list[int]:
        return self.block_ids[: -(-self.num_prompt_tokens // block_size)]
