"""Which addresses an outbound POST may reach: public unicast only, unless an admin's allow-list names the host or a
network holding its address. One rule for the API's webhooks and MLflow (``core.net_guard``, the list from settings)
and the engine's http rewards on workers (the list the service recorded in the spec at submission).

A tenant names the URL and a service host POSTs to it, so an unchecked URL reaches whatever that host can: cloud
metadata, Redis, PostgreSQL, admin ports on loopback. ``checked`` refuses what is not HTTPS or resolves to a
non-public address (loopback, private, link-local, multicast, shared, reserved, documentation and benchmarking
ranges: everything ``ipaddress`` does not call global and the ranges of ``_NOT_PUBLIC``; an IPv6 address carrying an
IPv4 one — mapped, compatible, NAT64, 6to4 — is judged by both). ``pin`` returns the address it checked, and the
caller connects to that address (SNI and Host keep the name): a DNS answer that changes after the check
(rebinding) is never followed.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
ALLOW_LIST = "webhook_allowed_hosts"  # the admin's setting the refusals name


class Blocked(ValueError):
    """A URL the service will not send to; the message starts with ``url:``."""


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


def is_public(ip: IP) -> bool:
    """Whether ``ip`` (and any IPv4 address it carries) is a public unicast address."""
    inner = embedded_ipv4(ip)
    if inner is not None and not is_public(inner):
        return False
    return ip.is_global and not any(ip.version == net.version and ip in net for net in _NOT_PUBLIC)


def allows(allowed: Sequence[str], host: str, ip: IP | None) -> bool:
    """Whether an allow-list entry names ``host`` or is a network (CIDR or address) holding ``ip``."""
    for entry in allowed:
        if entry.lower() == host.lower():
            return True
        try:
            network = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            continue
        if ip is not None and ip.version == network.version and ip in network:
            return True
    return False


def resolve(host: str, port: int) -> list[IP]:
    """Every address ``host`` resolves to now (``host`` itself when it is an address literal)."""
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        raise Blocked(f"url: host {host[:100]!r} does not resolve") from err
    return list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos))


def parse(url: str, max_length: int) -> httpx.URL:
    """``url`` parsed, an http(s) URL with a host of at most ``max_length`` characters, or ``Blocked``."""
    if len(url) > max_length:
        raise Blocked(f"url: longer than {max_length} characters")
    import httpx  # here: every engine process imports the specs, and only a URL check needs httpx (~0.15 s of CPU)

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as err:
        raise Blocked("url: not a valid URL") from err
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise Blocked("url: must be an https:// URL with a host")
    return parsed


def checked(url: str, allowed: Sequence[str], max_length: int) -> tuple[httpx.URL, IP]:
    """``url`` parsed and the first address it resolves to, when every address may be reached; ``Blocked``
    (message names the field) otherwise."""
    parsed = parse(url, max_length)
    host, port = parsed.host, parsed.port or (443 if parsed.scheme == "https" else 80)
    addresses = resolve(host, port)
    for ip in addresses:
        if not is_public(ip) and not allows(allowed, host, ip):
            raise Blocked(
                f"url: {host[:100]} is a private, loopback, link-local, reserved, documentation or benchmarking "
                f"address (or an IPv6 form of one); internal receivers must be listed by an admin in {ALLOW_LIST}"
            )
    if parsed.scheme != "https" and not all(allows(allowed, host, ip) for ip in addresses):
        raise Blocked(f"url: must be https:// (plain http only for receivers an admin lists in {ALLOW_LIST})")
    return parsed, addresses[0]


def pin(url: str, allowed: Sequence[str], max_length: int) -> Target:
    """Resolve and check ``url`` now; the ``Target`` connects to exactly the address that passed."""
    parsed, ip = checked(url, allowed, max_length)
    return Target(url=parsed.copy_with(host=str(ip)), host=parsed.host, host_header=parsed.netloc.decode("ascii"))


def matching_entries(allowed: Sequence[str], url: str, max_length: int) -> list[str]:
    """The allow-list entries that let ``url`` through now (what a worker without the settings must carry);
    ``Blocked`` when the URL may not be reached at all."""
    parsed, _ = checked(url, allowed, max_length)
    addresses = resolve(parsed.host, parsed.port or (443 if parsed.scheme == "https" else 80))
    return [e for e in allowed if any(allows([e], parsed.host, ip) for ip in addresses)]
