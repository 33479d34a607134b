"""The demo model: a Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP)
with deterministic seeded weights, computing over the paged KV cache.

Batch invariance: an op whose result could depend on how many rows share one kernel call (matmuls,
reductions, transcendental activations, attention) runs once per sequence of the packed batch, on
64-byte-aligned inputs; only exact element-wise ops (gathers, adds, multiplies, cache writes) run over
the whole batch. A sequence's logits are therefore bit-identical whatever else is in its step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvconnect.core.cache import KVCache
from kvconnect.core.errors import LayoutError
from kvconnect.engine.attention import PagedBatch, aligned, paged_attention, write_kv
from kvconnect.engine.config import ModelConfig


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # (hidden,)
    wqkv: torch.Tensor  # ((H_q + 2 H_kv) * D, hidden)
    wo: torch.Tensor  # (hidden, H_q * D)
    mlp_norm: torch.Tensor  # (hidden,)
    w_gate_up: torch.Tensor  # (2 * intermediate, hidden)
    w_down: torch.Tensor  # (hidden, intermediate)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope_tables(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (max_position, head_dim / 2) each, computed in float64 once."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / config.head_dim)
    angles = torch.outer(torch.arange(config.max_position, dtype=torch.float64), inv_freq)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (T, H, D) with per-row cos/sin (T, D/2): only exact multiplies and adds."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def per_sequence(
    segments: list[tuple[int, int]], fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any
) -> torch.Tensor:
    """`fn(rows, *args)` for each sequence's rows separately, concatenated back in order."""
    outs = [fn(aligned(x[start:end]), *args) for start, end in segments]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        flash_kernel: Callable[..., Any] | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.flash_kernel = flash_kernel
        self.scale = 1.0 / math.sqrt(config.head_dim)
        gen = torch.Generator(device="cpu").manual_seed(config.seed)
        c = config

        def normal(*shape: int, std: float) -> torch.Tensor:
            w = torch.randn(shape, generator=gen, dtype=torch.float32) * std
            return w.to(device=self.device, dtype=dtype)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=self.device, dtype=dtype)

        qkv_out = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.embed = normal(c.vocab_size, c.hidden_size, std=1.0)
        self.layers = [
            LayerWeights(
                attn_norm=ones(c.hidden_size),
                wqkv=normal(qkv_out, c.hidden_size, std=c.hidden_size**-0.5),
                wo=normal(c.hidden_size, c.num_heads * c.head_dim, std=(c.num_heads * c.head_dim) ** -0.5),
                mlp_norm=ones(c.hidden_size),
                w_gate_up=normal(2 * c.intermediate_size, c.hidden_size, std=c.hidden_size**-0.5),
                w_down=normal(c.hidden_size, c.intermediate_size, std=c.intermediate_size**-0.5),
            )
            for _ in range(c.num_layers)
        ]
        self.final_norm = ones(c.hidden_size)
        self.lm_head = normal(c.vocab_size, c.hidden_size, std=c.hidden_size**-0.5)
        self.cos, self.sin = rope_tables(c, self.device, dtype)

    def check_cache(self, cache: KVCache) -> None:
        spec, c = cache.spec, self.config
        if (spec.num_layers, spec.num_kv_heads, spec.head_dim) != (c.num_layers, c.num_kv_heads, c.head_dim):
            raise LayoutError(
                f"cache (layers={spec.num_layers}, kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}) "
                f"does not fit the model ({c.num_layers}, {c.num_kv_heads}, {c.head_dim})"
            )

    # --- per-sequence pieces --------------------------------------------------------------------------

    def _attn_in(self, x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        return F.linear(rms_norm(x, lw.attn_norm, self.config.rms_norm_eps), lw.wqkv)

    def _mlp(self, x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        gate, up = F.linear(rms_norm(x, lw.mlp_norm, self.config.rms_norm_eps), lw.w_gate_up).chunk(2, dim=-1)
        return F.linear(aligned(F.silu(gate) * up), lw.w_down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x, self.final_norm, self.config.rms_norm_eps), self.lm_head).float()

    # --- forward ----------------------------------------------------------------------------------------

    def forward(self, batch: PagedBatch, cache: KVCache, *, compute_logits: bool = True) -> torch.Tensor | None:
        """Run the batch's new tokens, writing their K/V into `cache`; return float32 logits of each
        sequence's last token, (num_seqs, vocab), or None when `compute_logits` is False (a prefill)."""
        c = self.config
        segments = batch.segments
        num_tokens = batch.num_tokens
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q_shape = (num_tokens, c.num_heads, c.head_dim)
        kv_shape = (num_tokens, c.num_kv_heads, c.head_dim)
        x = self.embed[batch.input_ids]
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        for i, lw in enumerate(self.layers):
            qkv = per_sequence(segments, self._attn_in, x, lw)
            q = apply_rope(qkv[:, :q_dim].reshape(q_shape), cos, sin)
            k = apply_rope(qkv[:, q_dim : q_dim + kv_dim].reshape(kv_shape), cos, sin)
            v = qkv[:, q_dim + kv_dim :].reshape(kv_shape)
            k_cache, v_cache = cache.kv(i)
            write_kv(k_cache, v_cache, k, v, batch)
            attn = paged_attention(q, k_cache, v_cache, batch, scale=self.scale, flash_kernel=self.flash_kernel)
            x = x + per_sequence(segments, F.linear, attn.reshape(num_tokens, q_dim), lw.wo)
            x = x + per_sequence(segments, self._mlp, x, lw)
        if not compute_logits:
            return None
        last = x[batch.last_rows]
        return per_sequence([(r, r + 1) for r in range(last.shape[0])], self._logits, last)
