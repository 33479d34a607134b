"""Sampling parameters and the per-row sampler (greedy, temperature, top-p) with seeded generators.

Sampling runs on the CPU in float64 from a copy of one row of logits, so a token depends only on that
row and the request's own generator: deterministic given the seed, whatever the batch.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from kvconnect.core.errors import InvalidRequestError

GREEDY_EPS = 1e-5  # temperatures below this sample greedily


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # EOS stops generation unless this is set

    def __post_init__(self) -> None:
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise InvalidRequestError("temperature", f"must be finite and >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InvalidRequestError("top_p", f"must lie in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2**63):
            raise InvalidRequestError("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(type(t) is not int or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def make_generator(self) -> torch.Generator | None:
        """The request's own CPU generator (None for greedy); seeded randomly when `seed` is None."""
        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        return torch.Generator(device="cpu").manual_seed(seed)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """Pick a token from one row of logits (vocab,); return it and its log-probability under the
    model (untempered) distribution."""
    row = logits.detach().to(device="cpu", dtype=torch.float64)
    logprobs = torch.log_softmax(row, dim=-1)
    if params.greedy or generator is None:
        token = int(torch.argmax(row).item())
        return token, float(logprobs[token].item())
    probs = torch.softmax(row / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_probs = torch.where(before < params.top_p, sorted_probs, torch.zeros_like(sorted_probs))
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    token = int(torch.multinomial(probs, 1, generator=generator).item())
    return token, float(logprobs[token].item())
