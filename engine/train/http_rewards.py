"""Stage grpo's ``http`` reward: the team's own reward service scores completions in batches.

Each batch is one POST of ``{"items": [{"prompt", "completion", "reference"}, ...]}``, answered
``{"rewards": [number or null, ...]}`` in the same order (null: the service does not score that completion, TRL's
None). The address is checked before every POST (``engine.contract.net_rules.pin`` against the allow-list entries
the service recorded at submission) and the POST goes to the address that passed, so a DNS answer that turns
private after submission is never followed. A timeout, a connection error, a non-2xx answer, a body that is not
the answer above (garbage, wrong length, non-numbers) is retried ``retries`` times with a doubling backoff; a batch
that still fails scores NaN for its completions (TRL's None: the weighted sum skips it) and is counted as failures,
never failing the step.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import httpx

from engine.contract import net_rules
from engine.contract.spec import HTTP_REWARD_MAX_URL, RewardFunc

log = logging.getLogger("engine.train")
BACKOFF_S = 0.5  # the first retry's wait; each further one doubles it
MAX_BACKOFF_S = 8.0
MAX_ANSWER_BYTES = 16 << 20  # a service answering more than this for one batch is not answering the protocol


class BadAnswer(ValueError):
    """The service answered, but not ``{"rewards": [...]}`` of the batch's length."""


def parse_answer(body: bytes, expected: int) -> list[float]:
    """The rewards of one answer (NaN where the service sent null), or ``BadAnswer``."""
    try:
        data: Any = json.loads(body)
    except ValueError as err:
        raise BadAnswer("not JSON") from err
    rewards = data.get("rewards") if isinstance(data, dict) else None
    if not isinstance(rewards, list):
        raise BadAnswer('not an object with a "rewards" list')
    if len(rewards) != expected:
        raise BadAnswer(f"{len(rewards)} rewards for {expected} completions")
    out = []
    for value in rewards:
        if value is None:
            out.append(math.nan)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isinf(value):
            out.append(float(value))  # a NaN the lenient parser let through reads as null
        else:
            raise BadAnswer(f"reward {str(value)[:40]!r} is not a finite number or null")
    return out


class HttpReward:
    """One configured http reward function."""

    def __init__(self, func: RewardFunc) -> None:
        assert func.url is not None  # the spec requires it for http
        self.func, self.key, self.url = func, func.key, func.url

    def score(self, items: Sequence[dict[str, str]]) -> tuple[list[float], int]:
        """Rewards of ``items`` ({prompt, completion, reference}) in ``batch_size`` POSTs, and how many of them
        could not be scored (their batch failed every try: NaN)."""
        values: list[float] = []
        failures = 0
        size = self.func.batch_size
        for first in range(0, len(items), size):
            batch = items[first : first + size]
            got = self._batch(batch)
            if got is None:
                values.extend([math.nan] * len(batch))
                failures += len(batch)
            else:
                values.extend(got)
        return values, failures

    def _batch(self, batch: Sequence[dict[str, str]]) -> list[float] | None:
        body = json.dumps({"items": list(batch)}).encode()
        for attempt in range(self.func.retries + 1):
            if attempt:
                time.sleep(min(BACKOFF_S * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                return parse_answer(self._post(body), len(batch))
            except net_rules.Blocked as err:  # the address is refused: no retry reaches it
                log.warning("reward %s: not sent (%s)", self.key, err)
                return None
            except (httpx.HTTPError, BadAnswer) as err:
                log.warning("reward %s: try %d of %d failed: %s", self.key, attempt + 1, self.func.retries + 1, err)
        return None

    def _post(self, body: bytes) -> bytes:
        target = net_rules.pin(self.url, self.func.allowed_hosts, HTTP_REWARD_MAX_URL)
        headers = {"content-type": "application/json", "host": target.host_header}
        with (
            httpx.Client(timeout=self.func.timeout_s, follow_redirects=False, trust_env=False) as client,
            client.stream(
                "POST", target.url, content=body, extensions={"sni_hostname": target.host}, headers=headers
            ) as response,
        ):
            response.raise_for_status()
            answer = bytearray()
            deadline = time.monotonic() + self.func.timeout_s  # httpx's timeout is per read: bound the whole answer
            for chunk in response.iter_bytes():
                answer += chunk
                if len(answer) > MAX_ANSWER_BYTES:
                    raise BadAnswer(f"answer over {MAX_ANSWER_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout(f"answer not complete in timeout_s {self.func.timeout_s}")
            return bytes(answer)
