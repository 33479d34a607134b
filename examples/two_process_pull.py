"""Two processes, one pull: a prefill process holds a prompt's KV blocks, a decode process reads them.

    python examples/two_process_pull.py            (CPU; add --device cuda on a GPU host)

The prefill process allocates a KV cache, fills three blocks (standing in for a computed prompt), leases
them and hands the decode process the lease's `kv_transfer_params` (here over a pipe; in a deployment they
travel in the prefill's HTTP answer, through the proxy). The decode process pulls them with one NIXL READ
into blocks of its own cache and checks every byte against what the prefill process reports.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp

import msgspec

from kvconnect import CacheSpec, KVCache, KVConnector, KVTransferParams, LayoutKind, connector_config


def cache_spec(device: str) -> CacheSpec:
    return CacheSpec(
        kind=LayoutKind.CROSS_LAYER,
        dtype="float16",
        num_layers=4,
        num_blocks=64,
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
        device=device,
    )


def prefill(pipe, device: str) -> None:
    cache = KVCache.allocate(cache_spec(device))
    for region in cache.regions:
        region.normal_()  # a prompt's KV, as far as the transfer is concerned
    with KVConnector(cache, connector_config()) as conn:
        params = conn.lease("prompt-1", [7, 8, 9], num_tokens=40)  # 40 tokens in 3 blocks of 16
        pipe.send((msgspec.json.encode(params), [cache.block_bytes(b) for b in (7, 8, 9)]))
        pipe.recv()  # wait until the decode side has read (its READ's notification ends the lease)
        print(f"prefill: lease {params.remote_request_id} ended {conn.lease_state(params.remote_lease_id).value}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    device = ap.parse_args().device
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=prefill, args=(theirs, device))
    proc.start()
    try:
        raw, expected = mine.recv()
        params = msgspec.json.decode(raw, type=KVTransferParams)
        cache = KVCache.allocate(cache_spec(device))
        with KVConnector(cache, connector_config()) as conn:
            handle = conn.pull(params, [0, 1, 2])
            stats = handle.wait(timeout_s=30)  # raises a kvconnect error if the pull failed
            same = [cache.block_bytes(b) for b in (0, 1, 2)] == expected
            print(
                f"decode: pulled {stats.bytes} bytes from {params.remote_engine_id} in "
                f"{stats.num_descs_merged} descriptor(s), {stats.total_s * 1e3:.1f} ms; bytes equal: {same}"
            )
        mine.send("done")
    finally:
        proc.join(30)
    return 0 if same and proc.exitcode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
