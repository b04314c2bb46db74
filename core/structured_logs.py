"""JSON log lines carrying the request id that caused them, from the API through the broker into the worker.

The API takes a request's ``X-Request-ID`` (or makes one) and binds it for the request (``bound``); a job created
then keeps it (``jobs.request_id``); every message about the job carries it as the ``llmjobs_request_id`` header
(``core.messaging``); the worker binds it (with the job id) while it handles the message. Every log record of the
process gets the bound ids through ``ContextFilter``; ``python-json-logger`` writes the lines.
"""

from __future__ import annotations

import logging
import re
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from pythonjsonlogger.json import JsonFormatter

REQUEST_ID: ContextVar[str | None] = ContextVar("llmjobs_request_id", default=None)
JOB_ID: ContextVar[str | None] = ContextVar("llmjobs_job_id", default=None)
HEADER = "llmjobs_request_id"  # the Celery message header
VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
FIELDS = "%(asctime)s %(levelname)s %(name)s %(message)s %(request_id)s %(job_id)s"


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def accept_request_id(value: str | None) -> str:
    """A caller's X-Request-ID if it is a sane token (it goes into logs and headers), else a fresh id."""
    return value if value and VALID_ID.fullmatch(value) else new_request_id()


def current_request_id() -> str | None:
    return REQUEST_ID.get()


@contextmanager
def bound(request_id: str | None = None, job_id: str | None = None) -> Iterator[None]:
    """Log records made inside carry these ids (contextvars: threads started by anyio copy them)."""
    tokens = [(var, var.set(value)) for var, value in ((REQUEST_ID, request_id), (JOB_ID, job_id)) if value]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


class ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        record.job_id = JOB_ID.get()
        return True


def json_handler(stream: object = None) -> logging.Handler:
    handler = logging.StreamHandler(stream or sys.stderr)  # type: ignore[arg-type]
    handler.setFormatter(
        JsonFormatter(FIELDS, rename_fields={"asctime": "time", "levelname": "level", "name": "logger"})
    )
    handler.addFilter(ContextFilter())
    return handler


def configure(level: str = "INFO", json_lines: bool = True) -> None:
    """The process's root logger: one stderr handler, JSON lines (or plain text with the ids appended)."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    if json_lines:
        root.addHandler(json_handler())
    else:
        plain = logging.StreamHandler()
        plain.setFormatter(
            logging.Formatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s [request_id=%(request_id)s job_id=%(job_id)s]"
            )
        )
        plain.addFilter(ContextFilter())
        root.addHandler(plain)
    root.setLevel(level)
