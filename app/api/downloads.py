"""Downloads of a job's outputs: one file with Range support, a directory or a file set as a streamed tar."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable

from app.api.deps import PrincipalDep, SessionDep, SettingsDep
from app.api.jobs import ERRORS
from core import downloads
from core.errors import ApiError
from core.jobs import get_visible_job
from core.paths import download_areas

router = APIRouter(prefix="/v1/jobs/{job_id}", tags=["observe"])


class RangedFile(FileResponse):
    """starlette's ``FileResponse`` (Range, If-Range, multipart ranges) with a bad ``Range`` answered as the API's
    JSON error, not starlette's plain text: 400 for a malformed header, 416 (with ``Content-Range``) for one past
    the end. Raised while the response starts, before anything is sent, so the app's error handlers answer."""

    @classmethod
    def _parse_range_header(cls, http_range: str, file_size: int) -> list[tuple[int, int]]:
        try:
            return super()._parse_range_header(http_range, file_size)
        except MalformedRangeHeader as err:
            raise ApiError(400, "invalid_range", f"Range: {err.content} ({http_range[:100]!r})", "Range") from None
        except RangeNotSatisfiable as err:
            raise HTTPException(
                416,
                f"Range: {http_range[:100]!r} is not inside the file ({err.max_size} bytes)",
                headers={"Content-Range": f"bytes */{err.max_size}"},
            ) from None


@router.get(
    "/artifacts/{name}/download",
    responses={
        **ERRORS,
        400: {"description": "A malformed Range header"},
        416: {"description": "A Range past the end of the file"},
        200: {
            "description": "the file (Range requests answered with 206), or an uncompressed tar of a "
            "directory or file set",
            "content": {"application/octet-stream": {}, "application/x-tar": {}},
        },
    },
)
def download_artifact(
    job_id: str,
    name: str,
    session: SessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    file: Annotated[
        str | None,
        Query(
            max_length=4096,
            description="one file of a directory artifact (path relative to it) or of a prefix artifact (its name)",
        ),
    ] = None,
) -> Any:
    """Download an output of the job: a file as it is, a directory (e.g. an exported HF model) as a tar stream."""
    job = get_visible_job(session, job_id, principal)
    artifact = downloads.job_artifact(session, job.id, name)
    areas = download_areas(settings, job.team, Path(job.run_dir))
    found = downloads.locate(artifact, areas, file)
    session.close()  # a slow reader of a large file must not hold a database connection
    if found.file is not None:
        return RangedFile(found.file, filename=found.file.name, media_type="application/octet-stream")
    return StreamingResponse(
        downloads.tar_stream(found.members, areas),
        media_type="application/x-tar",
        headers={"Content-Disposition": f'attachment; filename="{found.archive_name}"'},
    )
