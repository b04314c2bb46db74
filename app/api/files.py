"""File uploads into the caller team's area of the data roots (``core.uploads``), and the listing of that area.

``PUT /v1/files/{path}`` takes the raw bytes as the body and streams them to disk in 1 MiB writes (the body-limit
and input-guard middlewares let it through unread, under ``upload_max_bytes``), so a model shard never sits in
memory. The answer carries the server path to name in a spec and the SHA-256 of what arrived.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from app.api.deps import PrincipalDep, SettingsDep
from app.schemas import FileDeleted, FilePublic, ListPage
from core import uploads
from core.errors import ApiError

router = APIRouter(prefix="/v1/files", tags=["files"])
FLUSH = 1 << 20
ERRORS: dict[int | str, dict[str, str]] = {401: {"description": "No or bad token"}}
UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "description": "the file's bytes, as they are",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary", "minLength": 1}}},
    }
}


def upload_slot(request: Request, principal: PrincipalDep) -> Iterator[None]:
    """One of the team's upload slots, held until the upload's answer is sent."""
    with request.app.state.uploads.hold(principal.team):
        yield


@router.put(
    "/{path:path}",
    status_code=201,
    response_model=FilePublic,
    openapi_extra=UPLOAD_BODY,
    responses={
        **ERRORS,
        200: {"description": "An existing file replaced (overwrite=true)", "model": FilePublic},
        409: {"description": "The file exists (and overwrite is false), or a part of the path is a file or directory"},
        400: {"description": "The body is empty: an upload carries the file's bytes (no empty files)"},
        408: {"description": "The body stalled for body_read_timeout_s"},
        413: {"description": "Larger than the server's upload_max_bytes, or past the team's storage quota"},
        422: {"description": "The path is absolute, has '..' or empty parts, or goes through a symbolic link"},
        429: {"description": "The team has team_max_uploads uploads in progress (see Retry-After)"},
    },
)
async def upload_file(
    path: str,
    request: Request,
    response: Response,
    principal: PrincipalDep,
    settings: SettingsDep,
    _slot: Annotated[None, Depends(upload_slot)],
    overwrite: Annotated[bool, Query(description="replace the file if it exists (default: 409)")] = False,
) -> FilePublic:
    """Upload one file to ``<first data root>/teams/<team>/uploads/<path>`` (directories are created). The body is
    the file; one that stalls for ``body_read_timeout_s`` is cut off with 408. A team may have ``team_max_uploads``
    in progress at once (429 with Retry-After past it)."""
    target = await run_in_threadpool(uploads.destination, settings, principal.team, path, overwrite)
    declared = request.headers.get("content-length", "")
    upload = await run_in_threadpool(
        uploads.start, settings, principal.team, target, int(declared) if declared.isdigit() else None
    )
    try:
        pending = bytearray()
        async for chunk in request.stream():
            pending += chunk
            if len(pending) >= FLUSH:
                await run_in_threadpool(upload.write, bytes(pending))
                pending.clear()
        await run_in_threadpool(upload.write, bytes(pending))
        if upload.size == 0:  # no body at all, or Content-Length: 0: over HTTP the two look the same
            raise ApiError(400, "empty_body", "body: empty; send the file's bytes (empty files are not taken)", "body")
        replaced = await run_in_threadpool(upload.commit, overwrite)
    except BaseException:
        await run_in_threadpool(upload.discard)
        raise
    if replaced:
        response.status_code = 200
    stat = target.stat()
    return FilePublic(
        path=target.relative_to(uploads.upload_area(settings, principal.team)).as_posix(),
        server_path=str(target),
        size_bytes=upload.size,
        sha256=upload.digest.hexdigest(),
        modified_at=datetime.fromtimestamp(stat.st_mtime, tz=timezone.utc),
    )


@router.delete(
    "/{path:path}",
    response_model=FileDeleted,
    responses={
        **ERRORS,
        404: {"description": "No such uploaded file"},
        409: {"description": "The path is a directory"},
        422: {"description": "The path is absolute, has '..' or empty parts, or goes through a symbolic link"},
    },
)
def delete_file(path: str, principal: PrincipalDep, settings: SettingsDep) -> FileDeleted:
    """Delete one of your team's uploaded files (directories it leaves empty go too). Jobs that name it and have not
    read it yet will fail on the missing input."""
    uploads.delete_file(settings, principal.team, path)
    return FileDeleted(path=uploads.checked_path(path), deleted=True)


@router.get("", response_model=ListPage[FilePublic], responses=ERRORS)
def list_files(
    principal: PrincipalDep,
    settings: SettingsDep,
    prefix: Annotated[
        str | None, Query(max_length=uploads.MAX_PATH_CHARS, description="only under this directory")
    ] = None,
    after: Annotated[
        str | None, Query(max_length=uploads.MAX_PATH_CHARS, description="last_id of the previous page")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
) -> ListPage[FilePublic]:
    """Your team's uploaded files, by path (the id of each is its path)."""
    found = [f for f in uploads.list_files(settings, principal.team, prefix) if after is None or f.path > after]
    data = [
        FilePublic(path=f.path, server_path=f.server_path, size_bytes=f.size_bytes, modified_at=f.modified_at)
        for f in found[:limit]
    ]
    return ListPage[FilePublic].of(data, len(found) > limit, key=lambda f: f.path)
