"""Where webhooks (and the MLflow report) may be sent: public HTTPS endpoints, plus internal receivers an admin
lists in settings (``webhook_allowed_hosts``).

The rule itself is ``engine.contract.net_rules`` (the engine's http rewards apply it on workers too): ``check_url``
refuses at registration what is not HTTPS or resolves to a non-public address unless the admin's list allows it;
``pin`` repeats the check at every delivery and returns the address it checked, and the sender connects to that
address (SNI and Host keep the name): a DNS answer that changes after the check (rebinding) is never followed.
"""

from __future__ import annotations

from core.settings import Settings
from engine.contract.net_rules import Blocked, Target, checked
from engine.contract.net_rules import is_public as _public
from engine.contract.net_rules import pin as _pin

__all__ = ["BLOCKED_REASON", "Blocked", "Target", "_public", "check_url", "pin"]
BLOCKED_REASON = "blocked: destination not allowed"


def check_url(url: str, settings: Settings) -> str:
    """``url`` when the service may send to it now; ``Blocked`` (message names the field) otherwise."""
    checked(url, settings.webhook_allowed_hosts, settings.webhook_max_url_length)
    return url


def pin(url: str, settings: Settings) -> Target:
    """Resolve and check ``url`` now; the ``Target`` connects to exactly the address that passed."""
    return _pin(url, settings.webhook_allowed_hosts, settings.webhook_max_url_length)
