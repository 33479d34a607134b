"""A prefill worker in its own process, driven over a pipe by tests (real NIXL, real ZMQ)."""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import dataclass
from typing import Any

import msgspec

from kvconnect.core.layout import CacheSpec

UCX_VARS = ("UCX_TLS", "UCX_NET_DEVICES", "NIXL_LOG_LEVEL", "UCX_CUDA_IPC_MAX_STREAMS")


def _prefill_main(conn: Any, spec_raw: bytes, seed: int, config_raw: dict, env: dict, device: str | None) -> None:
    os.environ.update(env)
    import torch

    from kvconnect.core.cache import KVCache
    from kvconnect.core.config import connector_config
    from kvconnect.core.connector import KVConnector

    spec = msgspec.msgpack.decode(spec_raw, type=CacheSpec)
    if device and device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    cache = KVCache.allocate(spec, device=device)
    cache.fill_pattern(seed)
    freed: list[int] = []
    connector = KVConnector(cache, connector_config({}, **config_raw), on_blocks_freed=freed.extend)
    conn.send(("ready", connector.side_channel_port, connector.incarnation_id))
    try:
        while True:
            cmd, *args = conn.recv()
            try:
                if _serve(cmd, args, conn, connector, cache, spec, freed):
                    break
            except Exception as e:  # report to the test instead of dying
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        connector.close()
        conn.send("stopped")


def reference_kv(seed: int, num_tokens: int, spec: CacheSpec) -> Any:
    """The whole model's KV for `num_tokens` tokens, (tokens, layers, 2, model KV heads, head_dim): what every
    rank of a TP group holds its slice of (deterministic in `seed`)."""
    import torch

    from kvconnect.core.cache import TORCH_DTYPES

    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (num_tokens, spec.num_layers, 2, spec.model_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=gen).to(TORCH_DTYPES[spec.dtype])


def rank_tokens(cache: Any, block_ids: list[int], num_tokens: int) -> Any:
    """Tokens [0, n) of this rank's cache in `block_ids`, as (tokens, layers, 2, H, D) on the CPU."""
    import torch

    spec = cache.spec
    layers = []
    for layer in range(spec.num_layers):
        halves = [view[block_ids].reshape(-1, spec.num_kv_heads, spec.head_dim)[:num_tokens].cpu()
                  for view in cache.kv(layer)]
        layers.append(torch.stack(halves, dim=1))
    return torch.stack(layers, dim=1)


def _serve(cmd: str, args: list, conn: Any, connector: Any, cache: Any, spec: CacheSpec, freed: list) -> bool:
    """Answer one command; True means stop."""
    import torch

    if cmd == "stop":
        return True
    if cmd == "lease":
        conn.send(msgspec.json.encode(connector.lease(*args)))
    elif cmd == "state":
        conn.send(connector.leases.state(args[0]).value)
    elif cmd == "freed":
        conn.send(sorted(freed))
    elif cmd == "held":
        conn.send(connector.leases.num_blocks_held)
    elif cmd == "expire":
        conn.send(connector.leases.force_expire(args[0]).value)
    elif cmd == "block":
        conn.send(cache.block_bytes(args[0]))
    elif cmd == "randn":  # finite values, for attention checks
        gen = torch.Generator(device="cpu").manual_seed(args[0])
        for t in cache.regions:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        conn.send("ok")
    elif cmd == "kv":  # one layer's K and V of the given blocks, as CPU tensors
        k, v = cache.kv(args[0])
        conn.send((k[args[1]].cpu(), v[args[1]].cpu()))
    elif cmd == "fill_ref":  # (seed, num_tokens, block_ids): this rank's heads of the reference, in token order
        seed, num_tokens, ids = args
        ref = reference_kv(seed, num_tokens, spec)
        lo, hi = spec.head_range()
        t = torch.arange(num_tokens)
        blk, slot = torch.as_tensor(ids)[t // spec.block_size], t % spec.block_size
        for layer in range(spec.num_layers):
            for kv, view in enumerate(cache.kv(layer)):
                view[blk, slot] = ref[:, layer, kv, lo:hi].to(view.device)
        conn.send("ok")
    elif cmd == "tokens":  # (block_ids, num_tokens)
        conn.send(rank_tokens(cache, *args))
    elif cmd == "pull":  # (kv_transfer_params as JSON, local block ids): ("ok", stats) or ("failed", class, text)
        from kvconnect.core.errors import KVConnectError
        from kvconnect.core.protocol import KVTransferParams

        params = msgspec.json.decode(args[0], type=KVTransferParams)
        try:
            stats = connector.pull(params, args[1]).wait(60)
        except KVConnectError as e:
            conn.send(("failed", type(e).__name__, str(e)))
        else:
            conn.send(("ok", msgspec.to_builtins(stats)))
    elif cmd == "overwrite":
        for layer in range(spec.num_layers):
            for t in cache.kv(layer):
                t[args[0]].view(torch.uint8).fill_(0xAB)
        conn.send("ok")
    else:
        raise ValueError(f"unknown command {cmd!r}")
    return False


@dataclass
class PrefillProc:
    proc: Any
    conn: Any
    port: int
    incarnation_id: str

    @classmethod
    def start(cls, spec: CacheSpec, seed: int = 1, env: dict | None = None, device: str | None = None,
              **config: Any) -> PrefillProc:
        ctx = mp.get_context("spawn")
        inherited = {k: os.environ[k] for k in UCX_VARS if k in os.environ}
        parent, child = ctx.Pipe()
        config.setdefault("side_channel_host", "127.0.0.1")
        proc = ctx.Process(
            target=_prefill_main,
            args=(child, msgspec.msgpack.encode(spec), seed, config, {**inherited, **(env or {})}, device),
            daemon=True,
        )
        proc.start()
        if not parent.poll(60):
            proc.kill()
            raise RuntimeError("prefill process did not start within 60 s")
        tag, port, inc = parent.recv()
        assert tag == "ready"
        return cls(proc, parent, port, inc)

    def ask(self, *cmd: Any, timeout_s: float = 30) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"prefill process did not answer {cmd[0]!r} within {timeout_s}s")
        answer = self.conn.recv()
        if isinstance(answer, tuple) and answer and answer[0] == "error":
            raise RuntimeError(f"prefill process: {answer[1]}")
        return answer

    def lease(self, request_id: str, block_ids: list[int]):
        from kvconnect.core.protocol import KVTransferParams

        return msgspec.json.decode(self.ask("lease", request_id, block_ids), type=KVTransferParams)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.ask("stop", timeout_s=10)
            except (TimeoutError, EOFError, BrokenPipeError, OSError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
