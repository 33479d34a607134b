"""`kvconnect serve`: a worker's flags (each defaults to its KVCONNECT_* variable), built and run.

The worker itself (engine, connector, OpenAI routes) is `server.Worker`; this module turns the command line
into its settings, checks the device, warns about a decode open to the network without a peer allow-list,
and runs it under uvicorn until it is stopped.
"""

from __future__ import annotations

import argparse
import logging

from kvconnect.core.allowlist import is_loopback
from kvconnect.core.config import (
    FailurePolicy,
    HeteroPathChoice,
    TransportChoice,
    connector_config,
    env_choice,
    env_int,
    env_setting,
)
from kvconnect.core.errors import ConfigError
from kvconnect.core.plan.layout import LayoutKind
from kvconnect.engine.config import EngineConfig
from kvconnect.serving.server import ROLES, Worker

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags default to their KVCONNECT_* variable; a bad variable is a ConfigError naming it (exit 2)."""
    layouts = [k.value for k in LayoutKind]
    p.add_argument("--role", choices=ROLES, default=env_choice("ROLE", ROLES, "both"))
    p.add_argument("--host", default=env_setting("HOST", "127.0.0.1"), help="HTTP bind address")
    p.add_argument("--port", type=int, default=env_int("PORT", 8000, 1, 65535), help="HTTP port")
    p.add_argument("--side-channel-host", default=None, help="bind address of the ZMQ side channel")
    p.add_argument("--side-channel-port", type=int, default=None)
    p.add_argument("--advertise-host", default=None, help="address peers dial (default: side-channel host)")
    p.add_argument("--layout", choices=layouts, default=env_choice("LAYOUT", layouts, "blocks_first"))
    p.add_argument("--block-size", type=int, default=env_int("BLOCK_SIZE", 16, 1))
    p.add_argument("--num-blocks", type=int, default=env_int("NUM_BLOCKS", 1024, 1))
    p.add_argument("--device", default=env_setting("DEVICE", "cpu"), help="cpu, cuda or cuda:N")
    p.add_argument("--secret-file", default=None, help="read the side-channel secret from this file")
    p.add_argument(
        "--insecure-side-channel",
        action="store_true",
        default=None,
        help="allow a side channel on a non-loopback address without a secret (trusted networks only)",
    )
    p.add_argument(
        "--peer-allowlist",
        default=None,
        help="decode: prefill hosts or CIDRs it may dial, comma-separated (default: any)",
    )
    p.add_argument("--transport", choices=[x.value for x in TransportChoice], default=None)
    p.add_argument("--hetero-path", choices=[x.value for x in HeteroPathChoice], default=None)
    p.add_argument("--staging-mb", type=int, default=None, help="staging cache for heterogeneous pairs (0 = off)")
    p.add_argument("--engine-id", default=None)
    p.add_argument("--lease-ttl-s", type=float, default=None)
    p.add_argument("--failure-policy", choices=[x.value for x in FailurePolicy], default=None)
    p.add_argument("--pull-timeout-s", type=float, default=None, help="deadline of one pull (READ + confirm)")
    p.add_argument("--handshake-timeout-s", type=float, default=None)
    p.add_argument(
        "--verdict",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode/both: time a NIXL READ against a copy at start-up, log it and export it in /metrics",
    )
    p.add_argument(
        "--refuse-tcp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode/both: refuse to start when UCX carries that READ over TCP (implies --verdict)",
    )


def build_worker(args: argparse.Namespace) -> Worker:
    conn = connector_config(
        engine_id=args.engine_id,
        side_channel_host=args.side_channel_host,
        side_channel_port=args.side_channel_port,
        advertise_host=args.advertise_host,
        lease_ttl_s=args.lease_ttl_s,
        failure_policy=args.failure_policy,
        pull_timeout_s=args.pull_timeout_s,
        handshake_timeout_s=args.handshake_timeout_s,
        verdict=args.verdict,
        refuse_tcp=args.refuse_tcp,
        secret_file=args.secret_file,
        insecure_side_channel=args.insecure_side_channel,
        peer_allowlist=args.peer_allowlist,
        transport=args.transport,
        hetero_path=args.hetero_path,
        staging_mb=args.staging_mb,
    )
    check_device(args.device)
    exposed = exposure_warning(args.role, args.host, conn.peer_allowlist)
    if exposed:
        log.warning("%s", exposed)
    engine = EngineConfig(
        layout=LayoutKind(args.layout), block_size=args.block_size, num_blocks=args.num_blocks, device=args.device
    )
    return Worker(args.role, engine, conn)


def exposure_warning(role: str, http_host: str, peer_allowlist: str) -> str:
    """What to warn about when a decode's HTTP port is reachable from other machines and no peer allow-list
    is set: any client there can then make it dial any host and port (its params name the prefill)."""
    if role == "prefill" or is_loopback(http_host) or peer_allowlist.strip():
        return ""
    return (
        f"decode HTTP on {http_host} with no peer allow-list: a client can make this worker connect to any "
        "host and port it names; set --peer-allowlist (KVCONNECT_PEER_ALLOWLIST) to the prefill workers"
    )


def check_device(device: str) -> None:
    """ConfigError unless `device` names a device this torch can use."""
    import re

    import torch

    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ConfigError(f"device {device!r} (--device, KVCONNECT_DEVICE) is not valid: expected cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {device!r}: this torch has no usable CUDA (torch {torch.__version__}); "
                "use --device cpu or a CUDA build of torch"
            )
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: only {torch.cuda.device_count()} CUDA devices")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    worker = build_worker(args)  # (ConfigError: a bad setting, or the verdict refused this host's transport)
    try:
        uvicorn.run(worker.app(), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        worker.close()
    return 0
