"""Same-host GPU fast path: map the peer's cache with CUDA IPC and gather blocks with one kernel.

NIXL/UCX pays a fixed software cost per descriptor, flat over a wide range of sizes, so even one descriptor per
block leaves much of an NVLink link idle at the block sizes vLLM uses (the ladder and its per-descriptor cost:
results/gpu/h200-pair/, results/gpu/descriptors-h100/). When prefill and decode GPUs sit in one host, the decode
worker instead maps the prefill worker's registered regions (CUDA IPC, driver API through ctypes) and copies every
(unit, block) of a request with a single Triton kernel that reads the peer's memory directly: no per-descriptor
software cost. The lease protocol is unchanged: the kernel runs only while the lease is held, and the pull is
usable only after the prefill side confirms it.

Nothing here runs at import time; torch and triton are imported on first use.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvconnect.core.agent import NixlAgent, XferState
from kvconnect.core.board import boot_id
from kvconnect.core.errors import InvalidRequestError
from kvconnect.core.plan.descriptors import PairPlan, PullPlan
from kvconnect.core.plan.hetero import ReadPath, SourcePlan
from kvconnect.core.transports.base import Link, Move, Transport, TransportKind
from kvconnect.core.transports.cuda_driver import GraphSlots, MappedPeer, PeerCopyError, export_region

if TYPE_CHECKING:
    from kvconnect.core.cache import KVCache
    from kvconnect.core.wire.protocol import PeerInfo

log = logging.getLogger(__name__)

_WORD_BYTES = 8  # the kernel moves int64 words
_CHUNK_WORDS = 4096  # words per program: 32 KiB
_RING = 8  # upload slots (gathers in flight before a post waits)
_PROGRAMS_PER_SM = 8  # the gather's fixed grid


class IpcOffer(msgspec.Struct, array_like=True):
    """What a prefill offers same-host peers (in `PeerInfo.offers["ipc"]`): where its regions can be mapped."""

    host_id: str  # the kernel's boot id: peers with equal ids may share GPU memory
    handles: list[bytes]  # per region, the IPC handle of the allocation holding it
    offsets: list[int]  # per region, its offset inside that allocation


_offer_decoder = msgspec.msgpack.Decoder(IpcOffer)


def warm_up(device: Any) -> None:
    """Compile the gather kernel now (a gather of nothing), so the first same-host peer does not wait for it
    (~1 s with a cold Triton cache). The current CUDA device must be `device`."""
    import torch

    words = torch.zeros(_CHUNK_WORDS, dtype=torch.int64, device=device)
    table = torch.zeros(1, dtype=torch.int64, device=device)
    ids = torch.zeros(3, dtype=torch.int64, device=device)  # count 0
    _kernel()[(1,)](words, words, table, table, ids, 1, 1, _CHUNK_WORDS, 1, 1, CHUNK=_CHUNK_WORDS, num_warps=8)
    torch.cuda.synchronize(device)


class IpcGather:
    """A peer's cache mapped into this process, ready to gather requests with one kernel each.

    Both sides' unit tables (word offsets of unit u of block b, relative to region 0) live on the device
    from the handshake on, so a request uploads only its (remote, local) block id pairs: posting costs
    one small copy and one kernel launch, whatever the layout.
    """

    def __init__(self, mapped: MappedPeer, pair: Any, cache: Any) -> None:
        import torch

        self.mapped = mapped
        self._device = cache.regions[0].device
        self._num_units = pair.local_units.num_units
        self._unit_words = pair.unit_bytes // _WORD_BYTES
        self._src_origin = mapped.region_addrs[0]
        self._dst_origin = cache.base_addrs()[0]
        src = pair.remote_descs(mapped.region_addrs, 0)[:, 0] - self._src_origin
        dst = pair.local_descs(cache.base_addrs(), 0)[:, 0] - self._dst_origin
        if (src % _WORD_BYTES).any() or (dst % _WORD_BYTES).any():
            raise PeerCopyError(f"units are not aligned to {_WORD_BYTES}-byte words")
        self._src_table = torch.from_numpy(src // _WORD_BYTES).to(self._device)  # (U * nb_remote,)
        self._dst_table = torch.from_numpy(dst // _WORD_BYTES).to(self._device)  # (U * nb_local,)
        self._nb_src = pair.remote_spec.num_blocks
        self._nb_dst = pair.local_spec.num_blocks
        self._stream = torch.cuda.Stream(device=self._device)
        self._src_ptr, self._dst_ptr = _Ptr(self._src_origin), _Ptr(self._dst_origin)  # fixed per peer
        self._chunks = -(-self._unit_words // _CHUNK_WORDS)
        props = torch.cuda.get_device_properties(self._device)
        self._programs = props.multi_processor_count * _PROGRAMS_PER_SM
        # Each post writes [n, (remote, local) * n] into a ring slot of pinned host memory, copies it up
        # (asynchronously: a pageable upload is synchronous and costs ~70 us) and replays that slot's CUDA graph
        # of the gather (a Triton launch from Python costs ~30-50 us; a replay a few). A slot is reused only
        # after the gather that read it has finished.
        cap = 1 + 2 * self._nb_dst
        self._host_ids = [torch.zeros(cap, dtype=torch.int64, pin_memory=True) for _ in range(_RING)]
        self._host_words = [host.numpy() for host in self._host_ids]
        self._dev_ids = [torch.zeros(cap, dtype=torch.int64, device=self._device) for _ in range(_RING)]
        self._done = [torch.cuda.Event() for _ in range(_RING)]
        self._used = [False] * _RING
        self._next_slot = 0
        self._graphs: list[Any] = []
        with torch.cuda.stream(self._stream):
            self._launch(0)  # compiles the kernel (count 0: no work)
        self._stream.synchronize()
        try:
            for slot in range(_RING):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                    self._launch(slot)
                self._graphs.append(graph)
        except Exception as e:  # e.g. a driver without graph support: launch directly
            log.info("IPC gather: CUDA graph capture failed (%s); launching the kernel directly", e)
            self._graphs = []
        self._slots: GraphSlots | None = None  # the graphs posted with driver calls (torch's wrappers otherwise)
        if self._graphs:
            try:
                execs = [int(graph.raw_cuda_graph_exec()) for graph in self._graphs]
                uploads = [(d.data_ptr(), h.data_ptr()) for d, h in zip(self._dev_ids, self._host_ids, strict=True)]
                self._slots = GraphSlots(self._stream.cuda_stream, execs, uploads)
            except (AttributeError, RuntimeError, PeerCopyError) as e:  # (an older torch has no raw handles)
                log.info("IPC gather: posting through torch's graph replay (%s)", e)

    def _launch(self, slot: int) -> None:
        _kernel()[(self._programs,)](
            self._src_ptr,
            self._dst_ptr,
            self._src_table,
            self._dst_table,
            self._dev_ids[slot],
            self._nb_src,
            self._nb_dst,
            self._unit_words,
            self._num_units,
            self._chunks,
            CHUNK=_CHUNK_WORDS,
            num_warps=8,
        )

    @classmethod
    def open(cls, offer: IpcOffer, pair: Any, cache: Any) -> IpcGather:
        """Map the regions `offer` names for pulls planned by `pair` into `cache`."""
        if not offer.handles:
            raise PeerCopyError("peer exports no CUDA IPC handles")
        if not offer.host_id or offer.host_id != boot_id():
            raise PeerCopyError("peer is on another host")
        if pair.unit_bytes % _WORD_BYTES:
            raise PeerCopyError(f"units of {pair.unit_bytes} bytes are not whole {_WORD_BYTES}-byte words")
        try:
            _kernel()
        except ImportError as e:
            raise PeerCopyError(f"triton is not available: {e}") from e
        import torch

        mapped = MappedPeer.open(offer.handles, offer.offsets)
        try:
            # its id tensors must be ordinary ones whichever thread opens the peer: a vLLM worker drives the
            # connector inside its forward's inference mode, and a tensor made there cannot be written outside
            # it (the loop thread's next post failed: "Inplace update to inference tensor outside InferenceMode")
            with torch.inference_mode(False):
                return cls(mapped, pair, cache)
        except Exception:
            mapped.close()
            raise

    def post(self, local_ids: np.ndarray, remote_ids: np.ndarray) -> Any:
        """Enqueue one request's gather (validated ids); returns what to poll for its end (`query()`)."""
        n = int(local_ids.shape[0])
        slot = self._next_slot
        self._next_slot = (slot + 1) % _RING
        slots = self._slots
        if self._used[slot] and slots is not None:  # (waits only while _RING gathers are in flight)
            slots.wait(slot)
        elif self._used[slot]:
            self._done[slot].synchronize()
        words = self._host_words[slot]
        words[0] = n
        words[1 : 1 + 2 * n : 2] = remote_ids
        words[2 : 2 + 2 * n : 2] = local_ids
        try:
            if slots is not None:
                slots.post(slot, (1 + 2 * n) * _WORD_BYTES)
                self._used[slot] = True
                return _SlotDone(slots, slot)
            self._post_torch(slot, n)
        except Exception as e:
            raise PeerCopyError(f"gather kernel launch failed: {type(e).__name__}: {e}") from e
        self._used[slot] = True
        return self._done[slot]

    def _post_torch(self, slot: int, n: int) -> None:
        import torch

        with torch.cuda.stream(self._stream):
            self._dev_ids[slot][: 1 + 2 * n].copy_(self._host_ids[slot][: 1 + 2 * n], non_blocking=True)
            if self._graphs:
                self._graphs[slot].replay()
            else:
                self._launch(slot)
            self._done[slot].record(self._stream)

    def close(self) -> None:
        self._stream.synchronize()
        if self._slots is not None:
            self._slots.close()
        self.mapped.close()


class _SlotDone:
    """A gather posted through `GraphSlots`: polled like a torch event."""

    def __init__(self, slots: GraphSlots, slot: int) -> None:
        self._slots, self._slot = slots, slot

    def query(self) -> bool:
        return self._slots.done(self._slot)


class _Ptr:
    """A raw device address Triton accepts as an int64 pointer argument."""

    def __init__(self, addr: int) -> None:
        self._addr = addr
        import torch

        self.dtype = torch.int64

    def data_ptr(self) -> int:
        return self._addr


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["nb_src", "nb_dst", "unit_words", "num_units", "chunks"])  # one build for all
    def gather_blocks(
        src, dst, src_table, dst_table, ids, nb_src, nb_dst, unit_words, num_units, chunks, CHUNK: tl.constexpr
    ):
        # ids = [n, remote_0, local_0, remote_1, local_1, ...]; a fixed grid of programs walks the
        # n * num_units * chunks work items (chunk c of unit u of pair i), so one launch (or graph) fits any n
        n = tl.load(ids)
        total = n * num_units * chunks
        step = tl.num_programs(0).to(tl.int64)
        for w in range(tl.program_id(0).to(tl.int64), total, step):
            c = w % chunks
            d = w // chunks
            u = d // n
            i = d % n
            s_off = tl.load(src_table + u * nb_src + tl.load(ids + 1 + 2 * i))
            d_off = tl.load(dst_table + u * nb_dst + tl.load(ids + 2 + 2 * i))
            offs = c * CHUNK + tl.arange(0, CHUNK)
            mask = offs < unit_words
            tl.store(dst + d_off + offs, tl.load(src + s_off + offs, mask=mask), mask=mask)

    return gather_blocks


class IpcMove(Move):
    """One pull as one gather."""

    abandonable = False  # a local kernel: it always finishes, so it is waited for, never given up

    def __init__(self, gather: IpcGather, pair: PairPlan, local_ids: np.ndarray, remote_ids: np.ndarray) -> None:
        self._gather, self._pair, self.local_ids, self.remote_ids = gather, pair, local_ids, remote_ids
        self._event: Any = None

    def post(self, notif: bytes) -> tuple[XferState, PullPlan]:
        self._event = self._gather.post(self.local_ids, self.remote_ids)  # launch first: the plan is bookkeeping
        return XferState.PROC, self._pair.summary(int(self.local_ids.size))

    def state(self) -> XferState:
        return XferState.DONE if self._event.query() else XferState.PROC

    def release(self) -> None:
        self._event = None


class IpcLink(Link):
    def __init__(self, gather: IpcGather, pair: PairPlan) -> None:
        self._gather, self._pair = gather, pair

    def prepare(
        self,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        num_tokens: int | None,
        remote_offset: int = 0,
        state_ids: np.ndarray | None = None,
    ) -> IpcMove:
        if remote_offset:
            raise InvalidRequestError("remote_block_ids", "the IPC gather copies whole blocks from their first token")
        if self._pair.state_from:
            raise InvalidRequestError("remote_block_ids", "the IPC gather copies whole blocks, not state runs")
        local, remote = self._pair.bounds_checked(local_ids, remote_ids)  # one kernel: issue order is irrelevant
        return IpcMove(self._gather, self._pair, local, remote)

    def close(self) -> None:
        self._gather.close()


class IpcTransport(Transport):
    """Same-host GPU peers' pulls as gathers; no notification (the confirmation ends the lease)."""

    kind = TransportKind.IPC.value
    notifies = False

    def __init__(self) -> None:
        self._cache: KVCache | None = None

    @classmethod
    def applies(cls, cache: KVCache) -> bool:
        return cache.spec.device == "cuda"

    def start(self, cache: KVCache, agent: NixlAgent) -> bytes:
        try:
            warm_up(cache.regions[0].device)
        except Exception as e:  # Triton needs a C compiler and Python headers at first use
            raise PeerCopyError(f"{type(e).__name__}: {e}"[:300]) from e
        self._cache = cache
        exported = [export_region(addr) for addr in cache.base_addrs()]
        return msgspec.msgpack.encode(IpcOffer(boot_id(), [h for h, _ in exported], [o for _, o in exported]))

    def open(self, offer: bytes, info: PeerInfo, plan: SourcePlan) -> IpcLink:
        assert self._cache is not None, "IpcTransport.open before start"
        if not offer:
            raise PeerCopyError("not offered by the peer")
        if info.spec.device != "cuda":
            raise PeerCopyError("the peer's cache is not on a GPU")
        if plan.path is not ReadPath.BLOCK:
            raise PeerCopyError(f"the gather moves whole blocks, this pair needs the {plan.path.value} path")
        try:
            decoded = _offer_decoder.decode(offer)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise PeerCopyError(f"malformed IPC offer: {e}") from e
        if len(decoded.handles) != len(info.base_addrs) or len(decoded.offsets) != len(decoded.handles):
            raise PeerCopyError(f"IPC offer names {len(decoded.handles)} regions, the peer has {len(info.base_addrs)}")
        return IpcLink(IpcGather.open(decoded, plan.pair, self._cache), plan.pair)
