"""The Python SDK of the llmjobs service: ``Client`` (sync) and ``AsyncClient`` over its HTTP API, typed answers
(``llmjobs.types``) and typed errors (``llmjobs.errors``). It speaks HTTP only: nothing of the service is imported.

    from llmjobs import Client
    with Client() as client:  # LLMJOBS_URL, LLMJOBS_TOKEN
        job = client.wait(client.create_job({"kind": "preprocess", ...})["id"])
"""

from llmjobs.aio import AsyncClient
from llmjobs.client import Client
from llmjobs.errors import (
    ApiConnectionError,
    BadRequest,
    Conflict,
    Forbidden,
    LlmjobsError,
    NotFound,
    PayloadTooLarge,
    ServerError,
    Unauthorized,
    ValidationError,
    WaitTimeout,
)
from llmjobs.types import TERMINAL_STATES, StreamMessage

__all__ = [
    "TERMINAL_STATES",
    "ApiConnectionError",
    "AsyncClient",
    "BadRequest",
    "Client",
    "Conflict",
    "Forbidden",
    "LlmjobsError",
    "NotFound",
    "PayloadTooLarge",
    "ServerError",
    "StreamMessage",
    "Unauthorized",
    "ValidationError",
    "WaitTimeout",
]
