"""Where Gym servers may live: the egress the coordinator allows itself
(docs/configuration.md#gym-egress).

Registration accepts a Gym server's URL only when its host is written in a canonical form and
every address it names or resolves to is allowed; every control connection checks the resolved
address again as it connects (a name cannot resolve to something else later), and connects to
the address it checked. Some addresses are never allowed, whatever the setting says: the
unspecified and link-local ranges (the cloud metadata services live there, and at
``fd00:ec2::254`` and ``100.100.100.200``), multicast and reserved ranges, and the coordinator's
own and its database's endpoints.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpcore

__all__ = [
    "EgressPolicy",
    "EgressRefused",
    "GuardedBackend",
    "guarded_transport",
    "parse_gym_url",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_NEVER: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",  # unspecified, "this network"
        "169.254.0.0/16",  # link-local: 169.254.169.254 is the metadata service of most clouds
        "100.100.100.200/32",  # Alibaba Cloud's metadata service
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, broadcast
        "::/128",
        "fe80::/10",
        "ff00::/8",
        "fd00:ec2::254/128",  # AWS's metadata service over IPv6
    )
)
_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*\.?$")


class EgressRefused(httpcore.ConnectError):
    """A Gym server's address the policy does not allow; no connection was made."""


def _canonical(ip: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address is judged as the IPv4 address it carries."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True)
class EgressPolicy:
    """``networks``: the ranges Gym servers may be in; ``hosts``: names allowed whatever they
    resolve to (``name`` or ``*.suffix``), still never to a forbidden address. ``endpoints``:
    ``(address, port)`` pairs never allowed (the database's); ``local_ports``: ports never
    allowed on this host's own addresses (the coordinator's)."""

    networks: tuple[IPNetwork, ...]
    hosts: tuple[str, ...] = ()
    endpoints: frozenset[tuple[IPAddress, int]] = frozenset()
    local_ports: frozenset[int] = frozenset()
    local_addresses: frozenset[IPAddress] = field(default_factory=frozenset)

    @classmethod
    def parse(
        cls,
        text: str,
        *,
        endpoints: Iterable[tuple[str, int]] = (),
        local_ports: Iterable[int] = (),
        local_addresses: Iterable[str] = (),
    ) -> EgressPolicy:
        """``"10.0.0.0/8,gym.example.com,*.gym.svc.cluster.local"``; a bad item is a ValueError naming it."""
        networks: list[IPNetwork] = []
        hosts: list[str] = []
        for item in filter(None, (part.strip().lower() for part in text.split(","))):
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
                continue
            except ValueError:
                pass
            name = item[2:] if item.startswith("*.") else item
            if not _NAME.fullmatch(name) or _looks_numeric(name):
                raise ValueError(f"Gym egress entry {item!r} is neither a network (CIDR) nor a host name (or *.suffix)")
            hosts.append(item.rstrip("."))
        return cls(
            tuple(networks),
            tuple(hosts),
            frozenset((_canonical(ipaddress.ip_address(a)), int(p)) for a, p in endpoints),
            frozenset(local_ports),
            frozenset(_canonical(ipaddress.ip_address(a)) for a in local_addresses),
        )

    # --- addresses --------------------------------------------------------------------------

    def check_address(self, host: str, ip: IPAddress, port: int) -> None:
        """ValueError when ``host`` at ``ip``:``port`` is not allowed."""
        ip = _canonical(ip)
        if any(ip in net for net in _NEVER):
            raise ValueError(f"{ip} is never a Gym server's address (unspecified, link-local, metadata, multicast or reserved)")
        if (ip, port) in self.endpoints:
            raise ValueError(f"{ip}:{port} is the coordinator's database")
        if port in self.local_ports and (ip.is_loopback or ip in self.local_addresses):
            raise ValueError(f"port {port} of this host is the coordinator itself")
        if self._host_allowed(host):
            return
        if not any(ip in net for net in self.networks if net.version == ip.version):
            raise ValueError(f"{ip} is outside the networks Gym servers may be in (CKPTC_GYM_ALLOWED_NETWORKS)")

    def _host_allowed(self, host: str) -> bool:
        host = host.rstrip(".").lower()
        for allowed in self.hosts:
            if allowed.startswith("*.") and host.endswith(allowed[1:]) or host == allowed:
                return True
        return False

    async def resolve(self, host: str, port: int) -> list[str]:
        """Every address ``host`` resolves to, each allowed; ValueError when it resolves to none
        or to any address that is not allowed (a name that also points elsewhere is refused)."""
        ip = _literal(host)
        if ip is not None:
            self.check_address(host, ip, port)
            return [str(ip)]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise ValueError(f"host {host!r} does not resolve ({e.strerror or e})") from None
        found: list[str] = []
        for *_, sockaddr in infos:
            addr = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            self.check_address(host, addr, port)
            if str(addr) not in found:
                found.append(str(addr))
        if not found:
            raise ValueError(f"host {host!r} resolves to no address")
        return found


def parse_gym_url(url: str) -> tuple[str, int]:
    """A Gym server's base URL as registration accepts it: its host (lower case, without
    brackets) and port. ValueError names what is wrong; nothing is resolved."""
    if any(not c.isprintable() or c.isspace() for c in url):
        raise ValueError("must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"is not a valid URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an absolute http(s) URL")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValueError("must not carry a user or password (the Gym control token is sent as a bearer token)")
    if parts.query or parts.fragment:
        raise ValueError("must not carry a query or fragment")
    host = parts.hostname
    if not host.isascii():
        raise ValueError("host must be ASCII: write an internationalised name in its xn-- form")
    port = port if port is not None else (443 if parts.scheme == "https" else 80)
    if port == 0:
        raise ValueError("port must be between 1 and 65535")
    if _literal(host) is None and (not _NAME.fullmatch(host) or _looks_numeric(host)):
        raise ValueError(f"host {host!r} is not a canonical host name or address (an address is written a.b.c.d or [v6])")
    return host, port


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _looks_numeric(name: str) -> bool:
    """A name some resolvers would read as an IPv4 address (``2130706433``, ``127.1``,
    ``0x7f.1``, ``0177.0.0.1``): refused, it is no canonical form of anything."""
    try:
        socket.inet_aton(name.rstrip("."))
        return True
    except OSError:
        return name.rstrip(".").rsplit(".", 1)[-1].isdigit()


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, connecting only to addresses the policy allows: the name is
    resolved here, every address it resolves to checked, and the first one connected to."""

    def __init__(self, policy: EgressPolicy, inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.policy = policy
        self.inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(
        self, host: str, port: int, timeout: float | None = None, local_address: str | None = None, socket_options: Any = None
    ) -> httpcore.AsyncNetworkStream:
        try:
            addresses = await self.policy.resolve(host, port)
        except ValueError as e:
            raise EgressRefused(f"egress refused: {host}:{port}: {e}") from None
        return await self.inner.connect_tcp(addresses[0], port, timeout=timeout, local_address=local_address, socket_options=socket_options)

    async def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        raise EgressRefused("egress refused: a Gym server is reached over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def guarded_transport(policy: EgressPolicy, *, verify: Any, limits: Any) -> Any:
    """An httpx transport whose connections go through :class:`GuardedBackend`."""
    import httpx

    transport = httpx.AsyncHTTPTransport(verify=verify, limits=limits, trust_env=False)
    # The pool httpx builds, again with the guarded backend (httpx has no option for it).
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=verify,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=GuardedBackend(policy),
    )
    return transport
