"""Settings: a side channel closed by default, the peer allow-list, the secret file, and bad values from a flag
or the environment ending the command with exit status 2 and one line naming them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvconnect.core.allowlist import is_loopback, parse_allowlist
from kvconnect.core.cache import KVCache
from kvconnect.core.config import connector_config
from kvconnect.core.connector import KVConnector
from kvconnect.core.errors import ConfigError
from kvconnect.core.plan.layout import CacheSpec, LayoutKind

ROOT = Path(__file__).resolve().parents[1]


def test_a_side_channel_beyond_loopback_needs_a_secret_or_an_explicit_opt_out(tmp_path: Path) -> None:
    exposed = {"KVCONNECT_SIDE_CHANNEL_HOST": "0.0.0.0", "KVCONNECT_ADVERTISE_HOST": "10.0.0.5"}
    with pytest.raises(ConfigError) as e:
        connector_config(exposed)
    assert "KVCONNECT_SECRET" in str(e.value) and "KVCONNECT_INSECURE_SIDE_CHANNEL" in str(e.value)
    with pytest.raises(ConfigError, match="not a loopback address"):
        connector_config({"KVCONNECT_SIDE_CHANNEL_HOST": "10.0.0.5"})
    assert connector_config({**exposed, "KVCONNECT_SECRET": "s3"}).secret == "s3"
    assert connector_config({**exposed, "KVCONNECT_INSECURE_SIDE_CHANNEL": "1"}).insecure_side_channel
    for host in ("127.0.0.1", "127.3.2.1", "::1", "localhost"):  # the demo and tests stay easy
        assert connector_config({"KVCONNECT_SIDE_CHANNEL_HOST": host}).secret == ""
    secret = tmp_path / "secret"
    secret.write_text("from-a-file\n")
    assert connector_config({**exposed, "KVCONNECT_SECRET_FILE": str(secret)}).secret == "from-a-file"
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        connector_config({**exposed, "KVCONNECT_SECRET_FILE": str(tmp_path / "empty")})
    with pytest.raises(ConfigError, match="cannot be read"):
        connector_config({"KVCONNECT_SECRET_FILE": str(tmp_path / "missing")})


def test_the_peer_allowlist_takes_addresses_networks_and_names() -> None:
    allow = parse_allowlist("10.0.0.0/8, 192.168.1.7, prefill-0.kv.svc.cluster.local, fd00::/8")
    assert allow.allows("10.200.3.4") and allow.allows("192.168.1.7") and allow.allows("fd00::1")
    assert allow.allows("Prefill-0.kv.svc.cluster.local") and allow.allows("[fd00::2]")
    assert not allow.allows("192.168.1.8") and not allow.allows("11.0.0.1") and not allow.allows("evil.example")
    assert parse_allowlist("").open and parse_allowlist("").allows("anything")
    for bad in ("10.0.0.0/33", "not a host", "999.1.1.1", "-x.com"):
        with pytest.raises(ConfigError, match="peer_allowlist"):
            parse_allowlist(bad)
    assert is_loopback("127.0.0.1") and not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")


@pytest.mark.parametrize(
    "env,field",
    [
        ({"KVCONNECT_TRANSPORT": "tcp"}, "transport"),
        ({"KVCONNECT_SIDE_CHANNEL_PORT": "abc"}, "side_channel_port"),
        ({"KVCONNECT_LEASE_TTL_S": "soon"}, "lease_ttl_s"),
        ({"KVCONNECT_CONFIRM_READS": "maybe"}, "confirm_reads"),
    ],
)
def test_a_bad_variable_is_named_with_its_value_and_what_is_allowed(env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        connector_config(env)
    text = str(e.value)
    var, value = next(iter(env.items()))
    assert var in text and repr(value) in text and "expected" in text and "\n" not in text


def kvconnect(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVCONNECT_")}
    return subprocess.run(
        [sys.executable, "-m", "kvconnect.cli", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    "args,env,names",
    [
        (["serve"], {"KVCONNECT_LAYOUT": "nonsense"}, ["KVCONNECT_LAYOUT", "'nonsense'", "cross_layer"]),
        (["serve"], {"KVCONNECT_PORT": "abc"}, ["KVCONNECT_PORT", "'abc'", "integer"]),
        (["serve"], {"KVCONNECT_TRANSPORT": "x"}, ["KVCONNECT_TRANSPORT", "'x'", "nixl"]),
        (["serve", "--device", "cuda"], {}, ["device", "'cuda'", "CUDA"]),
        (
            ["serve", "--side-channel-host", "0.0.0.0", "--advertise-host", "10.1.1.1"],
            {},
            ["KVCONNECT_SECRET", "--insecure-side-channel"],
        ),
        (["serve", "--peer-allowlist", "no such host!"], {}, ["peer_allowlist", "'no such host!'"]),
        (["proxy"], {}, ["--prefill", "KVCONNECT_PREFILL_URLS"]),
        (["proxy", "--prefill", "localhost:1", "--decode", "http://127.0.0.1:2"], {}, ["'localhost:1'", "http"]),
        (["--log-level", "loud", "serve"], {}, ["--log-level", "LOUD"]),
        (["serve"], {"KVCONNECT_LOG_LEVEL": "loud"}, ["KVCONNECT_LOG_LEVEL", "'loud'"]),
    ],
)
def test_bad_settings_exit_2_with_one_line_naming_them(args: list[str], env: dict[str, str], names: list[str]) -> None:
    done = kvconnect(*args, env=env)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in done.stderr and lines, done.stderr
    assert all(name in lines[-1] for name in names), lines[-1]


def test_the_help_is_written_for_users() -> None:
    done = kvconnect("--help")
    assert done.returncode == 0
    assert done.stdout.splitlines()[2].startswith("kvconnect moves a prompt's KV cache"), done.stdout[:300]
    serve = kvconnect("serve", "--help").stdout
    for flag in (
        "--secret-file",
        "--transport",
        "--hetero-path",
        "--staging-mb",
        "--peer-allowlist",
        "--insecure-side-channel",
    ):
        assert flag in serve, flag


def test_a_connector_without_read_confirmation_warns_that_it_is_not_fail_closed(caplog) -> None:
    spec = CacheSpec(
        kind=LayoutKind.BLOCKS_FIRST,
        dtype="float16",
        num_layers=1,
        num_blocks=4,
        block_size=4,
        num_kv_heads=1,
        head_dim=8,
    )
    with caplog.at_level(logging.WARNING):
        with KVConnector(KVCache.allocate(spec), connector_config({}, confirm_reads=False)):
            pass
    assert any("confirm_reads" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        with KVConnector(KVCache.allocate(spec), connector_config({})):
            pass
    assert not any("confirm_reads" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "1e9"])
def test_the_lease_grace_is_a_bounded_non_negative_time(raw: str) -> None:
    with pytest.raises(ConfigError, match="lease_grace_s must be between 0 and"):
        connector_config({"KVCONNECT_LEASE_GRACE_S": raw})
    assert connector_config({"KVCONNECT_LEASE_GRACE_S": "3"}).lease_grace_s == 3


@pytest.mark.parametrize("raw", ["-1", "65", "100000"])
def test_the_nixl_thread_pool_is_bounded(raw: str) -> None:
    """A variable may not make a worker start 100,000 UCX threads (or pass a negative count through)."""
    with pytest.raises(ConfigError, match=f"nixl_threads must be between 0 and 64, got {raw}"):
        connector_config({"KVCONNECT_NIXL_THREADS": raw})
    assert connector_config({"KVCONNECT_NIXL_THREADS": "4"}).nixl_threads == 4


def loop_cpus_of_a_connector_made_on(cpus: set[int], **config: str) -> set[int]:
    """The CPUs a connector's I/O thread may run on, the connector made by a thread pinned to `cpus` (as
    vLLM pins each worker's main thread to its compute cores)."""
    out: dict[str, set[int]] = {}

    def make() -> None:
        os.sched_setaffinity(0, cpus)
        spec = CacheSpec(
            kind=LayoutKind.CROSS_LAYER,
            num_blocks=2,
            dtype="float16",
            num_layers=1,
            block_size=16,
            num_kv_heads=1,
            head_dim=16,
        )
        with KVConnector(KVCache.allocate(spec), connector_config({}, **config)) as conn:
            conn.wait_idle()  # (the loop has placed itself)
            native_id = conn._loop._thread.native_id
            assert native_id is not None
            out["cpus"] = os.sched_getaffinity(native_id)

    t = threading.Thread(target=make)
    t.start()
    t.join(60)
    return out["cpus"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_io_thread_leaves_the_core_its_creator_was_pinned_to() -> None:
    """A connector made in a pinned thread still runs its I/O loop on every CPU the process may use, or on
    loop_cpus when set: pinned with the engine's spinning main thread, it missed pull deadlines."""
    allowed = os.sched_getaffinity(0)
    first, last = min(allowed), max(allowed)
    assert loop_cpus_of_a_connector_made_on({first}) == allowed
    assert loop_cpus_of_a_connector_made_on({first}, loop_cpus=str(last)) == {last}
    with pytest.raises(ConfigError, match="loop_cpus.*KVCONNECT_LOOP_CPUS.*'x'"):
        connector_config({"KVCONNECT_LOOP_CPUS": "0,x"})


def test_the_secret_never_shows_in_a_repr_an_error_or_vllms_start_up_line(caplog) -> None:
    """vLLM logs kv_connector_extra_config in clear; a repr or a refused value would print the secret too."""

    from kvconnect.core.errors import ConfigError

    config = connector_config({}, secret="hunter2-secret", side_channel_host="127.0.0.1")
    assert "hunter2-secret" not in repr(config) and "secret=<hidden>" in repr(config)
    with pytest.raises(ConfigError) as e:
        connector_config({"KVCONNECT_SECRET": "x"}, secret=987654321)
    assert "987654321" not in str(e.value) and "secret" in str(e.value)
    pytest.importorskip("vllm", reason="the plug-in's settings need vllm")
    from types import SimpleNamespace

    from kvconnect.vllm.settings import read_settings

    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"secret": "hunter2-secret"}, engine_id="e", kv_role="kv_producer"
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=16),
    )
    with pytest.raises(ConfigError, match="secret_file") as refused:  # (vLLM would print it in its log)
        read_settings(vllm_config)
    assert "hunter2-secret" not in str(refused.value)
