"""The only module that imports NIXL: a typed wrapper over one NIXL agent.

NIXL's string states become `XferState`, its binding exceptions become kvconnect errors, and every
handle it hands out is tracked so `close()` can release in the order NIXL needs: transfers, prepared
lists, remote agents, then registrations. The agent is not thread-safe (NIXL's default sync mode):
one owner thread drives it (the connector's loop).

Which build is loaded: `KVCONNECT_NIXL_MODULE` if set (e.g. `nixl_cu12`), else the cu12 build when
torch is built for CUDA 12 and it is installed, else `nixl_cu13`, else the `nixl` meta package.
Importing `<build>._api` directly avoids the meta package's torch import and its cu12/cu13 clash.
"""

from __future__ import annotations

import enum
import importlib
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from kvconnect.core.config import env_setting
from kvconnect.core.errors import InvalidRequestError, NixlError, PeerGoneError, TransferError

log = logging.getLogger(__name__)

_api: ModuleType | None = None
_bind: ModuleType | None = None


class XferState(str, enum.Enum):
    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


class MemKind(str, enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"

    @classmethod
    def for_device(cls, device: str) -> MemKind:
        return cls.VRAM if device == "cuda" else cls.DRAM


def _candidates() -> list[str]:
    forced = env_setting("NIXL_MODULE")
    if forced:
        return [forced]
    order = ["nixl_cu13", "nixl_cu12"]
    try:
        import torch

        if (torch.version.cuda or "").startswith("12"):
            order.reverse()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return [*order, "nixl"]


def nixl_module() -> tuple[ModuleType, ModuleType]:
    """(api, bindings) of the NIXL build in use; imported on first call, never at import time."""
    global _api, _bind
    if _api is None:
        errors = []
        for name in _candidates():
            try:
                _api = importlib.import_module(f"{name}._api")
                _bind = importlib.import_module(f"{name}._bindings")
                break
            except ImportError as e:
                errors.append(f"{name}: {e}")
        else:
            raise NixlError("no NIXL build importable (" + "; ".join(errors) + ")")
    assert _bind is not None
    return _api, _bind


def _wrap(e: Exception, what: str) -> Exception:
    """Map a NIXL binding exception to our family."""
    kind = type(e).__name__
    if kind == "nixlRemoteDisconnectError":
        return PeerGoneError(f"{what}: remote agent disconnected ({e})")
    if kind in ("nixlInvalidParamError", "nixlNotFoundError"):
        return InvalidRequestError("descriptors", f"{what}: NIXL refused ({kind}: {e})")
    if kind.startswith("nixl"):
        return TransferError(f"{what}: {kind}: {e}")
    return NixlError(f"{what}: {e!r}")


@dataclass
class PreppedList:
    handle: Any
    agent_name: str  # "" for the local side
    num_descs: int


@dataclass
class XferHandle:
    handle: Any
    released: bool = False


@dataclass
class AgentOptions:
    # UCX's thread pool: this many dedicated threads, each posting (and, over cma, copying) its share of a
    # descriptor list; 0 = none, every transfer on the calling thread. NIXL splits a list only once it holds
    # `split_batch_size` descriptors (1,024 unless told), which a merged kvconnect list never does, so
    # kvconnect asks for a split of every list: max(n / threads, 1) descriptors per thread.
    num_threads: int = 0
    progress_thread: bool = False  # NIXL's progress thread busy-spins a core; we poll instead
    telemetry: bool = False
    merge_descs: bool = True  # NIXL's merging of adjacent descriptors (off: `skip_desc_merge`, to measure it)
    backends: tuple[str, ...] = ("UCX",)


@dataclass
class NixlAgent:
    """One NIXL agent and everything it owns."""

    name: str
    options: AgentOptions = field(default_factory=AgentOptions)
    _agent: Any = None
    _regs: list[Any] = field(default_factory=list)
    _lists: list[PreppedList] = field(default_factory=list)
    _remotes: set[str] = field(default_factory=set)
    _xfers: list[XferHandle] = field(default_factory=list)

    def __post_init__(self) -> None:
        api, _ = nixl_module()
        pooled = self.options.num_threads > 0 and "UCX" in self.options.backends
        conf = api.nixl_agent_config(
            enable_prog_thread=self.options.progress_thread,
            enable_listen_thread=False,
            capture_telemetry=self.options.telemetry,
            num_threads=self.options.num_threads,
            backends=[b for b in self.options.backends if not (pooled and b == "UCX")],
        )
        try:
            self._agent = api.nixl_agent(self.name, conf)
            if pooled:  # nixl_agent_config passes num_threads but no split size: create UCX here
                self._agent.create_backend(
                    "UCX", {"num_threads": str(self.options.num_threads), "split_batch_size": "1"}
                )
        except Exception as e:
            raise NixlError(f"cannot create NIXL agent {self.name!r} (check UCX_TLS includes tcp): {e}") from e
        if not self._agent.backends:
            raise NixlError(f"NIXL agent {self.name!r} has none of the backends {self.options.backends}")

    def backend_params(self, backend: str = "UCX") -> dict[str, str]:
        """The parameters `backend` was created with (what this agent asked NIXL for)."""
        return dict(self._agent.get_backend_params(backend))

    # --- memory ------------------------------------------------------------------------------------

    def register(self, regions: np.ndarray, mem: MemKind) -> None:
        """Register (N, 3) regions of (addr, nbytes, device id)."""
        try:
            self._regs.append(self._agent.register_memory(np.ascontiguousarray(regions), mem.value))
        except Exception as e:
            raise _wrap(e, "register_memory") from e

    def metadata(self) -> bytes:
        """A snapshot: register memory first, then publish."""
        return bytes(self._agent.get_agent_metadata())

    # --- peers -------------------------------------------------------------------------------------

    def add_remote(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise _wrap(e, "add_remote_agent") from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.add(name)
        return name

    def remove_remote(self, agent_name: str) -> None:
        for lst in [lst for lst in self._lists if lst.agent_name == agent_name]:
            self.release_list(lst)
        if agent_name in self._remotes:
            self._remotes.discard(agent_name)
            try:
                self._agent.remove_remote_agent(agent_name)
            except Exception as e:  # the peer may already be gone; nothing left to free
                log.debug("remove_remote_agent(%s): %s", agent_name, e)

    # --- descriptor lists --------------------------------------------------------------------------

    def prep(self, agent_name: str, descs: np.ndarray, mem: MemKind) -> PreppedList:
        """Prepare (N, 3) descriptors, or (N, 5) strided rows; agent_name "" means the local side."""
        arr = np.ascontiguousarray(descs, dtype=np.int64)
        count = int(arr[:, 4].sum()) if arr.shape[1] == 5 else int(arr.shape[0])
        try:
            h = self._agent.prep_xfer_dlist(agent_name or "NIXL_INIT_AGENT", arr, mem.value)
        except Exception as e:
            raise _wrap(e, "prep_xfer_dlist") from e
        lst = PreppedList(h, agent_name, count)
        self._lists.append(lst)
        return lst

    def release_list(self, lst: PreppedList) -> None:
        if lst in self._lists:
            self._lists.remove(lst)
            try:
                self._agent.release_dlist_handle(lst.handle)
            except Exception as e:
                log.debug("release_dlist_handle: %s", e)

    # --- transfers ---------------------------------------------------------------------------------

    def read(
        self,
        local: PreppedList,
        local_indices: np.ndarray,
        remote: PreppedList,
        remote_indices: np.ndarray,
        notif: bytes,
    ) -> XferHandle:
        """Create a READ of remote descriptors into local ones; post it with `post`."""
        try:
            # (NIXL marks skip_desc_merge deprecated: passed only when merging is off, for a measurement)
            skip = {} if self.options.merge_descs else {"skip_desc_merge": True}
            h = self._agent.make_prepped_xfer(
                "READ", local.handle, local_indices, remote.handle, remote_indices, notif, **skip
            )
        except Exception as e:
            raise _wrap(e, "make_prepped_xfer") from e
        xfer = XferHandle(h)
        self._xfers.append(xfer)
        return xfer

    def post(self, xfer: XferHandle) -> XferState:
        try:
            return XferState(self._agent.transfer(xfer.handle))
        except Exception as e:
            raise _wrap(e, "transfer") from e

    def state(self, xfer: XferHandle) -> XferState:
        try:
            return XferState(self._agent.check_xfer_state(xfer.handle))
        except Exception as e:
            raise _wrap(e, "check_xfer_state") from e

    def telemetry_descs(self, xfer: XferHandle) -> int | None:
        """Descriptors NIXL actually issued (after its own merging), when telemetry is on."""
        if not self.options.telemetry:
            return None
        try:
            return int(self._agent.get_xfer_telemetry(xfer.handle).descCount)
        except Exception:
            return None

    def release(self, xfer: XferHandle) -> None:
        """Release a transfer handle. This does not stop a READ already posted: NIXL cannot cancel one, and a
        released READ may still write its data (see pull.AbandonedReads); its notification is lost."""
        if xfer.released:
            return
        xfer.released = True
        if xfer in self._xfers:
            self._xfers.remove(xfer)
        try:
            self._agent.release_xfer_handle(xfer.handle)
        except Exception as e:
            log.debug("release_xfer_handle: %s", e)

    def notifs(self) -> dict[str, list[bytes]]:
        """New notifications by remote agent name; also drives progress on the target side."""
        try:
            got = self._agent.get_new_notifs()
        except Exception as e:
            raise _wrap(e, "get_new_notifs") from e
        return {(k.decode() if isinstance(k, bytes) else k): list(v) for k, v in got.items()}

    def close(self) -> None:
        """Release everything in NIXL's order; the caller frees the tensors only after this."""
        if self._agent is None:
            return
        for xfer in list(self._xfers):
            self.release(xfer)
        for lst in list(self._lists):
            self.release_list(lst)
        for name in list(self._remotes):
            self.remove_remote(name)
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                log.debug("deregister_memory: %s", e)
        self._regs.clear()
        self._agent = None
