"""Stage grpo's http rewards: their URLs under the webhook address rules (``core.net_guard``), checked at submission,
and the admin's allow decision written into the spec, since the engine on a worker has no settings to ask.

The engine repeats the address check before every POST against the entries recorded here (DNS rebinding): a host
that resolved to a public address at submission and to a private one later is refused there.
"""

from __future__ import annotations

from core import net_guard
from core.errors import ApiError
from core.settings import Settings
from engine.contract.net_rules import matching_entries
from engine.contract.spec import JobBase, TrainSpec


def check_http_rewards(spec: TrainSpec, settings: Settings, where: str = "") -> None:
    """422 naming ``reward_funcs.<i>.url`` for an http reward the service may not POST to now."""
    for i, func in enumerate(spec.reward_funcs):
        if func.name != "http" or func.url is None:
            continue
        try:
            net_guard.check_url(func.url, settings)
        except net_guard.Blocked as err:
            field = f"{where}reward_funcs.{i}.url"
            raise ApiError(422, "validation_error", f"{field}: {str(err).removeprefix('url: ')}", field) from err


def stamp_allowed_hosts(spec: JobBase, settings: Settings) -> None:
    """Replace each http reward's ``allowed_hosts`` (a submitter's value included) with the admin's entries that let
    its URL through now; none when the URL is public or no longer passes (the worker then refuses non-public)."""
    if not isinstance(spec, TrainSpec):
        return
    for func in spec.reward_funcs:
        if func.name != "http" or func.url is None:
            continue
        try:
            entries = matching_entries(settings.webhook_allowed_hosts, func.url, settings.webhook_max_url_length)
        except net_guard.Blocked:
            entries = []
        func.allowed_hosts = entries  # assignment marks the field set, so spec_to_json keeps it
