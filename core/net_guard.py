"""Where webhooks may be sent: public HTTPS endpoints, plus internal receivers an admin lists in settings.

A tenant names the URL and the API POSTs to it, so an unchecked URL reaches whatever the API host can: cloud
metadata, Redis, PostgreSQL, admin ports on loopback. ``check_url`` refuses at registration what is not HTTPS or
resolves to a non-public address (loopback, private, link-local, multicast, shared/reserved ranges: everything
``ipaddress`` does not call global), unless ``webhook_allowed_hosts`` names the host or a network holding its
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


def _public(ip: IP) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


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
                f"url: {host[:100]} is a private, loopback, link-local or reserved address; internal "
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
