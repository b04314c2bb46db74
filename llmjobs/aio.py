"""``llmjobs.AsyncClient``: ``llmjobs.Client`` for asyncio code, method for method (lists are async iterators).

Kept as a line-by-line twin of ``llmjobs.client`` rather than generated from it: a reader sees every ``await``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, cast

import anyio
import httpx
from httpx_sse import aconnect_sse
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


class AsyncClient:
    """``AsyncClient(url=None, token=None)``: as ``Client``; ``http``: an ``httpx.AsyncClient`` to use instead."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        http: httpx.AsyncClient | None = None,
        max_retries: int = len(c.RETRY_DELAYS_S),
    ):
        self.url = c.base_url(url)
        self.max_retries = max_retries
        self.http = http or httpx.AsyncClient(base_url=self.url, headers=c.auth_headers(token), timeout=timeout)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One API call; its JSON answer, or the typed error. A read, or a write with an Idempotency-Key, answered
        502/503/504 is sent again up to ``max_retries`` times, after the answer's Retry-After or a backoff."""
        retry = c.may_retry(method, kwargs.get("headers"))
        attempt = 0
        while True:
            try:
                response = await self.http.request(method, path, **kwargs)
            except httpx.HTTPError as err:
                raise unreachable(self.url, err) from err
            delay = c.resend_delay(response, retry, attempt, self.max_retries)
            if delay is None:
                return c.answer(response)
            await anyio.sleep(delay)
            attempt += 1

    # jobs
    async def create_job(self, spec: Mapping[str, Any] | str | bytes, *, idempotency_key: str | None = None) -> Job:
        """Submit a spec (a mapping, or JSON text); a replay with the same ``idempotency_key`` returns the same job."""
        return cast(Job, await self.request("POST", "/v1/jobs", **c.spec_request(spec, idempotency_key)))

    async def jobs_page(self, *, after: str | None = None, limit: int = 20, **filters: Unpack[c.JobFilters]) -> Page:
        """One page of the team's jobs, newest first (``filters``: state, kind, name, parent_id, metadata)."""
        params = c.jobs_query(filters, after, limit)
        return cast(Page, await self.request("GET", "/v1/jobs", params=params))

    def list_jobs(self, *, page_size: int = 100, **filters: Unpack[c.JobFilters]) -> AsyncIterator[Job]:
        """Every matching job, newest first, fetched page by page as the iteration goes."""
        return self._pages(c.Pages("/v1/jobs", c.jobs_query(filters, None, page_size)))

    async def get_job(self, job_id: str) -> Job:
        return cast(Job, await self.request("GET", c.job_path(job_id)))

    async def cancel_job(self, job_id: str) -> Job:
        return cast(Job, await self.request("POST", c.job_path(job_id, "/cancel")))

    async def delete_job(self, job_id: str, *, outputs: bool = False) -> JobDeleted:
        """Delete a finished job (``Conflict`` while it runs); ``outputs``: its output files too."""
        return cast(
            JobDeleted, await self.request("DELETE", c.job_path(job_id), params={"outputs": str(outputs).lower()})
        )

    async def wait(self, job_id: str, *, timeout: float | None = None, poll_interval: float = 1.0) -> Job:
        """Poll until the job is succeeded, failed or cancelled and return it; ``WaitTimeout`` after ``timeout`` s."""
        deadline = None if timeout is None else anyio.current_time() + timeout
        while True:
            job = await self.get_job(job_id)
            if job["state"] in TERMINAL_STATES:
                return job
            if deadline is not None and anyio.current_time() >= deadline:
                raise WaitTimeout(f"{job_id} still {job['state']} after {timeout}s", cast(dict[str, Any], job))
            await anyio.sleep(poll_interval)

    # what a job records
    def events(
        self, job_id: str, *, types: str | None = None, after: int = 0, page_size: int = 1000
    ) -> AsyncIterator[Event]:
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
    ) -> AsyncIterator[LogLine]:
        """Log lines of one stream (default the launcher's: every rank; ``rank=0`` or ``stream="rank0"``: one)."""
        return self._pages(c.logs_pages(job_id, stream, rank, q, offset, page_size))

    def metrics(self, job_id: str, *, names: str | None = None, page_size: int = 10000) -> AsyncIterator[MetricPoint]:
        """Every metric point by step (``names``: comma-separated), paged by ``next_cursor``: none lost."""
        return self._pages(c.metrics_pages(job_id, names, page_size))

    async def stream(
        self, job_id: str, *, last_event_id: str | None = None, retries: int = len(c.RETRY_DELAYS_S)
    ) -> AsyncIterator[StreamMessage]:
        """The job's live Server-Sent Events until its ``end`` message; after a dropped connection or a 502/503/504
        answer it reconnects (up to ``retries`` times in a row) with ``Last-Event-ID``, so nothing is missed or
        repeated."""
        resume = c.Resume(self.url, job_id, last_event_id, retries)
        while True:
            lost: httpx.TransportError | None = None
            try:
                async with aconnect_sse(
                    self.http, "GET", resume.path, headers=resume.headers(), timeout=None
                ) as source:
                    if source.response.status_code >= 400:
                        await source.response.aread()
                        resume.refused(source.response)
                    else:
                        async for sse in source.aiter_sse():
                            if (message := resume.message(sse.event, sse.data, sse.id)) is not None:
                                yield message
                                if message.event == "end":
                                    return
            except httpx.TransportError as err:
                lost = err
            await anyio.sleep(resume.lost(lost))

    async def checkpoints(self, job_id: str) -> list[Checkpoint]:
        """A train job's checkpoints, oldest first, with the loss at each."""
        return cast(list[Checkpoint], (await self.request("GET", c.job_path(job_id, "/checkpoints")))["data"])

    async def artifacts(self, job_id: str) -> list[Artifact]:
        """The files and directories the job wrote, each with its size and download URL."""
        return cast(list[Artifact], (await self.request("GET", c.job_path(job_id, "/artifacts")))["data"])

    async def download(self, job_id: str, name: str, dest: str | os.PathLike[str], *, file: str | None = None) -> int:
        """Stream artifact ``name`` into ``dest`` (a directory arrives as a tar; ``file``: one file of it); returns
        the bytes written. A failed download leaves no partial file."""
        written = 0
        try:
            async with self.http.stream(
                "GET", c.download_path(job_id, name), params={"file": file} if file else None, timeout=None
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise error_from(response)
                async with await anyio.open_file(dest, "wb") as out:
                    async for chunk in response.aiter_bytes(c.CHUNK):
                        written += await out.write(chunk)
        except httpx.HTTPError as err:
            Path(dest).unlink(missing_ok=True)
            raise unreachable(self.url, err) from err
        return written

    async def _pages(self, pages: c.Pages) -> AsyncIterator[Any]:
        """Every item of a paged list, each page fetched when the iteration reaches it."""
        params = pages.params
        while True:
            page = await self.request("GET", pages.path, params=params)
            for item in page["data"]:
                yield item
            if (following := pages.following(params, page)) is None:
                return
            params = following

    # files
    async def upload(self, local: str | os.PathLike[str], path: str, *, overwrite: bool = False) -> File:
        """Stream the local file to ``path`` in the team's upload area; the answer has its ``server_path`` (name it
        in a spec) and ``sha256``. ``Conflict`` if it exists and not ``overwrite``."""
        size = os.path.getsize(local)
        async with await anyio.open_file(local, "rb") as body:
            return cast(
                File,
                await self.request(
                    "PUT", c.file_path(path), content=_chunks(body), **c.upload_request(size, overwrite)
                ),
            )

    async def upload_dir(
        self, local_dir: str | os.PathLike[str], path: str | None = None, *, overwrite: bool = False
    ) -> list[File]:
        """Upload every file under ``local_dir`` (e.g. a small HF model directory) below ``path``, one by one."""
        return [
            await self.upload(file, c.join(path, rel), overwrite=overwrite) for file, rel in c.tree(Path(local_dir))
        ]

    def files(self, *, prefix: str | None = None, page_size: int = 1000) -> AsyncIterator[File]:
        """The team's uploaded files, by path."""
        return self._pages(c.files_pages(prefix, page_size))

    async def delete_file(self, path: str) -> FileDeleted:
        """Delete one uploaded file of the team (directories it leaves empty go too); ``NotFound`` if there is none."""
        return cast(FileDeleted, await self.request("DELETE", c.file_path(path)))


async def _chunks(body: anyio.AsyncFile[bytes]) -> AsyncIterator[bytes]:
    while chunk := await body.read(c.CHUNK):
        yield chunk
