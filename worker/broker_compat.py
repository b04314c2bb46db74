"""Keep a Celery worker alive when its Redis broker goes away (kombu 5.7).

When the consumer loses its Redis connection, Celery closes that connection and opens a new one. Two calls then
reach kombu's Redis QoS of the old channel, whose transport has already dropped its ``connection`` (or its
``client``): restoring the unacknowledged messages while closing it, and later the ack (or reject) of a task that
was running through the outage. Each builds a Redis client from the missing connection, an ``AttributeError``
escapes (Celery's ``ignore_errors`` swallows connection errors only), Celery calls it an "Unrecoverable error" and
the worker exits, taking its running jobs with it. ``install`` makes those calls log and give up, as they would
have with a connection error. Nothing is lost by that: Redis gives unacknowledged messages back after the
visibility timeout, a redelivered ``run_node`` finds its node taken and does nothing, and the reconciler re-sends
the message of any job that still waits (the job row, not the message, is the record).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
GUARDED = ("restore_unacked", "ack", "reject")  # the QoS calls that build a client from the channel's connection


def _guard(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(self, *args, **kwargs)
        except AttributeError as err:
            if "'NoneType'" not in str(err):
                raise  # not the dropped connection: a real bug
            log.warning(
                "broker connection lost: %s on the old channel skipped (%s); Redis restores unacknowledged "
                "messages after the visibility timeout",
                name,
                err,
            )
            return None

    guarded._llmjobs_guarded = True  # type: ignore[attr-defined]
    return guarded


def install() -> None:
    """Patch kombu's Redis QoS once (idempotent; a no-op where the Redis client is not installed)."""
    try:
        from kombu.transport import redis as kombu_redis
    except ImportError:  # no redis client: no Redis broker either
        return
    for name in GUARDED:
        call = getattr(kombu_redis.QoS, name)
        if not getattr(call, "_llmjobs_guarded", False):
            setattr(kombu_redis.QoS, name, _guard(name, call))
