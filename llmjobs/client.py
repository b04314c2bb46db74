"""``llmjobs.Client``: the service's HTTP API from Python, synchronously (``llmjobs.AsyncClient`` is the async twin).

Lists are iterators that follow the API's cursors (``last_id``, ``next_cursor``, ``next_offset``) page after page, so
no row is lost or repeated; ``stream`` reconnects with ``Last-Event-ID`` after a dropped connection; reads and
idempotent writes answered 502/503/504 are sent again (``max_retries``, ``Retry-After``); downloads and uploads
stream in chunks. Errors are ``llmjobs.errors`` exceptions carrying the API's ``code`` and ``field``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import httpx
from httpx_sse import connect_sse
from typing_extensions import Self, Unpack

from llmjobs import _common as c
from llmjobs.errors import WaitTimeout, error_from, unreachable
from llmjobs.types import (
    TERMINAL_STATES,
    Artifact,
    Checkpoint,
    Event,
    File,
    FileDeleted,
    Job,
    JobDeleted,
    LogLine,
    MetricPoint,
    Page,
    StreamMessage,
)


class Client:
    """``Client(url=None, token=None)``: ``url`` defaults to ``LLMJOBS_URL`` (else http://127.0.0.1:8000), ``token``
    to ``LLMJOBS_TOKEN``. ``http``: an ``httpx.Client`` to use instead (its base URL and headers are kept)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        http: httpx.Client | None = None,
        max_retries: int = len(c.RETRY_DELAYS_S),
    ):
        self.url = c.base_url(url)
        self.max_retries = max_retries
        self.http = http or httpx.Client(base_url=self.url, headers=c.auth_headers(token), timeout=timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One API call; its JSON answer, or the typed error. A read, or a write with an Idempotency-Key, answered
        502/503/504 is sent again up to ``max_retries`` times, after the answer's Retry-After or a backoff."""
        retry = c.may_retry(method, kwargs.get("headers"))
        attempt = 0
        while True:
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.HTTPError as err:
                raise unreachable(self.url, err) from err
            delay = c.resend_delay(response, retry, attempt, self.max_retries)
            if delay is None:
                return c.answer(response)
            time.sleep(delay)
            attempt += 1

    # jobs
    def create_job(self, spec: Mapping[str, Any] | str | bytes, *, idempotency_key: str | None = None) -> Job:
        """Submit a spec (a mapping, or JSON text); a replay with the same ``idempotency_key`` returns the same job."""
        return cast(Job, self.request("POST", "/v1/jobs", **c.spec_request(spec, idempotency_key)))

    def jobs_page(self, *, after: str | None = None, limit: int = 20, **filters: Unpack[c.JobFilters]) -> Page:
        """One page of the team's jobs, newest first (``filters``: state, kind, name, parent_id, metadata)."""
        params = c.jobs_query(filters, after, limit)
        return cast(Page, self.request("GET", "/v1/jobs", params=params))

    def list_jobs(self, *, page_size: int = 100, **filters: Unpack[c.JobFilters]) -> Iterator[Job]:
        """Every matching job, newest first, fetched page by page as the iteration goes."""
        return self._pages(c.Pages("/v1/jobs", c.jobs_query(filters, None, page_size)))

    def get_job(self, job_id: str) -> Job:
        return cast(Job, self.request("GET", c.job_path(job_id)))

    def cancel_job(self, job_id: str) -> Job:
        return cast(Job, self.request("POST", c.job_path(job_id, "/cancel")))

    def delete_job(self, job_id: str, *, outputs: bool = False) -> JobDeleted:
        """Delete a finished job (``Conflict`` while it runs); ``outputs``: its output files too."""
        return cast(JobDeleted, self.request("DELETE", c.job_path(job_id), params={"outputs": str(outputs).lower()}))

    def wait(self, job_id: str, *, timeout: float | None = None, poll_interval: float = 1.0) -> Job:
        """Poll until the job is succeeded, failed or cancelled and return it; ``WaitTimeout`` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get_job(job_id)
            if job["state"] in TERMINAL_STATES:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"{job_id} still {job['state']} after {timeout}s", cast(dict[str, Any], job))
            time.sleep(poll_interval)

    # what a job records
    def events(
        self, job_id: str, *, types: str | None = None, after: int = 0, page_size: int = 1000
    ) -> Iterator[Event]:
        """The job's events, oldest first (``types``: comma-separated, e.g. "state,checkpoint")."""
        return self._pages(c.events_pages(job_id, types, after, page_size))

    def logs(
        self,
        job_id: str,
        *,
        stream: str | None = None,
        rank: int | None = None,
        q: str | None = None,
        offset: int = 0,
        page_size: int = 5000,
    ) -> Iterator[LogLine]:
        """Log lines of one stream (default the launcher's: every rank; ``rank=0`` or ``stream="rank0"``: one)."""
        return self._pages(c.logs_pages(job_id, stream, rank, q, offset, page_size))

    def metrics(self, job_id: str, *, names: str | None = None, page_size: int = 10000) -> Iterator[MetricPoint]:
        """Every metric point by step (``names``: comma-separated), paged by ``next_cursor``: none lost."""
        return self._pages(c.metrics_pages(job_id, names, page_size))

    def stream(
        self, job_id: str, *, last_event_id: str | None = None, retries: int = len(c.RETRY_DELAYS_S)
    ) -> Generator[StreamMessage, None, None]:
        """The job's live Server-Sent Events until its ``end`` message; after a dropped connection or a 502/503/504
        answer it reconnects (up to ``retries`` times in a row) with ``Last-Event-ID``, so nothing is missed or
        repeated."""
        resume = c.Resume(self.url, job_id, last_event_id, retries)
        while True:
            lost: httpx.TransportError | None = None
            try:
                with connect_sse(self.http, "GET", resume.path, headers=resume.headers(), timeout=None) as source:
                    if source.response.status_code >= 400:
                        source.response.read()
                        resume.refused(source.response)
                    else:
                        for sse in source.iter_sse():
                            if (message := resume.message(sse.event, sse.data, sse.id)) is not None:
                                yield message
                                if message.event == "end":
                                    return
            except httpx.TransportError as err:
                lost = err
            time.sleep(resume.lost(lost))

    def checkpoints(self, job_id: str) -> list[Checkpoint]:
        """A train job's checkpoints, oldest first, with the loss at each."""
        return cast(list[Checkpoint], self.request("GET", c.job_path(job_id, "/checkpoints"))["data"])

    def artifacts(self, job_id: str) -> list[Artifact]:
        """The files and directories the job wrote, each with its size and download URL."""
        return cast(list[Artifact], self.request("GET", c.job_path(job_id, "/artifacts"))["data"])

    def download(self, job_id: str, name: str, dest: str | os.PathLike[str], *, file: str | None = None) -> int:
        """Stream artifact ``name`` into ``dest`` (a directory arrives as a tar; ``file``: one file of it); returns
        the bytes written. A failed download leaves no partial file."""
        written = 0
        try:
            with self.http.stream(
                "GET", c.download_path(job_id, name), params={"file": file} if file else None, timeout=None
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise error_from(response)
                with open(dest, "wb") as out:
                    for chunk in response.iter_bytes(c.CHUNK):
                        written += out.write(chunk)
        except httpx.HTTPError as err:
            Path(dest).unlink(missing_ok=True)
            raise unreachable(self.url, err) from err
        return written

    def _pages(self, pages: c.Pages) -> Iterator[Any]:
        """Every item of a paged list, each page fetched when the iteration reaches it."""
        params = pages.params
        while True:
            page = self.request("GET", pages.path, params=params)
            yield from page["data"]
            if (following := pages.following(params, page)) is None:
                return
            params = following

    # files
    def upload(self, local: str | os.PathLike[str], path: str, *, overwrite: bool = False) -> File:
        """Stream the local file to ``path`` in the team's upload area; the answer has its ``server_path`` (name it
        in a spec) and ``sha256``. ``Conflict`` if it exists and not ``overwrite``."""
        size = os.path.getsize(local)
        with open(local, "rb") as body:
            return cast(
                File,
                self.request("PUT", c.file_path(path), content=body, **c.upload_request(size, overwrite)),
            )

    def upload_dir(
        self, local_dir: str | os.PathLike[str], path: str | None = None, *, overwrite: bool = False
    ) -> list[File]:
        """Upload every file under ``local_dir`` (e.g. a small HF model directory) below ``path``, one by one."""
        return [self.upload(file, c.join(path, rel), overwrite=overwrite) for file, rel in c.tree(Path(local_dir))]

    def files(self, *, prefix: str | None = None, page_size: int = 1000) -> Iterator[File]:
        """The team's uploaded files, by path."""
        return self._pages(c.files_pages(prefix, page_size))

    def delete_file(self, path: str) -> FileDeleted:
        """Delete one uploaded file of the team (directories it leaves empty go too); ``NotFound`` if there is none."""
        return cast(FileDeleted, self.request("DELETE", c.file_path(path)))
