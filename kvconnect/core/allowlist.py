"""Which prefill peers a decode worker may dial: hosts and networks, parsed once (pure, no I/O).

`kv_transfer_params` name the host a decode worker connects to. A client that can reach a decode worker
directly could otherwise make it dial any address; with an allow-list (`peer_allowlist`, comma-separated
IP addresses, CIDR networks or host names) a pull naming another host is refused before any connection.
Names are compared as written (no DNS lookup): list the names the prefill workers advertise.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

from kvconnect.core.errors import ConfigError, InvalidRequestError
from kvconnect.core.plan.params import canonical_host

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?$")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class AllowList:
    networks: tuple[Network, ...]
    names: frozenset[str]

    @property
    def open(self) -> bool:
        """True when nothing was listed: every peer is allowed."""
        return not self.networks and not self.names

    def allows(self, host: str) -> bool:
        """Whether `host`, in its one spelling (`params.canonical_host`: a bracketed IPv4 address or a numeric name
        is no host at all), is listed."""
        if self.open:
            return True
        try:
            canonical = canonical_host(host)
        except InvalidRequestError:
            return False
        try:
            addr = ipaddress.ip_address(canonical)
        except ValueError:
            return canonical in self.names
        return any(addr in net for net in self.networks)

    def check(self, host: str, field: str) -> None:
        """InvalidRequestError naming `field` unless `host` is allowed (before any connection is made)."""
        if not self.allows(host):
            raise InvalidRequestError(field, f"{host!r} is not an allowed prefill peer (peer_allowlist)")


@functools.lru_cache(maxsize=32)
def parse_allowlist(text: str) -> AllowList:
    """`text`: comma-separated IPs, CIDRs or host names ("" = any peer); ConfigError names a bad entry."""
    networks: list[Network] = []
    names: set[str] = set()
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            continue
        except ValueError:
            pass
        if not _HOSTNAME.match(entry) or entry.replace(".", "").isdigit():
            raise ConfigError(f"peer_allowlist: {entry!r} is neither an IP address, a CIDR network nor a host name")
        names.add(entry.lower().rstrip("."))
    return AllowList(tuple(networks), frozenset(names))


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a socket on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
