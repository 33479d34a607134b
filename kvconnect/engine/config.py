"""Typed settings of the demo engine: the model's shape and the engine's cache and scheduling knobs.

Pure data with validation (`ConfigError` names the field); nothing here reads the environment — the
package-level `kvconnect/config.py` owns `KVCONNECT_*` and may build these from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvconnect.core.errors import ConfigError
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.engine.tokenizer import VOCAB_SIZE

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the Llama-architecture demo model; `seed` fixes every weight."""

    vocab_size: int = VOCAB_SIZE  # 256 bytes + BOS + EOS + 256 words
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 768
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if type(self.vocab_size) is not int or self.vocab_size < VOCAB_SIZE:
            raise ConfigError(f"model.vocab_size must be >= {VOCAB_SIZE}, got {self.vocab_size!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ConfigError("model.rope_theta and model.rms_norm_eps must be positive")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's model, paged-cache layout and scheduling limits."""

    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutKind = LayoutKind.BLOCKS_FIRST
    block_size: int = 16
    num_blocks: int = 512
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    kv_cache_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype of activations and weights
    max_num_seqs: int = 64  # admitted (loading, prefilling or decoding) requests at once
    attention_backend: str = "auto"  # "auto", "reference" or "flash_attn"
    load_poll_interval_s: float = 0.0005  # idle wait between KVLoader polls

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "layout", LayoutKind(self.layout))
        except ValueError as e:
            kinds = [k.value for k in LayoutKind]
            raise ConfigError(f"layout must be one of {kinds}, got {self.layout!r}") from e
        for name in ("block_size", "num_blocks", "max_num_seqs"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("kv_cache_dtype", "dtype"):
            if getattr(self, name) not in FLOAT_DTYPES:
                raise ConfigError(f"{name} must be one of {FLOAT_DTYPES}, got {getattr(self, name)!r}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"device {self.device!r} is not a torch device") from e
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        if self.attention_backend not in ("auto", "reference", "flash_attn"):
            raise ConfigError(
                f"attention_backend must be auto, reference or flash_attn, got {self.attention_backend!r}"
            )
        if not self.load_poll_interval_s > 0:
            raise ConfigError(f"load_poll_interval_s must be positive, got {self.load_poll_interval_s!r}")

    @property
    def device_kind(self) -> str:
        return torch.device(self.device).type

    def cache_spec(self) -> CacheSpec:
        """The CacheSpec of this engine's paged KV cache (what the handshake publishes)."""
        m = self.model
        return CacheSpec(
            kind=self.layout,
            dtype=self.kv_cache_dtype,
            num_layers=m.num_layers,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            device=self.device_kind,
        )
