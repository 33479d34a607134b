"""docker/docker-compose.yml run for real with rootful podman and podman-compose: one project per use, with
a unique name, its own bridge network and the proxy published on a free loopback port; torn down by `down`
(also when `up` fails), which reports what compose itself left behind before removing it.

A `ComposeProject` takes the shipped compose file, a profile (`cpu` or `vllm`), the variables the file
reads (images, secret, model directory, ...) and an optional override file (extra services such as an
aggregated reference, other commands or environment: what `-f a.yml -f b.yml` merges). Its services are
reachable from this host at their addresses on the project's network (`url(service)`) and through the
published proxy (`proxy_url`). What a test asks of a container (its addresses, its namespaces, its
interface byte counters) is read from the host: podman's inspect and the container's /proc entries.

Podman facts this follows (Debian 12's podman 4.3, no systemd): healthchecks never run by themselves, so
`depends_on: service_healthy` is ignored and readiness is polled over HTTP here; restart policies are not
applied either (a killed container stays down until `start`); a restarted container gets a new address,
which the network's DNS (aardvark-dns) then answers for its name.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvconnect.harness.images import ROOT, TAGS, podman
from kvconnect.harness.net import free_port

log = logging.getLogger(__name__)

COMPOSE_FILE = ROOT / "docker" / "docker-compose.yml"
PROJECT_LABEL = "io.podman.compose.project"
UP_TIMEOUT_S = 300.0


class ComposeError(RuntimeError):
    """A compose step that failed or timed out; the message names it and carries the relevant logs."""


def shipped_services() -> dict[str, Any]:
    """The compose file's services as written (anchors resolved, variables not yet interpolated): the base
    for an override's extra services, e.g. an aggregated reference built like the prefill."""
    import yaml

    return dict(yaml.safe_load(COMPOSE_FILE.read_text())["services"])


def compose_binary() -> list[str]:
    """podman-compose, from this interpreter's environment (the `compose` extra) or the PATH."""
    here = Path(sys.executable).with_name("podman-compose")
    exe = str(here) if here.exists() else shutil.which("podman-compose")
    if exe is None:
        raise ComposeError("podman-compose is not installed: pip install 'kvconnect[compose]' (PyPI's podman-compose)")
    return [exe]


@dataclass
class ComposeProject:
    """One run of the compose file. Use as a context manager, or call `up` and (always) `down`."""

    profile: str
    log_dir: Path
    variables: dict[str, str] = field(default_factory=dict)  # what the compose file interpolates
    override: dict[str, Any] | None = None  # a second compose file merged over the shipped one
    name: str = ""
    proxy_port: int = 0
    secret: str = ""
    up_timeout_s: float = UP_TIMEOUT_S

    def __post_init__(self) -> None:
        self.name = self.name or f"kvct{os.getpid()}{secrets.token_hex(2)}"
        self.proxy_port = self.proxy_port or free_port()
        self.secret = self.secret or secrets.token_hex(32)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    # --- compose ------------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment compose runs in: no COMPOSE_*/KVCONNECT_* of the caller's shell leaks in."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "KVCONNECT_"))}
        env.update(
            COMPOSE_PROFILES=self.profile,
            KVCONNECT_SECRET=self.secret,
            KVCONNECT_PROXY_PUBLISH=f"127.0.0.1:{self.proxy_port}",
            KVCONNECT_CPU_IMAGE=TAGS["cpu"],
            KVCONNECT_VLLM_CPU_IMAGE=TAGS["vllm-cpu"],
        )
        env.update(self.variables)
        return env

    def files(self) -> list[str]:
        args = ["-f", str(COMPOSE_FILE)]
        if self.override is not None:
            path = self.log_dir / "override.yml"
            path.write_text(json.dumps(self.override, indent=2))  # (JSON is YAML)
            args += ["-f", str(path)]
        return args

    def compose(self, *args: str, timeout_s: float = 300.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [*compose_binary(), "--in-pod", "false", "-p", self.name, *self.files(), *args]
        t0 = time.monotonic()
        out = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=timeout_s)
        took_s = time.monotonic() - t0
        with open(self.log_dir / "compose.log", "a") as f:
            f.write(
                f"$ podman-compose {' '.join(args)}  (rc {out.returncode}, {took_s:.1f} s)\n{out.stdout}{out.stderr}\n"
            )
        log.info("podman-compose %s: rc %d in %.1f s", " ".join(args), out.returncode, took_s)
        if check and out.returncode != 0:
            raise ComposeError(f"podman-compose {' '.join(args)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
        return out

    def up(self, services: list[str] | None = None, health: list[str] | None = None) -> ComposeProject:
        """`up -d --no-build` (images are built beforehand: kvconnect.harness.images), then poll until the
        proxy's /health (200 only while every worker it knows answers) and each of `health` answer 200."""
        try:
            self.compose("up", "-d", "--no-build", *(services or []))
            self.wait_healthy(["proxy", *(health or [])])
        except BaseException:
            self.down()
            raise
        return self

    def wait_healthy(self, services: list[str], timeout_s: float | None = None) -> None:
        timeout_s = timeout_s or self.up_timeout_s
        deadline = time.monotonic() + timeout_s
        pending = list(services)
        while pending:
            for service in list(pending):
                state = self.state(service)
                if state not in ("running", "created", "configured", "initialized"):
                    raise ComposeError(f"{service} is {state or 'missing'} while starting:\n{self.logs(service)}")
                url = self.proxy_url if service == "proxy" else self.url(service)
                try:
                    if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                        pending.remove(service)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                tails = "\n".join(self.logs(s) for s in pending)
                raise ComposeError(f"not healthy within {timeout_s:.0f} s: {pending}\n{tails}")
            if pending:
                time.sleep(0.5)

    def down(self) -> list[str]:
        """`down` (containers stopped and removed, the network removed); returns what compose itself left
        (containers or the network, by name), then removes those too, so nothing outlives the project. The
        containers' logs are saved into log_dir first."""
        self.save_logs()
        try:
            self.compose("down", "-v", "-t", "10", timeout_s=180.0, check=False)
        except subprocess.TimeoutExpired:
            log.warning("podman-compose down of %s timed out", self.name)
        left = self.leftovers()
        for item in left:
            podman("rm", "-f", "-t", "0", item, check=False)
            podman("network", "rm", "-f", item, check=False)
        return left

    def leftovers(self) -> list[str]:
        """Containers labelled with this project, and its networks, that exist now."""
        ps = podman("ps", "-a", "--filter", f"label={PROJECT_LABEL}={self.name}", "--format", "{{.Names}}")
        nets = podman("network", "ls", "--format", "{{.Name}}")
        mine = [n for n in nets.stdout.split() if n.startswith(f"{self.name}_")]
        return ps.stdout.split() + mine

    def __enter__(self) -> ComposeProject:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # --- containers -----------------------------------------------------------------------------------

    def container(self, service: str) -> str:
        return f"{self.name}_{service}_1"

    def inspect(self, service: str) -> dict[str, Any]:
        out = podman("inspect", "--type", "container", self.container(service), check=False)
        return json.loads(out.stdout)[0] if out.returncode == 0 and out.stdout.strip() else {}

    def state(self, service: str) -> str:
        return str(self.inspect(service).get("State", {}).get("Status", ""))

    def ip(self, service: str) -> str:
        """The container's address on the project's network (reachable from this host)."""
        nets = self.inspect(service).get("NetworkSettings", {}).get("Networks", {})
        addrs = [n.get("IPAddress") for n in nets.values() if n.get("IPAddress")]
        if not addrs:
            raise ComposeError(f"{service} has no address (state {self.state(service) or 'missing'})")
        return str(addrs[0])

    def url(self, service: str, port: int = 8000) -> str:
        return f"http://{self.ip(service)}:{port}"

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def pid(self, service: str) -> int:
        pid = int(self.inspect(service).get("State", {}).get("Pid", 0))
        if pid <= 0:
            raise ComposeError(f"{service} runs no process (state {self.state(service) or 'missing'})")
        return pid

    def namespace(self, service: str, kind: str) -> str:
        """The container's namespace of `kind` ("net", "ipc", ...), e.g. 'net:[4026532291]'."""
        return os.readlink(f"/proc/{self.pid(service)}/ns/{kind}")

    def netdev(self, service: str, dev: str = "eth0") -> tuple[int, int]:
        """(received, sent) bytes of interface `dev` inside the container (its /proc/net/dev)."""
        for line in Path(f"/proc/{self.pid(service)}/net/dev").read_text().splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == dev:
                words = counters.split()
                return int(words[0]), int(words[8])
        raise ComposeError(f"{service} has no interface {dev}")

    def kill(self, service: str) -> None:
        podman("kill", self.container(service))

    def pause(self, service: str) -> None:
        podman("pause", self.container(service))

    def start(self, service: str) -> None:
        podman("start", self.container(service))

    def logs(self, service: str, lines: int = 60) -> str:
        out = podman("logs", "--tail", str(lines), self.container(service), check=False)
        return f"--- {service} ---\n{out.stdout}{out.stderr}"

    def save_logs(self) -> None:
        """Every container's whole log into log_dir (for a failed test's report)."""
        ps = podman("ps", "-a", "--filter", f"label={PROJECT_LABEL}={self.name}", "--format", "{{.Names}}", check=False)
        for name in ps.stdout.split():
            out = podman("logs", name, check=False, timeout_s=60.0)
            (self.log_dir / f"{name}.log").write_text(out.stdout + out.stderr)


@contextmanager
def running(project: ComposeProject, **up: Any) -> Iterator[ComposeProject]:
    """`up` now, `down` at the end (also on failure)."""
    project.up(**up)
    try:
        yield project
    finally:
        project.down()
