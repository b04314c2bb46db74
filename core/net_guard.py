"""Where webhooks may be sent: public HTTPS endpoints, plus internal receivers an admin lists in settings.

A tenant names the URL and the API POSTs to it, so an unchecked URL reaches whatever the API host can: cloud
metadata, Redis, PostgreSQL, admin ports on loopback. ``check_url`` refuses at registration what is not HTTPS or
resolves to a non-public address (loopback, private, link-local, multicast, shared, reserved, documentation and
benchmarking ranges: everything ``ipaddress`` does not call global and the ranges of ``_NOT_PUBLIC``; an IPv6
address carrying an IPv4 one — mapped, compatible, NAT64, 6to4 — is judged by both), unless ``webhook_allowed_hosts`` names the host or a network holding its
address. ``pin`` repeats the check at every delivery and returns the address it checked, and the sender connects to
that address (SNI and Host keep the name): a DNS answer that changes after the check (rebinding) is never followed.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import httpx

from core.settings import Settings

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
BLOCKED_REASON = "blocked: destination not allowed"


class Blocked(ValueError):
    """A webhook URL the service will not send to; the message starts with ``url:``."""


@dataclass(frozen=True)
class Target:
    """Where one POST goes: ``url`` has the checked address as host; ``host`` is the name for Host and SNI."""

    url: httpx.URL
    host: str
    host_header: str


# Not reachable as a public receiver, whatever ``ipaddress.is_global`` says in this Python (its lists changed in
# 3.11.10/3.12.4): reserved, documentation, benchmarking, relay and local-use translation ranges.
_NOT_PUBLIC = [
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",  # "this network"
        "100.64.0.0/10",  # shared address space (carrier NAT, cloud metadata at 100.100.100.200)
        "192.0.0.0/24",  # IETF protocol assignments
        "192.0.2.0/24",  # TEST-NET-1
        "192.88.99.0/24",  # 6to4 relay anycast (deprecated)
        "198.18.0.0/15",  # benchmarking
        "198.51.100.0/24",  # TEST-NET-2
        "203.0.113.0/24",  # TEST-NET-3
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and the broadcast address
        "::/128",
        "::1/128",
        "64:ff9b:1::/48",  # local-use IPv4/IPv6 translation (RFC 8215): only inside a network
        "100::/64",  # discard-only
        "2001::/23",  # IETF protocol assignments (Teredo, ORCHID, benchmarking 2001:2::/48)
        "2001:db8::/32",  # documentation
        "3fff::/20",  # documentation (RFC 9637)
        "5f00::/16",  # segment routing SIDs
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated)
        "ff00::/8",  # multicast
    )
]
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # well-known NAT64 prefix: the last 32 bits are the IPv4 address
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated ::a.b.c.d


def embedded_ipv4(ip: IP) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries and reaches: IPv4-mapped (::ffff:a.b.c.d), IPv4-compatible
    (::a.b.c.d), NAT64 (64:ff9b::a.b.c.d) and 6to4 (2002:AABB:CCDD::); None for any other."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64 or (ip in _IPV4_COMPATIBLE and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _public(ip: IP) -> bool:
    """Whether ``ip`` (and any IPv4 address it carries) is a public unicast address."""
    inner = embedded_ipv4(ip)
    if inner is not None and not _public(inner):
        return False
    return ip.is_global and not any(ip.version == net.version and ip in net for net in _NOT_PUBLIC)


def _admin_allows(host: str, ip: IP | None, settings: Settings) -> bool:
    for entry in settings.webhook_allowed_hosts:
        if entry.lower() == host.lower():
            return True
        try:
            network = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            continue
        if ip is not None and ip.version == network.version and ip in network:
            return True
    return False


def _resolve(host: str, port: int) -> list[IP]:
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        raise Blocked(f"url: host {host[:100]!r} does not resolve") from err
    return list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos))


def _parse(url: str, settings: Settings) -> httpx.URL:
    if len(url) > settings.webhook_max_url_length:
        raise Blocked(f"url: longer than {settings.webhook_max_url_length} characters")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as err:
        raise Blocked("url: not a valid URL") from err
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise Blocked("url: must be an https:// URL with a host")
    return parsed


def _checked(url: str, settings: Settings) -> tuple[httpx.URL, IP]:
    parsed = _parse(url, settings)
    host, port = parsed.host, parsed.port or (443 if parsed.scheme == "https" else 80)
    addresses = _resolve(host, port)
    for ip in addresses:
        if not _public(ip) and not _admin_allows(host, ip, settings):
            raise Blocked(
                f"url: {host[:100]} is a private, loopback, link-local, reserved, documentation or benchmarking "
                "address (or an IPv6 form of one); internal "
                "receivers must be listed by an admin in webhook_allowed_hosts"
            )
    if parsed.scheme != "https" and not all(_admin_allows(host, ip, settings) for ip in addresses):
        raise Blocked("url: must be https:// (plain http only for receivers an admin lists in webhook_allowed_hosts)")
    return parsed, addresses[0]


def check_url(url: str, settings: Settings) -> str:
    """``url`` when the service may send to it now; ``Blocked`` (message names the field) otherwise."""
    _checked(url, settings)
    return url


def pin(url: str, settings: Settings) -> Target:
    """Resolve and check ``url`` now; the ``Target`` connects to exactly the address that passed."""
    parsed, ip = _checked(url, settings)
    return Target(url=parsed.copy_with(host=str(ip)), host=parsed.host, host_header=parsed.netloc.decode("ascii"))
