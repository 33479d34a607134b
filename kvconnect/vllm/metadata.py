"""What the scheduler-side connector tells its workers each step, and what workers tell it once.

`StepOrders` rides in vLLM's `SchedulerOutput` from the EngineCore process to every worker process
(pickled), so it holds plain values and msgspec structs only. The client's `kv_transfer_params` are parsed
once, by the scheduler; invalid ones travel as the field and reason the worker fails the load with.
`WorkerHello` goes the other way once, at start-up, through vLLM's handshake-metadata hook: the
side-channel port and incarnation each rank really has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from kvconnect.core.plan.params import KVTransferParams


@dataclass(frozen=True)
class LeaseOrder:
    """Prefill: hold these blocks for a remote reader (the request finished, its params were returned)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int  # tokens of KV the blocks hold
    lease_id: str  # drawn by the scheduler, so that every TP rank grants the same lease
    prompt_digest: bytes = b""  # binds the lease to the prompt (params.prompt_digest)
    group_sizes: tuple[int, ...] = ()  # blocks per KV cache group, `block_ids` being the groups in turn


@dataclass(frozen=True)
class PullOrder:
    """Decode: pull the remote prompt's blocks into these local ones."""

    request_id: str
    params: KVTransferParams | None  # the request's kv_transfer_params; None: invalid (`refused` says why)
    local_block_ids: list[list[int]]  # per KV cache group, the blocks the local prefix cache did not fill
    num_prompt_tokens: int
    num_local_hit_tokens: int  # prompt tokens the local prefix cache holds (block aligned)
    refused: tuple[str, str] | None = None  # (field, reason): the worker fails the load naming them
    prompt_digest: bytes = b""  # of the prompt this decode serves: a lease bound to another refuses the read
    arrival_time: float = 0.0  # wall clock when the request reached this vLLM (its timeline starts there)


@dataclass
class StepOrders(KVConnectorMetadata):
    leases: list[LeaseOrder] = field(default_factory=list)
    pulls: list[PullOrder] = field(default_factory=list)
    releases: list[KVTransferParams] = field(default_factory=list)  # params of leases nobody will read
    # (params, prompt binding) of leases whose requests still wait in the decode's queue: renew them
    renewals: list[tuple[KVTransferParams, bytes]] = field(default_factory=list)
    # nothing to compute this step: vLLM steps anyway while a transfer is pending, so the workers wait a
    # little for one to end instead of letting the engine spin (see worker.py)
    idle: bool = False


@dataclass(frozen=True)
class WorkerHello(KVConnectorHandshakeMetadata):
    tp_rank: int
    side_channel_port: int
    incarnation_id: str
