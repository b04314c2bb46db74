"""Optional Redis pub/sub: writers announce "job X has new rows"; SSE streams wake on it instead of waiting a poll.

The rows themselves are always read from the database, so a lost notification delays a stream, never loses data.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import Any

log = logging.getLogger(__name__)


def channel(job_id: str) -> str:
    return f"llmjobs:job:{job_id}"


@lru_cache(maxsize=4)
def _client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)


def notify(redis_url: str | None, job_id: str, **counts: int) -> None:
    """Publish a wake-up for ``job_id``'s streams; a Redis outage only costs latency, so it is logged, not raised."""
    if not redis_url:
        return
    try:
        _client(redis_url).publish(channel(job_id), json.dumps(counts))
    except Exception as err:  # noqa: BLE001 - pub/sub is an optimisation
        log.warning("redis publish failed: %s", err)
