"""LoRA adapters loaded into a running deployment through the API (vLLM's ``/v1/load_lora_adapter``), and unloaded.

An engine holds what was loaded into it in memory only, so what the API lists is the engine's attempt's: each load
and unload is an event of the serve job (``lora_adapter``, ``{"name", "path", "loaded"}``) tagged with the attempt
it reached, and a deployment's loaded adapters are its current attempt's events folded in order. An attempt that
restarts (engine crash, host lost) starts with its spec's adapters only, as vLLM forgets dynamic loads on restart.

A loaded name holds a row of ``served_names`` (``core.jobs``: team and name unique), as the names of a submitted
deployment do: another deployment or a second load cannot take it while it is held, and the row goes when the
adapter is unloaded or the job ends (``core.jobs.transition``). The row outlives a restart of the job's engine, so the
name stays the team's until it is unloaded (or loaded again into the new attempt).
"""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.errors import ApiError
from core.jobs import add_event
from core.models import Event, Job, ServedName

EVENT = "lora_adapter"


def loaded_adapters(session: Session, job: Job) -> dict[str, str]:
    """Name -> checkpoint path of the adapters loaded into ``job``'s current attempt and not unloaded since."""
    events = session.scalars(
        select(Event)
        .where(Event.job_id == job.id, Event.type == EVENT, Event.attempt == job.attempt_count)
        .order_by(Event.id)
    )
    loaded: dict[str, str] = {}
    for event in events:
        data = event.data or {}
        name, path = data.get("name"), data.get("path")
        if not isinstance(name, str):
            continue
        if data.get("loaded") and isinstance(path, str):
            loaded[name] = path
        else:
            loaded.pop(name, None)
    return loaded


def record(session: Session, job: Job, name: str, path: str, loaded: bool) -> None:
    """A load (``loaded``) or unload of adapter ``name`` in ``job``'s current attempt, committed."""
    verb = "loaded" if loaded else "unloaded"
    add_event(
        session,
        job.id,
        EVENT,
        f"LoRA adapter {name} {verb}",
        data={"name": name, "path": path, "loaded": loaded},
        attempt=job.attempt_count,
    )
    session.commit()


def reserve_name(session: Session, team: str, name: str, job_id: str) -> None:
    """Hold ``name`` for deployment ``job_id`` (committed); 409 naming ``lora_name`` when another holds it."""
    session.add(ServedName(team=team, name=name, job_id=job_id))
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        holder = holder_of(session, team, name)
        if holder != job_id:  # this deployment's own row (a load again after its engine restarted) is fine
            raise ApiError(
                409,
                "conflict",
                f"lora_name: {name!r} is already served by deployment {holder} of your team; give another name, or "
                "unload it first",
                "lora_name",
            ) from None


def holder_of(session: Session, team: str, name: str) -> str | None:
    """The job holding ``name`` in ``team`` (a live deployment's name or adapter), if any."""
    return session.scalar(select(ServedName.job_id).where(ServedName.team == team, ServedName.name == name))


def release_name(session: Session, team: str, name: str, job_id: str) -> None:
    """``name`` free again (the row ``job_id`` held), committed."""
    session.execute(
        delete(ServedName)
        .where(ServedName.team == team, ServedName.name == name, ServedName.job_id == job_id)
        .execution_options(synchronize_session=False)
    )
    session.commit()
