"""The cluster as GET /v1/hosts shows it: every registered host, its leases and the team of each leased job."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.models import Host, Job, Lease


@dataclass
class Inventory:
    hosts: list[Host]
    leases: dict[str, dict[int, Lease]]  # host -> device -> lease
    teams: dict[str, str]  # leased job -> its team


def inventory(session: Session) -> Inventory:
    leases: dict[str, dict[int, Lease]] = {}
    for lease in session.scalars(select(Lease)):
        leases.setdefault(lease.host, {})[lease.device] = lease
    job_ids = {lease.job_id for held in leases.values() for lease in held.values()}
    teams: dict[str, str] = {}
    if job_ids:
        teams = {job_id: team for job_id, team in session.execute(select(Job.id, Job.team).where(Job.id.in_(job_ids)))}
    return Inventory(list(session.scalars(select(Host).order_by(Host.name))), leases, teams)
