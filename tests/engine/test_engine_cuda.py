"""The engine on a CUDA device (run on the GPU machine: `pytest -m gpu tests/engine`): batch
invariance, cross-layout loads and 16-bit caches on the device."""

from __future__ import annotations

import pytest
import torch

from kvconnect.core.plan.layout import LayoutKind
from kvconnect.engine import Engine

from .support import CopyLoader, RecordingKeeper, generate, prompt, small_config, submit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_batched_decode_is_bitwise_equal_to_alone() -> None:
    lengths = [7, 16, 17, 40, 3, 25, 12, 33]
    with Engine(small_config(device="cuda")) as e:
        alone = [generate(e, prompt(i, n), 12, f"alone{i}") for i, n in enumerate(lengths)]
    e = Engine(small_config(device="cuda"))
    together = [submit(e, f"t{i}", prompt(i, n), 12) for i, n in enumerate(lengths)]
    with e:
        for c in together:
            c.wait()
        assert e.peak_decode_batch >= len(lengths) - 1
    for a, t in zip(alone, together, strict=True):
        assert (t.tokens, t.logprobs) == (a.tokens, a.logprobs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_load_across_layouts_equals_aggregated(dtype: str) -> None:
    ids = prompt(3, 37)
    kw = dict(device="cuda", dtype=dtype, kv_cache_dtype=dtype)
    with (
        Engine(small_config(LayoutKind.BLOCKS_FIRST, **kw)) as a,
        Engine(small_config(LayoutKind.CROSS_LAYER, **kw)) as b,
    ):
        assert a.cache.regions[0].is_cuda and b.cache.regions[0].is_cuda
        ref = generate(a, ids, 10, "ref")
        keeper = RecordingKeeper()
        generate(a, ids, 1, "pre", kv_keeper=keeper)
        out = generate(b, ids, 10, "dec", kv_loader=CopyLoader(a, b, keeper.kept["pre"][0]))
        assert (out.tokens, out.logprobs) == (ref.tokens, ref.logprobs)
        assert len(set(ref.tokens)) > 1
