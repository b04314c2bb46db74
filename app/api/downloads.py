"""Downloads of a job's outputs: one file with Range support, a directory or a file set as a streamed tar."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse, StreamingResponse

from app.api.deps import PrincipalDep, SessionDep, SettingsDep
from app.api.jobs import ERRORS
from core import downloads
from core.jobs import get_visible_job

router = APIRouter(prefix="/v1/jobs/{job_id}", tags=["observe"])


@router.get(
    "/artifacts/{name}/download",
    responses={
        **ERRORS,
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
    roots = [*settings.data_roots, Path(job.run_dir).resolve()]
    found = downloads.locate(artifact, roots, file)
    if found.file is not None:
        return FileResponse(found.file, filename=found.file.name, media_type="application/octet-stream")
    return StreamingResponse(
        downloads.tar_stream(found.members),
        media_type="application/x-tar",
        headers={"Content-Disposition": f'attachment; filename="{found.archive_name}"'},
    )
