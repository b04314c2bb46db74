"""Generation through a running deployment: an eval's test prompts sent to ``python -m engine serve``.

Each prompt's token ids (rendered by the eval, with its template, exactly as a loaded model would get them) are POSTed
to ``<deployment_url>/v1/generate`` in the engine's own protocol (``engine.contract.serve_request.ServeRequest``
with ``prompt_token_ids``; JSON lines back with every token's id), ``concurrency`` at a time so the deployment
batches them continuously. Tokens are cut at the first stop token as ``engine.eval.generate`` cuts them, so scoring
is the same code on the same ids, and greedy decoding gives the loaded model's answers token for token.

The stdlib's ``urllib`` speaks HTTP here: the engine depends on no web client library, and one JSON POST per prompt
needs none. A 429 (the deployment's queue is full) waits its ``Retry-After`` and asks again; a 400/404 is the spec's
fault (``BadInput`` naming ``deployment``); a deployment that does not answer, answers 5xx or ends an answer with an
error line is a retryable failure of the job (never an empty answer scored).
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.contract.runfiles import BadInput
from engine.contract.serve_request import RequestError, SamplingOptions, ServeRequest
from engine.contract.spec import EvalSpec

TIMEOUT_S = 600.0  # one prompt's whole generation
MAX_QUEUE_WAITS = 120


_SPEC_FIELDS = {"max_tokens": "max_new_tokens"}  # the eval spec's name of a serving request field


@dataclasses.dataclass(frozen=True)
class RemoteOptions:
    """What every request asks for: the eval's decoding settings as the contract's serving request."""

    options: SamplingOptions
    model: str | None  # the deployment's served name or one of its adapters (None: its base)
    stop_ids: frozenset[int]

    @classmethod
    def of_spec(cls, spec: EvalSpec, stop_ids: frozenset[int]) -> RemoteOptions:
        """The eval's decoding settings in the serving request's terms (its top_p "off" is 1.0, eval's 0); one the
        serving request refuses (a temperature over 2) is ``BadInput`` naming the eval spec's field."""
        try:
            options = SamplingOptions(
                max_tokens=spec.max_new_tokens,
                temperature=0.0 if spec.greedy else spec.temperature,
                top_k=spec.top_k,
                top_p=spec.top_p or 1.0,
                seed=spec.seed,
            )
        except RequestError as err:
            field = _SPEC_FIELDS.get(err.field, err.field)
            raise BadInput(f"{field}: {err.detail} on a deployment", field) from err
        return cls(options, spec.deployment, stop_ids)

    def request(self, prompt_ids: list[int]) -> ServeRequest:
        return ServeRequest(options=self.options, prompt_token_ids=prompt_ids, model=self.model)


def _post(url: str, generation: ServeRequest) -> Iterator[dict[str, Any]]:
    """The JSON lines of one generation; a full queue is waited out."""
    data = json.dumps(generation.to_json()).encode()
    for _ in range(MAX_QUEUE_WAITS):
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
        try:
            response = urllib.request.urlopen(request, timeout=TIMEOUT_S)  # noqa: S310 - an http(s) URL (spec pattern)
        except urllib.error.HTTPError as err:
            if err.code == 429:
                time.sleep(float(err.headers.get("Retry-After") or 1))
                continue
            detail = json.loads(err.read() or b"{}").get("error", {}).get("message", err.reason)
            if err.code >= 500:  # the deployment failed the request (engine.serve.server): not the spec's fault
                raise RuntimeError(
                    f"deployment: it failed a request ({err.code}): {detail}; the job is retried"
                ) from err
            raise BadInput(
                f"deployment: the deployment refused the request ({err.code}): {detail}", "deployment"
            ) from err
        with response:
            yield from (json.loads(line) for line in response if line.strip())
        return
    raise RuntimeError(f"deployment: its queue stayed full for {MAX_QUEUE_WAITS} tries")


def generate_one(url: str, prompt_ids: list[int], opts: RemoteOptions) -> dict[str, Any]:
    """One prompt's answer: ``tokens`` (cut before the first stop token), ``finish_reason``, ``generated``."""
    tokens: list[int] = []
    generated = 0
    for line in _post(url.rstrip("/") + "/v1/generate", opts.request(prompt_ids)):
        if line.get("type") == "token" and line.get("index", 0) == 0:
            tokens.append(int(line["token_id"]))
        elif line.get("type") == "finish" and line.get("index", 0) == 0:
            generated = int(line.get("completion_tokens", len(tokens)))
        elif line.get("type") == "error":
            raise RuntimeError(f"deployment: its answer failed: {line['error']['message']}; the job is retried")
    cut = next((i for i, token in enumerate(tokens) if token in opts.stop_ids), None)
    if cut is None:
        return {"tokens": tokens, "finish_reason": "length", "generated": generated or len(tokens)}
    return {"tokens": tokens[:cut], "finish_reason": "stop", "generated": generated or cut + 1}


def generate_remote(
    url: str,
    prompts: list[list[int]],
    opts: RemoteOptions,
    concurrency: int,
    on_done: Callable[[int, dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every prompt's answer (with its ``index``), ``concurrency`` requests in flight; ``on_done`` after each."""
    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="eval-remote") as pool:
            futures = [pool.submit(generate_one, url, ids, opts) for ids in prompts]
            records = []
            for i, future in enumerate(futures):
                records.append({"index": i, **future.result()})
                if on_done is not None:
                    on_done(i, records[-1])
            return records
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
        raise RuntimeError(f"deployment: {url} did not answer ({err}); the job is retried") from err
