"""Paged KV caches as torch tensors: allocation in each layout, FlashAttention views, stride checks.

`KVCache` pairs a `CacheSpec` with the tensors that hold it. Whatever builds one (our allocator or an
engine handing over its own tensors) goes through `KVCache.from_tensors`, which checks shape, dtype,
device and the strides actually observed against the declared layout, so a cache that would be
silently corrupted by our byte math is refused up front.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvconnect.core.errors import LayoutError
from kvconnect.core.plan.layout import CacheSpec, LayoutKind

TORCH_DTYPES = {  # (uint8 is also how an engine's opaque pages are registered)
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


@dataclass(frozen=True)
class KVCache:
    spec: CacheSpec
    regions: tuple[torch.Tensor, ...]  # one per layer, or one for cross_layer

    @classmethod
    def allocate(cls, spec: CacheSpec, device: str | torch.device | None = None) -> KVCache:
        """Zero-filled cache in `spec`'s layout on `device` (default: spec.device)."""
        dev = torch.device(device if device is not None else spec.device)
        if dev.type != spec.device:
            raise LayoutError(f"spec says device {spec.device!r} but allocation asked for {dev}")
        dtype = TORCH_DTYPES[spec.torch_dtype_name]
        regions = tuple(torch.zeros(spec.region_shape(), dtype=dtype, device=dev) for _ in range(spec.num_regions))
        return cls(spec, regions)

    @classmethod
    def from_tensors(cls, spec: CacheSpec, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> KVCache:
        """Wrap existing tensors after checking them against `spec` (shape, dtype, device, strides)."""
        cache = cls(spec, tuple(tensors))
        cache.verify()
        return cache

    def verify(self) -> None:
        spec = self.spec
        if len(self.regions) != spec.num_regions:
            raise LayoutError(f"{spec.kind.value} needs {spec.num_regions} tensors, got {len(self.regions)}")
        want_shape, want_strides = spec.region_shape(), spec.region_strides()
        for i, t in enumerate(self.regions):
            where = f"cache tensor {i}"
            if tuple(t.shape) != want_shape:
                raise LayoutError(f"{where}: shape {tuple(t.shape)} != {want_shape} for {spec.kind.value}")
            if t.dtype != TORCH_DTYPES[spec.torch_dtype_name]:
                raise LayoutError(f"{where}: dtype {t.dtype} != {spec.torch_dtype_name}")
            if t.device.type != spec.device:
                raise LayoutError(f"{where}: device {t.device} != {spec.device}")
            if tuple(t.stride()) != want_strides:
                raise LayoutError(
                    f"{where}: strides {tuple(t.stride())} disagree with {spec.kind.value} "
                    f"(expected {want_strides}); the byte math would corrupt it"
                )

    @property
    def device_id(self) -> int:
        dev = self.regions[0].device
        return dev.index if dev.type == "cuda" and dev.index is not None else 0

    def base_addrs(self) -> list[int]:
        return [int(t.data_ptr()) for t in self.regions]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashAttention paged views of one layer: K and V, each (num_blocks, block_size, H, D).

        For an HND cache these are strided views (tokens and heads swapped back), never copies. An engine's
        opaque pages have none: LayoutError."""
        if self.spec.page:
            raise LayoutError(f"{self.spec.page} pages are the engine's format: kvconnect has no K/V views of them")
        kind = self.spec.kind
        if kind is LayoutKind.BLOCKS_FIRST:
            t = self.regions[layer]
            k, v = t[:, 0], t[:, 1]
        elif kind is LayoutKind.KV_FIRST:
            t = self.regions[layer]
            k, v = t[0], t[1]
        else:
            t = self.regions[0]
            k, v = t[:, layer, 0], t[:, layer, 1]
        if self.spec.token_layout == "HND":
            return k.transpose(1, 2), v.transpose(1, 2)
        return k, v

    def block_bytes(self, block_id: int) -> bytes:
        """Every byte of one block (all layers, K then V), in a layout-independent order (an engine's pages:
        each layer's page as it lies)."""
        if self.spec.page:
            return b"".join(t[block_id].cpu().numpy().tobytes() for t in self.regions)
        parts = []
        for layer in range(self.spec.num_layers):
            k, v = self.kv(layer)
            parts.append(k[block_id].contiguous().view(torch.uint8).cpu().numpy().tobytes())
            parts.append(v[block_id].contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return b"".join(parts)

    def logical(self) -> torch.Tensor:
        """A (num_blocks, num_layers, 2, block_size, H, D) copy, identical for every layout."""
        return torch.stack([torch.stack(self.kv(layer), dim=1) for layer in range(self.spec.num_layers)], dim=1)

    def fill_pattern(self, seed: int) -> None:
        """Fill every byte with a seeded random pattern (tests and the benchmark)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for t in self.regions:
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
