"""The calibration itself: a NIXL READ between two processes of this host, timed against a copy of the
same bytes, with UCX's protocol log read afterwards (`kvconnect.verdict` says why and how).

`python -m kvconnect.verdict.probe` is the child process `calibrate` runs; `kvconnect verdict` runs
`calibrate` once and prints the verdict as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec
import numpy as np

from kvconnect.core.agent import MemKind, NixlAgent, XferState
from kvconnect.core.config import ConnectorConfig, env_setting
from kvconnect.core.errors import ConfigError, KVConnectError, NixlError
from kvconnect.verdict.ucx_tables import NUM_DESCS, MiB, TransportVerdict, parse_proto_tables, read_transports

log = logging.getLogger(__name__)

DEFAULT_BYTES = 64 * MiB  # DRAM too: 16 MiB plus its copy fit a 32 MiB L3, and the ceiling became cache speed


# --- the measurement (runs in the child process) ------------------------------------------------------


def _device(name: str, current: bool = False) -> Any:
    """`name` as a torch device, bare "cuda" as cuda:0 (what a fresh worker uses); `current`: make it so."""
    import torch

    dev = torch.device(name)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)
        if current:
            torch.cuda.set_device(dev)
    return dev


def _sync(dev: Any) -> None:
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize(dev)


def _pattern(nbytes: int, dev: Any) -> Any:
    """Distinct 8-byte words, so a READ that lands anywhere but its place is caught."""
    import torch

    return torch.arange(nbytes // 8, dtype=torch.int64, device=dev).view(torch.uint8)


def _descs(addr: int, nbytes: int, dev_id: int, count: int = NUM_DESCS) -> np.ndarray:
    """`count` equal (addr, nbytes, device id) rows covering the buffer; count=1 is its registration."""
    step = nbytes // count
    return np.array([[addr + i * step, step, dev_id] for i in range(count)], dtype=np.int64)


def _target_main(pipe: Any, device: str, nbytes: int) -> None:
    """The spawned owner of the source buffer: register it, publish, and drive NIXL progress until told."""
    agent = None
    try:
        dev = _device(device, current=True)
        src = _pattern(nbytes, dev)
        _sync(dev)
        agent = NixlAgent(f"kvc-verdict-target-{os.getpid()}")
        agent.register(_descs(src.data_ptr(), nbytes, dev.index or 0, 1), MemKind.for_device(dev.type))
        pipe.send(("ok", (agent.metadata(), src.data_ptr(), dev.index or 0)))
        with contextlib.suppress(EOFError):  # EOF: the reader is gone
            while not pipe.poll(0.001) or pipe.recv() != "stop":  # progress for emulated READs (TCP)
                agent.notifs()
    except Exception as e:  # report to the reader instead of dying silently
        pipe.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        if agent is not None:
            agent.close()


def _answer(pipe: Any, deadline: float, proc: Any) -> Any:
    if not pipe.poll(max(deadline - time.monotonic(), 0.0)):
        raise NixlError("transport verdict: the target process did not start in time")
    try:
        tag, value = pipe.recv()
    except EOFError as e:
        raise NixlError(f"transport verdict: the target process exited (code {proc.exitcode})") from e
    if tag != "ok":
        raise NixlError(f"transport verdict: the target process failed: {value}")
    return value


def _read_once(agent: NixlAgent, local: Any, remote: Any, deadline: float) -> float:
    idx = np.arange(NUM_DESCS, dtype=np.int64)
    xfer = agent.read(local, idx, remote, idx, b"")
    try:
        t0 = time.perf_counter()
        state = agent.post(xfer)
        while state is XferState.PROC:
            if time.monotonic() > deadline:
                raise NixlError("transport verdict: a calibration READ did not finish before the deadline")
            state = agent.state(xfer)
        if state is not XferState.DONE:
            raise NixlError(f"transport verdict: calibration READ ended in {state.value}")
        return time.perf_counter() - t0
    finally:
        agent.release(xfer)


def _copy_s(dst: Any, src: Any) -> float:
    _sync(src.device)
    _sync(dst.device)
    t0 = time.perf_counter()
    dst.copy_(src)
    _sync(dst.device)
    return time.perf_counter() - t0


def measure(device: str, peer_device: str, nbytes: int, reps: int, timeout_s: float) -> TransportVerdict:
    """READ `nbytes` from a spawned process's buffer on `peer_device` into one on `device`, `reps` timed
    times after a first-contact READ, then as many torch copies; transport left "unknown" (see calibrate)."""
    import torch

    t_start = time.monotonic()
    deadline = t_start + timeout_s
    dev, peer = _device(device, current=True), _device(peer_device)
    torch.set_num_threads(1)  # a DRAM ceiling of one thread, as one READ is (cma: one process_vm_readv)
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(
        target=_target_main, args=(child, peer_device, nbytes), daemon=True, name="kvconnect-verdict-target"
    )
    proc.start()
    child.close()
    agent = None
    try:
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        agent = NixlAgent(f"kvc-verdict-reader-{os.getpid()}")
        mem, peer_mem = MemKind.for_device(dev.type), MemKind.for_device(peer.type)
        agent.register(_descs(dst.data_ptr(), nbytes, dev.index or 0, 1), mem)
        metadata, src_addr, src_dev_id = _answer(pipe, deadline, proc)
        remote = agent.prep(agent.add_remote(metadata), _descs(src_addr, nbytes, src_dev_id), peer_mem)
        local = agent.prep("", _descs(dst.data_ptr(), nbytes, dev.index or 0), mem)
        times_s = [_read_once(agent, local, remote, deadline) for _ in range(reps + 1)][1:]
        _sync(dev)
        if not torch.equal(dst, _pattern(nbytes, dev)):
            raise NixlError("transport verdict: the calibration READ delivered wrong bytes")
        src = _pattern(nbytes, peer)
        _copy_s(dst, src)  # first touch, peer access, before anything is timed
        copies_s = [_copy_s(dst, src) for _ in range(reps)]
    finally:
        if agent is not None:
            agent.close()  # UCX prints its used-protocols table here
        with contextlib.suppress(OSError):  # the target may be gone already
            pipe.send("stop")
        proc.join(max(deadline - time.monotonic(), 1.0))
        if proc.is_alive():
            proc.kill()
        pipe.close()
    gbps = nbytes / float(np.median(times_s)) / 1e9
    ceiling = nbytes / float(np.median(copies_s)) / 1e9
    return TransportVerdict(
        gbps=gbps,
        ceiling_gbps=ceiling,
        ratio=gbps / ceiling,
        transport="unknown",
        mem_kind=mem.value,
        device=str(dev),
        peer_device=str(peer),
        bytes=nbytes,
        reps=reps,
        ceiling_kind=f"torch copy {peer} -> {dev}" + (", 1 CPU thread" if dev.type == peer.type == "cpu" else ""),
        duration_s=time.monotonic() - t_start,
    )


def child_main(argv: list[str]) -> int:
    """`python -m kvconnect.verdict.probe --out PATH ...`: measure and write the verdict as JSON to PATH."""
    p = argparse.ArgumentParser(prog="python -m kvconnect.verdict.probe")
    add_arguments(p)  # the parent passes every value explicitly
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        verdict = measure(args.device, args.peer_device, args.bytes, args.reps, args.timeout_s)
    except Exception as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    with open(args.out, "wb") as f:
        f.write(msgspec.json.encode(verdict))
    return 0


# --- the parent side: run the child, name the transport, apply the policy -------------------------------


def _ucx_log(tmp: str) -> str:
    """Everything UCX logged in the child and its target (one `ucx.<pid>` file each)."""
    text = []
    for name in sorted(os.listdir(tmp)):
        if name.startswith("ucx."):
            with open(os.path.join(tmp, name), errors="replace") as f:
                text.append(f.read())
    return "".join(text)


def calibrate(
    device: str = "cpu",
    peer_device: str = "",
    nbytes: int = 0,
    reps: int = 5,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> TransportVerdict:
    """Measure in a child process (`env` added to this one's environment) and name the READ's transport.
    `NixlError` when the calibration fails or overruns `timeout_s`; a transport UCX did not report is "unknown"."""
    peer_device = peer_device or device
    nbytes = nbytes or DEFAULT_BYTES
    if nbytes < NUM_DESCS * 8 or nbytes % (NUM_DESCS * 8):
        raise ConfigError(f"verdict_bytes must be a positive multiple of {NUM_DESCS * 8}, got {nbytes}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvconnect-verdict-") as tmp:
        out = os.path.join(tmp, "verdict.json")
        child_env = {
            **os.environ,
            "NIXL_LOG_LEVEL": "WARN",
            **(env or {}),
            "UCX_PROTO_INFO": "used",
            "UCX_LOG_FILE": os.path.join(tmp, "ucx.%p"),
        }
        cmd = [
            sys.executable,
            "-m",
            "kvconnect.verdict.probe",
            "--device",
            device,
            "--peer-device",
            peer_device,
            "--bytes",
            str(nbytes),
            "--reps",
            str(reps),
            "--timeout-s",
            str(timeout_s),
            "--out",
            out,
        ]
        try:
            proc = subprocess.Popen(
                cmd,
                env=child_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )  # a group: killable whole
            try:
                _, err = proc.communicate(timeout=timeout_s + 5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise NixlError(f"transport verdict: calibration did not finish within {timeout_s:.0f} s") from None
            if proc.returncode != 0:
                tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
                errors = [ln.strip() for ln in _ucx_log(tmp).splitlines() if " ERROR " in ln][:3]
                raise NixlError(
                    f"transport verdict: calibration failed: {tail[0]}"
                    + ("; UCX: " + " | ".join(errors) if errors else "")
                )
            with open(out, "rb") as f:
                verdict = msgspec.json.decode(f.read(), type=TransportVerdict)
            text = _ucx_log(tmp)
        except (OSError, msgspec.DecodeError) as e:
            raise NixlError(f"transport verdict: cannot run the calibration: {e}") from e
    transports, configs, protocol = read_transports(parse_proto_tables(text))
    return msgspec.structs.replace(
        verdict,
        transport="+".join(transports) or "unknown",
        transports=transports,
        ucx_config=configs,
        protocol=protocol,
        duration_s=time.monotonic() - t0,
    )


def check_transport(verdict: TransportVerdict, refuse_tcp: bool) -> None:
    """Raise `ConfigError` naming the transport and the setting when TCP carried the READ and that is refused."""
    if refuse_tcp and verdict.is_tcp:
        raise ConfigError(
            f"transport verdict: the NIXL READ ran over {verdict.transport} (UCX {', '.join(verdict.ucx_config)}: "
            f"{verdict.protocol}), {verdict.gbps:.2f} GB/s, and refuse_tcp is set (KVCONNECT_REFUSE_TCP, "
            f"--refuse-tcp). UCX fell back to TCP: check UCX_TLS (now {os.environ.get('UCX_TLS', 'unset')!r}) "
            "and that shared memory, cuda_ipc or RDMA transports are usable here, or drop refuse_tcp to accept TCP"
        )


def startup_verdict(device: str, config: ConnectorConfig) -> TransportVerdict | None:
    """The worker's start-up check: log the verdict, refuse TCP if told to. A calibration that fails is
    logged and skipped (None); only a refused transport stops the worker."""
    try:
        verdict = calibrate(
            device, config.verdict_peer_device, config.verdict_bytes, timeout_s=config.verdict_timeout_s
        )
    except KVConnectError as e:
        log.warning("transport verdict unavailable, starting without it: %s", e)
        return None
    log.log(logging.WARNING if verdict.is_tcp else logging.INFO, "%s", verdict.summary())
    if verdict.transport == "unknown" and config.refuse_tcp:
        log.warning("transport verdict: UCX did not report the READ's transport, so refuse_tcp cannot apply")
    check_transport(verdict, config.refuse_tcp)
    return verdict


# --- `kvconnect verdict` ---------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=env_setting("DEVICE", "cpu"), help="cpu (DRAM) or cuda[:N] (VRAM)")
    p.add_argument(
        "--peer-device",
        default=env_setting("VERDICT_PEER_DEVICE", ""),
        help="device of the buffer that is read (default: --device)",
    )
    p.add_argument(
        "--bytes",
        type=int,
        default=int(env_setting("VERDICT_BYTES", "0") or 0),
        help="scratch buffer size in bytes (default 64 MiB)",
    )
    p.add_argument("--reps", type=int, default=5, help="timed READs and copies")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--refuse-tcp", action="store_true", help="exit 2 when UCX used TCP for the READ")


def run(args: argparse.Namespace) -> int:
    try:
        verdict = calibrate(args.device, args.peer_device, args.bytes, args.reps, args.timeout_s)
        log.info("%s", verdict.summary())
        print(msgspec.json.format(msgspec.json.encode(verdict), indent=2).decode())
        check_transport(verdict, args.refuse_tcp)
    except KVConnectError as e:
        log.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    from kvconnect.verdict import probe as _importable  # functions spawned processes can find by module name

    sys.exit(_importable.child_main(sys.argv[1:]))
