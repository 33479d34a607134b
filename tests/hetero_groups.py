"""TP groups across processes for the heterogeneous-pull tests (CPU here, VRAM in tests/gpu): the cases,
their cache specs, and `run_group`, which runs one case and checks every byte and every lease."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import msgspec
import numpy as np
import torch

from kvconnect.core.plan.hetero import plan_sources
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.plan.params import new_lease_id
from kvconnect.harness.net import free_port_run
from kvconnect.harness.prefill import PrefillProcess, reference_kv
from tests.faultkit import poll_until

LAYERS, HEAD_DIM, TOKENS, SEED = 3, 8, 150, 11


def spec(
    kind: LayoutKind, tp: int, rank: int, heads: int, block: int, layout: str, blocks: int, device: str = "cpu"
) -> CacheSpec:
    return CacheSpec(
        kind=kind,
        dtype="bfloat16",
        num_layers=LAYERS,
        num_blocks=blocks,
        block_size=block,
        num_kv_heads=max(heads // tp, 1),
        head_dim=HEAD_DIM,
        tp_size=tp,
        tp_rank=rank,
        token_layout=layout,
        total_kv_heads=heads,
        device=device.split(":")[0],
    )


CASES = {
    # name: (model heads, prefill (tp, kind, block, layout), decode (tp, kind, block, layout), path)
    # (which path `auto` takes depends on the device's cost model, tested in test_hetero.py; here the
    # direct cases force it so both paths run across processes on every device)
    "2to1_nhd16_to_hnd64_staging": (
        4,
        (2, LayoutKind.CROSS_LAYER, 16, "NHD"),
        (1, LayoutKind.BLOCKS_FIRST, 64, "HND"),
        "staging",
    ),
    "1to2_hnd_direct_two_readers": (
        4,
        (1, LayoutKind.KV_FIRST, 16, "HND"),
        (2, LayoutKind.CROSS_LAYER, 16, "HND"),
        "direct",
    ),
    "2to1_replicated_head": (
        1,
        (2, LayoutKind.BLOCKS_FIRST, 64, "NHD"),
        (1, LayoutKind.CROSS_LAYER, 16, "NHD"),
        "direct",
    ),
}


def run_group(case: str, device_of: Callable[[str, int], str]) -> list[dict]:
    """Run one CASES entry with ranks on `device_of("prefill"|"decode", rank)`; returns the decode stats."""
    heads, (tp_p, kind_p, bs_p, lay_p), (tp_d, kind_d, bs_d, lay_d), path = CASES[case]
    rng = np.random.default_rng(5)
    nb_p, nb_d = -(-TOKENS // bs_p), -(-TOKENS // bs_d)
    p_ids = rng.permutation(nb_p + 4)[:nb_p].tolist()
    d_ids = rng.permutation(nb_d + 4)[:nb_d].tolist()
    base = free_port_run(tp_p)
    with ExitStack() as stack:
        prefill = []
        for r in range(tp_p):
            dev = device_of("prefill", r)
            proc = PrefillProcess.start(
                spec(kind_p, tp_p, r, heads, bs_p, lay_p, nb_p + 4, dev),
                device=dev,
                side_channel_port=base + r,
                engine_id="pfx",
                staging_mb=1,
            )
            stack.callback(proc.stop)
            proc.ask("fill_ref", SEED, TOKENS, p_ids)
            prefill.append(proc)
        decode = []
        for d in range(tp_d):
            dev = device_of("decode", d)
            proc = PrefillProcess.start(
                spec(kind_d, tp_d, d, heads, bs_d, lay_d, nb_d + 4, dev),
                device=dev,
                engine_id=f"dec{d}",
                staging_mb=1,
                hetero_path="auto" if path == "staging" else path,
            )
            stack.callback(proc.stop)
            decode.append(proc)
        lease_id = new_lease_id()  # one id for the prefill's TP group
        params = [proc.lease("req-1", p_ids, None, lease_id) for proc in prefill]
        assert {x.remote_port for x in params} == {base}  # every rank names the group's base port
        wire = msgspec.json.encode(msgspec.structs.replace(params[0], remote_num_tokens=TOKENS))
        for proc in decode:
            proc.send("pull", wire, d_ids)  # all decode ranks pull at once
        results = [proc.answer("pull", 90) for proc in decode]
        for d, res in enumerate(results):
            assert res[0] == "ok", f"decode rank {d}: {res}"
            assert set(res[1]["path"].split("+")) == {path}
            assert res[1]["num_sources"] == len(plan_sources(spec(kind_d, tp_d, d, heads, bs_d, lay_d, 1), tp_p).reads)
        ref = reference_kv(SEED, TOKENS, spec(kind_p, 1, 0, heads, bs_p, lay_p, 1))
        for d, proc in enumerate(decode):
            lo, hi = spec(kind_d, tp_d, d, heads, bs_d, lay_d, 1).head_range()
            got = proc.ask("tokens", d_ids, TOKENS)
            assert torch.equal(got.view(torch.uint8), ref[:, :, :, lo:hi].contiguous().view(torch.uint8)), d
        for proc in prefill:
            poll_until(lambda proc=proc: proc.ask("held") == 0, what="prefill lease ended")
            assert proc.ask("state", "req-1") in ("completed", "released")
            assert proc.ask("freed") == sorted(p_ids)
    return [res[1] for res in results]
