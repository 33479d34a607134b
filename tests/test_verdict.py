"""Transport verdict (verdict.py): real NIXL READs between two local processes, UCX's own report of the
transport, the refuse_tcp policy, the `kvconnect verdict` command and a decode worker's start-up check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvconnect.core.config import connector_config
from kvconnect.core.errors import ConfigError
from kvconnect.harness.net import free_port, poll_until
from kvconnect.verdict.probe import calibrate, check_transport
from kvconnect.verdict.ucx_tables import ProtoUse, parse_proto_tables, read_transports
from tests.faultkit import scrape

pytestmark = pytest.mark.cluster  # worker clusters in processes: the full tier (`dev.sh fast` skips them)

MiB = 2**20
SHARED_MEMORY = {"cma", "posix", "sysv", "knem", "xpmem"}
P = "[1795981202.739115] [vm:21980:0]   "  # UCX's log prefix

USED_TABLES = f"""\
{P}+-------+--------+-------------+-----------------------------------+
{P}| ini intra-node cfg#1                                             |
{P}| remote memory read by ucp_get*(multi) into host memory from host |
{P}+-------+--------+-------------+-----------------------------------+
{P}| Count | Range  | Description |              Config               |
{P}+-------+--------+-------------+-----------------------------------+
{P}|     5 | 0..inf | zero-copy   | cma/memory                        |
{P}+-------+--------+-------------+-----------------------------------+
[1795981202.7] [vm:21980:0]     parser.c:2370 UCX  WARN  unused environment variable: UCX_FOO
{P}+-------+------------+-----------------------------+---------------+
{P}| ini intra-node cfg#1                                               |
{P}| active message by ucp_am_send* from host memory                    |
{P}+-------+------------+-----------------------------+---------------+
{P}| Count |   Range    |    Description              |    Config     |
{P}+-------+------------+-----------------------------+---------------+
{P}|     2 |   1..16515 | zero-copy                   | tcp/lo        |
{P}+-------+------------+-----------------------------+---------------+
"""

MULTI_RAIL = f"""\
{P}| dec inter-node cfg#3                                                      |
{P}| remote memory read by ucp_get* into cuda memory from cuda                 |
{P}| Count |  Range  | Description | Config                                    |
{P}|     1 | 0..8191 | short       | tcp/eth0                                  |
{P}|    40 | 8192..inf | zero-copy | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |
"""


def test_parse_reads_only_the_get_rows_and_names_their_transports() -> None:
    rows = parse_proto_tables(USED_TABLES)
    assert (
        ProtoUse(
            "remote memory read by ucp_get*(multi) into host memory from host", 5, "0..inf", "zero-copy", "cma/memory"
        )
        in rows
    )
    assert len(rows) == 2  # the active-message row (notifications over tcp) is parsed but is no READ
    assert read_transports(rows) == (("cma",), ("cma/memory",), "zero-copy")
    transports, configs, protocol = read_transports(parse_proto_tables(MULTI_RAIL))
    assert transports == ("rc_mlx5", "tcp")  # most used first
    assert protocol == "zero-copy, short" and len(configs) == 2


def test_parse_without_a_read_table_says_nothing() -> None:
    for text in ("", "garbage | with | bars\n+--+\n", USED_TABLES.split("[1795981202.7]")[1]):
        assert read_transports(parse_proto_tables(text)) == ((), (), "")
    y_mode = f"""\
{P}| ini intra-node cfg#1                                             |
{P}| remote memory read by ucp_get*(multi) into host memory from host |
{P}| Range  | Description | Config     |
{P}| 0..inf | zero-copy   | cma/memory |
"""
    rows = parse_proto_tables(y_mode)  # UCX_PROTO_INFO=y tables have no Count column
    assert [r.count for r in rows] == [None] and read_transports(rows)[0] == ("cma",)


def test_loopback_verdict_is_positive_and_names_a_shared_memory_transport() -> None:
    v = calibrate("cpu", nbytes=16 * MiB, reps=3)
    assert v.gbps > 0 and v.ceiling_gbps > 0 and v.ratio == pytest.approx(v.gbps / v.ceiling_gbps)
    assert v.transport in SHARED_MEMORY and not v.is_tcp, v  # tests run with UCX_TLS=tcp,cma,sm,self
    assert (v.mem_kind, v.bytes, v.reps, v.device, v.peer_device) == ("DRAM", 16 * MiB, 3, "cpu", "cpu")
    assert "GB/s ceiling" in v.summary() and v.transport in v.summary()
    check_transport(v, refuse_tcp=True)  # not TCP: nothing to refuse


def test_forced_tcp_is_named_and_refused_only_when_asked() -> None:
    v = calibrate("cpu", nbytes=16 * MiB, reps=3, env={"UCX_TLS": "tcp"})
    assert v.transport == "tcp" and v.is_tcp and v.gbps > 0 and v.ceiling_gbps > 0, v
    assert v.ucx_config and v.ucx_config[0].startswith("tcp/")
    check_transport(v, refuse_tcp=False)
    with pytest.raises(ConfigError, match="refuse_tcp") as err:
        check_transport(v, refuse_tcp=True)
    assert "over tcp" in str(err.value) and "KVCONNECT_REFUSE_TCP" in str(err.value)


def test_cli_prints_json_and_exits_2_when_tcp_is_refused() -> None:
    env = {**os.environ, "UCX_TLS": "tcp"}
    out = subprocess.run(
        [sys.executable, "-m", "kvconnect.cli", "verdict", "--bytes", str(16 * MiB), "--reps", "2", "--refuse-tcp"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    verdict = json.loads(out.stdout)
    assert verdict["transport"] == "tcp" and verdict["gbps"] > 0 and verdict["bytes"] == 16 * MiB
    assert "refuse_tcp" in out.stderr and "over tcp" in out.stderr


def _serve(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    port, log_path = free_port(), tmp_path / "worker.log"
    cmd = [
        sys.executable,
        "-m",
        "kvconnect.cli",
        "--log-level",
        "INFO",
        "serve",
        "--role",
        "decode",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--side-channel-host",
        "127.0.0.1",
        "--num-blocks",
        "64",
        *args,
    ]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log_file, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log_path


def _up(proc: subprocess.Popen[bytes], url: str) -> bool:
    assert proc.poll() is None, f"worker exited with {proc.returncode}"
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_decode_worker_logs_the_verdict_and_exports_it(tmp_path: Path) -> None:
    proc, url, log_path = _serve(tmp_path, {"KVCONNECT_VERDICT_BYTES": str(16 * MiB)}, "--verdict")
    try:
        poll_until(lambda: _up(proc, url), timeout_s=60, what="decode worker up")
        health = httpx.get(url + "/health", timeout=5).json()["transport_verdict"]
        samples = scrape(url)
        assert samples[("kvconnect_transport_gbps", ())] == pytest.approx(health["gbps"]) and health["gbps"] > 0
        assert samples[("kvconnect_transport_ceiling_gbps", ())] > 0
        info = [labels for (name, labels) in samples if name == "kvconnect_transport_info"]
        assert len(info) == 1 and dict(info[0])["transport"] == health["transport"] != "unknown"
        assert dict(info[0])["mem_kind"] == "DRAM"
    finally:
        proc.terminate()
        proc.wait(15)
    line = next(ln for ln in log_path.read_text().splitlines() if "transport verdict:" in ln)
    assert "GB/s ceiling" in line and f"over {health['transport']}" in line


def test_decode_worker_refuses_tcp_at_startup(tmp_path: Path) -> None:
    env = {"UCX_TLS": "tcp", "KVCONNECT_REFUSE_TCP": "true", "KVCONNECT_VERDICT_BYTES": str(16 * MiB)}
    proc, url, log_path = _serve(tmp_path, env)
    try:
        assert proc.wait(60) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    text = log_path.read_text()
    assert "refuse_tcp" in text and "NIXL READ ran over tcp" in text, text[-2000:]


def test_verdict_settings_are_validated() -> None:
    cfg = connector_config({"KVCONNECT_VERDICT": "1", "KVCONNECT_REFUSE_TCP": "false"})
    assert cfg.verdict and not cfg.refuse_tcp and cfg.verdict_bytes == 0 and cfg.verdict_peer_device == ""
    for bad in ({"verdict_bytes": 1000}, {"verdict_peer_device": "gpu0"}, {"verdict_timeout_s": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            connector_config({}, **bad)


def _gpu_pairs() -> list[tuple[str, str]]:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [("cuda:0", "cuda:0")] + ([("cuda:0", "cuda:1")] if count > 1 else [])


@pytest.mark.gpu
@pytest.mark.parametrize(("device", "peer"), _gpu_pairs())
def test_vram_verdict_is_not_tcp(device: str, peer: str) -> None:
    """On a GPU host with UCX's defaults the READ between two processes goes over cuda_ipc (or cuda_copy)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    v = calibrate(device, peer, reps=5)
    print(v.summary(), v.ucx_config)
    assert v.mem_kind == "VRAM" and v.gbps > 0 and v.ceiling_gbps > 0 and v.transport != "unknown", v
    assert not v.is_tcp, v
